"""``runtime: compose``: kvdrill brings a user's own compose file up for the drill and takes it down after
(drills/stack/attach.py with drills/stack/compose_project.py, the path the built-in container stacks take).

The compose file is the one test_attach_compose.py brings up by hand (user_stack/docker-compose.yml:
Toxiproxy, a real LMCache MP server and a real vLLM-CPU engine, on kvdrill's own Docker engine); here the
stack file says `runtime: compose`, names the file and the variables it reads, and kvdrill does the rest.
`kvdrill stack check` reads the compose file without starting anything; the flagship's zeroed chunk is a
FAIL as on the sandbox, with the chunk restored; afterwards nothing of the run's project is left on the
engine, and nothing of the user's compose project by hand is touched.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from ruamel.yaml import YAML

from drills.stack.compose_project import engine_state_dir
from drills.stack.containers import PROJECT_LABEL
from drills.stack.dockerd import OwnedEngine
from drills.stack.images import sandbox_image

from .conftest import ARTIFACTS, REPO, run_kvdrill
from .test_attach import SERVED, _events, _run_dir
from .test_attach_compose import user_compose_inputs
from .test_docker_stack import engine  # noqa: F401 - kvdrill's own Docker engine, started and checked once

# in `make test-catalogue`, beside the compose project attached by hand (test_attach_compose.py): a vLLM
# start in a container and the flagship take about 3 minutes; make test drives the same compose runtime
# through the built-in container stack (test_docker_stack.py's flagship)
pytestmark = [pytest.mark.real, pytest.mark.catalogue]

COMPOSE = Path(__file__).with_name("user_stack") / "docker-compose.yml"


def _stack_file(d: Path, image: str, docker_host: str) -> Path:
    """The user's stack file: the compose file, the variables it reads, and per service its URL and order."""
    env, ports, token = user_compose_inputs(d, image)
    stack = {"version": 1, "name": "user-compose-runtime", "runtime": "compose", "served_model": SERVED,
             "model_path": env["MODEL"],
             # the engine named as a user names theirs (a socket on this host): kvdrill builds nothing there and
             # reads the image from the compose file's own variable; the built-in container stacks take the
             # other path (kvdrill's engine by default, KVD_IMAGE)
             "compose": {"files": [str(COMPOSE)], "env": env, "docker_host": docker_host},
             "services": {
                 "toxiproxy": {"url": f"http://127.0.0.1:{ports['P_TOXI']}", "token_file": str(token),
                               "proxies": {"lmcache": "engine -> lmcache"}, "startup_deadline": "60s",
                               "host_addresses": {"0.0.0.0:6555": f"127.0.0.1:{ports['P_PROXY']}",
                                                  "lmcache:5555": f"127.0.0.1:{ports['P_ZMQ']}"}},
                 "lmcache": {"url": f"http://127.0.0.1:{ports['P_HTTP']}", "chunk_size": 256,
                             "l2": {"path": str(d / "l2")}, "startup_deadline": "120s"},
                 "engine": {"url": f"http://127.0.0.1:{ports['P_ENGINE']}", "depends_on": ["toxiproxy"],
                            "after_start": ["lmcache"], "startup_deadline": "300s"}}}
    path = d / "stack.yaml"
    with path.open("w") as fh:
        YAML().dump(stack, fh)
    return path


def test_kvdrill_brings_the_users_compose_file_up_for_the_drill_and_takes_it_down(engine, tmp_path):  # noqa: F811
    client = engine
    stack_file = _stack_file(tmp_path, sandbox_image(client), OwnedEngine(engine_state_dir()).base_url)
    before = {c.id for c in client.containers.list(all=True)}

    check = run_kvdrill(["stack", "check", str(stack_file), "--json"], timeout=120)
    assert check.returncode == 0, check.stdout + check.stderr
    doc = json.loads(check.stdout)
    assert doc["services"]["engine"]["control"].startswith("compose service engine")
    assert doc["faults"]["process kill lmcache"] == "yes"  # kvdrill starts it, and docker start brings it back
    assert {c.id for c in client.containers.list(all=True)} == before  # a check starts nothing

    reports = ARTIFACTS / "compose-runtime"
    reports.mkdir(parents=True, exist_ok=True)
    proc = run_kvdrill(["run", str(REPO / "scenarios" / "flagship" / "hit-rate-is-not-correctness.yaml"),
                        "--stack", str(stack_file), "--reports-dir", str(reports)], timeout=900)
    run_dir = _run_dir(proc.stderr)
    verdict = json.loads((run_dir / "verdict.json").read_text())
    assert proc.returncode == 0 and verdict["verdict"] == "fail", f"{verdict['verdict']}: {verdict['reason']} ({run_dir})"
    correctness = next(c for c in verdict["checks"] if c["name"] == "correctness")
    assert correctness["verdict"] == "fail", correctness
    [healed] = _events(run_dir, "fault.healed")
    assert healed["data"]["undone"] and not healed["data"].get("failed")
    # the project was the run's: created from the user's file, each service started by kvdrill, all removed
    [created] = _events(run_dir, "docker.project_created")
    assert created["data"]["compose_files"] == [str(COMPOSE)]
    assert created["data"]["docker_host"] == OwnedEngine(engine_state_dir()).base_url
    assert not _events(run_dir, "docker.image")  # nothing built on a user's engine
    assert sorted(created["data"]["containers"]) == sorted(f"{created['data']['project']}_{s}_1"
                                                            for s in ("engine", "lmcache", "toxiproxy"))
    assert {e["data"]["service"] for e in _events(run_dir, "service.started")} == {"engine", "lmcache", "toxiproxy"}
    [removed] = _events(run_dir, "docker.project_removed")
    assert removed["data"]["left"] == []
    project = created["data"]["project"]
    assert not client.containers.list(all=True, filters={"label": f"{PROJECT_LABEL}={project}"})
    assert {c.id for c in client.containers.list(all=True)} == before
