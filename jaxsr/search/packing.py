"""Several prompts' Speculative Rejection searches at once, in shared decode loops.

Up to `concurrent` prompts are in flight, each with its own memory plan and bookkeeping
(`speculative_rejection.PromptSearch`). Every round, the searches whose next round has the same shapes
(rows, row-cache slots, prompt slots) are stacked into one decode state — rows grouped by prompt, each
group attending to its own prompt's caches — and decoded in one loop, each prompt's rows pausing at its
own decision point (`pause_at` per row). The state is then split back per prompt, and each prompt
scores its rows, decides and compacts on its own. A finished prompt's place goes to the next prompt.
Stacking copies the members' caches for the round: while it runs, memory holds the stack and, for a
moment, the members' own states (transient, not counted in the plans).

A prompt's rows draw their random streams from (seed, prompt, sample, token index) and pause where its
own plan says, so its tokens, decisions and result are those of searching it alone; only floats that
depend on the batch (a reward model's scores) may differ in the last bits. Stacks are padded to a
power of two of prompts with copies marked dead, so the compiled shapes stay few.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Sequence
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from jaxsr.decoding.driver import Sampler
from jaxsr.decoding.state import DecodeState, HostRows, pin
from jaxsr.ladder import bucket
from jaxsr.models.cache import PromptCache
from jaxsr.search.speculative_rejection import PromptSearch


@jax.jit
def stack(states: tuple[DecodeState, ...], prompts: tuple[tuple[PromptCache, ...], ...], live: jax.Array):
    """One decode state (and its prompt caches, one per model) of same-shaped single-prompt states, in
    order; entries from `live` on are padding (their rows dead). Step and position counters restart."""

    def cat(*xs):
        return jnp.concatenate(xs, axis=0)

    first = states[0]
    state = jax.tree.map(cat, *(s.replace(seed=None, steps=None, forwards=None) for s in states))
    dead = jnp.arange(state.tokens.shape[0]) >= live * first.tokens.shape[0]
    state = state.replace(
        alive=state.alive & ~dead,
        done=state.done | dead,
        seed=first.seed,
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
    per_row = state.replace(seed=None, steps=None, forwards=None)
    parts = []
    for p, (steps, forwards) in enumerate(counters):
        part = jax.tree.map(lambda x, p=p: x[p * G : (p + 1) * G], per_row)
        part = part.replace(seed=state.seed, steps=steps + state.steps, forwards=forwards + state.forwards)
        parts.append(pin(part))
    return tuple(parts)


def search_packed(sampler: Sampler, searches: Sequence[PromptSearch], concurrent: int) -> None:
    """Run every search to its end, at most `concurrent` at once (see the module docstring). A stack's
    decode time is shared evenly among its prompts (`decode_s`: they have the same rows). Each prompt's
    `wall_s` is the time spent on it (prefill, its decode share, scoring, compaction) plus an even share
    of the round's time spent on no prompt in particular, so a prompt's parts never exceed its wall time
    and the prompts' wall times add up to the call's."""
    pending, running = list(searches)[::-1], []
    while pending or running:
        t0 = time.perf_counter()
        spent = [search.attributed() for search in running]
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
        for search in running:
            search.score()
            search.decide()
        own = [search.attributed() - before for search, before in zip(running, spent, strict=True)]
        share = max(0.0, time.perf_counter() - t0 - sum(own)) / len(running)
        for search, mine in zip(running, own, strict=True):
            search.wall += mine + share
        running = [s for s in running if not s.finished]


def decode_together(sampler: Sampler, members: list[PromptSearch]) -> None:
    """One round of every member (same shapes) in one decode loop; each takes its rows back."""
    pauses = [m.begin_round() for m in members]
    if len(members) == 1:  # alone: the state decodes as it is
        (member,) = members
        t0 = time.perf_counter()
        state = sampler.decode_loop(member.state, member.prompts, jnp.asarray(pauses[0], jnp.int32))
        host = HostRows.read(state)  # the state's counters are cumulative: the round is the difference
        steps, forwards = host.steps - member.steps_done, host.forwards - member.forwards_done
        member.read_round(state, host, time.perf_counter() - t0, steps, forwards)
        return
    t0 = time.perf_counter()
    stacked = bucket(len(members), 1)
    padding = [members[0]] * (stacked - len(members))
    counters = tuple((np.int32(m.steps_done), m.forwards_done.astype(np.int32)) for m in members + padding)
    G = members[0].state.tokens.shape[0]
    state, prompts = stack(
        tuple(m.state for m in members + padding),
        tuple(m.prompts for m in members + padding),
        jnp.int32(len(members)),
    )
    for member in members:  # the stack holds the rows now
        member.state = None
    pause_at = jnp.asarray(np.repeat(np.array(pauses + pauses[:1] * len(padding), np.int32), G))
    state = sampler.decode_loop(state, prompts, pause_at)
    host = HostRows.read(state)
    parts = split(state, counters, stacked=stacked)[: len(members)]
    seconds = time.perf_counter() - t0
    for p, (member, part) in enumerate(zip(members, parts, strict=True)):
        mine = host.take(slice(p * G, (p + 1) * G))
        member.read_round(part, mine, seconds / len(members), host.steps, host.forwards)
