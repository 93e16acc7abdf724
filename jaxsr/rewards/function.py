"""A plain function as a reward: `fn(prompt_text, response_text) -> float`, called once per response."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from jaxsr.rewards.base import Candidates


class FunctionReward:
    """Scores each response by `fn(prompt, response)` (the user's prompt and the response as text),
    for rewards that need no batching: a rule, a regex, an API call. For batched model calls, write a
    class with `score(candidates)` instead (README: Custom rewards)."""

    def __init__(self, fn: Callable[[str, str], float]):
        self.fn = fn
        self.name = f"function:{getattr(fn, '__qualname__', type(fn).__name__)}"
        self.token_forwards = 0

    def score(self, candidates: Candidates) -> np.ndarray:
        return np.array([self.fn(candidates.prompt_text, t) for t in candidates.texts], np.float64)
