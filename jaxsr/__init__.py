"""jaxsr: inference-time alignment decoding in JAX (Best-of-N, Speculative Rejection, speculative and
contrastive decoding)."""

from jaxsr.loading.api import load_model, load_reward_model
from jaxsr.models.model import Model, RewardModel

__all__ = ["Model", "RewardModel", "load_model", "load_reward_model"]
