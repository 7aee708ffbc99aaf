"""The pytest plugin as a user gets it: pytest installed beside the kvdrill wheel in a fresh venv
(conftest's ``installed_wheel``), a user's test file and scenario in an empty directory, run with
``--kvdrill-stack`` against the sandbox. The scenario is the flagship's fault on one prompt (its shared chunk
zeroed in L2, then read back from L2): the test asserts the cache kept the answer right; that fails, and
pytest's failure report carries a kvdrill section with the verdict line, the first differing token with both
texts, and the report's path (the run directory is real, with its verdict). This is also the wheel's one real
drill (tests/real/test_wheel.py): run from an empty directory, its report under ./reports, its versions
manifest against the pins the wheel carries. (The flagship itself runs four times elsewhere in make test.)"""

from __future__ import annotations

import json
import subprocess

import pytest

pytestmark = pytest.mark.real

USER_TEST = '''
def test_cache_keeps_answers_right_when_a_chunk_is_zeroed(drill):
    verdict = drill.run("zeroed-chunk.yaml")
    assert verdict.passed
'''
USER_SCENARIO = ("name: zeroed-chunk\nseed: 7\n"
                 "workload: {prompts: 1, shared_prefix_tokens: 512, unique_tokens: 320, max_tokens: 8, concurrency: 1}\n"
                 "chaos:\n  faults:\n    - {injector: kv_corrupt, params: {mode: zero, prompts: all, chunk: 1}}\n"
                 "  actions: [clear_l1, reset_prefix_cache]\n"
                 "recovery: {enabled: false}\n"
                 "checks: {recovery: {enabled: false}}\n"
                 "expect: {verdict: fail, failing_checks: [correctness, hit_rate]}\n")


def test_a_users_pytest_runs_a_zeroed_chunk_drill_and_its_failure_shows_the_first_differing_token(installed_wheel, tmp_path):
    kvdrill, _, env = installed_wheel
    python = kvdrill.parent / "python"
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", "pytest>=8"],
                   check=True, capture_output=True, timeout=600, env=env)
    (tmp_path / "test_my_cache.py").write_text(USER_TEST)
    (tmp_path / "zeroed-chunk.yaml").write_text(USER_SCENARIO)
    reports = tmp_path / "reports"  # the default: ./reports under the directory it runs in
    proc = subprocess.run([str(python), "-m", "pytest", "-p", "no:cacheprovider", "-q", "--kvdrill-stack", "sandbox",
                           "test_my_cache.py"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1 and "1 failed" in out, out[-4000:]
    assert "kvdrill: the drills this test ran" in out, out[-4000:]
    assert "kvdrill FAIL: correctness:" in out and "first differing token at index" in out, out[-4000:]
    assert "expected: '" in out and "got:      '" in out
    [run_dir] = [p for p in reports.iterdir() if p.is_dir()]
    assert f"report: {run_dir / 'report.md'}" in out
    doc = json.loads((run_dir / "verdict.json").read_text())
    assert doc["verdict"] == "fail" and doc["expectation"]["held"]  # kvdrill's own expectation held
    # the wheel's drill: the versions manifest compares what ran with the pins the wheel carries
    versions = json.loads((run_dir / "versions.json").read_text())
    assert versions["components"]["lmcache"] == versions["pinned"]["lmcache"], versions
