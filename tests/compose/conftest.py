from __future__ import annotations

import pytest


@pytest.fixture
def model(tmp_path, monkeypatch):
    """A kvdrill home holding a model directory, so a container stack's prepare() can link and bind it."""
    monkeypatch.setenv("KVDRILL_HOME", str(tmp_path / "home"))
    from drills.pins import load_pins, model_dir
    path = model_dir(load_pins())
    path.mkdir(parents=True)
    (path / "model.safetensors").write_bytes(b"weights")
    (path / "config.json").write_text("{}")
    return path
