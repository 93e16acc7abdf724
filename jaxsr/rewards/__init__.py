"""Rewards for Best-of-N and Speculative Rejection."""

from __future__ import annotations

from typing import Any

from jaxsr.models.encoder import EncoderModel
from jaxsr.models.model import RewardModel
from jaxsr.rewards.base import Candidates, Reward
from jaxsr.rewards.certainty import SelfCertainty
from jaxsr.rewards.classifier import ClassifierReward
from jaxsr.rewards.function import FunctionReward
from jaxsr.rewards.implicit import ImplicitReward
from jaxsr.rewards.likelihood import SelfLikelihood
from jaxsr.rewards.similarity import EmbeddingSimilarity

__all__ = [
    "Candidates",
    "ClassifierReward",
    "EmbeddingSimilarity",
    "FunctionReward",
    "ImplicitReward",
    "Reward",
    "SelfCertainty",
    "SelfLikelihood",
    "as_reward",
]


REQUIRED = {"name": str, "token_forwards": int}
"""A reward object's attributes besides `score`, and their types."""


def as_reward(reward: Any) -> Reward:
    """Accept a RewardModel, an EncoderModel, an object implementing `Reward` (`score(candidates)`,
    `name`, `token_forwards`; optional `token_scorer`, `score_many`, `check`), or a plain function
    `fn(prompt, response) -> float` (`FunctionReward`)."""
    if isinstance(reward, RewardModel):
        return ClassifierReward(reward)
    if isinstance(reward, EncoderModel):
        return EmbeddingSimilarity(reward)
    if hasattr(reward, "score"):
        _check_reward_object(reward)
        return reward
    if callable(reward) and not isinstance(reward, type):
        return FunctionReward(reward)
    raise TypeError(
        "reward: expected a jaxsr.RewardModel, a jaxsr.EncoderModel, a reward object with "
        "`score(candidates)` (e.g. jaxsr.rewards.SelfLikelihood()) or a function (prompt, response) -> "
        f"float, got {type(reward).__name__}"
    )


def _check_reward_object(reward: Any) -> None:
    """A reward object has every attribute of the protocol, of the right kind; each missing or wrong
    one is named."""
    kind = type(reward).__name__
    if not callable(reward.score):
        raise TypeError(f"reward: {kind}'s `score` must be a method, got {type(reward.score).__name__}")
    for attribute, expected in REQUIRED.items():
        if not hasattr(reward, attribute):
            raise TypeError(f"reward: {kind} has `score` but no `{attribute}` (of type {expected.__name__})")
        value = getattr(reward, attribute)
        if isinstance(value, bool) or not isinstance(value, expected):
            wanted = expected.__name__
            raise TypeError(f"reward: {kind}'s `{attribute}` must be of type {wanted}, got {value!r}")
    for optional in ("token_scorer", "score_many", "check"):
        method = getattr(reward, optional, None)
        if method is not None and not callable(method):
            raise TypeError(f"reward: {kind}'s `{optional}` must be a method, got {type(method).__name__}")
