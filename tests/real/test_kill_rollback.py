"""Crash-proof heal, proven by killing: SIGKILL at many random points, then `kvdrill rollback`, then nothing
of the run is left. Every time.

Design (cost matters: a full sandbox drill is minutes of vLLM start-up, so 50 of them would not fit):

* **The cheap, many kill points** (``test_sigkill_campaign``, >= 50 by default): each point starts
  ``tests/real/kill_harness.py`` as its own kvdrill-like process on a fresh run directory. It builds the
  run's real objects with the sandbox's own code (tmpfs or loop-ext4 L2 mounted by
  ``SandboxStack._mount_l2``, the FUSE fault filesystem over it, a ``kvd-*`` namespace created the way the
  Mooncake stack does, a process group started by ``ProcessDriver`` that forks a SIGTERM-ignoring child
  with a /dev/shm segment) and loops the real injectors' plan/inject/verify/heal over them, journaling as
  the runner does. The test SIGKILLs it at a seeded random moment (most after its setup, inside the
  inject/verify/heal loop; some during setup, i.e. mid-mount, mid-namespace, mid-fork), runs
  ``kvdrill rollback RUN``, and asserts: exit 0; no kvdrill mount, loop device or namespace left beyond
  what was there before; no filler file; no kvdrill toxic on the shared Toxiproxy server's proxies and
  every proxy enabled; every chunk file back to its sha256; no process of the run left (stopped or
  not); a second rollback finds nothing to undo; the journal stays readable and carries an ABORTED
  verdict. Variants cover every family the sandbox has: kv_corrupt (six modes), disk (fill, full, inodes,
  shrink, readonly, readonly and errno through the fault filesystem, tmpfs and ext4), network (Toxiproxy
  toxics and down; kernel bandwidth, down and loss in a namespace) and process (stop, kill, term,
  restart) and kv_corrupt on a Redis L2 (zero, bitflip, swap: the values of a redis-server the test runs,
  each back to its bytes after rollback) and on an lm:// cache server (zero, truncate, stale: the values of an
  ``lmcache_server`` the test runs, each back to its bytes, format, dtype and shape after rollback) and on Mooncake
  objects (zero, truncate, swap: a master and a contributor the point starts in a namespace of the run; rollback
  reads each object back through Mooncake's client before it stops them). ``model`` is not here: its swap needs
  engines to restart; its undo is unit-tested.
  The Toxiproxy server and the chunk files are the test's, shared by every point, so their state after
  rollback is the proof (a run-owned server would take its toxics with it when stopped). The chunk
  files are written by this test, not by LMCache (no engine here); the injector and rollback treat
  them exactly as chunk files.
* **Kill points in a full drill** (``test_sigkill_full_drill``): one real ``kvdrill run`` of the
  fault-filesystem disk scenario, SIGKILLed at a seeded moment inside its chaos phase (the errno rule
  loaded into the FUSE daemon, LMCache and vLLM running), then the same rollback and assertions, plus no
  vLLM/LMCache process of the run left.

The seed (``KVDRILL_KILL_SEED``, default fixed) and each point's variant, delay and the harness's last
step are printed and written to reports/tests/kill-rollback/points.jsonl, so a failure can be replayed.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from drills.journal import read_history
from drills.rollback import rollback
from drills.stack.lm_wire import LmClient, parse_lm_url
from drills.stack.netns import NETNS_DIR
from drills.stack.process import group_members, tagged_pids
from drills.stack.sandbox import free_port
from drills.toxiproxy import api_headers
from tests.lm_server import lm_server
from tests.real.conftest import ARTIFACTS, KVDRILL, REPO
from tests.real.kill_harness import TOKEN, TOKEN_FILE, VARIANTS, lm_values

pytestmark = pytest.mark.real

POINTS = int(os.environ.get("KVDRILL_KILL_POINTS", "52"))
SEED = int(os.environ.get("KVDRILL_KILL_SEED", "20261130"))
OUT = ARTIFACTS / "kill-rollback"


def _sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def chunks(tmp_path_factory):
    d = tmp_path_factory.mktemp("chunks")
    rng = random.Random(SEED)
    for i in range(6):  # 3 prompts x 2 chunks, as the harness's stack reports them
        (d / f"chunk{i:02d}-{rng.getrandbits(64):016x}.data").write_bytes(rng.randbytes(64 * 1024))
    return d, {p.name: _sha(p) for p in d.iterdir()}


@pytest.fixture(scope="module")
def redis_l2(tmp_path_factory):
    """A redis-server shared by every kill point (it must outlive each kill, as a run's Redis outlives a SIGKILLed
    kvdrill), holding 6 chunk values under keys shaped as LMCache's resp adapter names them."""
    port = free_port()
    proc = subprocess.Popen(["/usr/bin/redis-server", "--bind", "127.0.0.1", "--port", str(port), "--save", "",
                             "--appendonly", "no", "--dir", str(tmp_path_factory.mktemp("redis"))],
                            stdout=subprocess.DEVNULL, start_new_session=True)
    url = f"redis://127.0.0.1:{port}"
    client = redis.Redis.from_url(url)
    deadline = time.monotonic() + 30
    while True:
        try:
            client.ping()
            break
        except redis.ConnectionError:
            assert time.monotonic() < deadline and proc.poll() is None, "the test's redis-server did not start"
            time.sleep(0.05)
    rng = random.Random(SEED + 7)
    values = {f"/models/m@01000100@0@{rng.getrandbits(128):032x}": rng.randbytes(64 * 1024) for _ in range(6)}
    yield url, client, values
    client.close()
    os.killpg(proc.pid, signal.SIGTERM)
    proc.wait(timeout=10)


LM_SEED = SEED + 8


@pytest.fixture(scope="module")
def lm_store(tmp_path_factory):
    """An lm:// cache server shared by every kill point (it outlives each kill, as a run's server outlives a SIGKILLed
    kvdrill), holding the harness's 6 values (kill_harness.lm_values)."""
    with lm_server(tmp_path_factory.mktemp("lmserver")) as url, LmClient(*parse_lm_url(url)) as client:
        yield url, client, lm_values(LM_SEED)


@pytest.fixture(scope="module")
def toxiproxy(tmp_path_factory):
    """A Toxiproxy server shared by every kill point (not the run's: it must outlive each kill), with a
    proxy `lmcache` in front of a server that greets every connection, as LMCache's ZMQ port does."""
    upstream = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve() -> None:
        upstream.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = upstream.accept()
            except OSError:
                continue
            try:
                conn.sendall(b"\xff")
            except OSError:
                pass
            threading.Timer(5.0, conn.close).start()

    threading.Thread(target=serve, daemon=True).start()
    d = tmp_path_factory.mktemp("toxiproxy")
    config = d / "toxiproxy.json"
    config.write_text(json.dumps([{"name": "lmcache", "listen": f"127.0.0.1:{free_port()}",
                                   "upstream": f"127.0.0.1:{upstream.getsockname()[1]}", "enabled": True}]))
    port = free_port()
    (d / TOKEN_FILE).write_text(TOKEN)  # as a stack runs it: the token, proxies on loopback only
    proc = subprocess.Popen([sys.executable, "-m", "drills.stack.toxiproxy_server", "--host", "127.0.0.1", "--port",
                             str(port), "--config", str(config), "--token-file", str(d / TOKEN_FILE),
                             "--listen-hosts", "127.0.0.1"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            httpx.get(url + "/version", timeout=1, trust_env=False)
            break
        except httpx.HTTPError:
            assert time.monotonic() < deadline and proc.poll() is None, "the test's Toxiproxy server did not start"
            time.sleep(0.1)
    yield url
    os.killpg(proc.pid, signal.SIGTERM)
    proc.wait(timeout=10)
    stop.set()
    upstream.close()


def _proxy_problems(url: str) -> list[str]:
    proxies = httpx.get(url + "/proxies", timeout=5, trust_env=False, headers=api_headers(TOKEN)).json()
    problems = []
    for name, p in proxies.items():
        problems += [f"toxic {t['name']} on {name}" for t in p["toxics"] if t["name"].startswith("kvdrill-")]
        if not p["enabled"]:
            problems.append(f"proxy {name} disabled")
    return problems


def _live(pids) -> list[int]:
    out = []
    for pid in pids:
        try:
            text = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        if text[text.rfind(")") + 2:].split()[0] not in ("Z", "X"):
            out.append(pid)
    return out


def run_leftovers(run: Path, history) -> dict[str, list[str]]:
    """Mounts under the run directory, loop devices on its images, and namespaces it journaled."""
    mounts = [f"{f[0]} on {f[1]}" for f in (line.split() for line in Path("/proc/mounts").read_text().splitlines())
              if f[1].startswith(str(run) + "/")]
    loops = [x for x in subprocess.run(["losetup", "-a"], capture_output=True, text=True).stdout.splitlines()
             if str(run) + "/" in x]
    names = {e.data["name"] for e in history.of_type("netns.planned", "netns.created")}
    return {"mounts": mounts, "loops": loops, "netns": sorted(n for n in names if (NETNS_DIR / n).exists())}


def _rollback(run: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([str(KVDRILL), "rollback", str(run)], capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)


def assert_rolled_back(run: Path, chunks: tuple[Path, dict[str, str]] | None,
                       toxiproxy: str | None, where: str, redis_values: tuple[Any, dict[str, bytes]] | None = None,
                       lm: tuple[Any, dict[str, Any]] | None = None, mooncake: bool = False) -> None:
    first = _rollback(run)
    assert first.returncode == 0, f"{where}: rollback failed:\n{first.stdout}\n{first.stderr}"
    history = read_history(run)
    started = {e.data["pgid"] for e in history.of_type("service.started")}
    # by this run's own names (other engineers' drills may mount and unmount beside this test)
    left = run_leftovers(run, history)
    assert not any(left.values()), f"{where}: left behind {left}\n{first.stdout}"
    fillers = [str(p) for p in run.rglob(".kvdrill-fill")]
    assert not fillers, f"{where}: filler files left {fillers}"
    procs = _live(set(tagged_pids({str(run)})) | {p for pg in started for p in group_members(pg)})
    assert not procs, f"{where}: processes of the run left: {procs}\n{first.stdout}"
    if chunks is not None:
        d, shas = chunks
        wrong = {n: (_sha(d / n) if (d / n).exists() else None) for n, s in shas.items()
                 if not (d / n).exists() or _sha(d / n) != s}
        assert not wrong, f"{where}: chunk files not restored: {wrong}"
    if toxiproxy is not None:
        assert not _proxy_problems(toxiproxy), f"{where}: {_proxy_problems(toxiproxy)}\n{first.stdout}"
    if redis_values is not None:
        client, values = redis_values
        wrong = [k for k, v in values.items() if client.get(k) != v]
        assert not wrong and client.dbsize() == len(values), f"{where}: Redis values not restored: {wrong}\n{first.stdout}"
    if lm is not None:
        client, entries = lm
        wrong = [k for k, v in entries.items() if client.get(k) != v]  # bytes, format, dtype and shape
        assert not wrong, f"{where}: lm:// values not restored: {wrong}\n{first.stdout}"
    if mooncake:
        # the store is the run's (rollback stops it and deletes its namespace after the faults), so the proof is
        # rollback's own: each object of a fault the run did not heal was read back through Mooncake's client with
        # its original digest, written back first where it differed (restore() counts nothing it did not read)
        healed = {e.data["fault_id"] for e in history.of_type("fault.healed")}
        keys = {entry["key"] for e in history.of_type("fault.undo") if e.data["fault_id"] not in healed
                for entry in e.data["restore"]}
        assert all(entry.get("tier") == "mooncake" for e in history.of_type("fault.undo") for entry in e.data["restore"])
        proven = {e.data["what"] for e in history.of_type("rollback.undone", "rollback.already_healed")}
        assert keys <= proven and not list(history.of_type("rollback.failed")), \
            f"{where}: Mooncake objects not proven restored: {sorted(keys - proven)}\n{first.stdout}"
    assert len(history.problems) <= 1, f"{where}: journal unreadable: {history.problems}"  # at most the torn line
    verdict = history.first("verdict")
    assert verdict is not None and verdict.data["verdict"] in ("aborted", "pass", "fail", "error"), where
    # the second one in-process (the CLI's start-up is a second per point): it must find nothing left
    second = rollback(run, grace=2.0)
    assert second.ok and not second.of("undone"), f"{where}: second rollback undid {second.of('undone')}"


def test_sigkill_campaign(tmp_path, chunks, toxiproxy, redis_l2, lm_store):
    rng = random.Random(SEED)
    # KVDRILL_KILL_VARIANTS=kv-mooncake-,disk-: only the variants that start so (with KVDRILL_KILL_POINTS, to replay)
    only = [p for p in os.environ.get("KVDRILL_KILL_VARIANTS", "").split(",") if p]
    names = sorted(v for v in VARIANTS if not only or v.startswith(tuple(only)))
    order = [names[i % len(names)] for i in range(POINTS)]
    rng.shuffle(order)
    OUT.mkdir(parents=True, exist_ok=True)
    record = (OUT / "points.jsonl").open("w")
    started = time.monotonic()
    landed: dict[str, int] = {}
    for n, variant in enumerate(order):
        run = (tmp_path / f"p{n:02d}-{variant}").resolve()
        run.mkdir()
        # the chunk files live in the run's own stack directory, as a drill's L2 does: rollback restores a
        # file only there (or in an L2 volume of a project the run made), never one a journal names elsewhere
        run_chunks = run / "stack" / "chunks"
        shutil.copytree(chunks[0], run_chunks)
        on_redis = VARIANTS[variant][2].get("redis", False)
        if on_redis:  # every point starts from the original values
            redis_l2[1].flushdb()
            redis_l2[1].mset(redis_l2[2])
        on_lm = VARIANTS[variant][2].get("lm", False)
        if on_lm:
            for key, entry in lm_store[2].items():
                lm_store[1].put(key, entry)
        during_setup = rng.random() < 0.15
        delay = rng.uniform(0.0, 0.8) if during_setup else rng.uniform(0.0, 2.5)
        proc = subprocess.Popen([sys.executable, "-m", "tests.real.kill_harness", str(run), variant, str(SEED + n),
                                 "--toxiproxy", toxiproxy, "--chunks", str(run_chunks), "--redis", redis_l2[0],
                                 "--lm", lm_store[0], "--lm-seed", str(LM_SEED)],
                                stdout=(run / "harness.out").open("w"), stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True,
                                env={**os.environ, "PYTHONPATH": str(REPO)})
        log = run / "harness.log"
        # wait for the journal to exist (a kill during the interpreter's imports tests nothing), or for the
        # setup to finish; then the random delay
        mark = "setup" if during_setup else "READY"
        deadline = time.monotonic() + 60
        while mark not in (log.read_text() if log.exists() else ""):
            assert proc.poll() is None, f"harness {variant} exited: {(run / 'harness.out').read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"harness {variant} not ready in 60s"
            time.sleep(0.02)
        time.sleep(delay)
        exited = proc.poll()
        proc.send_signal(signal.SIGKILL)  # the harness alone: what it started must be found by rollback
        proc.wait()
        steps = log.read_text().splitlines() if log.exists() else []
        last = steps[-1].split(" ", 1)[1] if steps else "(before its first step)"
        landed[last.split()[0]] = landed.get(last.split()[0], 0) + 1
        point = {"n": n, "variant": variant, "seed": SEED + n, "during_setup": during_setup,
                 "delay_s": round(delay, 3), "last_step": last, "exited_before_kill": exited}
        record.write(json.dumps(point) + "\n")
        record.flush()
        assert exited is None, f"harness died on its own before the kill: {point}\n{(run / 'harness.out').read_text()[-3000:]}"
        assert not any("NOT EFFECTIVE" in s for s in steps), f"{point}: an injection did not take effect: {steps[-3:]}"
        assert_rolled_back(run, (run_chunks, chunks[1]), toxiproxy, f"kill point {point}",
                           redis_l2[1:] if on_redis else None, lm_store[1:] if on_lm else None,
                           mooncake=VARIANTS[variant][2].get("mooncake", False))
    record.close()
    print(f"{POINTS} kill points in {time.monotonic() - started:.0f}s; last step before each kill: {landed}")
    assert POINTS >= 50 or os.environ.get("KVDRILL_KILL_POINTS"), "the campaign needs at least 50 kill points"


FULL_DRILL = REPO / "scenarios" / "basics" / "disk-errno-write-eio.yaml"


def test_sigkill_full_drill(tmp_path):
    """A real drill (LMCache + two vLLMs + Toxiproxy + tmpfs + FUSE fault filesystem) killed inside chaos."""
    rng = random.Random(SEED + 1000)
    reports = tmp_path / "reports"
    proc = subprocess.Popen([str(KVDRILL), "run", str(FULL_DRILL), "--reports-dir", str(reports)],
                            stdout=subprocess.DEVNULL, stderr=(tmp_path / "run.err").open("w"),
                            stdin=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 900
    run = None
    delay = rng.uniform(0.0, 4.0)
    try:
        while True:
            assert proc.poll() is None, f"the drill ended before the kill: {(tmp_path / 'run.err').read_text()[-3000:]}"
            assert time.monotonic() < deadline, "the drill did not reach chaos within 15 minutes"
            runs = list(reports.glob("*/journal.jsonl"))
            if runs:
                run = runs[0].parent
                if any(e.type == "fault.undo" for e in read_history(run).events):
                    break
            time.sleep(0.2)
        time.sleep(delay)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert run is not None
    history = read_history(run)
    started = {e.data["pgid"] for e in history.of_type("service.started")}
    assert started, "the drill started no service before the kill"
    print(f"full drill killed {delay:.2f}s after its fault.undo; last event: {history.events[-1].type}")
    assert_rolled_back(run.resolve(), None, None, f"full drill {run.name} (+{delay:.2f}s)")
