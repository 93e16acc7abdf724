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
from jaxsr.decoding.state import DecodeState, pin, record
from jaxsr.decoding.steps import Controls, Graphs, Method, Params, PromptCaches, next_tokens
from jaxsr.models.cache import PromptCache, RowCache

NO_PAUSE = np.int32(np.iinfo(np.int32).max)
"""A `pause_at` that never pauses, as a traced value: paused and unpaused runs share one program."""


@partial(jax.jit, static_argnums=0)
def prefill(graph: nnx.GraphDef, params: nnx.State, tokens: jax.Array, mask: jax.Array):
    """Prefill left-padded prompts once: (last-position logits [P, V] float32, PromptCache)."""
    module = nnx.merge(graph, params)
    hidden, cache = module.prefill(tokens, mask)
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
    G = B // last_logits[0].shape[0]
    zeros = jnp.zeros((B,), jnp.int32)
    state = DecodeState(
        tokens=jnp.zeros((B, capacity), jnp.int32),
        num_generated=zeros,
        finished=jnp.zeros((B,), bool),
        done=~new.alive,
        alive=new.alive,
        logprob_sum=jnp.zeros((B,), jnp.float32),
        certainty_sum=jnp.zeros((B,), jnp.float32),
        prompt_id=jnp.repeat(new.prompt_ids, G),
        sample_id=new.sample_ids,
        max_new_tokens=new.max_new_tokens,
        stop_ids=new.stop_ids,
        seed=jnp.asarray(new.seed, jnp.uint32),
        rows=tuple(RowCache.empty_like(prompt, B, cache_capacity) for prompt in prompts),
        steps=jnp.zeros((), jnp.int32),
        forwards=jnp.zeros((len(prompts),), jnp.int32),
        target_calls=zeros,
        accepted=zeros,
        tested=zeros,
        stops=new.stops,
        tail=None if new.stops is None else stops.initial_tail(new.stops, B),
    )
    logits = tuple(jnp.repeat(z, G, axis=0) for z in last_logits)
    tokens = next_tokens(method, state, prompts[0], logits, controls)
    return pin(record(state, tokens, token_statistics(logits[0], tokens), new.alive))


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
    pause_at: jax.Array | None = None,
    observer: Observer | None = None,
) -> DecodeState:
    """Step until every row is done (or has reached `pause_at` tokens). No host sync inside.

    A speculative step may carry a row past `pause_at` by up to γ tokens. `None` never pauses (a
    program of its own); `NO_PAUSE` shares one compiled program with paused runs. An `observer`
    updates `state.observation` after every step."""
    limit = jnp.iinfo(jnp.int32).max if pause_at is None else pause_at

    def running(s: DecodeState) -> jax.Array:
        return (~s.done & (s.num_generated < limit)).any()

    def body(s: DecodeState) -> DecodeState:
        if observer is None:
            return pin(method.step(graphs, params, s, prompts, controls, limit))
        after, logits = method.advance(graphs, params, s, prompts, controls, limit)
        return pin(after.replace(observation=observer.update(s.observation, s, s.active(limit), logits)))

    return jax.lax.while_loop(running, body, state)
