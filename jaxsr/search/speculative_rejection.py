"""Speculative Rejection (Sun, Haider, Zhang et al., NeurIPS 2024).

Best-of-N that starts as wide as the KV memory budget allows and, whenever the cache segment is full
(or every `decision_interval` tokens), scores the partial responses and stops the worst. Each prompt
is searched within its own budget, its KV prefilled once and shared by every row (several prompts'
searches can run at once, their rows decoded together: `jaxsr.search.packing`). Rows live in a
fixed-shape decode state; finished and rejected rows are masked, and at each decision point the
survivors are gathered into a rung of a static batch ladder B0 > round((1-α)·B0) > … (the rows the
keep rule leaves when no response has finished; one row less where it would not shrink). A rung's
row cache takes every slot the budget allows (the first rung's rounded down to a multiple of
SLOT_ALIGN), so the rows the rule keeps fit the next rung and grow there whenever the memory can
hold them; each rung is one compiled shape. Survivors are never re-prefilled.

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

from jaxsr.checks import check_positive_int, is_int, is_real
from jaxsr.decoding.driver import Sampler, as_sampler, raw_samples, row_inputs
from jaxsr.decoding.inputs import Request, check_sampling, prepare
from jaxsr.decoding.sampling import SamplingConfig
from jaxsr.decoding.state import DecodeState, HostRows
from jaxsr.ladder import bucket
from jaxsr.models.model import Model
from jaxsr.results import Result, Sample
from jaxsr.rewards import as_reward
from jaxsr.rewards.base import Reward
from jaxsr.search.candidates import best, check_reward, score_rows, token_scorer
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


def check_rejection_rate(rejection_rate: Any) -> float:
    if not is_real(rejection_rate):
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


MAX_PROMPT_BUCKET = 2**20


def _check_bucket(min_prompt_bucket: Any) -> int:
    bucket = check_positive_int("min_prompt_bucket", min_prompt_bucket)
    if bucket > MAX_PROMPT_BUCKET:
        raise ValueError(f"min_prompt_bucket: expected at most {MAX_PROMPT_BUCKET} slots, got {bucket}")
    return bucket


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
        if not isinstance(rule, str) or rule not in ("keep_fraction", "quantile"):
            raise ValueError(f"rule: expected 'keep_fraction' or 'quantile', got {rule!r}")
        if not is_int(min_keep) or min_keep not in (0, 1):
            raise ValueError(f"min_keep: expected 0 (the reference's count) or 1, got {min_keep!r}")
        if decision_interval is not None:
            decision_interval = check_positive_int("decision_interval", decision_interval)
        return cls(
            rate=check_rejection_rate(rejection_rate),
            rule=rule,
            min_keep=int(min_keep),
            decision_interval=decision_interval,
            min_first_segment=check_positive_int("min_first_segment", min_first_segment),
            min_prompt_bucket=_check_bucket(min_prompt_bucket),
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
    concurrent_prompts: int = 1,
    chat: bool | None = None,
    stop_token_ids: Sequence[int] = (),
    prompt_offset: int = 0,
) -> list[Result]:
    """Speculative Rejection per prompt; `rejection_rate=0` with a budget that holds all n rows is
    exactly `best_of_n` with the same seed. `model` is a language model or a two-model sampler. See
    the module docstring for the algorithm. `min_keep` floors each decision's keep count (1; 0 is the
    reference's count, which can stop every row).

    `memory_budget` is each prompt's KV budget. `concurrent_prompts` prompts search at once, each within
    its own budget (memory in use: up to `concurrent_prompts` budgets; with `memory_budget=None` the
    device's free memory is split among them): the rows of prompts whose rounds have the same shapes
    decode together in one batch, and a finished prompt's memory goes to the next prompt. Each prompt's
    result is the one it gets searched alone with the same budget (`jaxsr.search.packing`).

    `min_prompt_bucket` pads every prompt to at least that many slots (a power of two), so prompts of
    different lengths share compiled programs (on accelerators, where compiles are costly); the padding
    counts against the memory budget."""
    from jaxsr.search.packing import search_packed

    sampler = as_sampler(model, check_sampling(sampling))
    reward = as_reward(reward)
    config = SearchConfig.checked(
        rejection_rate, rule, min_keep, decision_interval, min_first_segment, min_prompt_bucket
    )
    if n is not None:
        n = check_positive_int("n", n)
    concurrent_prompts = check_positive_int("concurrent_prompts", concurrent_prompts)
    request = prepare(
        sampler.models, prompts, max_new_tokens=max_new_tokens, sampling=sampling, seed=seed, chat=chat,
        stop_token_ids=stop_token_ids, prompt_offset=prompt_offset,
    )  # fmt: skip
    check_reward(reward, sampler.target, prompts, request.encoded)
    concurrent_prompts = min(concurrent_prompts, len(request.encoded))  # no more in flight than there are
    # every prompt's plan before any decoding: a prompt that cannot fit its budget is refused up front
    plans = [
        memory_plan(sampler, config, request, len(ids), n, memory_budget, concurrent_prompts)
        for ids in request.encoded
    ]
    searches = [
        PromptSearch(sampler, reward, config, request, plan, i, prompt)
        for i, (plan, prompt) in enumerate(zip(plans, prompts, strict=True))
    ]
    with sampler.on_mesh():
        search_packed(sampler, searches, concurrent_prompts)
    return [s.result() for s in searches]


def memory_plan(
    sampler: Sampler,
    config: SearchConfig,
    request: Request,
    prompt_len: int,
    n: int | None,
    memory_budget: Any,
    concurrent_prompts: int = 1,
) -> MemoryPlan:
    """The memory plan of one prompt: its budget in slots of all of the sampler's caches (a share of
    the device's free memory when no budget is given)."""
    prompt_slots = bucket(prompt_len, config.min_prompt_bucket)
    max_new_tokens = request.max_new_tokens
    fallback = None if n is None else prompt_slots + n * (bucket(max_new_tokens) + sampler.headroom)
    budget = budget_slots(
        memory_budget, sampler.slot_bytes, fallback, sampler.mesh, copies=concurrent_prompts
    )
    if memory_budget is None and fallback is None:
        budget //= concurrent_prompts  # derived from the device: shared by the prompts in flight
    return MemoryPlan(
        budget, prompt_slots, max_new_tokens, n, config.rate, config.min_first_segment, sampler.headroom
    )


class PromptSearch:
    """One prompt's search, in named steps a scheduler drives (`packing.search_packed`): `start`
    (prefill, first rows), then rounds of decode (`begin_round`, then `read_round` on its rows), `score`,
    `decide` and `compact` — until every row is done or nothing continues; then `result`. On a mesh each
    rung's batch is padded with dead rows so that it splits over the `data` shards (the plan, and so the
    result, stays the same)."""

    def __init__(
        self,
        sampler: Sampler,
        reward: Reward,
        config: SearchConfig,
        request: Request,
        plan: MemoryPlan,
        index: int,
        prompt: Any,
    ):
        self.sampler, self.reward, self.config = sampler, reward, config
        self.request, self.plan = request, plan
        self.index, self.prompt, self.ids = index, prompt, request.encoded[index]
        self.forwards = dict.fromkeys(sampler.roles, plan.prompt_slots)
        self.timings = dict.fromkeys(("prefill_s", "decode_s", "scoring_s", "compaction_s"), 0.0)
        self.book = Book()
        self.rounds: list[dict[str, Any]] = []
        self.decisions: list[dict[str, Any]] = []
        self.generated = 1
        """The longest live row's tokens at the last decision point."""
        self.round_samples: list[Sample] = []
        self.finished = False
        self.state: DecodeState | None = None
        self.prompts: tuple = ()
        """The prompt's caches in every model (prefilled once)."""
        self.wall = 0.0
        self._reward_forwards = 0
        self.live = 0
        """Alive rows of the state (set where the rows are made: start, compact)."""
        self.steps_done = 0
        self.forwards_done = np.zeros(len(sampler.models), np.int64)
        """Decode steps and positions per row per model the state has run (its own counters, on the host)."""

    # -- steps ---------------------------------------------------------------------------------------

    def start(self) -> None:
        """Prefill the prompt in every model (its slots padded to the plan's bucket) and set up the first
        rung's rows, each with its first token (sample ids 0 … B0−1: Best-of-N's random streams)."""
        t0 = time.perf_counter()
        sampler, plan, request = self.sampler, self.plan, self.request
        self.scorer = token_scorer(sampler.target, self.reward, self.prompt, request.max_new_tokens)
        tokens, mask = left_pad([self.ids], 1, plan.prompt_slots)
        prefilled = sampler.prefill(jnp.asarray(tokens), jnp.asarray(mask))
        jax.block_until_ready(prefilled)
        self.prompts = prefilled[1]
        rows = plan.ladder[0]
        inputs = row_inputs(
            sampler.target, prompts=1, real_prompts=1, samples_per_prompt=padded_rows(rows, sampler.mesh),
            live_per_prompt=rows, first_sample=0, num_samples=rows, max_new_tokens=request.max_new_tokens,
            seed=request.seed, first_prompt_id=request.prompt_offset + self.index,
            stop_token_ids=request.stop_token_ids,
        )  # fmt: skip
        capacity = plan.capacity(rows) + plan.headroom
        self.state = sampler.init_state(prefilled, capacity=plan.max_slots, cache_capacity=capacity, **inputs)
        self.live = rows
        self.timings["prefill_s"] = time.perf_counter() - t0

    def shape(self) -> tuple[int, ...]:
        """What fixes the compiled shapes of this prompt's next round: searches with equal shapes can
        decode in one batch."""
        return (self.state.tokens.shape[0], self.state.rows[0].capacity, self.plan.prompt_slots)

    def begin_round(self) -> int:
        """The token count this round decodes to: the rung's cache segment is full (or the decision
        interval is reached, or the budget)."""
        self._slots = slots = self.state.rows[0].capacity  # segment + look-ahead headroom
        pause = min(self.plan.max_new_tokens, slots - self.plan.headroom + 1)
        if self.config.decision_interval is not None:
            pause = min(pause, self.generated + self.config.decision_interval)
        return pause

    def read_round(
        self, state: DecodeState, host: HostRows, seconds: float, steps: int, forwards: np.ndarray
    ):
        """Take the round's decoded rows back (`host`: their fields on the host) and log the round:
        `steps` decode steps ran over these rows, `forwards` positions per row through each model."""
        batch, slots = len(host.alive), self._slots
        end = int(host.num_generated[host.alive].max(initial=self.generated))
        self.rounds.append(
            {
                "start_token": self.generated,
                "end_token": end,
                "batch_size": batch,
                "live_rows": self.live,
                "steps": steps,
                "kv_bytes": (self.plan.prompt_slots + batch * slots) * self.sampler.slot_bytes,
                "decode_s": seconds,
            }
        )
        self.timings["decode_s"] += seconds
        for role, n in zip(self.sampler.roles, forwards, strict=True):
            self.forwards[role] += int(n) * batch
        self.steps_done += steps
        self.forwards_done = self.forwards_done + forwards
        self.state, self.host, self.generated = state, host, end

    def score(self) -> None:
        """Every live row of the round as a scored `Sample` (partial or complete). An on-device scorer
        reads the decode buffer where it lies."""
        t0 = time.perf_counter()
        before = self.reward.token_forwards
        host, state = self.host, self.state
        live_rows = np.flatnonzero(host.alive)
        raws = raw_samples(host, live_rows)
        on_device = None
        if self.scorer is not None:
            on_device = np.asarray(self.scorer(state.tokens, state.num_generated - state.finished))[live_rows]
        scores, texts = score_rows(
            self.sampler.target, self.reward, self.prompt, self.ids, [r.tokens for r in raws],
            host.logprob_sum[live_rows], host.num_generated[live_rows], on_device,
        )  # fmt: skip
        self.round_samples = [r.to_sample(t, float(s)) for r, t, s in zip(raws, texts, scores, strict=True)]
        self.live_rows = live_rows
        self._reward_forwards += self.reward.token_forwards - before
        self.timings["scoring_s"] += time.perf_counter() - t0

    def decide(self) -> None:
        """A decision point: the reference's bookkeeping (`decide`), the rung the continuing rows go to,
        and the survivors gathered there — or the search ends (every row done, or nothing continues, or
        memory cannot hold a row further). Logs the decision with its forced rejections and effective
        rate."""
        if self.host.done[self.host.alive].all():  # every row finished or reached max_new_tokens
            return self._finish()
        config, plan = self.config, self.plan
        book, continuing, decision = decide(
            self.book, self.round_samples, config.rate, config.rule, config.min_keep
        )
        rung = plan.next_rung(len(continuing), self.generated) if continuing else None
        decision["forced"] = len(continuing) - (0 if rung is None else min(rung, len(continuing)))
        decision["rate"] = 1 - (decision["kept"] - decision["forced"]) / decision["pool"]
        self.decisions.append({"token": self.generated, **decision})
        if rung is None:
            return self._finish()
        self.book = book
        self.compact(sorted(int(self.live_rows[j]) for j in continuing[:rung]), rung)

    def compact(self, survivors: list[int], rung: int) -> None:
        """Gather the survivors into the rung's batch (padded with dead rows to the mesh) and cache."""
        t0 = time.perf_counter()
        size = padded_rows(rung, self.sampler.mesh)
        index = np.array(survivors + [survivors[0]] * (size - len(survivors)), np.int32)
        alive = np.arange(size) < len(survivors)
        capacity = self.plan.capacity(rung) + self.plan.headroom
        self.state = self.sampler.compact(self.state, jnp.asarray(index), jnp.asarray(alive), capacity)
        self.live = len(survivors)
        self.timings["compaction_s"] += time.perf_counter() - t0

    def attributed(self) -> float:
        """Seconds spent on this prompt so far (prefill, decode, scoring, compaction)."""
        return sum(self.timings.values())

    def _finish(self) -> None:
        self.final = sorted([*self.book.permanent, *self.round_samples], key=lambda s: s.index)
        self.finished, self.state, self.prompts, self.host = True, None, (), None  # free the caches

    def result(self) -> Result:
        timings = self.timings
        stats = {
            "wall_s": self.wall,
            **timings,
            "host_s": self.wall - sum(timings.values()),
            "token_forwards": {**self.forwards, "reward": self._reward_forwards},
            "rounds": len(self.rounds),
            "batch_sizes": [r["live_rows"] for r in self.rounds],
            "kv_bytes": [r["kv_bytes"] for r in self.rounds],
            "round_log": self.rounds,
            "initial_batch": self.plan.ladder[0],
            "memory_budget_slots": self.plan.budget,
            "decisions": self.decisions,
            "forced_rejections": sum(d["forced"] for d in self.decisions),
        }
        return Result(prompt=self.prompt, samples=self.final, best=best(self.final), stats=stats)
