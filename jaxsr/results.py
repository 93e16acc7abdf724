"""What every decoding and search call returns: one `Result` per prompt."""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass
class Sample:
    """One generated response: its tokens (without the EOS/stop token), text and reward."""

    token_ids: list[int]
    text: str
    score: float | None = None
    finished: bool = False
    """True when it stopped on EOS/stop rather than on `max_new_tokens`."""
    logprob: float | None = None
    """Sum of the generator's log-probabilities of the sampled tokens (stop token included)."""
    index: int | None = None
    """Sample index within its prompt: with the seed and prompt index it fixes the random stream."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class Result:
    """Everything produced for one prompt."""

    prompt: str | list[int]
    samples: list[Sample]
    best: Sample | None = None
    stats: dict[str, Any] = dataclasses.field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "prompt": self.prompt,
            "samples": [s.to_dict() for s in self.samples],
            "best": None if self.best is None else self.best.to_dict(),
            "stats": self.stats,
        }
