"""Speculative Rejection with several prompts in flight (`concurrent_prompts`): each prompt's result is
the one it gets searched alone, its memory stays within its budget, and stacks compile once per shape."""

from __future__ import annotations

import time

import pytest
from compiles import compilations
from tiny import tiny_model
from tolerance import assert_same_sample

import jaxsr
from jaxsr.rewards import SelfLikelihood

# lengths in two prompt buckets (16 and 32 slots): searches of different shapes run side by side
PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8], list(range(1, 21)), [9, 9], [3, 1, 4, 1, 5, 9], [2, 7]]
OPTIONS = dict(n=16, rejection_rate=0.5, max_new_tokens=40, min_first_segment=8, seed=3)


@pytest.fixture(scope="module")
def lm():
    return tiny_model(seed=0, eos_token_ids=(5,))


def search(model, concurrent: int, prompts=PROMPTS, **kwargs):
    options = {**OPTIONS, **kwargs}
    budget = 32 + 16 * 8 + 16 * options.get("headroom", 0)
    options.pop("headroom", None)
    return jaxsr.speculative_rejection(
        model, SelfLikelihood(), prompts, memory_budget=budget, concurrent_prompts=concurrent, **options
    )


def assert_same_search(packed, alone):
    for p, a in zip(packed, alone, strict=True):
        assert [s.index for s in p.samples] == [s.index for s in a.samples]
        for x, y in zip(p.samples, a.samples, strict=True):
            assert_same_sample(x, y)  # tokens exactly; scores to f32 rounding (other batch shapes)
        assert p.best.index == a.best.index
        assert p.stats["decisions"] == a.stats["decisions"]
        for key in ("batch_sizes", "kv_bytes", "initial_batch", "memory_budget_slots", "rounds"):
            assert p.stats[key] == a.stats[key], key
        assert [r["end_token"] for r in p.stats["round_log"]] == [
            r["end_token"] for r in a.stats["round_log"]
        ]


@pytest.fixture(scope="module")
def alone(lm):
    return search(lm, 1)


@pytest.mark.slow  # per packing: SR of 6 prompts × 16 rows, 40 tokens, its stacked shapes compiled
@pytest.mark.parametrize("concurrent", [2, 4, 8])
def test_packed_prompts_get_the_result_each_gets_alone(lm, alone, concurrent):
    packed = search(lm, concurrent)
    assert_same_search(packed, alone)


def test_each_result_is_handed_on_as_its_search_ends(lm, alone):
    """`on_result(i, result)` is called once per prompt, as its search ends (searches end out of prompt
    order), with what the call then returns."""
    ended = []
    packed = search(lm, 3, on_result=lambda i, result: ended.append((i, result)))
    assert sorted(i for i, _ in ended) == list(range(len(PROMPTS)))
    assert [i for i, _ in ended] != list(range(len(PROMPTS)))
    for i, result in ended:
        assert result.samples == packed[i].samples and result.best == packed[i].best
    with pytest.raises(TypeError, match="on_result: expected a function"):
        search(lm, 3, on_result=[])
    ended = []
    best = jaxsr.best_of_n(
        lm, SelfLikelihood(), PROMPTS[:2], n=2, max_new_tokens=4, on_result=lambda i, r: ended.append((i, r))
    )
    assert [(i, r.best) for i, r in ended] == [(0, best[0].best), (1, best[1].best)]


def test_the_prompts_in_flight_are_scored_in_one_reward_call_a_round(lm, alone):
    """A reward with `score_many` gets every prompt in flight of a round in one call (3 here), and the
    searches are those each prompt gets alone."""

    class Counting(SelfLikelihood):
        def __init__(self):
            super().__init__()
            self.calls: list[int] = []

        def score_many(self, batches):
            self.calls.append(len(batches))
            return [self.score(c) for c in batches]

    reward = Counting()
    packed = jaxsr.speculative_rejection(
        lm, reward, PROMPTS, memory_budget=32 + 16 * 8, concurrent_prompts=3, **OPTIONS
    )
    assert max(reward.calls) == 3
    assert_same_search(packed, alone)


def test_the_searches_reject_and_diverge(alone):
    """What the comparisons above rest on: every prompt rejects, and finished rows send some prompts to
    other rungs than the rest (so stacks form, split and re-form)."""
    assert all(r.stats["rounds"] >= 2 for r in alone)
    assert len({tuple(r.stats["batch_sizes"]) for r in alone}) >= 2


def test_each_prompt_stays_within_its_budget_and_shares_the_wall_time(lm):
    """Prompts decoding alone and in stacks side by side: each prompt's timed parts fit in its wall time,
    and the wall times add up to no more than the call took."""
    t0 = time.perf_counter()
    packed = search(lm, 3)
    elapsed = time.perf_counter() - t0
    budget = packed[0].stats["memory_budget_slots"]
    parts = ("prefill_s", "decode_s", "scoring_s", "compaction_s", "compile_s")
    for r in packed:
        assert max(r.stats["kv_bytes"]) <= budget * lm.kv_slot_bytes
        assert r.stats["wall_s"] > 0 and r.stats["host_s"] >= -1e-9
        assert sum(r.stats[k] for k in parts) <= r.stats["wall_s"] + 1e-9
    assert sum(r.stats["wall_s"] for r in packed) <= elapsed


@pytest.mark.slow  # SR over speculative decoding of 4 prompts, alone and packed 4 at a time
def test_packed_search_over_speculative_decoding_matches_alone(lm):
    draft = tiny_model(seed=1, eos_token_ids=(5,))
    sampler = jaxsr.speculative_decoder(lm, draft, gamma=2)
    prompts = PROMPTS[:4]
    alone = search(sampler, 1, prompts, headroom=3)
    assert_same_search(search(sampler, 4, prompts, headroom=3), alone)


@pytest.mark.slow  # compiles packed SR's stacked rungs of a 3-layer model, then runs it again
def test_a_second_packed_call_compiles_nothing_new():
    """Without EOS every prompt of a bucket visits the same rungs, so a call with other prompts of the
    same buckets and another seed stacks the same shapes: nothing compiles again."""
    lm = tiny_model(seed=0, num_layers=3)  # no EOS, and shapes no other test compiles
    with compilations() as compiled:
        search(lm, 4, PROMPTS[:4])
    assert {"stack", "split"} <= set(compiled)  # the positive control: prompts were stacked
    with compilations() as compiled:
        search(lm, 4, [[7, 7, 7], [1, 2], list(range(3, 22)), [5, 5]], seed=11)
    assert not {"stack", "split", "decode_loop", "compact", "init_state", "prefill"} & set(compiled)


def test_concurrent_prompts_is_checked(lm):
    with pytest.raises(ValueError, match="concurrent_prompts"):
        search(lm, 0)
    with pytest.raises(TypeError, match="concurrent_prompts"):
        search(lm, 2.5)


def test_a_prompt_that_cannot_fit_its_budget_is_refused_before_any_decoding(lm):
    with compilations() as compiled, pytest.raises(ValueError, match="memory_budget"):
        jaxsr.speculative_rejection(
            lm, SelfLikelihood(), [[1, 2], list(range(1, 40))], n=4, max_new_tokens=8,
            memory_budget=16 + 4 * 8, concurrent_prompts=2,
        )  # fmt: skip
    assert "decode_loop" not in compiled and "prefill" not in compiled
