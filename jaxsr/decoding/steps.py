"""What one decode step does: the `Method` interface, and the methods that commit one token per step
(plain sampling, contrastive decoding). Speculative methods are in `speculative`.

A `Method` is a frozen, hashable dataclass (a static argument of the jitted programs in `loop`). It
runs `num_models` models (the target first: the model sampled from, or the expert), scores the next
token from their logits (`scores`), and advances a `DecodeState` by one step (`step`). How it samples
and the contrast weights are traced data passed beside it (`Controls`), so temperature, top-p, penalty
and α/β sweeps compile nothing new.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
from flax import nnx, struct

from jaxsr.decoding.contrast import Contrast, contrastive_scores
from jaxsr.decoding.sampling import Past, Sampling, draw, history, row_keys, token_statistics
from jaxsr.decoding.state import DecodeState, record
from jaxsr.models.cache import PromptCache, RowCache

Graphs = tuple[nnx.GraphDef, ...]
"""One graph per model (static)."""
Params = tuple[nnx.State, ...]
PromptCaches = tuple[PromptCache, ...]


@struct.dataclass
class Controls:
    """What a step takes beside the state, traced: how to sample (`SamplingConfig.compiled`) and the
    contrast weights of contrastive methods (else None)."""

    sampling: Sampling
    contrast: Contrast | None = None


@dataclasses.dataclass(frozen=True)
class Method:
    """How a sampler commits tokens. Subclasses set `num_models` and `roles` (the `token_forwards`
    keys of its models) and implement `scores` and `step`."""

    num_models: ClassVar[int] = 1
    roles: ClassVar[tuple[str, ...]] = ("generator",)

    @property
    def headroom(self) -> int:
        """Row-cache slots beyond the token budget that a step may write (look-ahead)."""
        return 0

    @property
    def baseline(self) -> Method:
        """The method whose distribution this one reproduces one token per step (itself here)."""
        return self

    def scores(self, logits: tuple[jax.Array, ...], controls: Controls, past: Past) -> jax.Array:
        """Raw scores [..., V] of the next token from each model's logits at the same positions, given
        what precedes them (`past`: the rows' tokens; the sampling's penalties and filters apply to the
        scores afterwards)."""
        raise NotImplementedError

    def step(
        self,
        graphs: Graphs,
        params: Params,
        state: DecodeState,
        prompts: PromptCaches,
        controls: Controls,
        pause_at: jax.Array | int,
    ) -> DecodeState:
        """Advance every active row short of `pause_at` tokens (pure: no host sync)."""
        raise NotImplementedError

    def advance(self, graphs, params, state, prompts, controls, pause_at) -> tuple[DecodeState, tuple]:
        """`step`, also returning each model's logits [B, V] at the position its token was drawn from
        (what an observer of the loop records): methods that commit one token per step."""
        raise TypeError(f"{type(self).__name__} commits several tokens per step: no logits to observe")


def forward(
    graph: nnx.GraphDef,
    params: nnx.State,
    tokens: jax.Array,
    index: jax.Array,
    prompt: PromptCache,
    rows: RowCache,
) -> tuple[jax.Array, RowCache]:
    """Feed tokens [B, T] that sit at generated indices `index` [B, T] (written at the same slots).

    Returns float32 logits [B, T, V] and the cache (its `length` is left for the caller). Positions
    are clamped to the model's context: only look-ahead tokens past the budget reach the clamp, and
    those are never kept."""
    module = nnx.merge(graph, params)
    G = index.shape[0] // prompt.num_prompts
    positions = jnp.minimum(
        jnp.repeat(prompt.length, G)[:, None] + index, module.config.max_position_embeddings - 1
    )
    hidden, rows = module.decode(tokens, positions, prompt, rows.replace(length=index[:, 0]))
    return module.logits(hidden), rows


def keys_of(state: DecodeState) -> jax.Array:
    """Each row's key for its next token."""
    return row_keys(state.seed, state.prompt_id, state.sample_id, state.num_generated)


def vocab_of(graph: nnx.GraphDef, params: nnx.State) -> int:
    """The vocabulary size of a model's logits (its config's; static)."""
    return nnx.merge(graph, params).config.vocab_size


def past_of(state: DecodeState, prompt: PromptCache) -> Past:
    """What precedes each row's next token: its generated tokens and its prompt's (`prompt`: the
    target's cache, rows grouped by prompt)."""
    G = state.tokens.shape[0] // prompt.num_prompts
    ids = jnp.repeat(jnp.where(prompt.mask, prompt.tokens, -1), G, axis=0)
    return Past(state.tokens, state.num_generated, ids)


def next_tokens(
    method: Method, state: DecodeState, prompt: PromptCache, logits: tuple[jax.Array, ...], controls: Controls
) -> jax.Array:
    """Each row's next token [B], drawn from the method's scores of the models' logits [B, V] at the
    row's next position (`prompt`: the target's cache)."""
    past, sampling = past_of(state, prompt), controls.sampling
    scores = method.scores(logits, controls, past)
    return draw(keys_of(state), scores, sampling, history(sampling, past, scores.shape[-1]))


@dataclasses.dataclass(frozen=True)
class PlainSampling(Method):
    """Plain sampling: one token per step from the target's logits (after the sampling's processing)."""

    def scores(self, logits: tuple[jax.Array, ...], controls: Controls, past: Past) -> jax.Array:
        return logits[0]

    def step(self, graphs, params, state, prompts, controls, pause_at):
        return self.advance(graphs, params, state, prompts, controls, pause_at)[0]

    def advance(self, graphs, params, state, prompts, controls, pause_at):
        active = state.active(pause_at)
        index, last = state.last_tokens()
        outputs = [
            forward(g, p, last[:, None], index[:, None], prompt, rows)
            for g, p, prompt, rows in zip(graphs, params, prompts, state.rows, strict=True)
        ]
        logits = tuple(z[:, 0] for z, _ in outputs)
        tokens = next_tokens(self, state, prompts[0], logits, controls)
        state = record(state, tokens, token_statistics(logits[0], tokens), active)
        state = state.with_rows(tuple(rows for _, rows in outputs))
        state = state.replace(
            steps=state.steps + 1, forwards=state.forwards + 1, target_calls=state.target_calls + active
        )
        return state, logits


@dataclasses.dataclass(frozen=True)
class ContrastiveDecoding(PlainSampling):
    """Contrastive decoding (`jaxsr.decoding.contrast`): the expert and the amateur step together, one
    token per step from their contrast; the recorded log-probability is the expert's own."""

    num_models: ClassVar[int] = 2
    roles: ClassVar[tuple[str, ...]] = ("expert", "amateur")

    def scores(self, logits: tuple[jax.Array, ...], controls: Controls, past: Past) -> jax.Array:
        return contrastive_scores(logits[0], logits[1], controls.contrast)
