"""The reset_prefix_cache action against vLLM's dev endpoint contract (success=false means retry).

The real endpoint is exercised by tests/real/test_sandbox_kv_corrupt.py and by every catalogue drill
that resets APC; here only the retry and error logic, on an in-process HTTP fake."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from drills.journal import Journal
from drills.stack import base
from drills.stack.base import ProcessStack
from drills.stack.process import StackError


class _Stack(ProcessStack):
    def __init__(self, run_dir: Path, http: httpx.AsyncClient) -> None:
        super().__init__(run_dir, Journal(run_dir / "run"), http)

    def url(self, name: str) -> str:
        return f"http://{name}"


def _run(tmp_path: Path, answers: list[httpx.Response]) -> tuple[list[httpx.Request], dict | Exception]:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return answers[min(len(seen), len(answers)) - 1]

    async def go() -> dict | Exception:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as http:
            try:
                return await _Stack(tmp_path, http).reset_prefix_cache()
            except StackError as exc:
                return exc

    return seen, asyncio.run(go())


def test_retries_while_vllm_holds_blocks_and_never_resets_the_connector(tmp_path: Path):
    busy, done = httpx.Response(200, json={"success": False}), httpx.Response(200, json={"success": True})
    seen, result = _run(tmp_path, [busy, busy, done])
    assert result == {"success": True, "attempts": 3}
    assert all(r.method == "POST" and r.url == "http://engine/reset_prefix_cache" for r in seen)
    assert "reset_external" not in str(seen[0].url)  # LMCache's chunks must stay


def test_without_dev_mode_the_error_says_what_to_set(tmp_path: Path):
    seen, result = _run(tmp_path, [httpx.Response(404)])
    assert isinstance(result, StackError) and "VLLM_SERVER_DEV_MODE=1" in str(result)
    assert len(seen) == 1  # an error is not retried: only success=false is


def test_a_dead_engine_is_a_stack_error_not_a_crash(tmp_path: Path):
    _, result = _run(tmp_path, [httpx.Response(500, text="boom")])
    assert isinstance(result, StackError) and "HTTPStatusError" in str(result)


def test_gives_up_at_the_deadline_naming_the_attempts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(base, "APC_RESET_DEADLINE_S", 1.2)
    seen, result = _run(tmp_path, [httpx.Response(200, json={"success": False})])
    assert isinstance(result, StackError) and "success=false" in str(result)
    assert f"{len(seen)} attempts" in str(result) and len(seen) >= 2
