"""The static shape ladder: sizes are rounded up to powers of two so that each rung compiles once."""

from __future__ import annotations


def bucket(n: int, minimum: int = 16, cap: int | None = None) -> int:
    """The rung for size `n`: the next power of two, at least `minimum`, at most `cap` when given."""
    rung = max(minimum, 1 << max(n - 1, 0).bit_length())
    return rung if cap is None else min(cap, rung)
