"""jaxsr: inference-time alignment decoding in JAX (Best-of-N, Speculative Rejection, speculative and
contrastive decoding)."""

from jaxsr.decoding.generate import generate
from jaxsr.decoding.sampling import SamplingConfig
from jaxsr.loading.api import load_model, load_reward_model
from jaxsr.models.model import Model, RewardModel
from jaxsr.results import Result, Sample

__all__ = [
    "Model",
    "Result",
    "RewardModel",
    "Sample",
    "SamplingConfig",
    "generate",
    "load_model",
    "load_reward_model",
]
