"""Self-likelihood: the paper's "maximize generation probability" reward, read off the sampling logits."""

from __future__ import annotations

from typing import Literal

import numpy as np

from jaxsr.rewards.base import Candidates


class SelfLikelihood:
    """Mean log-probability (or −perplexity) of a response under the generator itself.

    The sampler accumulates each token's raw log-probability as it samples, so scoring costs no
    forward pass (`token_forwards` stays 0)."""

    def __init__(self, kind: Literal["mean_logprob", "neg_perplexity"] = "mean_logprob"):
        if kind not in ("mean_logprob", "neg_perplexity"):
            raise ValueError(f"kind: expected 'mean_logprob' or 'neg_perplexity', got {kind!r}")
        self.kind = kind
        self.name = f"self_likelihood:{kind}"
        self.token_forwards = 0

    def score(self, candidates: Candidates) -> np.ndarray:
        mean = candidates.logprob_sum / np.maximum(candidates.num_tokens, 1)
        return mean if self.kind == "mean_logprob" else -np.exp(-mean)
