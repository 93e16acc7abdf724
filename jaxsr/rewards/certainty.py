"""Self-certainty (Kang et al., arXiv 2502.18581): how far the generator's own next-token distributions
over a response are from uniform, KL(U ‖ p) averaged over its tokens — a reward with no reward model
that picks Best-of-N winners by the model's confidence. The sampler sums it from the raw logits it
samples from (`DecodeState.certainty_sum`), so scoring costs no forward pass; a response that stopped
counts the position of the stop token it ended on too. Under a contrastive or speculative decoder
the distributions are the target's (the expert's)."""

from __future__ import annotations

import numpy as np

from jaxsr.rewards.base import Candidates


class SelfCertainty:
    """Mean KL(uniform ‖ p) of the generator's raw next-token distributions over each response."""

    def __init__(self) -> None:
        self.name = "self_certainty"
        self.token_forwards = 0

    def score(self, candidates: Candidates) -> np.ndarray:
        if candidates.certainty_sum is None:
            raise ValueError(
                "self_certainty: the candidates carry no certainty_sum (it is summed while jaxsr samples "
                "them; responses sampled elsewhere cannot be scored by it)"
            )
        return candidates.certainty_sum / np.maximum(candidates.num_tokens, 1)
