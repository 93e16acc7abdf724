"""Self-certainty (Kang et al., arXiv 2502.18581): how far the generator's own next-token distributions
over a response are from uniform, KL(U ‖ p) averaged over its tokens — a reward with no reward model
that picks Best-of-N winners by the model's confidence. Computed with one forward pass of the
generator over prompt and response (the response positions' logits only). A response that stopped
counts the position of the stop token it ended on too."""

from __future__ import annotations

import numpy as np

from jaxsr.decoding.inputs import check_language_model
from jaxsr.models.model import Model
from jaxsr.rewards.base import Candidates, reward_batch
from jaxsr.rewards.sequence import score_responses, split_by_batch


class SelfCertainty:
    """Mean KL(uniform ‖ p) of the generator's next-token distributions over each response."""

    def __init__(self, model: Model, batch_size: int | None = None):
        check_language_model(model, "model")
        self.model = model
        self.batch_size = reward_batch(batch_size, 32)
        self.name = f"self_certainty:{model.name or 'generator'}"
        self.token_forwards = 0

    def score(self, candidates: Candidates) -> np.ndarray:
        return self.score_many([candidates])[0]

    def score_many(self, batches: list[Candidates]) -> list[np.ndarray]:
        """Several prompts' responses, in shared batches."""
        sums, lengths, forwards = score_responses(self.model, batches, "certainty", self.batch_size)
        self.token_forwards += forwards
        return split_by_batch(sums / np.maximum(lengths, 1), batches)
