"""The local-disk topology: `topology: lmcache-local-disk` in stack files, the built-in stack.ref: sandbox-localdisk
(an attached stack of that shape is refused, not half run), its LMCache config and what it offers the fault
families, and the tier: a chunk's file found by the chunk's whole key, as LMCache's LocalDiskBackend names it."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from drills.journal import Journal
from drills.scenario import ScenarioError, StackSpec, parse_scenario
from drills.stack.api import capability_gaps
from drills.stack.chunk_tiers import LocalDiskTier, tier_of
from drills.stack.localdisk import LocalDiskStack
from drills.stack.stackfile import StackFileError, load_stack_file
from injectors.kv_corrupt import KvCorruptParams, restore

BASE = ("name: t\nserved_model: m\ntopology: lmcache-local-disk\nservices:\n"
        "  engine: {url: 'http://127.0.0.1:8000', chunk_size: 256}\n")
# a key as in-process LMCache 0.5.6 stores it (CacheEngineKey.to_string(): fmt@model@world@worker@hash@dtype)
KEY = "vllm@/root/.cache/kvdrill/served/m@1@0@-5f1c2a9e8b7d6c01@float32"


def _load(tmp_path: Path, text: str):
    path = tmp_path / "stack.yaml"
    path.write_text(text)
    return load_stack_file(path)


def test_a_local_disk_stack_file_needs_only_an_engine(tmp_path):
    f = _load(tmp_path, BASE + "  baseline: {url: 'http://127.0.0.1:8001'}\n")
    assert f.topology == "lmcache-local-disk" and f.services["engine"].chunk_size == 256
    with pytest.raises(StackFileError, match="lm-server is no role of a lmcache-local-disk stack"):
        _load(tmp_path, BASE + "  lm-server: {url: 'lm://127.0.0.1:26500'}\n")


def test_a_scenario_attaching_a_local_disk_stack_is_refused_until_attach_supports_it(tmp_path):
    (tmp_path / "stack.yaml").write_text(BASE)
    path = tmp_path / "s.yaml"
    path.write_text("name: s\nstack: {file: stack.yaml}\n")
    with pytest.raises(ScenarioError, match="stack.ref: sandbox-localdisk only"):
        parse_scenario(path.read_text(), path)


def test_the_built_in_stack_takes_every_kv_corrupt_mode_refuses_links_and_takes_disk_faults_on_a_run_fs():
    spec = StackSpec(ref="sandbox-localdisk")
    for mode in ("zero", "delete", "truncate", "stale", "swap", "bitflip"):
        assert capability_gaps(spec, "kv_corrupt", KvCorruptParams.model_validate({"mode": mode})) == [], mode
    from injectors.disk import DiskParams
    from injectors.network import NetworkParams

    [gap] = capability_gaps(spec, "network", NetworkParams.model_validate(
        {"proxy": "lm-server", "toxics": [{"type": "reset_peer", "attributes": {"timeout": 0}}]}))
    assert "no link to throttle or cut" in gap, gap
    [gap] = capability_gaps(spec, "disk", DiskParams.model_validate({"mode": "readonly"}))
    assert "set stack.lmcache.l2_fs" in gap, gap
    # on a filesystem the run mounts, the disk family reaches the local disk (D22's control)
    on_fs = StackSpec(ref="sandbox-localdisk", lmcache={"l2_fs": {"kind": "tmpfs", "size": "64MiB"}})
    assert capability_gaps(on_fs, "disk", DiskParams.model_validate({"mode": "full"})) == []
    assert LocalDiskStack.options_from(on_fs).l2_fs == {"kind": "tmpfs", "size": 64 << 20, "inodes": None,
                                                         "faultfs": False}


def test_the_stack_stores_on_a_directory_of_the_run_with_no_cpu_tier(tmp_path):
    run = tmp_path / "run"
    stack = LocalDiskStack.from_spec(StackSpec(ref="sandbox-localdisk"), run, Journal(tmp_path), httpx.AsyncClient())
    doc = stack.lmcache_config_doc()
    assert doc["local_disk"] == f"file://{run}/stack/local-disk/" and doc["local_cpu"] is False
    assert "remote_url" not in doc and stack.proxies == [] and set(stack.ports) == {"engine", "baseline"}
    assert stack.chunk_tier().describe() == {"tier": "fs", "l2_dir": str(run / "stack" / "local-disk")}
    assert LocalDiskStack.planned_l2(StackSpec(ref="sandbox-localdisk"), run) == (run / "stack" / "local-disk", None)


def test_the_stack_file_renders_an_engine_and_a_baseline_and_journals_where_the_kv_lives(tmp_path, monkeypatch):
    from drills.stack import lmserver

    run = tmp_path / "run"
    journal = Journal(tmp_path)
    stack = LocalDiskStack.from_spec(StackSpec(ref="sandbox-localdisk", baseline=True), run, journal,
                                     httpx.AsyncClient())
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").touch()
    monkeypatch.setattr(lmserver, "stack_venv", lambda: venv)
    monkeypatch.setattr(lmserver, "stack_python", lambda: venv / "bin" / "python")
    if not (stack.model_dir / "model.safetensors").exists():
        pytest.fail(f"the model is missing ({stack.model_dir}): run `make setup`")
    stack.prepare()  # no lmcache_server needed: this stack runs none
    assert set(stack.specs) == {"engine", "baseline"} and stack.specs["engine"].depends_on == []
    assert (run / "stack" / "local-disk").is_dir()
    journal.close()
    from drills.journal import read_history

    [prepared] = read_history(journal.path).of_type("stack.prepared")
    assert prepared.data["ref"] == "sandbox-localdisk"
    assert prepared.data["local_disk"] == str(run / "stack" / "local-disk") and "store_url" not in prepared.data


def test_a_chunk_is_found_by_its_whole_key_as_lmcache_names_its_file(tmp_path):
    tier = LocalDiskTier(tmp_path)
    other = KEY.replace("-5f1c", "-6f1c")
    (tmp_path / (KEY.replace("/", "-") + ".pt")).write_bytes(b"\x01" * 16)
    assert tier.locate([KEY, other, KEY]) == {KEY: str(tmp_path / (KEY.replace("/", "-") + ".pt"))}
    # removing files would not empty LMCache's own index: the tier never does it
    assert tier.remove() == {"l2_files_removed": 0} and tier.locate([KEY]) != {}


def test_an_undo_record_of_the_tier_is_restored_as_a_file_from_another_process(tmp_path):
    tier = LocalDiskTier(tmp_path / "disk")
    tier.directory.mkdir()
    path = tier.directory / (KEY.replace("/", "-") + ".pt")
    path.write_bytes(b"\x07" * 32)
    backup = tmp_path / "backup.chunk"
    backup.write_bytes(path.read_bytes())
    import hashlib

    record = {**tier.describe(), "path": str(path), "backup": str(backup),
              "sha256": hashlib.sha256(backup.read_bytes()).hexdigest(), "size": 32}
    assert isinstance(tier_of(record), LocalDiskTier.__mro__[1])  # rollback reads it as a file
    tier.delete(str(path))  # the "keep it visible" case: the file is gone, LMCache still lists it
    report = restore([record])
    assert report.undone == [str(path)] and path.read_bytes() == b"\x07" * 32


def test_open_files_under_counts_only_descriptors_into_the_directory(tmp_path):
    import os

    from drills.stack.localdisk import open_files_under

    inside, outside = tmp_path / "disk", tmp_path / "other"
    inside.mkdir()
    outside.mkdir()
    me = {os.getpid()}
    assert open_files_under(me, inside) == 0
    with open(inside / "a.pt", "wb"), open(outside / "b.pt", "wb"), open(inside / "c.pt", "wb"):
        assert open_files_under(me, inside) == 2
    assert open_files_under(me, inside) == 0
    assert open_files_under({2**22 + 7}, inside) == 0  # no such process
