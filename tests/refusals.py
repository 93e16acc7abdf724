"""What the tests of arguments refused before decoding share: a tiny model, a guard that fails the test
at any prefill, a custom reward that returns whatever it is told to, and a deadline for refusals that
must not hang (a FIFO where a file was expected).

A test module takes the fixtures by name (`lm, no_decoding = refusals.lm, refusals.no_decoding`); each
module then builds its own module-scoped `lm`."""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator

import pytest
from tiny import tiny_model

from jaxsr.decoding.driver import Sampler


@pytest.fixture(scope="module")
def lm():
    """A tiny random model whose responses end at 5 or 63 (so that a stop id of 63 changes nothing)."""
    return tiny_model(seed=0, eos_token_ids=(5, 63))


@pytest.fixture
def no_decoding(monkeypatch):
    """Any prefill fails the test: the refusals tested must come before the first forward pass."""

    def refuse(*args, **kwargs):
        raise AssertionError("decoding started before the arguments were checked")

    monkeypatch.setattr(Sampler, "prefill", refuse)


class Returns:
    """A custom reward that returns `value` for any candidates."""

    name, token_forwards = "fixed", 0

    def __init__(self, value):
        self.value = value

    def score(self, candidates):
        return self.value(len(candidates)) if callable(self.value) else self.value


@contextlib.contextmanager
def within(seconds: int) -> Iterator[None]:
    """Fail a block still running after `seconds` (one blocked on a FIFO) rather than hang the tests."""

    def stop(*_) -> None:
        raise TimeoutError(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, stop)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
