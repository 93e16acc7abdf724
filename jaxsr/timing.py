"""Wall time with JAX's compiling told apart, so that a stage's seconds say how long it ran.

JAX reports each trace, lowering and backend compile as a time span (`jax.monitoring`); a listener,
registered when this module is imported, keeps them. A shape compiles on its first use, inside whatever
stage runs it first: `Stopwatch` times a stage and splits its seconds into running and compiling."""

from __future__ import annotations

import time
from typing import Any

from jax import monitoring

COMPILE_EVENTS = frozenset(
    (
        "/jax/core/compile/jaxpr_trace_duration",
        "/jax/core/compile/jaxpr_to_mlir_module_duration",
        "/jax/core/compile/backend_compile_duration",
    )
)
_spans: list[tuple[float, float]] = []
"""(start, end) `time.time()` of each compile span, in the order they ended."""


def _record(event: str, start: float, end: float, **_: Any) -> None:
    if event in COMPILE_EVENTS:
        _spans.append((start, end))


monitoring.register_event_time_span_listener(_record)


def compiling(start: float, end: float = float("inf")) -> float:
    """Seconds JAX spent compiling within [start, end] (`time.time()`); nested spans count once."""
    inside = []
    for a, b in reversed(_spans):  # newest first: stop at the first span that ended before `start`
        if b < start:
            break
        inside.append((max(a, start), min(b, end)))
    total, reach = 0.0, start
    for a, b in sorted(inside):
        a = max(a, reach)
        if b > a:
            total, reach = total + b - a, b
    return total


class Stopwatch:
    """Times one stage from its creation: `split()` gives (seconds running, seconds compiling)."""

    def __init__(self) -> None:
        self.start = time.time()

    def split(self) -> tuple[float, float]:
        end = time.time()
        compiled = compiling(self.start, end)
        return max(0.0, end - self.start - compiled), compiled
