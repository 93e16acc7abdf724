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
more of them than the rule would of the live rows alone; a short first segment or a decoder's
look-ahead overshoot can leave too little room to grow), the lowest-ranked are also stopped, down to
the widest rung that can grow (where none can, the search ends on this round's rows):
`Result.stats["forced_rejections"]` and each decision's `forced` count them. With no finished
response and a first segment of at least 16 tokens at a Best-of-N budget this does not happen.

The rows may be decoded by a two-model decoder (`jaxsr.speculative_decoder` etc.): the budget then
counts positions in both models' caches, each row keeps the decoder's look-ahead headroom (γ+1 slots)
past its segment, and a speculative step may carry a row up to γ tokens past a decision point (its
partial response is scored as it stands).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from functools import partial
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jaxsr.decoding.decoders import Engine, PairDecoder, as_engine
from jaxsr.decoding.generate import check_row_ids, check_sampling, check_seed, row_inputs
from jaxsr.decoding.prompts import check_positive_int, encode_prompts, left_pad
from jaxsr.decoding.sampling import SamplingConfig
from jaxsr.ladder import bucket
from jaxsr.models.model import Model
from jaxsr.results import Result, Sample
from jaxsr.rewards import as_reward
from jaxsr.rewards.base import Reward
from jaxsr.search.candidates import best, score_rows, token_scorer
from jaxsr.search.memory import budget_slots
from jaxsr.sharding import mesh_of, on_mesh, padded_rows

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


class _Plan:
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
        self.max_slots = bucket(max_new_tokens)
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


def speculative_rejection(
    model: Model | PairDecoder,
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
    exactly `best_of_n` with the same seed. `model` is a language model or a two-model decoder. See
    the module docstring for the algorithm. `min_keep` floors each decision's keep count (1; 0 is the
    reference's count, which can stop every row).

    `min_prompt_bucket` pads every prompt to at least that many slots (a power of two), so prompts of
    different lengths share compiled programs (on accelerators, where compiles are costly); the padding
    counts against the memory budget."""
    sampling = check_sampling(sampling)
    engine = as_engine(model, sampling)
    reward = as_reward(reward)
    rate = _check_rate(rejection_rate)
    if n is not None:
        n = check_positive_int("n", n)
    max_new_tokens = check_positive_int("max_new_tokens", max_new_tokens)
    min_first_segment = check_positive_int("min_first_segment", min_first_segment)
    min_prompt_bucket = check_positive_int("min_prompt_bucket", min_prompt_bucket)
    if decision_interval is not None:
        decision_interval = check_positive_int("decision_interval", decision_interval)
    if rule not in ("keep_fraction", "quantile"):
        raise ValueError(f"rule: expected 'keep_fraction' or 'quantile', got {rule!r}")
    if isinstance(min_keep, bool) or min_keep not in (0, 1):
        raise ValueError(f"min_keep: expected 0 (the reference's count) or 1, got {min_keep!r}")
    seed = check_seed(seed)
    encoded = encode_prompts(engine.model, prompts, chat=chat)
    engine.check_context(encoded, max_new_tokens)
    stop_token_ids, prompt_offset = check_row_ids(engine.model, stop_token_ids, prompt_offset)
    mesh = mesh_of(*engine.models)
    results = []
    for i, (prompt, ids) in enumerate(zip(prompts, encoded, strict=True)):
        prompt_slots = bucket(len(ids), min_prompt_bucket)
        fallback = None if n is None else prompt_slots + n * (bucket(max_new_tokens) + engine.headroom)
        budget = budget_slots(memory_budget, engine.slot_bytes, fallback_slots=fallback, mesh=mesh)
        plan = _Plan(budget, prompt_slots, max_new_tokens, n, rate, min_first_segment, engine.headroom)
        with on_mesh(*engine.models):
            result = _one_prompt(
                engine,
                reward,
                prompt,
                ids,
                plan,
                max_new_tokens,
                seed,
                rate,
                rule,
                min_keep,
                decision_interval,
                stop_token_ids,
                prompt_offset + i,
                mesh,
            )
        results.append(result)
    return results


def _one_prompt(
    engine: Engine,
    reward: Reward,
    prompt: Any,
    ids: list[int],
    plan: _Plan,
    max_new_tokens: int,
    seed: int,
    rate: float,
    rule: Rule,
    min_keep: int,
    interval: int | None,
    stop_token_ids: Sequence[int],
    prompt_id: int,
    mesh: Mesh | None,
) -> Result:
    """One prompt's search. On a mesh each rung's batch is padded with dead rows so that it splits
    over the `data` shards (the plan, and so the result, stays the same)."""
    padded = partial(padded_rows, mesh=mesh)
    timings = dict.fromkeys(("prefill_s", "decode_s", "scoring_s", "compaction_s"), 0.0)
    t_start = time.perf_counter()
    reward_before = reward.token_forwards
    model = engine.model
    scorer = token_scorer(model, reward, prompt, max_new_tokens)
    tokens, mask = left_pad([ids], 1, plan.prompt_slots)
    prefilled = engine.prefill(jnp.asarray(tokens), jnp.asarray(mask))
    jax.block_until_ready(prefilled)
    timings["prefill_s"] = time.perf_counter() - t_start
    forwards = dict.fromkeys(engine.roles, plan.prompt_slots)

    rows = plan.ladder[0]
    first_rows = row_inputs(
        model, prompts=1, real_prompts=1, samples_per_prompt=padded(rows), live_per_prompt=rows,
        first_sample=0, num_samples=rows,
        max_new_tokens=max_new_tokens, seed=seed, first_prompt_id=prompt_id, stop_token_ids=stop_token_ids,
    )  # fmt: skip
    state = engine.init_state(
        prefilled, capacity=plan.max_slots, cache_capacity=plan.capacity(rows) + plan.headroom, **first_rows
    )
    book = Book()
    round_log: list[dict[str, Any]] = []
    decisions: list[dict[str, Any]] = []
    generated = 1
    calls_before = dict.fromkeys(engine.roles, 0)
    while True:
        base = engine.base(state)
        slots = base.rows.capacity  # segment + look-ahead headroom
        pause = min(max_new_tokens, slots - plan.headroom + 1)
        if interval is not None:
            pause = min(pause, generated + interval)
        t0 = time.perf_counter()
        live = int(np.asarray(base.alive).sum())
        state = engine.decode_loop(state, prefilled, jnp.asarray(pause, jnp.int32))
        base = engine.base(state)
        host = jax.device_get(
            (
                base.tokens,
                base.num_generated,
                base.finished,
                base.done,
                base.alive,
                base.logprob_sum,
                base.sample_id,
                base.steps,
                engine.calls(state),
            )
        )
        buf, num, finished, done, alive, logprob, sample_id, steps, calls = host
        decode_s = time.perf_counter() - t0
        timings["decode_s"] += decode_s
        batch = len(alive)
        steps_before = sum(r["steps"] for r in round_log)
        round_log.append(
            {
                "start_token": generated,
                "end_token": int(num[alive].max(initial=generated)),
                "batch_size": batch,
                "live_rows": live,
                "steps": int(steps) - steps_before,
                "kv_bytes": (plan.prompt_slots + batch * slots) * engine.slot_bytes,
                "decode_s": decode_s,
            }
        )
        for role, total in calls.items():
            forwards[role] += (int(total) - calls_before[role]) * batch
        calls_before = {role: int(total) for role, total in calls.items()}
        generated = int(num[alive].max(initial=generated))

        # score every live row of this round (partial or complete)
        t1 = time.perf_counter()
        live_rows = np.flatnonzero(alive)
        token_lists = [buf[r, : num[r] - finished[r]].tolist() for r in live_rows]
        on_device = None
        if scorer is not None:  # the decode buffer is scored where it lies
            on_device = np.asarray(scorer(base.tokens, base.num_generated - base.finished))[live_rows]
        scores, texts = score_rows(
            model, reward, prompt, ids, token_lists, logprob[live_rows], num[live_rows], on_device
        )
        round_samples = [
            Sample(
                token_ids=t,
                text=x,
                score=float(s),
                finished=bool(finished[r]),
                logprob=float(logprob[r]),
                index=int(sample_id[r]),
            )
            for r, t, x, s in zip(live_rows, token_lists, texts, scores, strict=True)
        ]
        timings["scoring_s"] += time.perf_counter() - t1
        if done[alive].all():  # last round: every row finished or reached max_new_tokens
            final = [*book.permanent, *round_samples]
            break
        after, continuing, decision = decide(book, round_samples, rate, rule, min_keep)
        rung = plan.next_rung(len(continuing), generated) if continuing else None
        decision["forced"] = len(continuing) - (0 if rung is None else min(rung, len(continuing)))
        decision["rate"] = 1 - (decision["kept"] - decision["forced"]) / decision["pool"]
        decisions.append({"token": generated, **decision})
        if rung is None:  # nothing continues (or memory cannot hold a row further): stop here
            final = [*book.permanent, *round_samples]
            break
        book = after
        survivors = sorted(int(live_rows[j]) for j in continuing[:rung])
        t2 = time.perf_counter()
        index = np.array(survivors + [survivors[0]] * (padded(rung) - len(survivors)), np.int32)
        alive_next = np.arange(padded(rung)) < len(survivors)
        state = engine.compact(
            state, jnp.asarray(index), jnp.asarray(alive_next), plan.capacity(rung) + plan.headroom
        )
        timings["compaction_s"] += time.perf_counter() - t2

    wall = time.perf_counter() - t_start
    final.sort(key=lambda s: s.index)
    stats = {
        "wall_s": wall,
        **timings,
        "host_s": wall - sum(timings.values()),
        "token_forwards": {**forwards, "reward": reward.token_forwards - reward_before},
        "rounds": len(round_log),
        "batch_sizes": [r["live_rows"] for r in round_log],
        "kv_bytes": [r["kv_bytes"] for r in round_log],
        "round_log": round_log,
        "initial_batch": plan.ladder[0],
        "memory_budget_slots": plan.budget,
        "decisions": decisions,
        "forced_rejections": sum(d["forced"] for d in decisions),
    }
    return Result(prompt=prompt, samples=final, best=best(final), stats=stats)
