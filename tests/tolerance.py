"""Comparing results of two different computations: tokens and choices exactly, floats to f32 rounding.

Two programs that compute the same log-probabilities or rewards in another way (another batch shape,
chunks instead of one batch, a mesh, a cached instead of a full forward, another CPU instruction set)
agree only to float32 rounding: XLA vectorises and orders each reduction by shape and ISA. A tolerance
is therefore stated wherever the two sides differ; bitwise equality is kept only where both sides are
literally the same computation.
"""

from __future__ import annotations

import pytest

import jaxsr

SCORE_RTOL = 1e-5
"""f32 sums of log-probabilities (and the self-likelihood scores, their means) from two programs: about
1e-6 apart relative to their size on AVX2, SSE4.2 and AVX; 1e-5 leaves a tenfold margin."""
SCORE_ATOL = 1e-5
"""The same for scores near zero."""


def assert_same_sample(
    got: jaxsr.Sample, expected: jaxsr.Sample, *, rtol: float = SCORE_RTOL, atol: float = SCORE_ATOL
) -> None:
    """Token ids, text, `finished` and the sample index exactly; `score` and `logprob` to float32
    rounding (`rtol`, `atol`): the two samples come from different computations."""
    assert (got.index, got.token_ids, got.text, got.finished) == (
        expected.index,
        expected.token_ids,
        expected.text,
        expected.finished,
    )
    for name in ("score", "logprob"):
        a, b = getattr(got, name), getattr(expected, name)
        assert (a is None) == (b is None), name
        if a is not None:
            assert a == pytest.approx(b, rel=rtol, abs=atol), name
