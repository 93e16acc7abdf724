"""A language model's log-probabilities of responses after their prompts, summed over each response:
what the implicit reward's reference computes in one forward pass, in shared bucketed batches."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxsr.ladder import bucket, fine_bucket, length_sorted_chunks
from jaxsr.models.model import Model
from jaxsr.rewards.base import Candidates
from jaxsr.sharding import padded_rows, place_rows
from jaxsr.text import left_pad


@partial(jax.jit, static_argnums=(0, 4))
def _response_sums(
    graph: nnx.GraphDef, params: nnx.State, tokens: jax.Array, mask: jax.Array, width: int, lengths: jax.Array
) -> jax.Array:
    """[B] log-probabilities summed over each row's last `lengths[b]` tokens (≤ `width`), rows
    left-padded: logits of the last `width` positions only."""
    module = nnx.merge(graph, params)
    hidden, _ = module.prefill(tokens, mask)
    logp = jax.nn.log_softmax(module.logits(hidden[:, -width - 1 : -1]).astype(jnp.float32), -1)
    values = jnp.take_along_axis(logp, tokens[:, -width:, None], -1)[..., 0]
    response = jnp.arange(width)[None, :] >= width - lengths[:, None]
    return jnp.where(response, values, 0.0).sum(-1)


def response_sums(
    model: Model, prompts: list[list[int]], responses: list[list[int]], batch_size: int
) -> tuple[np.ndarray, int]:
    """Log-probabilities summed over each response after its prompt, shortest sequences first in batches
    of `batch_size`; and the token positions run through the model. A sequence longer than the
    model's context is refused naming the model."""
    out, forwards = np.zeros(len(responses), np.float64), 0
    sequences = [p + r for p, r in zip(prompts, responses, strict=True)]
    longest = max(map(len, sequences), default=0)
    if longest > model.config.context:
        raise ValueError(
            f"{model.name or 'the model'}: a prompt and response of {longest} tokens exceed its context of "
            f"{model.config.context}"
        )
    for chunk in length_sorted_chunks([len(s) for s in sequences], batch_size):
        rows = padded_rows(fine_bucket(len(chunk)), model.mesh)  # splits over `data`
        length = min(fine_bucket(len(sequences[chunk[-1]]), 16), model.config.context)
        width = min(bucket(max(len(responses[i]) for i in chunk)), length - 1)
        tokens, mask = left_pad([sequences[i] for i in chunk], rows, length)
        mask[len(chunk) :, -1] = 1  # padding rows read one pad token instead of nothing
        lengths = np.zeros(rows, np.int32)
        lengths[: len(chunk)] = [len(responses[i]) for i in chunk]
        forwards += rows * length
        tokens, mask, lengths = place_rows(model.mesh, tokens, mask, lengths)
        sums = _response_sums(model.graph, model.params, tokens, mask, width, lengths)
        out[chunk] = np.asarray(sums)[: len(chunk)]
    return out, forwards


def stopped_responses(model: Model, candidates: Candidates) -> list[list[int]]:
    """Each response with the stop token that ended it (`logprob_sum` counts it): as sampled, or where
    the candidates do not say, the model's first EOS id."""
    token_ids, stops = candidates.token_ids, candidates.stop_tokens
    if stops is None:  # not sampled by jaxsr: a response that stopped ended on the first EOS id
        eos = model.eos_token_ids[0] if model.eos_token_ids else None
        counts = candidates.num_tokens
        stops = [eos if n > len(ids) else None for ids, n in zip(token_ids, counts, strict=True)]
    return [list(ids) + ([] if stop is None else [stop]) for ids, stop in zip(token_ids, stops, strict=True)]


def score_responses(
    model: Model, batches: list[Candidates], batch_size: int
) -> tuple[np.ndarray, np.ndarray, int]:
    """Every batch's responses (with their stop tokens) after their prompts, one after another: their
    log-probabilities' sums, the responses' lengths, and the token positions run through the model."""
    responses = [r for c in batches for r in stopped_responses(model, c)]
    prompts = [c.prompt_ids for c in batches for _ in c.token_ids]
    sums, forwards = response_sums(model, prompts, responses, batch_size)
    return sums, np.array([len(r) for r in responses], np.int64), forwards


def split_by_batch(values: np.ndarray, batches: list[Candidates]) -> list[np.ndarray]:
    """`values` of every batch's responses, one after another, split back per batch."""
    return np.split(values, np.cumsum([len(c) for c in batches])[:-1])
