"""Where bench scripts keep their results: one JSON line per invocation in bench/results/NAME.jsonl, with
the time and the machine first (bench/README.md quotes them)."""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"


def append(name: str, **fields: Any) -> dict[str, Any]:
    """Append ``fields`` (after when/host/cpus) to bench/results/NAME.jsonl and print their summary."""
    result = {"when": time.strftime("%Y-%m-%d %H:%M"), "host": platform.node(), "cpus": os.cpu_count(), **fields}
    RESULTS.mkdir(parents=True, exist_ok=True)
    with (RESULTS / f"{name}.jsonl").open("a") as fh:
        fh.write(json.dumps(result) + "\n")
    print(json.dumps(fields.get("summary"), indent=2))
    return result
