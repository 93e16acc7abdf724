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
    stop_token: int | None = None
    """The EOS or stop id that ended it (`logprob` counts it), None when it ran to `max_new_tokens`."""
    certainty: float | None = None
    """Sum over the positions `logprob` covers of the generator's self-certainty, KL(uniform ‖ p) of its
    raw next-token distribution (`rewards.SelfCertainty` reads its mean)."""
    stop_string: str | None = None
    """The stop string it ended on (its text is cut before it; `token_ids` keep the tokens that
    spelled it), None when it did not."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class Rejected:
    """A partial response a search stopped, and the decision that stopped it."""

    sample: Sample
    decision: int
    """Index of the decision in `Result.stats["decisions"]`."""
    at_token: int
    """Tokens the longest live row had generated at that decision."""
    forced: bool
    """Stopped because the memory could not hold it (kept by the rejection rule)."""

    def to_dict(self) -> dict[str, Any]:
        return {
            **self.sample.to_dict(),
            "decision": self.decision,
            "at_token": self.at_token,
            "forced": self.forced,
        }


@dataclasses.dataclass
class Result:
    """Everything produced for one prompt."""

    prompt: str | list[int] | list[dict[str, str]]
    samples: list[Sample]
    best: Sample | None = None
    stats: dict[str, Any] = dataclasses.field(default_factory=dict)
    rejected: list[Rejected] | None = None
    """Speculative Rejection with `keep_rejected`: the partial responses it stopped (preference data)."""

    def to_dict(self) -> dict[str, Any]:
        record = {
            "prompt": self.prompt,
            "samples": [s.to_dict() for s in self.samples],
            "best": None if self.best is None else self.best.to_dict(),
            "stats": self.stats,
        }
        if self.rejected is not None:
            record["rejected"] = [r.to_dict() for r in self.rejected]
        return record
