"""The implicit reward of a DPO-tuned policy (Rafailov et al. 2023): log π(y|x) − log π_ref(y|x), up to
DPO's β. TreeBoN (Qiu et al. 2024) prunes partial responses with its weighted form, the mean over the
response's tokens (`kind="mean"`); `kind="sum"` is DPO's own.

The policy must be the generator: its log-probabilities are the ones the sampler accumulated while
sampling (no forward pass); the reference runs one forward pass over prompt and response, reading the
response positions only, the stop token a response ended on included (as the policy's sum counts it).
The reference must read prompts and responses of the generator's lengths (its context is checked)."""

from __future__ import annotations

from typing import Literal

import numpy as np

from jaxsr.decoding.inputs import check_language_model
from jaxsr.models.model import Model
from jaxsr.rewards.base import Candidates, reward_batch
from jaxsr.rewards.sequence import score_responses, split_by_batch

Kind = Literal["mean", "sum"]


class ImplicitReward:
    """log π − log π_ref of each response (mean per token or sum), π the generator (`policy`)."""

    def __init__(self, policy: Model, reference: Model, kind: Kind = "mean", batch_size: int | None = None):
        check_language_model(policy, "policy")
        check_language_model(reference, "reference")
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
        reference, lengths, forwards = score_responses(self.reference, batches, self.batch_size)
        self.token_forwards += forwards
        implicit = np.concatenate([c.logprob_sum for c in batches]) - reference
        if self.kind == "mean":
            implicit = implicit / np.maximum(lengths, 1)
        return split_by_batch(implicit, batches)
