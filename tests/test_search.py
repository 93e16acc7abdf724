"""Best-of-N and Speculative Rejection on tiny random models with the self-likelihood reward."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from tiny import tiny_model
from tolerance import assert_same_sample

import jaxsr
from jaxsr.decoding import loop, state
from jaxsr.decoding.driver import as_sampler
from jaxsr.decoding.inputs import Options, prepare
from jaxsr.decoding.memory import budget_slots, parse_bytes
from jaxsr.rewards import SelfLikelihood
from jaxsr.search.memory import batch_ladder
from jaxsr.search.scheduler import Batch, Decision, PromptSearch, run_searches
from jaxsr.search.speculative_rejection import keep_mask

PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8]]


@pytest.fixture(scope="module")
def lm():
    return tiny_model(seed=0, eos_token_ids=(5,))


def reference_keep(scores: list[float], rate: float, floor: int) -> set[int]:
    """Plain-Python statement of the reference rule (sort by score, descending, first come first, keep
    int(round((1-α)·n))), floored at `floor`: 0 is the reference's count, 1 jaxsr's default."""
    k = max(floor, round((1 - rate) * len(scores)))
    ranked = sorted(range(len(scores)), key=lambda i: (-scores[i], i))
    return set(ranked[:k])


@pytest.mark.parametrize("floor", [0, 1])
@pytest.mark.parametrize("rate", [0.1, 0.3, 0.5, 0.7, 0.9])
def test_keep_rule_matches_plain_python(rate, floor):
    rng = np.random.default_rng(int(rate * 10))
    for size in [1, 2, 3, 5, 7, 10, 33]:
        scores = rng.integers(0, 4, size).astype(float)  # many ties
        kept = keep_mask(scores, rate, min_keep=floor)
        assert set(np.flatnonzero(kept)) == reference_keep(list(scores), rate, floor)


def test_keep_rule_rounds_half_to_even():
    assert keep_mask(np.arange(5.0), 0.5).sum() == 2  # round(2.5) == 2
    assert keep_mask(np.arange(3.0), 0.5).sum() == 2  # round(1.5) == 2
    assert keep_mask(np.arange(1.0), 0.9).sum() == 1  # jaxsr's floor: never empty
    assert keep_mask(np.arange(1.0), 0.5, min_keep=0).sum() == 0  # the reference's: round(0.5) == 0


def test_quantile_rule_keeps_scores_at_or_above_the_quantile():
    scores = np.array([0.1, 0.5, 0.2, 0.9, 0.4])
    kept = keep_mask(scores, 0.5, rule="quantile")
    assert set(np.flatnonzero(kept)) == {1, 3, 4}


def test_batch_ladder():
    assert batch_ladder(64, 0.5) == [64, 32, 16, 8, 4, 2, 1]
    assert batch_ladder(10, 0.3) == [10, 7, 5, 4, 3, 2, 1]
    assert batch_ladder(8, 0.0) == [8]


@pytest.mark.slow  # compiles Best-of-N and SR's one rung, 2 prompts × 8 rows
def test_zero_rejection_is_best_of_n(lm):
    reward = SelfLikelihood()
    bon = jaxsr.best_of_n(lm, reward, PROMPTS, n=8, max_new_tokens=20, seed=3)
    sr = jaxsr.speculative_rejection(
        lm, reward, PROMPTS, n=8, rejection_rate=0.0, max_new_tokens=20, seed=3, memory_budget=16 + 8 * 32
    )
    for a, b in zip(bon, sr, strict=True):
        assert [s.token_ids for s in a.samples] == [s.token_ids for s in b.samples]
        # the same choice; its log-probability only to f32 rounding (SR's cache has another capacity)
        assert a.best is not None and b.best is not None
        assert_same_sample(b.best, a.best)
        assert b.stats["rounds"] == 1


class Branching:
    """A search policy that forks: two rows; after 4 tokens each becomes two, the copy that keeps its
    parent's sample index and a child with index + 2; then both decode to the end."""

    prompt_slots = 16

    def first_batch(self) -> Batch:
        return Batch(2, 16)

    def round_end(self, generated: int, segment: int) -> int:
        return 4 if generated < 4 else 16

    def decide(self, samples, generated: int) -> Decision:
        ids = [samples[0].index, samples[0].index + 2, samples[1].index, samples[1].index + 2]
        return Decision([0, 0, 1, 1], Batch(4, 16), ids)

    def final(self, samples):
        return samples

    def stats(self):
        return {}


def test_a_search_that_branches_gives_each_child_a_stream_of_its_own():
    """A row kept twice is copied with its cache (no prefill again): the copy that keeps the parent's
    sample index decodes what the parent would have, the child shares the parent's first 4 tokens and
    then draws its own."""
    lm = tiny_model(seed=0, logit_scale=1.0)  # near-uniform: two streams do not agree for 12 tokens
    sampler = as_sampler(lm, jaxsr.SamplingConfig())
    request = prepare(sampler.models, PROMPTS[:1], Options(max_new_tokens=16, seed=3))
    search = PromptSearch(sampler, SelfLikelihood(), request, 0, Branching())
    run_searches(sampler, [search], concurrent=1)
    result = search.result()
    plain = jaxsr.generate(lm, PROMPTS[:1], max_new_tokens=16, num_samples=2, seed=3)[0].samples
    by_index = {s.index: s.token_ids for s in result.samples}
    assert sorted(by_index) == [0, 1, 2, 3] and result.stats["batch_sizes"] == [2, 4]
    assert result.stats["token_forwards"]["generator"] == 16 + 2 * 3 + 4 * 12  # prompt, then per round
    for parent in (0, 1):
        assert by_index[parent] == plain[parent].token_ids
        assert by_index[parent + 2][:4] == plain[parent].token_ids[:4]
        assert by_index[parent + 2][4:] != plain[parent].token_ids[4:]


@pytest.fixture(scope="module")
def sr_run(lm):
    budget = 16 + 32 * 8
    results = jaxsr.speculative_rejection(
        lm,
        SelfLikelihood(),
        PROMPTS,
        n=32,
        rejection_rate=0.5,
        max_new_tokens=40,
        seed=3,
        memory_budget=budget,
        min_first_segment=8,
    )
    bon = jaxsr.best_of_n(lm, SelfLikelihood(), PROMPTS, n=32, max_new_tokens=40, seed=3)
    return budget, results, bon


def test_survivors_continue_exactly_as_they_would_unrejected(sr_run):
    _, results, bon = sr_run
    for sr, full in zip(results, bon, strict=True):
        for sample in sr.samples:  # tokens exactly; scores to f32 rounding (other batch shapes)
            assert_same_sample(sample, full.samples[sample.index])


def test_batch_shrinks_and_memory_stays_within_budget(lm, sr_run):
    budget, results, _ = sr_run
    for r in results:
        sizes = r.stats["batch_sizes"]
        assert sizes[0] == 32 and r.stats["rounds"] >= 2
        assert all(b < a for a, b in itertools.pairwise(sizes))
        assert max(r.stats["kv_bytes"]) <= budget * lm.kv_slot_bytes
        # the prompt is prefilled once: generator forwards = prompt bucket + decode rows
        decode = sum(x["steps"] * x["batch_size"] for x in r.stats["round_log"])
        assert r.stats["token_forwards"]["generator"] == 16 + decode
        assert r.best is max(r.samples, key=lambda s: s.score)


def parse_budget(budget) -> int:
    return budget_slots(budget, slot_bytes=4)


def test_memory_derived_first_batch(lm):
    r = jaxsr.speculative_rejection(
        lm, SelfLikelihood(), PROMPTS[:1], rejection_rate=0.5, max_new_tokens=8, memory_budget=16 + 10 * 16
    )[0]
    assert r.stats["initial_batch"] == 10 and r.stats["batch_sizes"][0] == 10
    assert parse_budget(np.int64(16 + 10 * 16)) == 16 + 10 * 16  # NumPy ints count, as for `n` and `seed`


@pytest.mark.slow  # compiles every SR rung and compaction of a 3-layer model, then runs again
def test_each_rung_compiles_once():
    """Compilations = distinct rungs visited (decode) and distinct rung transitions (compaction); calls
    that revisit them compile nothing. Which rungs a call visits depends on its samples (EOS)."""
    lm = tiny_model(seed=0, eos_token_ids=(5,), num_layers=3)  # cache shapes no other test compiles
    kwargs = dict(n=16, rejection_rate=0.5, max_new_tokens=24, memory_budget=16 + 16 * 8, min_first_segment=8)
    calls = [([[1, 2, 3]], 1), ([[7, 8, 9, 10]], 2)]

    def run_all() -> tuple[set, set]:
        rungs, transitions = set(), set()
        for prompts, seed in calls:
            log = jaxsr.speculative_rejection(lm, SelfLikelihood(), prompts, seed=seed, **kwargs)[0]
            shapes = [(x["batch_size"], x["kv_bytes"]) for x in log.stats["round_log"]]
            rungs.update(shapes)
            transitions.update(itertools.pairwise(shapes))
        return rungs, transitions

    def sizes() -> tuple[int, int]:
        return loop.decode_loop._cache_size(), state.compact._cache_size()

    before = sizes()
    rungs, transitions = run_all()
    after = sizes()
    assert len(rungs) >= 3 and len(transitions) >= 2
    assert (after[0] - before[0], after[1] - before[1]) == (len(rungs), len(transitions))
    run_all()
    assert sizes() == after


@pytest.mark.slow  # compiles SR's rungs of a model no other test uses, at 2 prompt buckets
def test_a_prompt_bucket_floor_shares_compiled_programs_across_prompt_lengths():
    lm = tiny_model(seed=0, intermediate_size=24)  # no EOS: every call visits the same rungs
    kwargs = dict(n=8, rejection_rate=0.5, max_new_tokens=12, min_first_segment=8, memory_budget=32 + 8 * 8)
    short, long = [[1, 2, 3]], [list(range(1, 21))]  # 16- and 32-slot buckets

    def sizes() -> tuple[int, int]:
        return loop.prefill._cache_size(), loop.decode_loop._cache_size()

    jaxsr.speculative_rejection(lm, SelfLikelihood(), short, min_prompt_bucket=32, **kwargs)
    before = sizes()
    jaxsr.speculative_rejection(lm, SelfLikelihood(), long, min_prompt_bucket=32, **kwargs)
    assert sizes() == before
    jaxsr.speculative_rejection(lm, SelfLikelihood(), short, **kwargs)  # its own 16-slot bucket
    assert sizes()[0] == before[0] + 1


def test_decision_interval(lm):
    r = jaxsr.speculative_rejection(
        lm,
        SelfLikelihood(),
        PROMPTS[:1],
        n=8,
        rejection_rate=0.5,
        max_new_tokens=30,
        memory_budget=10_000,
        decision_interval=5,
    )[0]
    starts = [x["start_token"] for x in r.stats["round_log"]]
    assert starts == [1 + 5 * i for i in range(len(starts))] and len(starts) >= 3
    assert r.stats["batch_sizes"][:3] == [8, 4, 2]


def test_parse_bytes():
    assert parse_bytes("4GiB") == 4 * 2**30
    assert parse_bytes("1.5 MB") == 1_500_000
    with pytest.raises(ValueError, match="memory_budget"):
        parse_bytes("lots")


@pytest.mark.parametrize(
    ("kwargs", "error", "name"),
    [
        ({"rejection_rate": 1.0}, ValueError, "rejection_rate"),
        ({"rejection_rate": -0.1}, ValueError, "rejection_rate"),
        ({"n": 0}, ValueError, "n"),
        ({"memory_budget": 20}, ValueError, "memory_budget"),
        ({"memory_budget": 0}, ValueError, "memory_budget"),
        ({"memory_budget": "a lot"}, ValueError, "memory_budget"),
        ({"max_new_tokens": 0}, ValueError, "max_new_tokens"),
        ({"rule": "median"}, ValueError, "rule"),
        ({"min_keep": 2}, ValueError, "min_keep"),
        ({"reward": object()}, TypeError, "reward"),
        ({"prompts": []}, ValueError, "prompts"),
        ({"stop_token_ids": [-1]}, ValueError, "stop_token_ids"),
        ({"prompt_offset": -1}, ValueError, "prompt_offset"),
    ],
)
def test_speculative_rejection_refuses_bad_input(lm, kwargs, error, name):
    args = dict(reward=SelfLikelihood(), prompts=[[1, 2]], n=4, max_new_tokens=8, memory_budget=1000)
    args.update(kwargs)
    with pytest.raises(error, match=name):
        jaxsr.speculative_rejection(lm, **args)


def test_best_of_n_chunks_to_the_memory_budget(lm):
    whole = jaxsr.best_of_n(lm, SelfLikelihood(), PROMPTS[:1], n=8, max_new_tokens=10, seed=0)[0]
    chunked = jaxsr.best_of_n(
        lm, SelfLikelihood(), PROMPTS[:1], n=8, max_new_tokens=10, seed=0, memory_budget=16 + 2 * 16
    )[0]
    assert [s.token_ids for s in chunked.samples] == [s.token_ids for s in whole.samples]
    # chunks of 2 rows are another program than one batch of 8: log-probabilities and scores agree to
    # f32 rounding (3.8e-6 apart on an AVX2 CPU), the tokens and the choice exactly
    for got, expected in zip(chunked.samples, whole.samples, strict=True):
        assert_same_sample(got, expected)
    assert chunked.best is not None and chunked.best.index == whole.best.index
    assert chunked.stats["batch_rows"] == 2 and chunked.stats["kv_slots"] <= 16 + 2 * 16


def test_best_of_n_counts_every_prompt_cache_of_a_batch_in_the_budget(lm):
    """Fewer samples than rows: a batch holds several prompts, and each has its own prompt cache."""
    prompts = [[1 + i, 2, 3, 4, 5, 6, 7, 8, 9, 10] for i in range(8)]  # 16 prompt slots each
    budget = 144  # 4 prompts with one 16-slot row each (128 slots), not the 8 rows after one prompt
    results = jaxsr.best_of_n(lm, SelfLikelihood(), prompts, n=1, max_new_tokens=16, memory_budget=budget)
    assert {r.stats["batch_rows"] for r in results} == {4}
    assert all(r.stats["kv_bytes"] <= budget * lm.kv_slot_bytes for r in results)
    alone = [
        jaxsr.best_of_n(lm, SelfLikelihood(), [p], n=1, max_new_tokens=16, prompt_offset=i)[0]
        for i, p in enumerate(prompts[:2])
    ]
    assert [r.best.token_ids for r in results[:2]] == [r.best.token_ids for r in alone]
    with pytest.raises(ValueError, match="n"):
        jaxsr.best_of_n(lm, SelfLikelihood(), PROMPTS, n=0, max_new_tokens=4)
    with pytest.raises(ValueError, match="stop_token_ids"):
        jaxsr.best_of_n(lm, SelfLikelihood(), PROMPTS, n=2, max_new_tokens=4, stop_token_ids=[10**6])


@pytest.mark.slow  # compiles SR's rungs for a 12-slot first segment, 40 tokens
def test_the_first_segment_is_never_shorter_than_asked():
    """Segments are multiples of 8 slots: a minimum of 12 rounds up to 16 (fewer, longer rows), not
    down to 8, so the first decision comes after at least 12 tokens."""
    lm = tiny_model(seed=0)  # no EOS: rows run until the decision
    budget = 16 + 4 * 12  # prompt bucket + 4 rows of 12 slots
    r = jaxsr.speculative_rejection(
        lm, SelfLikelihood(), [[1, 2, 3]], max_new_tokens=40, memory_budget=budget, min_first_segment=12
    )[0]
    first = r.stats["round_log"][0]
    assert first["end_token"] >= 12 and first["batch_size"] == 3
    assert all(x["kv_bytes"] <= budget * lm.kv_slot_bytes for x in r.stats["round_log"])


class NaNReward:
    """A reward that cannot rank one response of a batch of more than two (so it passes the two
    stand-in responses it scores before decoding, and fails during the search)."""

    name = "nan-reward"
    token_forwards = 0

    def score(self, candidates):
        scores = np.arange(len(candidates), dtype=np.float64)
        if len(candidates) > 2:
            scores[0] = np.nan
        return scores


@pytest.mark.parametrize("search", ["best_of_n", "speculative_rejection"])
def test_a_non_finite_reward_is_refused_naming_the_reward(lm, search):
    kwargs = dict(n=4, max_new_tokens=8)
    if search == "speculative_rejection":
        kwargs["memory_budget"] = 16 + 4 * 16
    with pytest.raises(ValueError, match="reward: nan-reward returned a non-finite score"):
        getattr(jaxsr, search)(lm, NaNReward(), PROMPTS[:1], **kwargs)
