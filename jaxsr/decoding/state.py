"""The one decode-state pytree of every method, and the pure updates on it.

Rows are grouped by prompt ([prompts, G] flattened): all G rows of a prompt attend to its single
`PromptCache` (one per model), and each row keeps one `RowCache` per model holding only the tokens it
generated. A finished, paused or masked row keeps its slot in the fixed-shape batch; it just stops
changing. Between steps every row cache holds the row's generated tokens [0, n-1), n being its
committed tokens: the last committed token has not been fed yet. A step that looks ahead (drafting,
verification) writes further slots and then sets each `length` back to n-1 — a rejected draft is
rolled back by that pointer alone, its stale slots are overwritten before they can be attended to.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxsr.decoding import stops
from jaxsr.models.cache import RowCache
from jaxsr.sharding import constrain_rows, gather_rows, rows_where


@struct.dataclass
class DecodeState:
    tokens: jax.Array
    """[B, N] int32 generated tokens (the stop token included when a row finished)."""
    num_generated: jax.Array
    """[B] int32 tokens committed so far."""
    finished: jax.Array
    """[B] bool: the row sampled an EOS/stop id."""
    done: jax.Array
    """[B] bool: the row will not change any more (finished, out of budget, or not alive)."""
    alive: jax.Array
    """[B] bool: a real candidate (False for bucket padding and rejected rows)."""
    logprob_sum: jax.Array
    """[B] float32 sum of the (target) model's raw log-probabilities of the generated tokens."""
    certainty_sum: jax.Array
    """[B] float32 sum over the same positions of the (target) model's raw next-token distribution's
    self-certainty, KL(uniform ‖ p) (`sampling.token_statistics`)."""
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
    rows: tuple[RowCache, ...]
    """One row cache per model the method runs, the target's first."""
    steps: jax.Array
    """[] int32 decode steps run on this state."""
    forwards: jax.Array
    """[M] int32 token positions run per row through each model (prefills not counted)."""
    target_calls: jax.Array
    """[B] int32 target forward calls made while the row was active."""
    accepted: jax.Array
    """[B] int32 draft tokens accepted (speculative methods)."""
    tested: jax.Array
    """[B] int32 draft tokens put to the acceptance test (accepted + rejected)."""
    observation: Any = None
    """What a loop's observer records step by step (`loop.Observer`); None without one."""
    stops: Any = None
    """The call's stop strings (`stops.StopStrings`: token bytes and the strings), None without any."""
    tail: jax.Array | None = None
    """[B, window] int32 last bytes of each row's text, where stop strings are looked for (None
    without stop strings)."""

    def active(self, pause_at: jax.Array | int) -> jax.Array:
        """[B] rows a step advances: not done and short of `pause_at` tokens."""
        return ~self.done & (self.num_generated < pause_at)

    def last_tokens(self) -> tuple[jax.Array, jax.Array]:
        """(index of each row's last committed token, that token): what the next step feeds."""
        index = jnp.maximum(self.num_generated - 1, 0)
        return index, jnp.take_along_axis(self.tokens, index[:, None], axis=1)[:, 0]

    def with_rows(self, rows: tuple[RowCache, ...]) -> DecodeState:
        """The state with these caches, their pointers set to n-1 (rolling back any look-ahead)."""
        length = jnp.maximum(self.num_generated - 1, 0)
        return self.replace(rows=tuple(r.replace(length=length) for r in rows))


SHARED = ("seed", "rows", "steps", "forwards", "observation", "stops")
"""Fields that are not one entry per row: every other field of `DecodeState` is [B, ...]."""
PER_ROW = tuple(f.name for f in dataclasses.fields(DecodeState) if f.name not in SHARED)


def record(
    state: DecodeState, tokens: jax.Array, statistics: tuple[jax.Array, jax.Array], active: jax.Array
) -> DecodeState:
    """Append `tokens` [B] to the active rows, add their (log-probability, certainty) `statistics`
    ([B] each, `sampling.token_statistics`) and update their finished/done flags: a row finishes on a
    stop id, or on a token that completes a stop string in its text."""
    logp, certainty = statistics
    B = tokens.shape[0]
    index = jnp.where(active, state.num_generated, state.tokens.shape[1])  # inactive: write dropped
    buffer = state.tokens.at[jnp.arange(B), index].set(tokens, mode="drop")
    stopped = active & (tokens[:, None] == state.stop_ids).any(-1)
    if state.stops is not None:
        tail, completed = stops.advance(state.stops, state.tail, tokens, active)
        state, stopped = state.replace(tail=tail), stopped | completed
    num = state.num_generated + active
    finished = state.finished | stopped
    done = state.done | finished | (num >= state.max_new_tokens)
    return state.replace(
        tokens=buffer,
        num_generated=num,
        finished=finished,
        done=done,
        logprob_sum=state.logprob_sum + jnp.where(active, logp, 0.0),
        certainty_sum=state.certainty_sum + jnp.where(active, certainty, 0.0),
    )


def pin(state: DecodeState) -> DecodeState:
    """Under a mesh (`jaxsr.sharding.on_mesh`), keep every row and its caches on its `data` shard (the
    stop strings' tables stay as they are)."""
    per_row = constrain_rows(state.replace(rows=None, stops=None))
    return per_row.replace(rows=tuple(r.constrained() for r in state.rows), stops=state.stops)


@partial(jax.jit, static_argnames=("cache_capacity",))
def compact(
    state: DecodeState,
    index: jax.Array,
    alive: jax.Array,
    sample_ids: jax.Array | None = None,
    *,
    cache_capacity: int,
) -> DecodeState:
    """Gather rows `index` into a (smaller) batch whose row caches have `cache_capacity` slots (keep
    the method's look-ahead headroom). Survivors keep tokens, caches, random streams and counters;
    `alive=False` marks padding rows. A row may be gathered several times (a branch's children):
    `sample_ids` then gives each gathered row a sample index, and so a random stream, of its own.

    Rows attend to the prompt cache of their group (row b to prompt b // G), so the gather must keep
    each row in its prompt's group."""
    gathered = take_rows(state, index)
    if sample_ids is not None:
        gathered = gathered.replace(sample_id=sample_ids)
    rows = gather_rows(state.rows, index, lambda rows, i: tuple(r.take(i, cache_capacity) for r in rows))
    return pin(gathered.replace(done=gathered.done | ~alive, alive=alive, rows=rows))


def take_rows(state: DecodeState, rows: Any) -> DecodeState:
    """The state's per-row fields at `rows` (an index array or a slice; on device or on the host), the
    shared fields (caches included) as they are."""
    return state.replace(**{name: _at(getattr(state, name), rows) for name in PER_ROW})


def select_rows(where: jax.Array, a: DecodeState, b: DecodeState) -> DecodeState:
    """Per row, `a`'s per-row fields where `where` [B] is True and `b`'s elsewhere; the shared fields
    (caches included) are `b`'s."""
    picked = {name: getattr(b, name) for name in PER_ROW}
    return b.replace(
        **{n: None if x is None else rows_where(where, getattr(a, n), x) for n, x in picked.items()}
    )


def _at(field: Any, rows: Any) -> Any:
    """A per-row field's `rows` (None, a field the state does not use, stays None)."""
    return None if field is None else field[rows]


def to_host(state: DecodeState) -> DecodeState:
    """The state without its caches, every field a numpy array on the host, in one transfer: what the
    host reads of a decoded batch (responses, counters, acceptance)."""
    host = jax.device_get(state.replace(rows=(), observation=None, stops=None))
    return host.replace(steps=int(host.steps))


def response(host: DecodeState, row: int) -> list[int]:
    """Row `row`'s generated tokens without its stop token (`host` from `to_host`): a row that finished
    on a stop string keeps the token that completed it (its text is cut instead)."""
    return host.tokens[row, : int(host.num_generated[row]) - (stop_token(host, row) is not None)].tolist()


def stop_token(host: DecodeState, row: int) -> int | None:
    """The stop id row `row` finished on, None when it did not finish on one."""
    last = int(host.tokens[row, max(int(host.num_generated[row]) - 1, 0)])
    return last if host.finished[row] and last in host.stop_ids[row] else None


def concat_rows(hosts: list[DecodeState]) -> DecodeState:
    """Host states' rows one after another (their token buffers of one width); counters the first's."""
    first = hosts[0]
    fields = [name for name in PER_ROW if getattr(first, name) is not None]
    return first.replace(**{name: np.concatenate([getattr(h, name) for h in hosts]) for name in fields})
