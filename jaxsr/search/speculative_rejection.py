"""Speculative Rejection (Sun, Haider, Zhang et al., NeurIPS 2024).

Best-of-N that starts as wide as the KV memory budget allows and, whenever the cache segment is full
(or every `decision_interval` tokens), scores the partial responses and stops the worst. One prompt
at a time: its KV is prefilled once and shared by every row. Rows live in one fixed-shape decode
state; finished and rejected rows are masked, and at each decision point the survivors are gathered
into a rung of a static batch ladder B0 > round((1-α)·B0) > … (the rows the keep rule leaves when no
response has finished; one row less where it would not shrink). A rung's row cache takes every slot
the budget allows (the first rung's rounded down to a multiple of SLOT_ALIGN), so the rows the rule
keeps fit the next rung and grow there whenever the memory can hold them; each rung is one compiled
shape. Survivors are never re-prefilled.

Bookkeeping (the reference implementation's, `decide`): the pool of a decision point is the finished
responses kept at the previous one plus every row of this round, ranked by reward; the
round((1-α)·|pool|) best are kept (Python's round, half to even). Kept finished responses join a
permanent list that is never pruned, kept unfinished rows continue. The answer is the best of the
permanent list and the last round's rows, which are also `Result.samples`.
`Result.stats["decisions"]` gives each decision's pool size, keep count, forced rejections and
effective rejection rate.

Deviations from the reference implementation (deliberate): survivors keep their exact tokens and
cache (no re-tokenisation, no truncation to the shortest row) and padding is never attended to.
At least one pool member is kept (`min_keep=1`) where the reference's int(round(...)) can keep none
and end the search on partial responses; `min_keep=0` restores that. When the memory cannot hold the
kept unfinished rows at the tokens they already have (kept finished responses in the pool can leave
more of them than the rule would of the live rows alone; a short first segment or a sampler's
look-ahead overshoot can leave too little room to grow), the lowest-ranked are also stopped, down to
the widest rung that can grow (where none can, the search ends on this round's rows):
`Result.stats["forced_rejections"]` and each decision's `forced` count them. With no finished
response and a first segment of at least 16 tokens at a Best-of-N budget this does not happen.

The rows may be decoded by a two-model sampler (`jaxsr.speculative_decoder` etc.): the budget then
counts positions in both models' caches, each row keeps the sampler's look-ahead headroom (γ+1 slots)
past its segment, and a speculative step may carry a row up to γ tokens past a decision point (its
partial response is scored as it stands).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxsr.checks import check_positive_int
from jaxsr.decoding.driver import Sampler, as_sampler, raw_samples, row_inputs
from jaxsr.decoding.inputs import Request, check_sampling, prepare
from jaxsr.decoding.sampling import SamplingConfig
from jaxsr.decoding.state import DecodeState, HostRows
from jaxsr.ladder import bucket
from jaxsr.models.model import Model
from jaxsr.results import Result, Sample
from jaxsr.rewards import as_reward
from jaxsr.rewards.base import Reward
from jaxsr.search.candidates import best, score_rows, token_scorer
from jaxsr.search.memory import budget_slots
from jaxsr.sharding import padded_rows
from jaxsr.text import left_pad

Rule = Literal["keep_fraction", "quantile"]
SLOT_ALIGN = 8  # the first rung's row-cache length is a multiple of this (fewer shapes across budgets)


def batch_ladder(first: int, rejection_rate: float) -> list[int]:
    """B0, round((1-α)·B0), … down to 1: the rows the keep rule leaves when no response has finished.
    Where the rule would not shrink a rung (small rungs, small α) the next is one row less; α=0 is
    one rung."""
    rungs = [first]
    while rungs[-1] > 1 and rejection_rate > 0:
        rungs.append(min(rungs[-1] - 1, max(1, round((1 - rejection_rate) * rungs[-1]))))
    return rungs


def keep_mask(
    scores: np.ndarray, rejection_rate: float, rule: Rule = "keep_fraction", min_keep: int = 1
) -> np.ndarray:
    """Which pool members survive a decision point.

    keep_fraction (the reference's rule): the round((1-α)·|pool|) best (Python's round, half to even;
    ties broken by pool order), floored at `min_keep` (1 by default; the reference's is 0). quantile
    (the paper's rule): scores ≥ the α-quantile (the best always)."""
    kept = np.zeros(len(scores), bool)
    if len(scores) == 0:
        return kept
    if rule == "keep_fraction":
        k = min(len(scores), max(min_keep, round((1 - rejection_rate) * len(scores))))
        kept[np.argsort(-scores, kind="stable")[:k]] = True
    elif rule == "quantile":
        kept = scores >= np.quantile(scores, rejection_rate)
        kept[int(np.argmax(scores))] = True
    else:
        raise ValueError(f"rule: expected 'keep_fraction' or 'quantile', got {rule!r}")
    return kept


class Book(NamedTuple):
    """The reference's bookkeeping of finished responses between decision points."""

    permanent: tuple[Sample, ...] = ()
    """Every finished response kept at some decision point: never pruned, always a candidate."""
    carried: tuple[Sample, ...] = ()
    """The finished responses kept at the last decision point: ranked again at the next one."""


def decide(
    book: Book, round_samples: Sequence[Sample], rate: float, rule: Rule = "keep_fraction", min_keep: int = 1
) -> tuple[Book, list[int], dict[str, Any]]:
    """One decision point, as the reference makes it: the pool is `book.carried` plus every row of this
    round, ranked by score; finished members it keeps join `book.permanent` and are carried to the next
    pool, unfinished ones continue. Returns the new book, the continuing rows (indices into
    `round_samples`, best first) and the decision's pool size and keep count."""
    pool = [*book.carried, *round_samples]
    kept = keep_mask(np.array([s.score for s in pool], np.float64), rate, rule, min_keep)
    in_round = kept[len(book.carried) :]
    carried = tuple(s for s, k in zip(pool, kept, strict=True) if k and s.finished)
    new = tuple(s for s, k in zip(round_samples, in_round, strict=True) if k and s.finished)
    order = np.argsort(-np.array([s.score for s in round_samples], np.float64), kind="stable")
    continuing = [int(j) for j in order if in_round[j] and not round_samples[j].finished]
    return Book(book.permanent + new, carried), continuing, {"pool": len(pool), "kept": int(kept.sum())}


def _check_rate(rejection_rate: Any) -> float:
    if isinstance(rejection_rate, bool) or not isinstance(rejection_rate, int | float):
        raise TypeError(f"rejection_rate: expected a float in [0, 1), got {type(rejection_rate).__name__}")
    if not 0 <= rejection_rate < 1:
        raise ValueError(f"rejection_rate: expected a value in [0, 1), got {rejection_rate}")
    return float(rejection_rate)


class MemoryPlan:
    """Memory plan for one prompt: first batch, ladder, and each rung's row-cache length.

    A row of a rung takes `capacity(rows)` slots for its segment plus `headroom` look-ahead slots."""

    def __init__(
        self,
        budget: int,
        prompt_slots: int,
        max_new_tokens: int,
        n: int | None,
        rate: float,
        min_segment: int,
        headroom: int = 0,
    ):
        self.budget, self.prompt_slots, self.headroom = budget, prompt_slots, headroom
        self.max_new_tokens, self.max_slots = max_new_tokens, bucket(max_new_tokens)
        room = budget - prompt_slots
        # the first segment is a whole multiple of SLOT_ALIGN (see `capacity`): round the minimum up
        if min_segment > SLOT_ALIGN:
            min_segment = min(-(-min_segment // SLOT_ALIGN) * SLOT_ALIGN, max(self.max_slots, SLOT_ALIGN))
        per_row = min_segment + headroom
        if room < per_row:
            raise ValueError(
                f"memory_budget: {budget} KV slots cannot hold one row (prompt {prompt_slots} + "
                f"first segment {min_segment} + look-ahead {headroom})"
            )
        first = n if n is not None else room // per_row
        if first * per_row > room:
            raise ValueError(
                f"memory_budget: {budget} KV slots cannot start n={first} rows "
                f"({prompt_slots} prompt + {first}×{per_row} first-segment and look-ahead slots)"
            )
        self.ladder = batch_ladder(first, rate)

    def capacity(self, rows: int) -> int:
        """Segment slots per row at a rung of `rows` rows (the headroom comes on top). The first rung's
        is a multiple of SLOT_ALIGN (fewer compiled shapes across budgets); later rungs take every slot
        the budget allows, so that rows kept there grow whenever the memory can hold them."""
        room = (self.budget - self.prompt_slots) // rows - self.headroom
        if rows == self.ladder[0] and room >= SLOT_ALIGN:
            room = room // SLOT_ALIGN * SLOT_ALIGN
        return min(self.max_slots, room)

    def next_rung(self, survivors: int, generated: int) -> int | None:
        """Smallest rung ≥ survivors whose cache can grow past `generated`; else the widest that can."""
        fitting = [b for b in self.ladder if self.capacity(b) >= generated]
        if not fitting:
            return None
        wide_enough = [b for b in fitting if b >= survivors]
        return min(wide_enough) if wide_enough else max(fitting)


@dataclasses.dataclass(frozen=True)
class SearchConfig:
    """The options of one `speculative_rejection` call that every prompt's search shares, validated."""

    rate: float
    rule: Rule
    min_keep: int
    decision_interval: int | None
    min_first_segment: int
    min_prompt_bucket: int

    @classmethod
    def checked(
        cls,
        rejection_rate: Any,
        rule: Any,
        min_keep: Any,
        decision_interval: Any,
        min_first_segment: Any,
        min_prompt_bucket: Any,
    ) -> SearchConfig:
        if rule not in ("keep_fraction", "quantile"):
            raise ValueError(f"rule: expected 'keep_fraction' or 'quantile', got {rule!r}")
        if isinstance(min_keep, bool) or min_keep not in (0, 1):
            raise ValueError(f"min_keep: expected 0 (the reference's count) or 1, got {min_keep!r}")
        if decision_interval is not None:
            decision_interval = check_positive_int("decision_interval", decision_interval)
        return cls(
            rate=_check_rate(rejection_rate),
            rule=rule,
            min_keep=int(min_keep),
            decision_interval=decision_interval,
            min_first_segment=check_positive_int("min_first_segment", min_first_segment),
            min_prompt_bucket=check_positive_int("min_prompt_bucket", min_prompt_bucket),
        )


def speculative_rejection(
    model: Model | Sampler,
    reward: Any,
    prompts: Sequence[str] | Sequence[Sequence[int]],
    *,
    n: int | None = None,
    rejection_rate: float = 0.5,
    memory_budget: int | str | None = None,
    max_new_tokens: int,
    sampling: SamplingConfig = SamplingConfig(),
    seed: int = 0,
    decision_interval: int | None = None,
    rule: Rule = "keep_fraction",
    min_keep: int = 1,
    min_first_segment: int = 16,
    min_prompt_bucket: int = 16,
    chat: bool | None = None,
    stop_token_ids: Sequence[int] = (),
    prompt_offset: int = 0,
) -> list[Result]:
    """Speculative Rejection per prompt; `rejection_rate=0` with a budget that holds all n rows is
    exactly `best_of_n` with the same seed. `model` is a language model or a two-model sampler. See
    the module docstring for the algorithm. `min_keep` floors each decision's keep count (1; 0 is the
    reference's count, which can stop every row).

    `min_prompt_bucket` pads every prompt to at least that many slots (a power of two), so prompts of
    different lengths share compiled programs (on accelerators, where compiles are costly); the padding
    counts against the memory budget."""
    sampler = as_sampler(model, check_sampling(sampling))
    reward = as_reward(reward)
    config = SearchConfig.checked(
        rejection_rate, rule, min_keep, decision_interval, min_first_segment, min_prompt_bucket
    )
    if n is not None:
        n = check_positive_int("n", n)
    request = prepare(
        sampler.models, prompts, max_new_tokens=max_new_tokens, sampling=sampling, seed=seed, chat=chat,
        stop_token_ids=stop_token_ids, prompt_offset=prompt_offset,
    )  # fmt: skip
    results = []
    for i, (prompt, ids) in enumerate(zip(prompts, request.encoded, strict=True)):
        plan = memory_plan(sampler, config, request, len(ids), n, memory_budget)
        with sampler.on_mesh():
            results.append(search_prompt(sampler, reward, config, request, plan, i, prompt))
    return results


def memory_plan(
    sampler: Sampler,
    config: SearchConfig,
    request: Request,
    prompt_len: int,
    n: int | None,
    memory_budget: Any,
) -> MemoryPlan:
    """The memory plan of one prompt: its budget in slots of all of the sampler's caches."""
    prompt_slots = bucket(prompt_len, config.min_prompt_bucket)
    max_new_tokens = request.max_new_tokens
    fallback = None if n is None else prompt_slots + n * (bucket(max_new_tokens) + sampler.headroom)
    budget = budget_slots(memory_budget, sampler.slot_bytes, fallback_slots=fallback, mesh=sampler.mesh)
    return MemoryPlan(
        budget, prompt_slots, max_new_tokens, n, config.rate, config.min_first_segment, sampler.headroom
    )


@dataclasses.dataclass
class Progress:
    """One prompt's search on the host: its timers, work counters, logs and finished responses."""

    forwards: dict[str, int]
    timings: dict[str, float] = dataclasses.field(
        default_factory=lambda: dict.fromkeys(("prefill_s", "decode_s", "scoring_s", "compaction_s"), 0.0)
    )
    book: Book = dataclasses.field(default_factory=Book)
    rounds: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    decisions: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    generated: int = 1
    """The longest live row's tokens at the last decision point."""
    steps: int = 0
    forwards_seen: np.ndarray | None = None
    """The state's per-model position counters when last read (they accumulate across rounds)."""


def search_prompt(
    sampler: Sampler,
    reward: Reward,
    config: SearchConfig,
    request: Request,
    plan: MemoryPlan,
    index: int,
    prompt: Any,
) -> Result:
    """One prompt's search: decode a round, score it, decide, compact the survivors — until every row
    is done or nothing continues. On a mesh each rung's batch is padded with dead rows so that it splits
    over the `data` shards (the plan, and so the result, stays the same)."""
    t_start = time.perf_counter()
    ids = request.encoded[index]
    reward_before = reward.token_forwards
    scorer = token_scorer(sampler.target, reward, prompt, request.max_new_tokens)
    progress = Progress(forwards=dict.fromkeys(sampler.roles, plan.prompt_slots))
    prefilled = prefill_prompt(sampler, ids, plan, progress)
    state = first_rows(sampler, request, plan, request.prompt_offset + index, prefilled)
    while True:
        state, host = decode_round(sampler, plan, config, state, prefilled[1], progress)
        round_samples, live_rows = score_round(sampler, reward, scorer, prompt, ids, state, host, progress)
        if host.done[host.alive].all():  # every row finished or reached max_new_tokens
            break
        survivors, rung = choose_survivors(plan, config, progress, round_samples, live_rows)
        if rung is None:  # nothing continues (or memory cannot hold a row further): stop here
            break
        state = compact_survivors(sampler, plan, state, survivors, rung, progress)

    final = sorted([*progress.book.permanent, *round_samples], key=lambda s: s.index)
    wall = time.perf_counter() - t_start
    stats = {
        "wall_s": wall,
        **progress.timings,
        "host_s": wall - sum(progress.timings.values()),
        "token_forwards": {**progress.forwards, "reward": reward.token_forwards - reward_before},
        "rounds": len(progress.rounds),
        "batch_sizes": [r["live_rows"] for r in progress.rounds],
        "kv_bytes": [r["kv_bytes"] for r in progress.rounds],
        "round_log": progress.rounds,
        "initial_batch": plan.ladder[0],
        "memory_budget_slots": plan.budget,
        "decisions": progress.decisions,
        "forced_rejections": sum(d["forced"] for d in progress.decisions),
    }
    return Result(prompt=prompt, samples=final, best=best(final), stats=stats)


def prefill_prompt(sampler: Sampler, ids: list[int], plan: MemoryPlan, progress: Progress) -> Any:
    """The prompt's caches in every model, prefilled once (its slots padded to the plan's bucket)."""
    t0 = time.perf_counter()
    tokens, mask = left_pad([ids], 1, plan.prompt_slots)
    prefilled = sampler.prefill(jnp.asarray(tokens), jnp.asarray(mask))
    jax.block_until_ready(prefilled)
    progress.timings["prefill_s"] = time.perf_counter() - t0
    return prefilled


def first_rows(
    sampler: Sampler, request: Request, plan: MemoryPlan, prompt_id: int, prefilled: Any
) -> DecodeState:
    """The first rung's rows, each with its first token (sample ids 0 … B0−1: Best-of-N's streams)."""
    rows = plan.ladder[0]
    inputs = row_inputs(
        sampler.target, prompts=1, real_prompts=1, samples_per_prompt=padded_rows(rows, sampler.mesh),
        live_per_prompt=rows, first_sample=0, num_samples=rows, max_new_tokens=request.max_new_tokens,
        seed=request.seed, first_prompt_id=prompt_id, stop_token_ids=request.stop_token_ids,
    )  # fmt: skip
    capacity = plan.capacity(rows) + plan.headroom
    return sampler.init_state(prefilled, capacity=plan.max_slots, cache_capacity=capacity, **inputs)


def decode_round(
    sampler: Sampler,
    plan: MemoryPlan,
    config: SearchConfig,
    state: DecodeState,
    prompts: tuple,
    progress: Progress,
) -> tuple[DecodeState, HostRows]:
    """Decode until the rung's cache segment is full (or the decision interval, or every row is done),
    then read the rows to the host in one transfer and log the round."""
    slots = state.rows[0].capacity  # segment + look-ahead headroom
    pause = min(plan.max_new_tokens, slots - plan.headroom + 1)
    if config.decision_interval is not None:
        pause = min(pause, progress.generated + config.decision_interval)
    t0 = time.perf_counter()
    live = int(np.asarray(state.alive).sum())
    state = sampler.decode_loop(state, prompts, jnp.asarray(pause, jnp.int32))
    host = HostRows.read(state)
    seconds = time.perf_counter() - t0
    progress.timings["decode_s"] += seconds
    batch = len(host.alive)
    end = int(host.num_generated[host.alive].max(initial=progress.generated))
    progress.rounds.append(
        {
            "start_token": progress.generated,
            "end_token": end,
            "batch_size": batch,
            "live_rows": live,
            "steps": host.steps - progress.steps,
            "kv_bytes": (plan.prompt_slots + batch * slots) * sampler.slot_bytes,
            "decode_s": seconds,
        }
    )
    seen = np.zeros_like(host.forwards) if progress.forwards_seen is None else progress.forwards_seen
    for role, total, before in zip(sampler.roles, host.forwards, seen, strict=True):
        progress.forwards[role] += int(total - before) * batch
    progress.forwards_seen, progress.steps, progress.generated = host.forwards, host.steps, end
    return state, host


def score_round(
    sampler: Sampler,
    reward: Reward,
    scorer: Any,
    prompt: Any,
    ids: list[int],
    state: DecodeState,
    host: HostRows,
    progress: Progress,
) -> tuple[list[Sample], np.ndarray]:
    """Every live row of the round as a scored `Sample` (partial or complete), and the rows' indices.
    An on-device scorer reads the decode buffer where it lies."""
    t0 = time.perf_counter()
    live_rows = np.flatnonzero(host.alive)
    raws = raw_samples(host, live_rows)
    on_device = None
    if scorer is not None:
        on_device = np.asarray(scorer(state.tokens, state.num_generated - state.finished))[live_rows]
    scores, texts = score_rows(
        sampler.target, reward, prompt, ids, [r.tokens for r in raws],
        host.logprob_sum[live_rows], host.num_generated[live_rows], on_device,
    )  # fmt: skip
    samples = [r.to_sample(t, float(s)) for r, t, s in zip(raws, texts, scores, strict=True)]
    progress.timings["scoring_s"] += time.perf_counter() - t0
    return samples, live_rows


def choose_survivors(
    plan: MemoryPlan,
    config: SearchConfig,
    progress: Progress,
    round_samples: list[Sample],
    live_rows: np.ndarray,
) -> tuple[list[int], int | None]:
    """A decision point: the reference's bookkeeping (`decide`), then the rung the continuing rows go
    to (None: the search ends on this round). Returns the surviving rows (state indices, in order) and
    the rung, and logs the decision with its forced rejections and effective rate."""
    book, continuing, decision = decide(
        progress.book, round_samples, config.rate, config.rule, config.min_keep
    )
    rung = plan.next_rung(len(continuing), progress.generated) if continuing else None
    decision["forced"] = len(continuing) - (0 if rung is None else min(rung, len(continuing)))
    decision["rate"] = 1 - (decision["kept"] - decision["forced"]) / decision["pool"]
    progress.decisions.append({"token": progress.generated, **decision})
    if rung is None:
        return [], None
    progress.book = book
    return sorted(int(live_rows[j]) for j in continuing[:rung]), rung


def compact_survivors(
    sampler: Sampler,
    plan: MemoryPlan,
    state: DecodeState,
    survivors: list[int],
    rung: int,
    progress: Progress,
) -> DecodeState:
    """Gather the survivors into the rung's batch (padded with dead rows to the mesh) and cache length."""
    t0 = time.perf_counter()
    size = padded_rows(rung, sampler.mesh)
    index = np.array(survivors + [survivors[0]] * (size - len(survivors)), np.int32)
    alive = np.arange(size) < len(survivors)
    state = sampler.compact(
        state, jnp.asarray(index), jnp.asarray(alive), plan.capacity(rung) + plan.headroom
    )
    progress.timings["compaction_s"] += time.perf_counter() - t0
    return state
