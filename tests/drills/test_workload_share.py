"""Share ratios: which prompts share which prefix, seeded; without ``share`` the token ids are those
kvdrill produced before share ratios existed (digests taken from that code, same fake tokenizer)."""

from __future__ import annotations

import hashlib
import json

import pytest
from pydantic import ValidationError

from drills.scenario import WorkloadSpec
from drills.workload import build_prompts, share_groups


class Tok:
    """A deterministic stand-in tokenizer: one id per word."""

    async def tokenize(self, text: str) -> list[int]:
        return [sum(map(ord, w)) % 5000 + 1 for w in text.split()]


def digest(prompts) -> str:
    return hashlib.sha256(json.dumps([p.token_ids for p in prompts]).encode()).hexdigest()[:16]


@pytest.mark.parametrize(("fresh", "expected"), [(False, "4c2c8370a540580b"), (True, "86dfcb2edd471fe7")])
async def test_without_share_the_token_ids_are_unchanged(fresh, expected):
    spec = WorkloadSpec(prompts=6, shared_prefix_tokens=64, unique_tokens=32)
    ps = await build_prompts(Tok(), spec, 7, fresh=fresh)
    assert digest(ps) == expected
    assert {p.group for p in ps} == {0}


async def test_share_groups_and_ratio_split_the_prefixes():
    spec = WorkloadSpec(prompts=8, shared_prefix_tokens=64, unique_tokens=32, share={"groups": 2, "ratio": 0.75})
    ps = await build_prompts(Tok(), spec, 7)
    groups = [p.group for p in ps]
    assert groups == share_groups(spec, 7) == [0, 1, 0, None, None, 1, 0, 1]  # seeded, exact
    heads = {p.id: tuple(p.token_ids[:64]) for p in ps}
    by_group: dict = {}
    for p in ps:
        by_group.setdefault(p.group, set()).add(heads[p.id])
    assert len(by_group[0]) == 1 and len(by_group[1]) == 1 and by_group[0] != by_group[1]
    own = by_group[None]
    assert len(own) == 2 and not own & (by_group[0] | by_group[1])  # each unshared prompt has its own
    assert len({len(p.token_ids) for p in ps}) == 1  # lengths do not depend on the ratio
    # the unique parts are still unique, and the group-0 prefix is the one an unshared scenario gets
    plain = await build_prompts(Tok(), WorkloadSpec(prompts=8, shared_prefix_tokens=64, unique_tokens=32), 7)
    assert by_group[0] == {tuple(plain.prompts[0].token_ids[:64])}
    assert [p.token_ids[64:] for p in ps] == [p.token_ids[64:] for p in plain]
    again = await build_prompts(Tok(), spec, 7)
    assert digest(again) == digest(ps)
    other_seed = await build_prompts(Tok(), spec, 8)
    assert digest(other_seed) != digest(ps)


async def test_the_fresh_set_keeps_the_groups_and_their_prefixes():
    spec = WorkloadSpec(prompts=4, shared_prefix_tokens=64, unique_tokens=32, share={"groups": 1, "ratio": 0.5})
    main, fresh = await build_prompts(Tok(), spec, 3), await build_prompts(Tok(), spec, 3, fresh=True)
    assert [p.group for p in main] == [p.group for p in fresh]
    for a, b in zip(main, fresh):
        assert (a.token_ids[:64] == b.token_ids[:64]) == (a.group is not None)


def test_ratio_zero_shares_nothing():
    spec = WorkloadSpec(prompts=4, shared_prefix_tokens=64, share={"groups": 1, "ratio": 0})
    assert share_groups(spec, 1) == [None] * 4


@pytest.mark.parametrize(("workload", "message"), [
    ({"shared_prefix_tokens": 0, "share": {"ratio": 0.5}}, "needs workload.shared_prefix_tokens > 0"),
    ({"prompts": 4, "share": {"groups": 2, "ratio": 0.5}}, "fewer than 2 per group"),
    ({"share": {"ratio": 1.5}}, "less than or equal to 1"),
    ({"share": {"groups": 0}}, "greater than or equal to 1"),
    ({"share": {"group": 2}}, "Extra inputs are not permitted"),
])
def test_share_validation_errors_say_what_to_change(workload, message):
    with pytest.raises(ValidationError, match=message):
        WorkloadSpec(**workload)
