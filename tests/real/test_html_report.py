"""report.html in a real browser: Debian's chromium, headless, renders the stored real flagship run's
report (no stack needed) and the key elements must be laid out and visible, the embedded plots
decoded, and nothing fetched from outside the file. The screenshot is kept as a test artifact.
tests/real/test_flagship.py does the same for the flagship run it has just made."""

from __future__ import annotations

import json
import shutil

import pytest

from drills.analyze import analyze
from tests.drills.chromium import check_report

from .conftest import ARTIFACTS, REPO

pytestmark = pytest.mark.real

FLAGSHIP = REPO / "tests/fixtures/runs/20261130-135638-hit-rate-is-not-correctness-adcbee"
OUT = ARTIFACTS / "html-report"


def test_the_stored_flagship_report_renders_in_headless_chromium():
    run = OUT / FLAGSHIP.name
    shutil.rmtree(run, ignore_errors=True)
    shutil.copytree(FLAGSHIP, run)
    a = analyze(run, stamp="chromium")  # writes report.html exactly as `kvdrill analyze` does
    page = a.out_dir / "report.html"
    seen = check_report(page, OUT / "flagship-report.png")
    assert seen["headline"]["text"].startswith("FAIL: hit rate 100% but 4/4 responses wrong")
    assert "chaos-w1-p0-engine" in seen["failing"]["text"]  # per failing request, in the visible table
    record = json.loads((a.out_dir / "record.json").read_text())
    assert seen["record"]["text"].startswith("Run record") and record["run_id"] in seen["record"]["text"]
