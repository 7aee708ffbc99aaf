"""``workload.prompts_file``: the user's own prompts, one JSON object per line, instead of seeded stories.

    {"prompt": "Summarise the incident report below. ..."}
    {"messages": [{"role": "system", "content": "You are the on-call assistant. ..."},
                  {"role": "user", "content": "What failed first?"}], "max_tokens": 64}

A ``prompt`` is text, sent to ``/v1/completions``; ``prompt_embeds`` is a prompt given as embeddings (vLLM's own
wire form: base64 of a ``torch.save``d float tensor, tokens x hidden; drills/embeds.py), sent to
``/v1/completions`` too, where the engine runs with ``--enable-prompt-embeds``; ``messages`` is a chat, sent to ``/v1/chat/completions``
so the server applies its own chat template (and ``tools``, ``chat_template_kwargs``) as it does for users.
Either way the engine's tokenizer also turns the line into token ids first (vLLM's ``/tokenize``, for a chat
with the same template and fields), so the oracle, first-diff and ``kv_corrupt``'s chunks by prompt work on
what the engine saw; the chat endpoint's own ``prompt_token_ids`` are compared with them on every answer.
``max_tokens`` per line overrides ``workload.max_tokens``; ``request`` passes sampling and output fields
through to the engine (stop strings, logprobs, penalties, ...), named in :data:`REQUEST_FIELDS` so a typo is an
error here rather than a field the engine silently ignores. Sampling is greedy (temperature 0, seed 0), so the
checks can compare answers token by token; a recorded trace may keep its own ``temperature``, ``top_p`` and
``seed`` per line only where the scenario says ``workload.sampling: lines`` (validation context ``sampling``), and
a line that samples (temperature above 0) is then judged only by the checks that do not need token identity
(:data:`SAMPLED_CHECKS`). ``n``, ``best_of`` and beam search stay kvdrill's: one answer per request is compared.
``expected`` is the answer the line should get, for ``checks.score`` (the evaluation layer, drills/scoring.py).
``at`` is when the line was sent in a recorded trace (seconds from its start): ``workload.arrival: trace``
replays the lines at those times, scaled by its ``speed``.

The file is validated when the scenario is, each problem reported as ``FILE:LINE: field: why`` with the
allowed values, and read with a size cap (drills/inputs.py): a prompt set is data, never code.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

MAX_PROMPTS = 1024
Sampling = Literal["greedy", "lines"]
MAX_BYTES = 64 * 1024 * 1024


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Message(_Strict):
    role: Literal["system", "user", "assistant"]
    content: str = Field(min_length=1)


# fields of vLLM's completion and chat requests (vLLM 0.32's protocol.py) a line may pass through; what
# kvdrill itself sets (model, prompt/messages, max_tokens, stream, return_token_ids, cache_salt, seed) and
# what would break token identity with the oracle (temperature, top_p, n, beam search) are not among them
SAMPLING_FIELDS = frozenset({
    "stop", "stop_token_ids", "include_stop_str_in_output", "ignore_eos", "min_tokens", "logprobs", "prompt_logprobs",
    "presence_penalty", "frequency_penalty", "repetition_penalty", "length_penalty", "logit_bias", "allowed_token_ids",
    "bad_words", "skip_special_tokens", "spaces_between_special_tokens", "truncate_prompt_tokens", "response_format",
    "structured_outputs", "priority", "user", "min_p", "top_k"})
CHAT_ONLY_FIELDS = frozenset({"top_logprobs", "tools", "tool_choice", "parallel_tool_calls", "chat_template_kwargs",
                              "reasoning_effort", "include_reasoning"})
# chat fields that change how the prompt is rendered, so /tokenize must be given them too
RENDER_FIELDS = frozenset({"tools", "chat_template_kwargs"})
REQUEST_FIELDS = SAMPLING_FIELDS | CHAT_ONLY_FIELDS
# a line's own sampling, allowed only under workload.sampling: lines (a recorded trace's settings)
SAMPLING_OWNED = ("temperature", "top_p", "seed")
GREEDY_WHY = ("sampling is greedy in this drill, so answers are compared token by token with the no-cache answer; "
              "a recorded trace's own sampling needs workload.sampling: lines in the scenario")
# which checks judge a sampled line's answers: a sampled answer has no single right answer to compare with
TOKEN_IDENTITY_CHECKS = ("correctness", "production", "recovery")
SAMPLED_CHECKS = ("degenerate", "hit_rate", "leaks", "liveness", "slo", "logs", "score")
KVDRILL_OWNS = {"n": "one answer per request is compared",
                "use_beam_search": "beam search is not greedy", "best_of": "one answer per request is compared",
                "max_tokens": "use the line's own max_tokens", "stream": "kvdrill streams every request",
                "model": "the stack's served model is asked", "cache_salt": "kvdrill's oracle owns the salt",
                "return_token_ids": "kvdrill asks for token ids", "echo": "the answer alone is compared"}


class PromptLine(_Strict):
    prompt: str | None = Field(None, min_length=1, description="text, sent to /v1/completions")
    messages: list[Message] | None = Field(None, min_length=1, description="a chat, sent to /v1/chat/completions "
                                                                           "and rendered by the engine's template")
    prompt_embeds: str | None = Field(None, min_length=1, description="a prompt as embeddings: base64 of a "
                                      "torch.save'd float tensor (tokens x hidden), as vLLM's /v1/completions takes "
                                      "it; the engine needs --enable-prompt-embeds (stack.engine.prompt_embeds)")
    max_tokens: int | None = Field(None, ge=1, le=32768, description="this prompt's answer length (default: "
                                                                    "workload.max_tokens)")
    request: dict[str, Any] = Field(default_factory=dict, description="fields passed through to the engine's "
                                    "request (stop, logprobs, penalties, tools, ...; see REQUEST_FIELDS)")
    expected: str | None = Field(None, description="the answer this prompt should get, for checks.score")
    at: float | None = Field(None, ge=0, le=7 * 86400, description="seconds into a recorded trace: when "
                             "workload.arrival: trace sends this line")
    answer: str | None = Field(None, max_length=200_000, description="the answer production gave this request (a "
                               "recorded trace): the production check compares it with the no-cache answer and "
                               "with the drill's cached answers")

    @model_validator(mode="after")
    def _one_kind(self) -> PromptLine:
        if sum(x is not None for x in (self.prompt, self.messages, self.prompt_embeds)) != 1:
            raise ValueError("give exactly one of prompt (text), messages (a chat) or prompt_embeds (embeddings)")
        return self

    @field_validator("prompt_embeds")
    @classmethod
    def _a_tensor(cls, value: str | None) -> str | None:
        from drills.embeds import EmbedsError, read_embeds

        if value is not None:
            try:
                read_embeds(value)
            except EmbedsError as exc:
                raise ValueError(str(exc)) from None
        return value

    @field_validator("request")
    @classmethod
    def _known_fields(cls, request: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        sampling = (info.context or {}).get("sampling", "greedy")
        for name in request:
            if name in SAMPLING_OWNED:
                if sampling != "lines":
                    raise ValueError(f"{name}: not a line's to set ({GREEDY_WHY})")
                _sampling_value(name, request[name])
                continue
            if name in KVDRILL_OWNS:
                raise ValueError(f"{name}: not a line's to set ({KVDRILL_OWNS[name]})")
            if name not in REQUEST_FIELDS:
                raise ValueError(f"{name}: unknown field; allowed: {', '.join(sorted(REQUEST_FIELDS))}")
        return request

    @model_validator(mode="after")
    def _chat_fields_on_chats(self) -> PromptLine:
        if self.messages is None:
            chat_only = sorted(set(self.request) & CHAT_ONLY_FIELDS)
            if chat_only:
                kind = "a text prompt" if self.prompt is not None else "prompt_embeds"
                raise ValueError(f"request: {', '.join(chat_only)} only apply to a chat (messages), not to {kind}")
        if self.prompt_embeds is not None and "prompt_logprobs" in self.request:
            raise ValueError("request: prompt_logprobs: vLLM refuses it with prompt_embeds (there are no prompt "
                             "tokens to score)")
        return self

    @property
    def embeds(self):
        """The line's embeddings, read (shape, dtype, digest), or None."""
        from drills.embeds import read_embeds

        return read_embeds(self.prompt_embeds) if self.prompt_embeds is not None else None

    @property
    def sampled(self) -> bool:
        """Its answer is drawn, not argmax: a temperature above 0 (top_p and seed alone change nothing at 0)."""
        return float(self.request.get("temperature", 0)) > 0

    @property
    def render(self) -> dict[str, Any]:
        """The request fields that change how a chat is rendered (for /tokenize as for the chat endpoint)."""
        return {k: v for k, v in self.request.items() if k in RENDER_FIELDS}


@dataclass(frozen=True)
class PromptsFile:
    path: Path
    lines: list[tuple[int, PromptLine]]  # (line number in the file, the prompt), blank lines skipped
    sha256: str

    @property
    def kinds(self) -> dict[str, int]:
        chats = sum(1 for _, p in self.lines if p.messages is not None)
        embeds = sum(1 for _, p in self.lines if p.prompt_embeds is not None)
        sampled = sum(1 for _, p in self.lines if p.sampled)
        return {"text": len(self.lines) - chats - embeds, "chat": chats, **({"embeds": embeds} if embeds else {}),
                **({"sampled": sampled} if sampled else {})}


class PromptsFileError(Exception):
    def __init__(self, path: Path, problems: list[tuple[int | None, str]]) -> None:
        self.path, self.problems = path, problems
        super().__init__("\n".join(f"{path}:{line if line is not None else '?'}: {why}" for line, why in problems))


def _sampling_value(name: str, value: Any) -> None:
    """A line's own sampling setting, checked here: the engine's 400 would end the drill's oracle instead."""
    if name == "seed":
        if not isinstance(value, int) or isinstance(value, bool):
            raise ValueError(f"seed: {value!r} is not an integer")
        return
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ValueError(f"{name}: {value!r} is not a number")
    if name == "temperature" and not 0 <= value <= 2:
        raise ValueError(f"temperature: {value!r} is outside 0..2")
    if name == "top_p" and not 0 < value <= 1:
        raise ValueError(f"top_p: {value!r} is outside (0, 1]")


def load_prompts_file(path: Path, sampling: Sampling = "greedy") -> PromptsFile:
    """``sampling``: the scenario's ``workload.sampling``; ``lines`` lets a line keep its own temperature,
    top_p and seed."""
    from drills.inputs import InputFileError, read_limited

    try:
        raw = read_limited(path, MAX_BYTES, "prompts file", follow=True)
    except (InputFileError, OSError) as exc:
        raise PromptsFileError(path, [(None, f"cannot read the prompts file: {exc}; expected a JSONL file, its path "
                                             "relative to the scenario")]) from exc
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
            lines.append((number, PromptLine.model_validate(doc, context={"sampling": sampling})))
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
        return ("unknown field; allowed: prompt, messages, prompt_embeds, max_tokens, request, expected, at, answer "
                "(and role, content in a message)")
    if err["type"] == "literal_error":
        return f"{err['msg']}"  # pydantic names the allowed values
    return err["msg"].removeprefix("Value error, ")


def prompt_count(workload) -> int:
    """How many prompts a workload sends: its prompts file's lines, else ``workload.prompts``."""
    if workload.prompts_file is None:
        return workload.prompts
    return len(load_prompts_file(Path(workload.prompts_file), workload.sampling).lines)
