"""The implicit reward of a DPO-tuned policy (Rafailov et al. 2023): log π(y|x) − log π_ref(y|x), up to
DPO's β. TreeBoN (Qiu et al. 2024) prunes partial responses with its weighted form, the mean over the
response's tokens (`kind="mean"`); `kind="sum"` is DPO's own.

The policy must be the generator: its log-probabilities are the ones the sampler accumulated while
sampling (no forward pass); the reference runs one forward pass over prompt and response, reading the
response positions only. A response that stopped is scored with the policy's first EOS id as its stop
token (the generator's stop tokens are not passed to rewards)."""

from __future__ import annotations

from functools import partial
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxsr.ladder import bucket, fine_bucket, length_sorted_chunks
from jaxsr.models.model import Model
from jaxsr.rewards.base import Candidates, reward_batch
from jaxsr.sharding import padded_rows, place_rows
from jaxsr.text import left_pad

Kind = Literal["mean", "sum"]


@partial(jax.jit, static_argnums=(0, 4))
def _response_logprobs(
    graph: nnx.GraphDef, params: nnx.State, tokens: jax.Array, mask: jax.Array, width: int, lengths: jax.Array
) -> jax.Array:
    """[B] the model's log-probability of each row's last `lengths[b]` tokens (≤ `width`), given what
    precedes them (rows left-padded): logits of the last `width` positions only."""
    module = nnx.merge(graph, params)
    hidden, _ = module.prefill(tokens, mask)
    logits = module.logits(hidden[:, -width - 1 : -1]).astype(jnp.float32)
    picked = jnp.take_along_axis(jax.nn.log_softmax(logits, -1), tokens[:, -width:, None], -1)[..., 0]
    response = jnp.arange(width)[None, :] >= width - lengths[:, None]
    return jnp.where(response, picked, 0.0).sum(-1)


class ImplicitReward:
    """log π − log π_ref of each response (mean per token or sum), π the generator (`policy`)."""

    def __init__(self, policy: Model, reference: Model, kind: Kind = "mean", batch_size: int | None = None):
        for name, model in (("policy", policy), ("reference", reference)):
            if not isinstance(model, Model) or model.config.is_reward_model:
                raise TypeError(
                    f"{name}: expected a jaxsr.Model (language model), got {type(model).__name__}"
                )
        if policy.config.vocab_size != reference.config.vocab_size:
            raise ValueError(
                f"reference: its vocabulary ({reference.config.vocab_size} ids) is not the policy's "
                f"({policy.config.vocab_size}); the implicit reward compares both on the same tokens"
            )
        if kind not in ("mean", "sum"):
            raise ValueError(f"kind: expected 'mean' or 'sum', got {kind!r}")
        self.policy, self.reference, self.kind = policy, reference, kind
        self.batch_size = reward_batch(batch_size, 32)
        self.name = f"implicit:{reference.name or 'reference'}:{kind}"
        self.token_forwards = 0

    def score(self, candidates: Candidates) -> np.ndarray:
        return self.score_many([candidates])[0]

    def score_many(self, batches: list[Candidates]) -> list[np.ndarray]:
        """Several prompts' responses, the reference's log-probabilities computed in shared batches."""
        stop = list(self.policy.eos_token_ids[:1])
        responses = [
            list(ids) + stop * int(count > len(ids))
            for c in batches
            for ids, count in zip(c.token_ids, c.num_tokens, strict=True)
        ]
        prompts = [c.prompt_ids for c in batches for _ in c.token_ids]
        reference = self._reference(prompts, responses)
        policy = np.concatenate([c.logprob_sum for c in batches]) if batches else np.zeros(0)
        implicit = policy - reference
        if self.kind == "mean":
            implicit = implicit / np.maximum([len(r) for r in responses], 1)
        return np.split(implicit, np.cumsum([len(c) for c in batches])[:-1])

    def _reference(self, prompts: list[list[int]], responses: list[list[int]]) -> np.ndarray:
        """The reference's log-probability of each response after its prompt, shortest first."""
        model, out = self.reference, np.zeros(len(responses), np.float64)
        sequences = [p + r for p, r in zip(prompts, responses, strict=True)]
        for chunk in length_sorted_chunks([len(s) for s in sequences], self.batch_size):
            rows = padded_rows(fine_bucket(len(chunk)), model.mesh)  # splits over `data`
            length = min(fine_bucket(len(sequences[chunk[-1]]), 16), model.config.context)
            width = min(bucket(max(len(responses[i]) for i in chunk)), length - 1)
            tokens, mask = left_pad([sequences[i] for i in chunk], rows, length)
            mask[len(chunk) :, -1] = 1  # padding rows read one pad token instead of nothing
            lengths = np.zeros(rows, np.int32)
            lengths[: len(chunk)] = [len(responses[i]) for i in chunk]
            self.token_forwards += rows * length
            tokens, mask, lengths = place_rows(model.mesh, tokens, mask, lengths)
            scores = _response_logprobs(model.graph, model.params, tokens, mask, width, lengths)
            out[chunk] = np.asarray(scores)[: len(chunk)]
        return out
