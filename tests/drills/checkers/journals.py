"""Small journals written through the real Journal API, for checker tests without a stack."""

from __future__ import annotations

from pathlib import Path

from drills.journal import History, Journal, read_history

ORACLE = {0: ([11, 12, 13, 14], " the sea was calm"), 1: ([21, 22, 23, 24], " and so it was")}


def metrics(hit: float, requested: float, ext_hit: float = 0, ext_q: float = 0, l2: float = 0) -> dict:
    return {
        "lmcache": {'lmcache_mp_lookup_hit_tokens_total{cache_salt="",model_name="m"}': hit,
                    'lmcache_mp_lookup_requested_tokens_total{cache_salt="",model_name="m"}': requested,
                    'lmcache_mp_lookup_hit_l2_tokens_total{cache_salt="",model_name="m"}': l2},
        "engine": {'vllm:external_prefix_cache_hits_total{engine="0",model_name="smollm2"}': ext_hit,
                   'vllm:external_prefix_cache_queries_total{engine="0",model_name="smollm2"}': ext_q},
    }


def build(tmp: Path, chaos_answers: dict[int, tuple[list[int], str]] | None = None, *, chaos_hit=(1536, 1536),
          oracle=ORACLE, failed: set[int] = frozenset()) -> History:
    j = Journal(tmp)
    j.phase = "oracle"
    for pid, (tokens, text) in oracle.items():
        j.append("response", request_id=f"oracle-w1-p{pid}-baseline", prompt_id=pid, target="baseline", wave=1,
                 ok=True, token_ids=tokens, text=text, finish_reason="length")
    for phase in ("warm", "steady", "chaos", "recovery"):
        j.phase = phase
        j.append("observe.metrics", point="before", **metrics(0, 0))
        answers = chaos_answers if (phase == "chaos" and chaos_answers is not None) else oracle
        for pid, (tokens, text) in answers.items():
            ok = not (phase == "chaos" and pid in failed)
            j.append("response", request_id=f"{phase}-w1-p{pid}-engine", prompt_id=pid, target="engine", wave=1,
                     ok=ok, token_ids=tokens if ok else [], text=text if ok else "", error=None if ok else "HTTP 500",
                     finish_reason="stop" if not tokens else "length")
        hit, req = chaos_hit if phase == "chaos" else (0, 1536)
        j.append("observe.metrics", point="wave1", **metrics(hit, req, ext_hit=hit, ext_q=req + 250, l2=hit))
    j.phase = "chaos"
    j.append("observe.log", service="lmcache", file="logs/lmcache.log",
             matches=[{"line": 42, "text": "LMCache INFO: Retrieved 768 tokens in 0.045 seconds"}])
    j.close()
    return read_history(tmp)
