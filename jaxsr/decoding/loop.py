"""The jitted programs of every method: prefill, the rows' first tokens, and the token loop.

Research use, from your own code (`method` any `Method`; its models' graphs, params and prompt caches
as tuples, the target first; `controls` the traced sampling values and contrast weights,
`Controls(SamplingConfig(...).compiled(), contrast=None)`)::

    logits, prompt = prefill(lm.graph, lm.params, tokens, mask)          # once per prompt and model
    state = init_state((logits,), (prompt,), controls, NewRows(...), method=PlainSampling(), capacity=64)
    state = decode_loop((lm.graph,), (lm.params,), state, (prompt,), controls, method=PlainSampling())
    state = compact(state, survivors, alive, cache_capacity=...)         # e.g. a search's rejection
    state = decode_loop(...)                                              # nothing is prefilled again
"""

from __future__ import annotations

from functools import partial
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from jaxsr.decoding import stops
from jaxsr.decoding.sampling import token_statistics
from jaxsr.decoding.state import DecodeState, pin, record, select_rows, take_rows
from jaxsr.decoding.steps import Controls, Graphs, Method, Params, PromptCaches, next_tokens
from jaxsr.models.cache import PromptCache, RowCache
from jaxsr.sharding import rows_where

NO_PAUSE = np.int32(np.iinfo(np.int32).max)
"""A pause that never comes, as a traced value: paused and unpaused runs share one program."""


@struct.dataclass
class Pause:
    """Where a token loop stops before every row is done, traced (one program for all values): when
    the rows it would advance have `tokens` tokens ([] or per row [B]; a speculative step may carry a
    row past it by up to γ tokens), or when `free` of the prompts' groups of rows are free (every row
    of the group done: its slot can take another prompt). `free=None` is a program that never counts
    the groups (on a mesh the count is a second all-reduce a step)."""

    tokens: jax.Array = NO_PAUSE
    free: jax.Array | None = None


@partial(jax.jit, static_argnums=0, static_argnames=("slots",))
def prefill(
    graph: nnx.GraphDef, params: nnx.State, tokens: jax.Array, mask: jax.Array, *, slots: int | None = None
):
    """Prefill left-padded prompts once: (last-position logits [P, V] float32, PromptCache), the cache
    in `slots` slots when given (left-padded past the prompts' own, `PromptCache.left_padded`)."""
    module = nnx.merge(graph, params)
    hidden, cache = module.prefill(tokens, mask)
    cache = cache if slots is None else cache.left_padded(slots)
    return module.logits(hidden[:, -1]), cache.constrained()


@struct.dataclass
class NewRows:
    """The per-row inputs of a batch's new rows, grouped by prompt (B = P·G rows, G per prompt). A row's
    (seed, prompt id, sample id) is its random stream, whatever the batch it is in."""

    seed: jax.Array
    """[] uint32 base seed."""
    prompt_ids: jax.Array
    """[P] int32 global prompt index of each group."""
    sample_ids: jax.Array
    """[B] int32 sample index of each row within its prompt."""
    alive: jax.Array
    """[B] bool: a real candidate (False for padding rows)."""
    max_new_tokens: jax.Array
    """[B] int32 per-row token budget."""
    stop_ids: jax.Array
    """[B, S] int32 ids that finish a row (-1 pads)."""
    stops: Any = None
    """The stop strings that finish a row (`stops.StopStrings`), None without any."""


@partial(jax.jit, static_argnames=("method", "capacity", "cache_capacity"))
def init_state(
    last_logits: tuple[jax.Array, ...],
    prompts: tuple[PromptCache, ...],
    controls: Controls,
    new: NewRows,
    *,
    method: Method,
    capacity: int,
    cache_capacity: int | None = None,
) -> DecodeState:
    """Rows `new` for the prompts, their first token drawn from the method's scores of the prefills'
    last-position logits ([P, V] per model).

    `capacity` is the token-buffer length (≥ the largest budget); `cache_capacity` the row-cache
    slots (default `capacity`; a row needs one slot per generated token after the first, plus the
    method's headroom)."""
    cache_capacity = capacity if cache_capacity is None else cache_capacity
    B = new.sample_ids.shape[0]
    rows = tuple(RowCache.empty_like(prompt, B, cache_capacity) for prompt in prompts)
    return pin(first_tokens(last_logits, prompts, controls, new, method, capacity).replace(rows=rows))


def blank(new: NewRows, capacity: int, models: int) -> DecodeState:
    """Rows `new` before their first token, with token buffers of `capacity` and no caches (`rows=()`)."""
    B = new.sample_ids.shape[0]
    zeros = jnp.zeros((B,), jnp.int32)
    return DecodeState(
        tokens=jnp.zeros((B, capacity), jnp.int32),
        num_generated=zeros,
        finished=jnp.zeros((B,), bool),
        done=~new.alive,
        alive=new.alive,
        logprob_sum=jnp.zeros((B,), jnp.float32),
        certainty_sum=jnp.zeros((B,), jnp.float32),
        prompt_id=jnp.repeat(new.prompt_ids, B // new.prompt_ids.shape[0]),
        sample_id=new.sample_ids,
        max_new_tokens=new.max_new_tokens,
        stop_ids=new.stop_ids,
        seed=jnp.asarray(new.seed, jnp.uint32),
        rows=(),
        steps=jnp.zeros((), jnp.int32),
        forwards=jnp.zeros((models,), jnp.int32),
        target_calls=zeros,
        accepted=zeros,
        tested=zeros,
        stops=new.stops,
        tail=None if new.stops is None else stops.initial_tail(new.stops, B),
    )


def first_tokens(
    last_logits: tuple[jax.Array, ...],
    prompts: tuple[PromptCache, ...],
    controls: Controls,
    new: NewRows,
    method: Method,
    capacity: int,
) -> DecodeState:
    """Rows `new` (no caches) with their first token drawn from the prefills' last-position logits."""
    state = blank(new, capacity, len(prompts))
    G = new.sample_ids.shape[0] // last_logits[0].shape[0]
    logits = tuple(jnp.repeat(z, G, axis=0) for z in last_logits)
    tokens = next_tokens(method, state, prompts[0], logits, controls)
    return record(state, tokens, token_statistics(logits[0], tokens), new.alive)


@partial(jax.jit, static_argnames=("capacity", "cache_capacity"))
def empty_slab(
    prompts: tuple[PromptCache, ...], new: NewRows, *, capacity: int, cache_capacity: int
) -> tuple[DecodeState, tuple[PromptCache, ...]]:
    """A batch of prompt slots waiting for prompts (`insert`): the rows of `new` (all dead, one group
    of rows per slot) and, per model, a cache of one empty prompt per slot shaped as `prompts`' are."""
    slots = new.prompt_ids.shape[0]
    caches = tuple(jax.tree.map(lambda x: jnp.zeros((slots, *x.shape[1:]), x.dtype), p) for p in prompts)
    B = new.sample_ids.shape[0]
    rows = tuple(RowCache.empty_like(cache, B, cache_capacity) for cache in caches)
    return pin(blank(new, capacity, len(prompts)).replace(rows=rows)), tuple(c.constrained() for c in caches)


@partial(jax.jit, static_argnames=("method",), donate_argnames=("state", "caches"))
def insert(
    state: DecodeState,
    caches: tuple[PromptCache, ...],
    prefilled: tuple[tuple[jax.Array, ...], tuple[PromptCache, ...]],
    controls: Controls,
    new: NewRows,
    source: jax.Array,
    *,
    method: Method,
) -> tuple[DecodeState, tuple[PromptCache, ...]]:
    """Start rows `new` of prompts just prefilled (`prefilled`: each model's last-position logits and
    prompt cache) in a batch of prompt slots: slot s takes prefill row `source[s]` (-1: the slot keeps
    what it has), its rows `new`'s rows of that prompt, each with its first token (rows grouped by
    prompt, as many per slot as per prefilled prompt). Rows of other slots are untouched.

    Each slot's caches and rows are selected from the old or the new, never scattered: under a mesh
    every device keeps its own slots' and takes only the small prefill's rows from the others."""
    fresh = first_tokens(*prefilled, controls, new, method, state.tokens.shape[1])
    slots = caches[0].num_prompts
    R = state.tokens.shape[0] // slots
    taken, prompt = source >= 0, jnp.maximum(source, 0)
    rows = jnp.repeat(prompt, R) * R + jnp.tile(jnp.arange(R), slots)
    state = select_rows(jnp.repeat(taken, R), take_rows(fresh, rows), state)
    caches = tuple(
        jax.tree.map(lambda a, b: rows_where(taken, a[prompt], b), new_cache, cache)
        for new_cache, cache in zip(prefilled[1], caches, strict=True)
    )
    return pin(state.with_rows(state.rows)), tuple(c.constrained() for c in caches)


class Observer(Protocol):
    """What a token loop records beside the tokens, step by step (a frozen, hashable dataclass: it is
    part of the compiled program). The loop keeps the record in `DecodeState.observation` (set its
    initial value before the loop) and runs the method's `advance`, which also returns each model's
    logits at the position a token was drawn from. E.g. distillation keeps the teacher's top-k
    log-probabilities at every generated index."""

    def update(self, observation: Any, before: DecodeState, active: jax.Array, logits: tuple) -> Any:
        """The record after a step that advanced `active` rows of `before` with these logits [B, V]."""
        ...


@partial(jax.jit, static_argnames=("graphs", "method", "observer"), donate_argnames=("state",))
def decode_loop(
    graphs: Graphs,
    params: Params,
    state: DecodeState,
    prompts: PromptCaches,
    controls: Controls,
    *,
    method: Method,
    pause: Pause | None = None,
    observer: Observer | None = None,
) -> DecodeState:
    """Step until every row is done, or until the `pause` (`None` never pauses: a program of its own;
    `Pause()` shares one compiled program with paused runs). No host sync inside. An `observer`
    updates `state.observation` after every step."""
    limit = jnp.iinfo(jnp.int32).max if pause is None else pause.tokens
    groups = prompts[0].num_prompts

    def running(s: DecodeState) -> jax.Array:
        going = (~s.done & (s.num_generated < limit)).any()
        if pause is None or pause.free is None:
            return going
        return going & (s.done.reshape(groups, -1).all(-1).sum() < pause.free)

    def body(s: DecodeState) -> DecodeState:
        if observer is None:
            return pin(method.step(graphs, params, s, prompts, controls, limit))
        after, logits = method.advance(graphs, params, s, prompts, controls, limit)
        return pin(after.replace(observation=observer.update(s.observation, s, s.active(limit), logits)))

    return jax.lax.while_loop(running, body, state)
