"""Speculative Rejection's bookkeeping at decision points, against a plain-Python statement of the
reference implementation's loop, and on a tiny model whose reward is built to outrank a finished answer."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from tiny import tiny_model
from tolerance import assert_same_sample

import jaxsr
from jaxsr.ladder import bucket
from jaxsr.results import Sample
from jaxsr.rewards import SelfLikelihood
from jaxsr.search.memory import MemoryPlan, RowLayout
from jaxsr.search.speculative_rejection import Book, decide


def reference_search(scores: np.ndarray, finished: np.ndarray, rate: float) -> tuple[set, int, list[set]]:
    """The reference's loop (Zanette-Labs/SpeculativeRejection, `perform_speculative_rejection`) over
    synthetic rounds: row i scores scores[t, i] at round t and has finished there when finished[t, i].
    Returns the ids of the final candidates, the chosen id and the generating ids after each decision."""
    trajectories, finished_trajectories, generating, history = [], [], list(range(scores.shape[1])), []
    for t in range(len(scores)):
        current = [(float(scores[t, i]), bool(finished[t, i]), i) for i in generating]
        previous_finished = [x for x in trajectories if x[1]]
        finished_trajectories += previous_finished
        ranked = sorted(previous_finished + current, key=lambda x: x[0], reverse=True)
        trajectories = ranked[: round((1 - rate) * len(ranked))]  # the reference: int(round(...))
        generating = [x[2] for x in trajectories if not x[1]]
        history.append(set(generating))
        if not generating:
            break
    final = trajectories + current + finished_trajectories
    return {x[2] for x in final}, max(final, key=lambda x: x[0])[2], history


def decide_search(scores, finished, rate, min_keep=0):
    """The same rounds through `decide`, as `choose_survivors` drives it."""
    book, rows, history = Book(), list(range(scores.shape[1])), []
    for t in range(len(scores)):
        samples = [
            Sample([i], "", score=float(scores[t, i]), finished=bool(finished[t, i]), index=i) for i in rows
        ]
        after, continuing, stats = decide(book, samples, rate, min_keep=min_keep)
        assert stats["pool"] == len(book.carried) + len(samples)
        history.append({samples[j].index for j in continuing})
        if not continuing:
            final = [*book.permanent, *samples]
            break
        book, rows = after, sorted(samples[j].index for j in continuing)
    assert len({s.index for s in final}) == len(final)  # every candidate once
    return {s.index for s in final}, max(final, key=lambda s: s.score).index, history


@pytest.mark.parametrize("rate", [0.1, 0.3, 0.5, 0.7, 0.9])
def test_decisions_match_the_reference_loop(rate):
    rng = np.random.default_rng(round(rate * 10))
    for trial in range(40):
        n, rounds = int(rng.integers(1, 40)), int(rng.integers(1, 8))
        scores = rng.normal(size=(rounds, n))  # distinct: the order among equals is not at stake
        finished = rng.random((rounds, n)) < rng.uniform(0, 0.5)
        finished[-1] = True  # the last round: every row finished or out of tokens
        assert decide_search(scores, finished, rate) == reference_search(scores, finished, rate), trial


def test_a_finished_answer_outranked_later_stays_a_candidate():
    """Kept at decision 1, outranked at decision 2: it stays in the permanent list (the reference's) and
    is chosen, though it is no longer ranked."""
    book, first = Book(), [Sample([0], "", 0.9, True, index=0), Sample([1], "", 0.1, False, index=1)]
    book, continuing, _ = decide(book, [*first, Sample([2], "", 0.5, False, index=2)], 0.5)
    assert [s.index for s in book.permanent] == [0] and continuing == [2]
    book, continuing, stats = decide(book, [Sample([2, 3], "", 1.0, False, index=2)], 0.5)
    assert stats == {"pool": 2, "kept": 1} and book.carried == () and continuing == [0]
    assert [s.index for s in book.permanent] == [0]


def test_the_keep_count_floor_is_a_switch():
    """int(round(0.3·1)) = 0: the reference stops every row (min_keep=0); jaxsr's default keeps one."""
    pool = [Sample([0], "", 0.0, False, index=0)]
    assert decide(Book(), pool, 0.7, min_keep=0)[1] == []
    assert decide(Book(), pool, 0.7)[1] == [0]


class LengthReward:
    """A reward of the response's shape, built so that a response finished in the first segment ranks
    first at decision 1, below every partial response at decision 2, and above all at the end: finished
    ones score 0.9 (less 0.001 a token, the shortest first), partial ones 0 up to `first_end` tokens (the
    first round's end), 1 after it and 0 at `max_new_tokens`."""

    name, token_forwards = "length", 0

    def __init__(self, first_end: int, max_new_tokens: int):
        self.first_end, self.max_new_tokens, self.calls = first_end, max_new_tokens, []

    def score(self, candidates) -> np.ndarray:
        lengths = np.array([len(t) for t in candidates.token_ids])
        finished = candidates.num_tokens > lengths
        partial = np.where((lengths > self.first_end) & (lengths < self.max_new_tokens), 1.0, 0.0)
        scores = np.where(finished, 0.9 - 0.001 * lengths, partial)
        self.calls.append(scores)
        return scores


def test_an_early_finished_answer_outranked_by_partials_is_still_chosen():
    lm = tiny_model(seed=0, eos_token_ids=(5,))
    reward = LengthReward(first_end=9, max_new_tokens=40)  # 8 cache slots + the token after them
    kwargs = dict(n=32, max_new_tokens=40, seed=3)
    budget = 16 + 32 * 8
    r = jaxsr.speculative_rejection(
        lm, reward, [[1, 2, 3]], rejection_rate=0.5, memory_budget=budget, min_first_segment=8, **kwargs
    )[0]
    assert max(r.stats["kv_bytes"]) <= budget * lm.kv_slot_bytes
    stand_ins, first, second = reward.calls[:3]  # a reward not of jaxsr's own: two stand-ins first
    assert len(stand_ins) == 2
    early = np.flatnonzero(first > 0.5)
    assert len(early) >= 1 and early.size <= r.stats["decisions"][0]["kept"]  # all kept at decision 1
    # at decision 2 the partial responses (score 1) fill every kept place: the early answers are outranked
    assert (second == 1.0).sum() >= r.stats["decisions"][1]["kept"]
    assert r.best is not None and r.best.finished and len(r.best.token_ids) < 9
    assert r.best is max(r.samples, key=lambda s: s.score)
    bon = jaxsr.best_of_n(lm, LengthReward(9, 40), [[1, 2, 3]], **kwargs)[0]
    assert r.best.index == bon.best.index  # Best-of-N's choice too
    for sample in r.samples:
        assert_same_sample(sample, bon.samples[sample.index])


def no_eos_decisions(plan: MemoryPlan, room: int, max_new: int, rate: float, min_keep: int, overshoot: int):
    """The plan's decisions when no response finishes: each round fills its rung's cache (a speculative
    step may run `overshoot` tokens past it) and the rule keeps round((1-α)·rows). Yields whether the
    memory can hold the kept rows at the tokens generated, the kept count, the next rung and the rows
    of the rung decided at."""
    rows = plan.ladder[0]
    while True:
        assert rows * (plan.capacity(rows) + plan.headroom) <= room  # within the budget
        generated = min(max_new, plan.capacity(rows) + 1 + overshoot)
        keep = min(rows, max(min_keep, round((1 - rate) * rows)))
        if generated == max_new or keep == 0:
            return
        rung = plan.next_rung(keep, generated)
        yield keep * (generated + plan.headroom) <= room, keep, rung, rows
        if rung is None:
            return
        rows = rung


@pytest.mark.parametrize("min_keep", [0, 1])
@pytest.mark.parametrize("rate", [0.1, 0.3, 0.5, 0.7, 0.9])
def test_the_plan_forces_a_rejection_only_where_the_memory_cannot_hold_the_kept_rows(rate, min_keep):
    """The next rung is exactly the rule's keep count whenever the memory can hold those rows at the
    tokens already generated; otherwise fewer rows continue (a forced rejection). That happens with
    short first segments, long look-ahead overshoots or the last few rows, never at a Best-of-N budget
    with the default 16-token first segment. Rungs rounded down (the first to SLOT_ALIGN, every one's
    cache, look-ahead included, to a TPU's tiles: `align=8`) force no more, except where a decision
    keeps every row of its rung: those rows then stop growing within one tile of where the memory
    would stop them."""
    rows_of = [(0, 0), (4, 0), (5, 5), (9, 5)]  # (headroom, look-ahead): working memory, a draft's γ+1
    for prompt, budget, max_new, (headroom, lookahead), segment, align in itertools.product(
        [16, 64], [144, 528, 1000, 1040, 4112], [40, 128, 256], rows_of, [8, 16], [1, 8]
    ):
        try:
            layout = RowLayout(headroom, lookahead, align)
            plan = MemoryPlan(budget, prompt, max_new, None, rate, segment, layout)
        except ValueError:
            continue
        assert plan.capacity(plan.ladder[0]) >= segment
        above = None
        for rows in plan.ladder:  # a rung's cache is whole tiles unless that would cut arriving rows
            cache = plan.capacity(rows) + lookahead
            whole = cache // align * align
            assert cache == whole or (above is not None and whole - lookahead < above + 1 + headroom)
            above = plan.capacity(rows)
        for overshoot in {0, max(headroom - 1, 0)}:
            for fits, keep, rung, rows in no_eos_decisions(
                plan, budget - prompt, max_new, rate, min_keep, overshoot
            ):
                assert rung is None or (rung <= keep if fits else rung < keep)
                if fits and rung != keep:  # the slots a rung rounded down gave up
                    room_a_row = (budget - prompt) // keep - headroom
                    tile = plan.first_align if rows == plan.ladder[0] else align
                    assert keep == rows and room_a_row - plan.capacity(rows) < tile
    for max_new, n in itertools.product([32, 40, 128, 256, 512], [4, 8, 16]):
        budget = 16 + n * bucket(max_new)
        plan = MemoryPlan(budget, 16, max_new, None, rate, 16)
        assert all(fits for fits, *_ in no_eos_decisions(plan, budget - 16, max_new, rate, min_keep, 0))


def test_on_a_tpu_row_caches_are_whole_tiles_where_that_stops_no_row():
    """Keys stored as values (a TPU, float heads of 128 or more) want row caches of whole 8-slot tiles:
    a full row's cache is rounded up to them (`Sampler.cache_slots`), and a search's rungs are planned
    in them, look-ahead included: the first rung's always, a later one's where its rows still hold what
    the rows above bring; elsewhere (CPU, GPU, int8 keys, narrower heads) every cache is as before."""
    import types

    from jaxsr.decoding.driver import Sampler
    from jaxsr.models.cache import slot_tile

    tiles = [slot_tile(128, False, "tpu"), slot_tile(256, False, "tpu"), slot_tile(128, True, "tpu")]
    assert tiles == [8, 8, 1]
    assert slot_tile(64, False, "tpu") == slot_tile(128, False, "cpu") == slot_tile(128, False, "gpu") == 1
    draft = types.SimpleNamespace(slot_tile=8, headroom=5)  # γ=4 on a TPU
    assert [Sampler.cache_slots(draft, tokens) for tokens in (8, 11, 12, 512)] == [16, 16, 24, 520]
    assert Sampler.cache_slots(types.SimpleNamespace(slot_tile=1, headroom=5), 512) == 517

    def capacities(budget: int, rate: float, segment: int, align: int, lookahead: int = 0) -> list[int]:
        plan = MemoryPlan(128 + budget, 128, 512, None, rate, segment, RowLayout(lookahead, lookahead, align))
        return [plan.capacity(rows) for rows in plan.ladder]

    assert capacities(1536, 0.75, 8, 1) == capacities(1536, 0.75, 8, 8) == [8, 32, 128, 512, 512]
    assert capacities(1000, 0.75, 8, 1) == [8, 32, 125, 500, 512]  # rows 125, 31, 8, 2, 1
    assert capacities(1000, 0.75, 8, 8) == [8, 32, 120, 496, 512]
    # a draft's look-ahead (5 slots): the caches, not the segments, are whole tiles (11 + 5 = 16; the
    # last rung's 515 + 5 holds 512 tokens); the first at least one tile, so 62 rows instead of 76
    assert capacities(1000, 0.75, 8, 1, lookahead=5) == [8, 47, 195, 512]  # rows 76, 19, 5, 1
    assert capacities(1000, 0.75, 8, 8, lookahead=5) == [11, 51, 243, 515]  # rows 62, 16, 4, 1
    # α=0.1 from 16 slots: rungs a few slots apart keep every slot (a row arrives with one more token
    # than the rung above holds), until a whole tile also holds that
    assert capacities(684, 0.1, 16, 1)[:8] == [16, 18, 20, 22, 24, 27, 31, 34]
    assert capacities(684, 0.1, 16, 8)[:8] == [16, 18, 20, 22, 24, 27, 31, 32]


@pytest.mark.slow  # per rate (5): SR's rungs of 8 rows for 32 tokens, batch sizes of its own
@pytest.mark.parametrize("rate", [0.1, 0.3, 0.5, 0.7, 0.9])
def test_without_eos_every_kept_row_continues(rate):
    lm = tiny_model(seed=0)  # no EOS
    budget = 16 + 4 * 32  # Best-of-4's memory: 8 rows of a 16-token first segment
    r = jaxsr.speculative_rejection(
        lm, SelfLikelihood(), [[1, 2, 3]], rejection_rate=rate, max_new_tokens=32, memory_budget=budget
    )[0]
    sizes = r.stats["batch_sizes"]
    assert sizes[0] == 8 and r.stats["forced_rejections"] == 0
    assert sizes[1:] == [round((1 - rate) * b) for b in sizes[:-1]]  # the rule, every row of it
    for d, rows in zip(r.stats["decisions"], sizes, strict=False):
        assert d["pool"] == rows and d["forced"] == 0 and d["rate"] == pytest.approx(1 - d["kept"] / rows)
    assert max(r.stats["kv_bytes"]) <= budget * lm.kv_slot_bytes
    assert all(len(s.token_ids) == 32 for s in r.samples)


@pytest.mark.slow  # per rate: SR of 16 rows over its own rungs, then Best-of-N
@pytest.mark.parametrize("rate", [0.1, 0.3, 0.7])
def test_with_eos_memory_stays_within_budget_and_samples_are_best_of_n_rows(rate):
    lm = tiny_model(seed=0, eos_token_ids=(5,))
    budget, kwargs = 16 + 16 * 8, dict(n=16, max_new_tokens=24, seed=1)
    r = jaxsr.speculative_rejection(
        lm,
        SelfLikelihood(),
        [[1, 2, 3]],
        rejection_rate=rate,
        memory_budget=budget,
        min_first_segment=8,
        **kwargs,
    )[0]
    assert r.stats["rounds"] >= 2 and any(s.finished for s in r.samples)
    assert max(r.stats["kv_bytes"]) <= budget * lm.kv_slot_bytes
    assert r.stats["forced_rejections"] == sum(d["forced"] for d in r.stats["decisions"])
    bon = jaxsr.best_of_n(lm, SelfLikelihood(), [[1, 2, 3]], **kwargs)[0]
    for sample in r.samples:
        assert_same_sample(sample, bon.samples[sample.index])
    assert r.best is max(r.samples, key=lambda s: s.score)
