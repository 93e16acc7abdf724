"""Wall time with JAX's compiling told apart, so that a stage's seconds say how long it ran.

JAX reports each trace, lowering and backend compile as a time span (`jax.monitoring`); a listener,
registered when this module is imported, keeps them. A shape compiles on its first use, inside whatever
stage runs it first: `Stopwatch` times a stage and splits its seconds into running and compiling. A
thread that compiles ahead of the stages (`compiling_aside`) is not counted while the stages run beside
it; a stage that waits for its programs counts the wait (`waited`)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
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


_aside: set[int] = set()
"""The threads compiling aside (`compiling_aside`), by `threading.get_ident()`."""


def _record(event: str, start: float, end: float, **_: Any) -> None:
    if event in COMPILE_EVENTS and threading.get_ident() not in _aside:
        _spans.append((start, end))


@contextlib.contextmanager
def compiling_aside() -> Iterator[None]:
    """Compile inside the block (on a thread of its own) without it counting as compiling: the stages
    running meanwhile on other threads do not wait for it. They count what they wait for (`waited`)."""
    _aside.add(threading.get_ident())
    try:
        yield
    finally:
        _aside.discard(threading.get_ident())


def waited(start: float, end: float) -> None:
    """Count [start, end] (`time.time()`) as compiling: a stage waiting for programs compiled aside."""
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
