"""Self-certainty (Kang et al., arXiv 2502.18581): how far the generator's own next-token distributions
over a response are from uniform, KL(U ‖ p) averaged over its tokens — a reward with no reward model
that picks Best-of-N winners by the model's confidence. Computed with one forward pass of the
generator over prompt and response (the response positions' logits only). A response that stopped
counts its stop token's position too (as the generator's first EOS id)."""

from __future__ import annotations

import numpy as np

from jaxsr.models.model import Model
from jaxsr.rewards.base import Candidates, reward_batch
from jaxsr.rewards.sequence import check_language_model, response_sums, stopped_responses


class SelfCertainty:
    """Mean KL(uniform ‖ p) of the generator's next-token distributions over each response."""

    def __init__(self, model: Model, batch_size: int | None = None):
        check_language_model("model", model)
        self.model = model
        self.batch_size = reward_batch(batch_size, 32)
        self.name = f"self_certainty:{model.name or 'generator'}"
        self.token_forwards = 0

    def score(self, candidates: Candidates) -> np.ndarray:
        return self.score_many([candidates])[0]

    def score_many(self, batches: list[Candidates]) -> list[np.ndarray]:
        """Several prompts' responses, in shared batches."""
        responses = [r for c in batches for r in stopped_responses(self.model, c.token_ids, c.num_tokens)]
        prompts = [c.prompt_ids for c in batches for _ in c.token_ids]
        sums, forwards = response_sums(self.model, prompts, responses, "certainty", self.batch_size)
        self.token_forwards += forwards
        certainty = sums / np.maximum([len(r) for r in responses], 1)
        return np.split(certainty, np.cumsum([len(c) for c in batches])[:-1])
