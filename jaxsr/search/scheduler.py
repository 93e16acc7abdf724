"""The one search scheduler: prompts' searches run in rounds, several prompts' rows decoded together.

A search is one prompt's rows in a fixed-shape decode state, its prompt prefilled once per model and
shared by every row. It runs in rounds: decode until the rows pause, score the live rows' (partial)
responses, and let the method's `Policy` decide which rows continue and in what batch; the survivors
are gathered there (never re-prefilled; a row kept twice branches, each copy with a sample index and
so a random stream of its own). A new search method is a `Policy` (its first batch, where a round
pauses, what a decision keeps, what the search returns; optionally the responses it stopped):
Speculative Rejection's is `speculative_rejection.Rejection`.

`run_searches` keeps up to `concurrent` searches in flight. Every round, the searches whose next round
has the same shapes (rows, row-cache slots, prompt slots) are stacked into one decode state — rows
grouped by prompt, each group attending to its own prompt's caches — and decoded in one loop, each
prompt's rows pausing at its own point (`pause_at` per row). The state is then split back per prompt;
the prompts' responses are scored together (one reward call for all whose reward reads text:
`score_round`), and each prompt decides and compacts on its own. A finished prompt's place goes to the
next prompt. Stacking copies the members' caches for the round: while it runs, memory holds the stack and,
for a moment, the members' own states (transient, not counted in the plans).

A prompt's rows draw their random streams from (seed, prompt, sample, token index) and pause where its
own policy says, so its tokens, decisions and result are those of searching it alone; only floats that
depend on the batch (a reward model's scores) may differ in the last bits. Stacks are padded to a power
of two of prompts with copies marked dead, so the compiled shapes stay few.
"""

from __future__ import annotations

import dataclasses
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from jaxsr.decoding.driver import Layout, Sampler, samples_of
from jaxsr.decoding.inputs import Request
from jaxsr.decoding.state import DecodeState, pin, take_rows, to_host
from jaxsr.ladder import bucket
from jaxsr.models.cache import PromptCache
from jaxsr.results import Rejected, Result, Sample
from jaxsr.rewards.base import Reward
from jaxsr.search.candidates import (
    best,
    even_share,
    score_prompts,
    score_samples,
    token_scorer,
    true_to_text,
)
from jaxsr.sharding import padded_rows
from jaxsr.timing import Stopwatch


class Batch(NamedTuple):
    """A round's batch: `rows` live rows (before mesh padding), each with `segment` row-cache slots
    (the sampler's look-ahead headroom comes on top)."""

    rows: int
    segment: int


class Decision(NamedTuple):
    """Which rows continue: `keep` indexes the round's samples (the live rows, in row order); a row
    kept more than once branches, and `sample_ids` (one per entry of `keep`) then gives each copy a
    sample index, and so a random stream, of its own. None: every row keeps its own."""

    keep: list[int]
    batch: Batch
    sample_ids: list[int] | None = None


class Policy(Protocol):
    """What makes a search method: one prompt's decisions, with its own bookkeeping."""

    prompt_slots: int
    """Slots the prompt is padded to (its caches' length)."""

    def first_batch(self) -> Batch: ...

    def round_end(self, generated: int, segment: int) -> int:
        """The token count this round decodes to, from `generated` tokens (the longest live row's)."""
        ...

    def decide(self, samples: list[Sample], generated: int) -> Decision | None:
        """The rows that continue after a round whose live rows are `samples` (scored), or None: the
        search ends. Not called when every row is done."""
        ...

    def final(self, samples: list[Sample]) -> list[Sample]:
        """The search's samples (`Result.samples`), given the last round's."""
        ...

    def stats(self) -> dict[str, Any]:
        """The policy's own entries of `Result.stats`."""
        ...


def stopped_by(policy: Policy) -> list[Rejected] | None:
    """The responses a policy's decisions stopped, where it keeps them: its optional `rejected()`
    (`Result.rejected`; None for a policy without it)."""
    rejected = getattr(policy, "rejected", None)
    return None if rejected is None else rejected()


@dataclasses.dataclass
class Ledger:
    """What one search spent: seconds by stage, token positions run through each model (by role) and
    the reward, and the log of its rounds — its `Result.stats` but the policy's."""

    forwards: dict[str, int]
    timings: dict[str, float] = dataclasses.field(
        default_factory=lambda: dict.fromkeys(
            ("prefill_s", "decode_s", "scoring_s", "compaction_s", "compile_s"), 0.0
        )
    )
    reward_forwards: int = 0
    rounds: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    wall: float = 0.0

    def add(self, stage: str, seconds: tuple[float, float]) -> None:
        """A stage's (running, compiling) seconds: running to the stage's timing, compiling (a
        shape's first use) to `compile_s`."""
        self.timings[stage] += seconds[0]
        self.timings["compile_s"] += seconds[1]

    def spent(self) -> float:
        """Seconds attributed to the search so far (prefill, decode, scoring, compaction, compiling)."""
        return sum(self.timings.values())

    def stats(self) -> dict[str, Any]:
        return {
            "wall_s": self.wall,
            **self.timings,
            "host_s": self.wall - self.spent(),
            "token_forwards": {**self.forwards, "reward": self.reward_forwards},
            "rounds": len(self.rounds),
            "batch_sizes": [r["live_rows"] for r in self.rounds],
            "kv_bytes": [r["kv_bytes"] for r in self.rounds],
            "round_log": self.rounds,
        }


class PromptSearch:
    """One prompt's search, in the steps `run_searches` drives: `start` (prefill, first rows), then
    rounds of `begin_round` / `take_state` / `end_round` (the decoded rows back), `score` and
    `decide` (which compacts the survivors) — until `finished`; then `result`. On a mesh each batch is
    padded with dead rows so that it splits over the `data` shards (the result stays the same)."""

    def __init__(self, sampler: Sampler, reward: Reward, request: Request, index: int, policy: Policy):
        self.sampler, self.reward, self.request, self.policy = sampler, reward, request, policy
        self.index, self.prompt, self.ids = index, request.prompts[index], request.encoded[index]
        self.ledger = Ledger(dict.fromkeys(sampler.roles, policy.prompt_slots))
        self.scorer = None
        self.generated = 1
        """The longest live row's tokens at the last decision point."""
        self.samples: list[Sample] = []
        """The live rows of the last round, scored."""
        self.final: list[Sample] = []
        self.rejected: list[Rejected] | None = None
        self.finished = False
        self._state: DecodeState | None = None
        self._caches: tuple = ()
        """The prompt's caches in every model (prefilled once)."""
        self._host: DecodeState | None = None
        self._live, self._segment = 0, 0
        """Alive rows of the state and their cache segment (set where the rows are made)."""
        self._counters = (0, np.zeros(len(sampler.models), np.int64))
        """Decode steps and positions per row per model the state has run (its own counters)."""

    def start(self) -> None:
        """Prefill the prompt in every model (its slots padded to the policy's) and set up the first
        batch's rows, each with its first token (sample ids 0 … B0−1: Best-of-N's random streams)."""
        watch = Stopwatch()
        sampler, policy = self.sampler, self.policy
        self.scorer = token_scorer(sampler.target, self.reward, self.prompt, self.request.max_new_tokens)
        prefill = sampler.prefill_prompts([self.ids], 1, policy.prompt_slots)
        jax.block_until_ready(prefill.logits)
        self._caches = prefill.caches
        rows, segment = policy.first_batch()
        layout = Layout((self.index,), 1, padded_rows(rows, sampler.mesh), rows)
        self._state = sampler.start(prefill, layout, self.request, segment)
        self._live, self._segment = rows, segment
        self.ledger.add("prefill_s", watch.split())

    def shape(self) -> tuple[int, ...]:
        """What fixes the compiled shapes of this prompt's next round: searches with equal shapes can
        decode in one batch."""
        return (self._state.tokens.shape[0], self._state.rows[0].capacity, self.policy.prompt_slots)

    def begin_round(self) -> int:
        """The token count this round decodes to."""
        return self.policy.round_end(self.generated, self._segment)

    def take_state(self) -> tuple[DecodeState, tuple, tuple[int, np.ndarray]]:
        """Hand the decode state over for a round (it is donated): (state, prompt caches, the state's
        counters so far: steps, positions per row per model)."""
        state, self._state = self._state, None
        return state, self._caches, self._counters

    def end_round(self, state: DecodeState, host: DecodeState, seconds: tuple, counters: tuple) -> None:
        """Take the round's decoded rows back (`host`: them on the host) and log the round: `seconds`
        its (running, compiling) share, `counters` the state's (steps, positions per row per model)
        after it."""
        steps, forwards = counters[0] - self._counters[0], counters[1] - self._counters[1]
        batch, slots = len(host.alive), state.rows[0].capacity  # segment + look-ahead headroom
        end = int(host.num_generated[host.alive].max(initial=self.generated))
        ledger = self.ledger
        ledger.rounds.append(
            {
                "start_token": self.generated,
                "end_token": end,
                "batch_size": batch,
                "live_rows": self._live,
                "steps": int(steps),
                "kv_bytes": (self.policy.prompt_slots + batch * slots) * self.sampler.slot_bytes,
                "decode_s": seconds[0],
            }
        )
        ledger.add("decode_s", seconds)
        for role, n in zip(self.sampler.roles, forwards, strict=True):
            ledger.forwards[role] += int(n) * batch
        self._counters = (counters[0], self._counters[1] + forwards)
        self._state, self._host, self.generated = state, host, end

    def score(self) -> None:
        """Every live row of the round as a scored `Sample` (partial or complete). An on-device scorer
        reads the decode buffer where it lies."""
        watch = Stopwatch()
        before = self.reward.token_forwards
        on_device = None
        if self.scorer is not None:
            state, host = self._state, self._host
            lengths = state.num_generated - state.finished
            on_device = np.asarray(self.scorer(state.tokens, lengths))[np.flatnonzero(host.alive)]
        model = self.sampler.target
        self.samples = score_samples(
            model, self.reward, self.prompt, self.ids, self.round_samples(), on_device
        )
        self.ledger.reward_forwards += self.reward.token_forwards - before
        self.ledger.add("scoring_s", watch.split())

    def round_samples(self) -> list[Sample]:
        """The round's live rows as unscored `Sample`s, in row order."""
        host = self._host
        return samples_of(self.sampler.target, take_rows(host, np.flatnonzero(host.alive)), self.request.stop)

    def decide(self) -> None:
        """A decision point: the policy's, and the survivors gathered into its batch — or the search
        ends (every row done, or the policy ends it)."""
        host = self._host
        if host.done[host.alive].all():  # every row finished or reached max_new_tokens
            return self._finish()
        decision = self.policy.decide(self.samples, self.generated)
        if decision is None:
            return self._finish()
        order = np.argsort(decision.keep, kind="stable")  # survivors stay in row order
        live_rows = np.flatnonzero(host.alive)  # the rows of `samples`
        survivors = [int(live_rows[decision.keep[i]]) for i in order]
        ids = decision.sample_ids
        self._compact(survivors, decision.batch, None if ids is None else [ids[i] for i in order])

    def _compact(self, survivors: list[int], batch: Batch, sample_ids: list[int] | None) -> None:
        """Gather the survivors into the batch (padded with dead rows to the mesh) and its caches."""
        watch = Stopwatch()
        size = padded_rows(batch.rows, self.sampler.mesh)
        padding = size - len(survivors)
        index = jnp.asarray(np.array(survivors + survivors[:1] * padding, np.int32))
        alive = jnp.asarray(np.arange(size) < len(survivors))
        if sample_ids is not None:
            sample_ids = jnp.asarray(np.array(sample_ids + sample_ids[:1] * padding, np.int32))
        capacity = batch.segment + self.sampler.headroom
        self._state = self.sampler.compact(self._state, index, alive, capacity, sample_ids)
        self._live, self._segment = len(survivors), batch.segment
        self.ledger.add("compaction_s", watch.split())

    def _finish(self) -> None:
        self.final = self.policy.final(self.samples)
        self.finished, self._state, self._caches, self._host = True, None, (), None  # free the caches
        self.rejected = stopped_by(self.policy)
        if self.scorer is not None:  # scored from their ids: what is stored must be their text's reward
            self._true_to_text()

    def _true_to_text(self) -> None:
        """Rescore through their text the final (and kept rejected) responses the reward reads
        otherwise from their ids (`candidates.true_to_text`)."""
        watch, before = Stopwatch(), self.reward.token_forwards
        stopped = self.rejected or []
        kept = [*self.final, *(r.sample for r in stopped)]
        kept = true_to_text(self.sampler.target, self.reward, (self.prompt, self.ids, kept), self.scorer)
        self.final = kept[: len(self.final)]
        if self.rejected is not None:
            self.rejected = [
                dataclasses.replace(r, sample=s)
                for r, s in zip(stopped, kept[len(self.final) :], strict=True)
            ]
        self.ledger.reward_forwards += self.reward.token_forwards - before
        self.ledger.add("scoring_s", watch.split())

    def result(self) -> Result:
        stats = {**self.ledger.stats(), **self.policy.stats()}
        return Result(self.prompt, self.final, best(self.final), stats, self.rejected)


def run_searches(
    sampler: Sampler,
    searches: Sequence[PromptSearch],
    concurrent: int,
    on_end: Callable[[PromptSearch], None] | None = None,
) -> None:
    """Run every search to its end, at most `concurrent` at once (see the module docstring), calling
    `on_end(search)` as each one ends (a job writes its record then). A stack's decode time is shared
    evenly among its prompts (`decode_s`: they have the same rows). Each prompt's `wall_s` is the time
    spent on it (prefill, its decode share, scoring, compaction, compiling) plus an even share of the
    round's time spent on no prompt in particular, so a prompt's parts never exceed its wall time and
    the prompts' wall times add up to the call's (the time spent in `on_end` is not counted)."""
    pending, running = list(searches)[::-1], []
    while pending or running:
        t0 = time.perf_counter()
        spent = [search.ledger.spent() for search in running]
        while pending and len(running) < concurrent:
            search = pending.pop()
            spent.append(0.0)
            search.start()
            running.append(search)
        groups: dict[tuple, list[PromptSearch]] = defaultdict(list)
        for search in running:
            groups[search.shape()].append(search)
        for members in groups.values():
            decode_together(sampler, members)
        score_round(running)
        for search in running:
            search.decide()
        own = [search.ledger.spent() - before for search, before in zip(running, spent, strict=True)]
        share = max(0.0, time.perf_counter() - t0 - sum(own)) / len(running)
        for search, mine in zip(running, own, strict=True):
            search.ledger.wall += mine + share
        for search in running:
            if search.finished and on_end is not None:
                on_end(search)
        running = [s for s in running if not s.finished]


def score_round(searches: list[PromptSearch]) -> None:
    """Every search's round scored: on device where its reward reads the generator's ids, the others
    together, one reward call per reward for all their prompts (`score_prompts`: shared model batches),
    each search charged an even share of it."""
    by_reward: dict[int, list[PromptSearch]] = defaultdict(list)
    for search in searches:
        if search.scorer is not None:
            search.score()
        else:
            by_reward[id(search.reward)].append(search)
    for group in by_reward.values():
        reward, model, count = group[0].reward, group[0].sampler.target, len(group)
        watch, before = Stopwatch(), reward.token_forwards
        scored = score_prompts(model, reward, [(s.prompt, s.ids, s.round_samples()) for s in group])
        (running, compiled), forwards = watch.split(), reward.token_forwards - before
        for k, (search, samples) in enumerate(zip(group, scored, strict=True)):
            search.samples = samples
            search.ledger.reward_forwards += even_share(forwards, k, count)
            search.ledger.add("scoring_s", (running / count, compiled / count))


def decode_together(sampler: Sampler, members: list[PromptSearch]) -> None:
    """One round of every member (same shapes) in one decode loop; each takes its rows back."""
    pauses = [m.begin_round() for m in members]
    taken = [m.take_state() for m in members]
    watch = Stopwatch()
    if len(members) == 1:  # alone: the state decodes as it is
        state, caches, _ = taken[0]
        state = sampler.decode_loop(state, caches, jnp.asarray(pauses[0], jnp.int32))
        host = to_host(state)  # the state's counters are cumulative
        members[0].end_round(state, host, watch.split(), (host.steps, host.forwards))
        return
    stacked = bucket(len(members), 1)
    taken += taken[:1] * (stacked - len(members))  # padding: copies of the first, marked dead
    G = taken[0][0].tokens.shape[0]
    counters = tuple((np.int32(t[2][0]), t[2][1].astype(np.int32)) for t in taken)
    state, caches = stack(tuple(t[0] for t in taken), tuple(t[1] for t in taken), jnp.int32(len(members)))
    del taken  # the members' own states: only the stack holds the rows now
    pauses += pauses[:1] * (stacked - len(members))
    state = sampler.decode_loop(state, caches, jnp.asarray(np.repeat(np.array(pauses, np.int32), G)))
    host = to_host(state)
    parts = split(state, counters, stacked=stacked)[: len(members)]
    run, compiled = watch.split()
    seconds = (run / len(members), compiled / len(members))
    for p, (member, part) in enumerate(zip(members, parts, strict=True)):
        mine = take_rows(host, slice(p * G, (p + 1) * G))
        totals = (counters[p][0] + host.steps, counters[p][1] + host.forwards)
        member.end_round(part, mine, seconds, totals)


@jax.jit
def stack(states: tuple[DecodeState, ...], prompts: tuple[tuple[PromptCache, ...], ...], live: jax.Array):
    """One decode state (and its prompt caches, one per model) of same-shaped single-prompt states, in
    order; entries from `live` on are padding (their rows dead). Step and position counters restart."""

    def cat(*xs):
        return jnp.concatenate(xs, axis=0)

    first = states[0]
    state = jax.tree.map(cat, *(s.replace(seed=None, steps=None, forwards=None, stops=None) for s in states))
    dead = jnp.arange(state.tokens.shape[0]) >= live * first.tokens.shape[0]
    state = state.replace(
        alive=state.alive & ~dead,
        done=state.done | dead,
        seed=first.seed,
        stops=first.stops,
        steps=jnp.zeros((), jnp.int32),
        forwards=jnp.zeros_like(first.forwards),
    )
    caches = tuple(jax.tree.map(cat, *(p[m] for p in prompts)) for m in range(len(first.rows)))
    return pin(state), tuple(c.constrained() for c in caches)


@partial(jax.jit, static_argnames=("stacked",))
def split(state: DecodeState, counters: tuple, *, stacked: int) -> tuple[DecodeState, ...]:
    """The `stacked` prompts' states back from a stack (padding included), each with its (steps,
    forwards) counters in `counters` advanced by the stack's."""
    G = state.tokens.shape[0] // stacked
    parts = []
    for p, (steps, forwards) in enumerate(counters):
        part = take_rows(state, slice(p * G, (p + 1) * G))
        part = part.replace(rows=tuple(jax.tree.map(lambda x, p=p: x[p * G : (p + 1) * G], state.rows)))
        part = part.replace(steps=steps + state.steps, forwards=forwards + state.forwards)
        parts.append(pin(part))
    return tuple(parts)
