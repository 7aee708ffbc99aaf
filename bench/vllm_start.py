"""Benchmark: why vLLM starts slower in a container than as a local process (bench/stack_up.py measured
about 25 s more per engine on compose/sandbox-docker).

vLLM-CPU baselines (no KV connector, the flags of compose/sandbox-docker's `baseline`) are started, one
alone or ``--together 2`` at once (as a stack starts its engine and baseline), each timed from its start
to its /health answering 200, then stopped; runs rotate through the variants so a busy moment of the
machine hits all of them:

- ``process``: the stack venv on the host, as compose/sandbox runs it;
- ``container``: kvdrill/sandbox, as compose/sandbox-docker runs it (the image's own copy of the venv,
  on overlayfs, Docker's default seccomp profile);
- ``container-unconfined``: the same with ``seccomp=unconfined`` (is it the syscall filter?);
- ``container-host-venv``: the same with the host's venv and Python bound read-only over the image's
  (is it the image's separate, overlay-backed copy of the files?);
- ``process-cgroups``: the local process, moved at once into cgroups of its own for the controllers
  Docker gives a container (cpu, cpuacct, cpuset, memory, blkio, pids), without a limit (is it being a
  cgroup of its own?).

Usage: python bench/vllm_start.py [--runs N] [--together K] [--variants V ...]; appends rows to bench/results/vllm_start.jsonl.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import signal
import statistics
import subprocess
import time
from pathlib import Path

import benchlog
import httpx

from drills.pins import load_pins, model_dir, stack_python, stack_venv
from drills.stack.compose_project import engine_state_dir
from drills.stack.dockerd import LABEL, OwnedEngine
from drills.stack.images import StackInputs, sandbox_image
from drills.stack.sandbox import SERVED_MODEL, free_port

VARIANTS = ("process", "container", "container-unconfined", "container-host-venv", "process-cgroups")
CGROUP_CONTROLLERS = ("cpu", "cpuacct", "cpuset", "memory", "blkio", "pids")
DEADLINE_S = 300


def vllm_argv(python: str, model: Path, port: int, host: str) -> list[str]:
    return [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--served-model-name",
            SERVED_MODEL, "--host", host, "--port", str(port), "--dtype", load_pins().dtype, "--max-model-len",
            "4096", "--seed", "0", "--enforce-eager", "--no-enable-prefix-caching"]


def vllm_env() -> dict[str, str]:
    # compose/sandbox-docker's x-vllm-env
    return {"LD_PRELOAD": f"{stack_venv()}/lib/libiomp5.so", "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}


def wait_healthy(url: str, alive) -> float:
    started = time.perf_counter()
    while time.perf_counter() - started < DEADLINE_S:
        if not alive():
            raise RuntimeError(f"vLLM exited before {url} answered")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return time.perf_counter() - started
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    raise RuntimeError(f"{url} not healthy within {DEADLINE_S}s")


def own_cgroups(pid: int) -> list[Path]:
    """cgroup v1 directories of its own for ``pid``, as Docker makes per container (no limit set)."""
    made = []
    for controller in CGROUP_CONTROLLERS:
        root = Path("/sys/fs/cgroup") / controller
        path = root / f"kvdrill-bench-{pid}"
        path.mkdir()
        made.append(path)
        if controller == "cpuset":  # an empty cpuset takes no task
            for name in ("cpuset.cpus", "cpuset.mems"):
                (path / name).write_text((root / name).read_text())
        (path / "cgroup.procs").write_text(str(pid))
    return made


def run_process(model: Path, cgroups: bool = False) -> float:
    port = free_port()
    proc = subprocess.Popen(vllm_argv(str(stack_python()), model, port, "127.0.0.1"), env={**os.environ, **vllm_env()},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    made = own_cgroups(proc.pid) if cgroups else []
    try:
        return wait_healthy(f"http://127.0.0.1:{port}/health", lambda: proc.poll() is None)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        for path in made:
            remove_cgroup(path)


def remove_cgroup(path: Path, timeout: float = 10.0) -> None:
    """rmdir once the killed processes have left it (a cgroup with tasks is busy)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            path.rmdir()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def run_container(client, image: str, model: Path, variant: str) -> float:
    port = free_port()
    inputs = StackInputs.of_this_host()
    volumes = {str(model.parent): {"bind": str(model.parent), "mode": "ro"}}
    if variant == "container-host-venv":
        for path in (inputs.python_prefix, inputs.venv):
            volumes[str(path)] = {"bind": str(path), "mode": "ro"}
    container = client.containers.run(
        image, vllm_argv("python", model, 8000, "0.0.0.0"), environment=vllm_env(), detach=True,
        ports={"8000/tcp": ("127.0.0.1", port)}, ipc_mode="host", pid_mode="host", volumes=volumes,
        labels={LABEL: "1"}, security_opt=["seccomp=unconfined"] if variant == "container-unconfined" else None)
    try:
        def alive() -> bool:
            container.reload()
            return container.status == "running"
        return wait_healthy(f"http://127.0.0.1:{port}/health", alive)
    finally:
        container.remove(force=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=2, help="runs per variant")
    ap.add_argument("--together", type=int, default=1, help="vLLMs of the same variant started at once")
    ap.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    args = ap.parse_args()
    variants = tuple(args.variants)
    engine = OwnedEngine(engine_state_dir())
    started_engine = engine.running_pid() is None
    client = engine.start() if started_engine else engine.connect()
    image = sandbox_image(client)
    model = model_dir(load_pins())
    rows = []
    try:
        for i in range(args.runs):
            order = variants[i % len(variants):] + variants[:i % len(variants)]
            for variant in order:
                with concurrent.futures.ThreadPoolExecutor(args.together) as pool:
                    futures = [pool.submit(run_process, model, variant == "process-cgroups")
                               if variant.startswith("process")
                               else pool.submit(run_container, client, image, model, variant)
                               for _ in range(args.together)]
                    took = [f.result() for f in futures]
                row = {"variant": variant, "together": args.together, "healthy_s": round(max(took), 1),
                       "each_s": [round(t, 1) for t in took]}
                print(json.dumps(row), flush=True)
                rows.append(row)
    finally:
        if started_engine:
            engine.stop()
    summary = {v: {"median_s": statistics.median(r["healthy_s"] for r in rows if r["variant"] == v),
                   "runs_s": [r["healthy_s"] for r in rows if r["variant"] == v]} for v in variants}
    benchlog.append("vllm_start", image=image, together=args.together, runs=rows, summary=summary)


if __name__ == "__main__":
    main()
