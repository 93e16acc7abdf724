"""Argument checks every entry point shares: a bad value raises TypeError/ValueError naming it."""

from __future__ import annotations

import math
from typing import Any

import numpy as np


def check_positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name}: expected an int >= 1, got {value}")
    return int(value)


def check_seed(seed: Any) -> int:
    if isinstance(seed, bool) or not isinstance(seed, int | np.integer) or not 0 <= seed < 2**32:
        raise TypeError(f"seed: expected an int in [0, 2**32), got {seed!r}")
    return int(seed)


def check_number(name: str, value: Any) -> float:
    """A finite int or float."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name}: expected a number, got {type(value).__name__}")
    if not math.isfinite(value):
        raise ValueError(f"{name}: expected a finite number, got {value}")
    return float(value)
