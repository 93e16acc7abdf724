"""Rewards for Best-of-N and Speculative Rejection."""

from __future__ import annotations

from typing import Any

from jaxsr.models.encoder import EncoderModel
from jaxsr.models.model import RewardModel
from jaxsr.rewards.base import Candidates, Reward
from jaxsr.rewards.classifier import ClassifierReward
from jaxsr.rewards.likelihood import SelfLikelihood
from jaxsr.rewards.similarity import EmbeddingSimilarity

__all__ = ["Candidates", "ClassifierReward", "EmbeddingSimilarity", "Reward", "SelfLikelihood", "as_reward"]


def as_reward(reward: Any) -> Reward:
    """Accept a RewardModel, an EncoderModel, or any object implementing `Reward`."""
    if isinstance(reward, RewardModel):
        return ClassifierReward(reward)
    if isinstance(reward, EncoderModel):
        return EmbeddingSimilarity(reward)
    if isinstance(reward, Reward):
        if not callable(reward.score):
            raise TypeError(f"reward: its `score` must be a method, got {type(reward.score).__name__}")
        if isinstance(reward.token_forwards, bool) or not isinstance(reward.token_forwards, int):
            raise TypeError(f"reward: its `token_forwards` must be an int, got {reward.token_forwards!r}")
        for optional in ("token_scorer", "score_many"):
            method = getattr(reward, optional, None)
            if method is not None and not callable(method):
                raise TypeError(f"reward: its `{optional}` must be a method, got {type(method).__name__}")
        return reward
    raise TypeError(
        "reward: expected a jaxsr.RewardModel, a jaxsr.EncoderModel, or a reward object with "
        f"`score(candidates)` (e.g. jaxsr.rewards.SelfLikelihood()), got {type(reward).__name__}"
    )
