"""Static shape ladders: sizes are rounded up to a rung so that each rung compiles once."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def bucket(n: int, minimum: int = 16, cap: int | None = None) -> int:
    """The rung for size `n`: the next power of two, at least `minimum`, at most `cap` when given."""
    rung = max(minimum, 1 << max(n - 1, 0).bit_length())
    return rung if cap is None else min(cap, rung)


def round_up(n: int, multiple: int) -> int:
    """`n` rounded up to a multiple of `multiple`."""
    return -(-n // multiple) * multiple


def fine_bucket(n: int, minimum: int = 1, cap: int | None = None) -> int:
    """The rung for size `n` on a ladder of two rungs per octave (1, 2, 3, 4, 6, 8, 12, 16, 24, …: powers
    of two and 1.5 times them), at least `minimum`, at most `cap`: at most a third of a padded batch is
    padding (a power-of-two ladder allows half) for twice as many shapes. For batches whose work grows
    with their size and that are formed afresh all the time, such as reward-model inputs."""
    power = bucket(n, 1)
    rung = power * 3 // 4 if power >= 4 and n <= power * 3 // 4 else power
    rung = max(minimum, rung)
    return rung if cap is None else min(cap, rung)


def length_sorted_chunks(lengths: Sequence[int], size: int) -> list[np.ndarray]:
    """The indices of items of these `lengths`, shortest first, in chunks of at most `size`: each chunk
    pads to little more than its own longest item."""
    order = np.argsort(np.asarray(lengths), kind="stable")
    return [order[start : start + size] for start in range(0, len(order), size)]
