"""The pure batched sampler: one decode-state pytree, a step function, and a `lax.while_loop` driver.

Rows are grouped by prompt ([prompts, G] flattened): all G rows of a prompt attend to its single
`PromptCache`, and each row's `RowCache` holds only the tokens it generated. A finished, paused or
masked row keeps its slot in the fixed-shape batch; it just stops changing.

Randomness: row b's token at generated index t uses the key fold_in(seed, prompt_id, sample_id, t), so
the same seed gives the same tokens however prompts and samples are batched or bucketed.

Research use, from your own jitted code::

    logits, prompt = prefill(graph, params, prompt_tokens, prompt_mask)
    state = init_state(logits, prompt, samples_per_prompt=4, sampling=cfg, seed=0, ...)
    state = decode_loop(graph, params, state, prompt, sampling=cfg)   # or `step` in your own loop
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from flax import nnx, struct

from jaxsr.decoding.sampling import SamplingConfig, draw
from jaxsr.models.cache import PromptCache, RowCache
from jaxsr.sharding import constrain_rows


@struct.dataclass
class DecodeState:
    tokens: jax.Array
    """[B, N] int32 generated tokens (the stop token included when a row finished)."""
    num_generated: jax.Array
    """[B] int32 tokens generated so far."""
    finished: jax.Array
    """[B] bool: the row sampled an EOS/stop id."""
    done: jax.Array
    """[B] bool: the row will not change any more (finished, out of budget, or not alive)."""
    alive: jax.Array
    """[B] bool: a real candidate (False for bucket padding and rejected rows)."""
    logprob_sum: jax.Array
    """[B] float32 sum of the model's raw log-probabilities of the generated tokens."""
    prompt_id: jax.Array
    """[B] int32 global prompt index (for the random stream)."""
    sample_id: jax.Array
    """[B] int32 sample index within the prompt (for the random stream)."""
    max_new_tokens: jax.Array
    """[B] int32 per-row token budget."""
    stop_ids: jax.Array
    """[B, S] int32 ids that finish a row (-1 pads)."""
    seed: jax.Array
    """[] uint32 base seed."""
    rows: RowCache
    steps: jax.Array
    """[] int32 decode forward passes run on this state."""


def pin(state: DecodeState) -> DecodeState:
    """Under a mesh (`jaxsr.sharding.on_mesh`), keep every row and its cache on its `data` shard."""
    return constrain_rows(state.replace(rows=None)).replace(rows=state.rows.constrained())


@partial(jax.jit, static_argnames=("cache_capacity",))
def compact(state: DecodeState, index: jax.Array, alive: jax.Array, *, cache_capacity: int) -> DecodeState:
    """Gather rows `index` into a (smaller) batch whose row cache has `cache_capacity` slots.

    Survivors keep their tokens, cache entries and random streams; `alive=False` marks padding rows."""
    per_row = (
        "tokens",
        "num_generated",
        "finished",
        "done",
        "logprob_sum",
        "prompt_id",
        "sample_id",
        "max_new_tokens",
        "stop_ids",
    )
    gathered = {name: getattr(state, name)[index] for name in per_row}
    gathered["done"] = gathered["done"] | ~alive
    return pin(state.replace(**gathered, alive=alive, rows=state.rows.take(index, cache_capacity)))


def row_keys(seed: jax.Array, prompt_id: jax.Array, sample_id: jax.Array, index: jax.Array) -> jax.Array:
    """Per-row PRNG keys that depend only on (seed, prompt, sample, token index)."""

    def one(p, s, t):
        key = jax.random.fold_in(jax.random.PRNGKey(seed), p)
        return jax.random.fold_in(jax.random.fold_in(key, s), t)

    return jax.vmap(one)(prompt_id, sample_id, index)


def _choose(
    logits: jax.Array, state_like: tuple[jax.Array, ...], sampling: SamplingConfig
) -> tuple[jax.Array, jax.Array]:
    """Sample a token per row from raw logits [B, V]; also return its raw log-probability."""
    seed, prompt_id, sample_id, index = state_like
    tokens = draw(row_keys(seed, prompt_id, sample_id, index), logits, sampling)
    logits = logits.astype(jnp.float32)
    chosen = jnp.take_along_axis(logits, tokens[:, None], axis=-1)[:, 0]
    return tokens, chosen - jax.nn.logsumexp(logits, axis=-1)


def _record(state: DecodeState, tokens: jax.Array, logp: jax.Array, active: jax.Array) -> DecodeState:
    """Append `tokens` to the active rows and update their finished/done flags."""
    B = tokens.shape[0]
    index = jnp.where(active, state.num_generated, state.tokens.shape[1])  # inactive: write dropped
    buffer = state.tokens.at[jnp.arange(B), index].set(tokens, mode="drop")
    stopped = active & (tokens[:, None] == state.stop_ids).any(-1)
    num = state.num_generated + active
    finished = state.finished | stopped
    done = state.done | finished | (num >= state.max_new_tokens)
    return state.replace(
        tokens=buffer,
        num_generated=num,
        finished=finished,
        done=done,
        logprob_sum=state.logprob_sum + jnp.where(active, logp, 0.0),
    )


@partial(jax.jit, static_argnums=0)
def prefill(graph: nnx.GraphDef, params: nnx.State, tokens: jax.Array, mask: jax.Array):
    """Prefill left-padded prompts once: (last-position logits [P, V] float32, PromptCache)."""
    module = nnx.merge(graph, params)
    hidden, cache = module.prefill(tokens, mask)
    return module.logits(hidden[:, -1]), cache.constrained()


@partial(jax.jit, static_argnames=("samples_per_prompt", "capacity", "cache_capacity", "sampling"))
def init_state(
    last_logits: jax.Array,
    prompt: PromptCache,
    *,
    samples_per_prompt: int,
    capacity: int,
    sampling: SamplingConfig,
    cache_capacity: int | None = None,
    seed: jax.Array,
    prompt_ids: jax.Array,
    sample_ids: jax.Array,
    alive: jax.Array,
    max_new_tokens: jax.Array,
    stop_ids: jax.Array,
) -> DecodeState:
    """Rows for `samples_per_prompt` samples of each prompt, with their first token sampled.

    `prompt_ids` is [P]; `sample_ids`, `alive`, `max_new_tokens` are [B = P·G]; `stop_ids` is [B, S].
    `capacity` is the token-buffer length (≥ the largest budget); `cache_capacity` the row-cache
    slots (default `capacity`; a row needs one slot per generated token after the first).
    """
    cache_capacity = capacity if cache_capacity is None else cache_capacity
    G = samples_per_prompt
    P = last_logits.shape[0]
    B = P * G
    rows = RowCache.empty_like(prompt, B, cache_capacity)
    state = DecodeState(
        tokens=jnp.zeros((B, capacity), jnp.int32),
        num_generated=jnp.zeros((B,), jnp.int32),
        finished=jnp.zeros((B,), bool),
        done=~alive,
        alive=alive,
        logprob_sum=jnp.zeros((B,), jnp.float32),
        prompt_id=jnp.repeat(prompt_ids, G),
        sample_id=sample_ids,
        max_new_tokens=max_new_tokens,
        stop_ids=stop_ids,
        seed=jnp.asarray(seed, jnp.uint32),
        rows=rows,
        steps=jnp.zeros((), jnp.int32),
    )
    logits = jnp.repeat(last_logits, G, axis=0)
    tokens, logp = _choose(
        logits, (state.seed, state.prompt_id, state.sample_id, state.num_generated), sampling
    )
    return pin(_record(state, tokens, logp, alive))


def step(
    graph: nnx.GraphDef,
    params: nnx.State,
    state: DecodeState,
    prompt: PromptCache,
    sampling: SamplingConfig,
    pause_at: jax.Array | int | None = None,
) -> DecodeState:
    """Feed each active row its last token, sample the next. Pure: jit it, or call it inside a loop.

    Rows with `num_generated >= pause_at` are left untouched (a Speculative Rejection segment end)."""
    active = ~state.done
    if pause_at is not None:
        active &= state.num_generated < pause_at
    B = state.tokens.shape[0]
    G = B // prompt.num_prompts
    fed_index = jnp.maximum(state.num_generated - 1, 0)
    fed = jnp.take_along_axis(state.tokens, fed_index[:, None], axis=1)
    positions = jnp.repeat(prompt.length, G)[:, None] + fed_index[:, None]
    module = nnx.merge(graph, params)
    rows = state.rows.replace(length=fed_index)
    hidden, rows = module.decode(fed, positions, prompt, rows)
    logits = module.logits(hidden[:, 0])
    tokens, logp = _choose(
        logits, (state.seed, state.prompt_id, state.sample_id, state.num_generated), sampling
    )
    state = _record(state.replace(rows=rows.replace(length=fed_index + active)), tokens, logp, active)
    return pin(state.replace(steps=state.steps + 1))


@partial(jax.jit, static_argnums=0, static_argnames=("sampling",), donate_argnames=("state",))
def decode_loop(
    graph: nnx.GraphDef,
    params: nnx.State,
    state: DecodeState,
    prompt: PromptCache,
    *,
    sampling: SamplingConfig,
    pause_at: jax.Array | None = None,
) -> DecodeState:
    """Step until every row is done (or paused at `pause_at` tokens). No host sync inside."""
    limit = jnp.iinfo(jnp.int32).max if pause_at is None else pause_at

    def running(s: DecodeState) -> jax.Array:
        return (~s.done & (s.num_generated < limit)).any()

    return jax.lax.while_loop(running, lambda s: step(graph, params, s, prompt, sampling, limit), state)
