"""The jitted programs of every method: prefill, the rows' first tokens, and the token loop.

Research use, from your own code (`method` any `Method`; its models' graphs, params and prompt caches
as tuples, the target first; `contrast` the traced weights of contrastive methods, else None)::

    logits, prompt = prefill(lm.graph, lm.params, tokens, mask)          # once per prompt and model
    state = init_state((logits,), (prompt,), None, method=PlainSampling(cfg), samples_per_prompt=4, ...)
    state = decode_loop((lm.graph,), (lm.params,), state, (prompt,), None, method=PlainSampling(cfg))
    state = compact(state, survivors, alive, cache_capacity=...)         # e.g. a search's rejection
    state = decode_loop(...)                                              # nothing is prefilled again
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxsr.decoding.contrast import Contrast
from jaxsr.decoding.sampling import draw, token_logprob
from jaxsr.decoding.state import DecodeState, pin, record
from jaxsr.decoding.steps import Graphs, Method, Params, PromptCaches, keys_of
from jaxsr.models.cache import PromptCache, RowCache

NO_PAUSE = np.int32(np.iinfo(np.int32).max)
"""A `pause_at` that never pauses, as a traced value: paused and unpaused runs share one program."""


@partial(jax.jit, static_argnums=0)
def prefill(graph: nnx.GraphDef, params: nnx.State, tokens: jax.Array, mask: jax.Array):
    """Prefill left-padded prompts once: (last-position logits [P, V] float32, PromptCache)."""
    module = nnx.merge(graph, params)
    hidden, cache = module.prefill(tokens, mask)
    return module.logits(hidden[:, -1]), cache.constrained()


@partial(jax.jit, static_argnames=("method", "samples_per_prompt", "capacity", "cache_capacity"))
def init_state(
    last_logits: tuple[jax.Array, ...],
    prompts: tuple[PromptCache, ...],
    contrast: Contrast | None,
    *,
    method: Method,
    samples_per_prompt: int,
    capacity: int,
    cache_capacity: int | None = None,
    seed: jax.Array,
    prompt_ids: jax.Array,
    sample_ids: jax.Array,
    alive: jax.Array,
    max_new_tokens: jax.Array,
    stop_ids: jax.Array,
) -> DecodeState:
    """Rows for `samples_per_prompt` samples of each prompt, their first token drawn from the method's
    scores of the prefills' last-position logits ([P, V] per model).

    `prompt_ids` is [P]; `sample_ids`, `alive`, `max_new_tokens` are [B = P·G]; `stop_ids` is [B, S].
    `capacity` is the token-buffer length (≥ the largest budget); `cache_capacity` the row-cache
    slots (default `capacity`; a row needs one slot per generated token after the first, plus the
    method's headroom)."""
    cache_capacity = capacity if cache_capacity is None else cache_capacity
    G = samples_per_prompt
    B = last_logits[0].shape[0] * G
    zeros = jnp.zeros((B,), jnp.int32)
    state = DecodeState(
        tokens=jnp.zeros((B, capacity), jnp.int32),
        num_generated=zeros,
        finished=jnp.zeros((B,), bool),
        done=~alive,
        alive=alive,
        logprob_sum=jnp.zeros((B,), jnp.float32),
        prompt_id=jnp.repeat(prompt_ids, G),
        sample_id=sample_ids,
        max_new_tokens=max_new_tokens,
        stop_ids=stop_ids,
        seed=jnp.asarray(seed, jnp.uint32),
        rows=tuple(RowCache.empty_like(prompt, B, cache_capacity) for prompt in prompts),
        steps=jnp.zeros((), jnp.int32),
        forwards=jnp.zeros((len(prompts),), jnp.int32),
        target_calls=zeros,
        accepted=zeros,
        tested=zeros,
    )
    logits = tuple(jnp.repeat(z, G, axis=0) for z in last_logits)
    tokens = draw(keys_of(state), method.scores(logits, contrast), method.sampling)
    return pin(record(state, tokens, token_logprob(logits[0], tokens), alive))


@partial(jax.jit, static_argnames=("graphs", "method"), donate_argnames=("state",))
def decode_loop(
    graphs: Graphs,
    params: Params,
    state: DecodeState,
    prompts: PromptCaches,
    contrast: Contrast | None,
    *,
    method: Method,
    pause_at: jax.Array | None = None,
) -> DecodeState:
    """Step until every row is done (or has reached `pause_at` tokens). No host sync inside.

    A speculative step may carry a row past `pause_at` by up to γ tokens. `None` never pauses (a
    program of its own); `NO_PAUSE` shares one compiled program with paused runs."""
    limit = jnp.iinfo(jnp.int32).max if pause_at is None else pause_at

    def running(s: DecodeState) -> jax.Array:
        return (~s.done & (s.num_generated < limit)).any()

    def body(s: DecodeState) -> DecodeState:
        return pin(method.step(graphs, params, s, prompts, contrast, limit))

    return jax.lax.while_loop(running, body, state)
