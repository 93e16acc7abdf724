"""What a reward sees: one prompt and a batch of (possibly partial) responses to it."""

from __future__ import annotations

import dataclasses
from typing import Protocol, runtime_checkable

import jax
import numpy as np

from jaxsr.checks import check_positive_int


@dataclasses.dataclass
class Candidates:
    """Responses to one prompt, each cut before its EOS/stop token."""

    prompt_text: str
    """What the user asked: the prompt's text, or a conversation's last user turn."""
    prompt_ids: list[int]
    """The prompt as the generator saw it (chat template applied)."""
    token_ids: list[list[int]]
    texts: list[str]
    logprob_sum: np.ndarray
    """[n] generator log-probability of each response's sampled tokens (stop token included)."""
    num_tokens: np.ndarray
    """[n] tokens each logprob_sum covers."""
    messages: list[dict[str, str]] | None = None
    """The prompt as a conversation (system message, earlier turns, the user turn answered): what a
    reward model's chat template renders before the response. None: one user turn of `prompt_text`."""
    stop_tokens: list[int | None] | None = None
    """[n] the EOS or stop id that ended each response (None: it ran out of tokens); None when not
    known (the responses were not sampled by jaxsr)."""
    certainty_sum: np.ndarray | None = None
    """[n] the generator's self-certainty summed over the positions `logprob_sum` covers
    (`Sample.certainty`); None when not known (the responses were not sampled by jaxsr)."""

    def __post_init__(self) -> None:
        if self.messages is None:
            self.messages = [{"role": "user", "content": self.prompt_text}]

    def __len__(self) -> int:
        return len(self.token_ids)


@runtime_checkable
class Reward(Protocol):
    """Scores responses; `token_forwards` counts the token positions it ran through its model."""

    name: str
    token_forwards: int

    def score(self, candidates: Candidates) -> np.ndarray:
        """[n] float scores, higher is better."""
        ...


CPU_BATCH = 8
"""Responses a reward model scores a call on CPU, where larger batches run slower (MiniLM on 2 cores:
64 responses in one call took 2.3x the time of 8 calls of 8)."""


def reward_batch(batch_size: int | None, accelerated: int) -> int:
    """A reward model's responses per call: `batch_size` as given, else `accelerated` on a GPU/TPU and
    CPU_BATCH on CPU."""
    if batch_size is not None:
        return check_positive_int("batch_size", batch_size)
    return CPU_BATCH if jax.default_backend() == "cpu" else accelerated


def score_each(reward: Reward, batches: list[Candidates]) -> list[np.ndarray]:
    """Several prompts' candidates scored: in shared model batches where the reward has
    `score_many(batches) -> [scores of each]` (jaxsr's model rewards do), else one prompt at a time."""
    if not batches:
        return []
    many = getattr(reward, "score_many", None)
    if many is not None:
        return list(many(batches))
    return [reward.score(c) if len(c) else np.zeros(0) for c in batches]
