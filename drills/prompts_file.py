"""``workload.prompts_file``: the user's own prompts, one JSON object per line, instead of seeded stories.

    {"prompt": "Summarise the incident report below. ..."}
    {"messages": [{"role": "system", "content": "You are the on-call assistant. ..."},
                  {"role": "user", "content": "What failed first?"}], "max_tokens": 64}

A ``prompt`` is text; ``messages`` is a chat, rendered by the engine's own chat template. Either way the
engine's tokenizer turns it into token ids (vLLM's ``/tokenize``: for a chat, with the template and the
generation prompt applied, as ``/v1/chat/completions`` renders it), and the drill sends those ids, so the
oracle, the cached answers, first-diff and ``kv_corrupt``'s chunks by prompt all work on exactly what the
engine saw. ``max_tokens`` per line overrides ``workload.max_tokens``. Sampling stays greedy (temperature 0):
the checks compare answers token by token.

The file is validated when the scenario is, each problem reported as ``FILE:LINE: field: why`` with the
allowed values, and read with a size cap (drills/inputs.py): a prompt set is data, never code.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

MAX_PROMPTS = 1024
MAX_BYTES = 64 * 1024 * 1024


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Message(_Strict):
    role: Literal["system", "user", "assistant"]
    content: str = Field(min_length=1)


class PromptLine(_Strict):
    prompt: str | None = Field(None, min_length=1, description="text, sent as the engine tokenizes a completion's prompt")
    messages: list[Message] | None = Field(None, min_length=1, description="a chat, rendered by the engine's template")
    max_tokens: int | None = Field(None, ge=1, le=4096, description="this prompt's answer length (default: "
                                                                   "workload.max_tokens)")

    @model_validator(mode="after")
    def _one_kind(self) -> PromptLine:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt (text) or messages (a chat)")
        return self


@dataclass(frozen=True)
class PromptsFile:
    path: Path
    lines: list[tuple[int, PromptLine]]  # (line number in the file, the prompt), blank lines skipped
    sha256: str

    @property
    def kinds(self) -> dict[str, int]:
        chats = sum(1 for _, p in self.lines if p.messages is not None)
        return {"text": len(self.lines) - chats, "chat": chats}


class PromptsFileError(Exception):
    def __init__(self, path: Path, problems: list[tuple[int | None, str]]) -> None:
        self.path, self.problems = path, problems
        super().__init__("\n".join(f"{path}:{line if line is not None else '?'}: {why}" for line, why in problems))


def load_prompts_file(path: Path) -> PromptsFile:
    from drills.inputs import InputFileError, read_limited

    try:
        raw = read_limited(path, MAX_BYTES, "prompts file", follow=True)
    except (InputFileError, OSError) as exc:
        raise PromptsFileError(path, [(None, f"cannot read the prompts file: {exc}")]) from exc
    try:
        text = raw.decode()
    except UnicodeDecodeError as exc:
        raise PromptsFileError(path, [(None, f"not UTF-8 text ({exc.reason} at byte {exc.start})")]) from exc
    lines: list[tuple[int, PromptLine]] = []
    problems: list[tuple[int | None, str]] = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            doc = json.loads(line)
        except json.JSONDecodeError as exc:
            problems.append((number, f"not a JSON object: {exc.msg} (column {exc.colno})"))
            continue
        try:
            lines.append((number, PromptLine.model_validate(doc)))
        except ValidationError as exc:
            for err in exc.errors():
                where = ".".join(str(p) for p in err["loc"])
                problems.append((number, f"{where}: {_message(err)}" if where else _message(err)))
    if not problems and not lines:
        problems.append((None, "no prompt in the file (one JSON object per line: {\"prompt\": ...} or "
                               "{\"messages\": [...]})"))
    if len(lines) > MAX_PROMPTS:
        problems.append((lines[MAX_PROMPTS][0], f"more than {MAX_PROMPTS} prompts; split the set into several drills"))
    if problems:
        raise PromptsFileError(path, problems[:20])
    return PromptsFile(path=path, lines=lines, sha256=hashlib.sha256(raw).hexdigest())


def _message(err: dict) -> str:
    if err["type"] == "extra_forbidden":
        return "unknown field; allowed: prompt, messages, max_tokens (and role, content in a message)"
    if err["type"] == "literal_error":
        return f"{err['msg']}"  # pydantic names the allowed values
    return err["msg"].removeprefix("Value error, ")


def prompt_count(workload) -> int:
    """How many prompts a workload sends: its prompts file's lines, else ``workload.prompts``."""
    if workload.prompts_file is None:
        return workload.prompts
    return len(load_prompts_file(Path(workload.prompts_file)).lines)
