"""Argument checks every entry point shares: a bad value raises TypeError/ValueError naming it."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np


def is_int(value: Any) -> bool:
    """Whether `value` is an integer the API takes: a Python or NumPy int, not a bool (True is not 1)."""
    return isinstance(value, int | np.integer) and not isinstance(value, bool | np.bool_)


def is_real(value: Any) -> bool:
    """Whether `value` is a real number the API takes: an int as `is_int` says, or a Python or NumPy
    float (a NumPy scalar from a user's array counts as its Python twin)."""
    return is_int(value) or isinstance(value, float | np.floating)


def finite(value: Any) -> float | None:
    """`value` as a float when it is a finite number (not a bool), else None."""
    if not is_real(value) or not math.isfinite(value):
        return None
    return float(value)


def check_int(name: str, value: Any) -> int:
    """`value` as a Python int (see `is_int`)."""
    if not is_int(value):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}")
    return int(value)


def check_positive_int(name: str, value: Any) -> int:
    value = check_int(name, value)
    if value < 1:
        raise ValueError(f"{name}: expected an int >= 1, got {value}")
    return value


def check_unicode(name: str, text: str) -> str:
    """`text` if it is valid Unicode (no lone surrogates, which no tokenizer can take)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{name}: not valid Unicode text ({e.reason} at {e.start})") from None
    return text


def user_path(name: str, value: str | os.PathLike) -> Path:
    """A path as a shell user means it: `~` and `~user` expanded; one naming no known user (or no home)
    is refused naming `name`."""
    try:
        return Path(value).expanduser()
    except RuntimeError:  # what pathlib raises for ~nobody-known
        head = str(value).split(os.sep, 1)[0]
        raise ValueError(
            f"{name}: cannot expand {head!r} in {str(value)!r} (no such user or home directory)"
        ) from None


def check_seed(seed: Any) -> int:
    if not is_int(seed) or not 0 <= seed < 2**32:
        raise TypeError(f"seed: expected an int in [0, 2**32), got {seed!r}")
    return int(seed)


def check_number(name: str, value: Any) -> float:
    """`value` as a finite Python float (see `is_real`)."""
    if not is_real(value):
        raise TypeError(f"{name}: expected a number, got {type(value).__name__}")
    try:
        number = float(value)
    except OverflowError:  # an int beyond any float
        number = math.inf
    if not math.isfinite(number):
        raise ValueError(f"{name}: expected a finite number, got {str(value)[:24]}")
    return number


def check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool | np.bool_):
        raise TypeError(f"{name}: expected True or False, got {value!r}")
    return bool(value)


def check_callback(name: str, value: Any) -> None:
    """None or a callable."""
    if value is not None and not callable(value):
        raise TypeError(f"{name}: expected a function or None, got {type(value).__name__}")


RESPONSE_BYTES = 380
TOKEN_BYTES = 43
"""Host memory one returned `Sample` and each of its tokens take at least (measured with tracemalloc:
570 B for 4 tokens, 3.1 kB for 64 tokens of 49k-word ids with 4 characters of text each; a token is an
int object, its list slot and its text)."""


def host_available_bytes() -> int | None:
    """Memory the host can still give this process (Linux's MemAvailable), or None where it cannot say."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def device_free_bytes(devices: Sequence[jax.Device]) -> int | None:
    """Free memory of the fullest of `devices`, or None where the backend does not report it (CPU)."""
    free = []
    for device in devices:
        stats = device.memory_stats() or {}
        if "bytes_limit" not in stats:
            return None
        free.append(int(stats["bytes_limit"] - stats.get("bytes_in_use", 0)))
    return min(free)


def available_bytes(devices: Sequence[jax.Device]) -> int | None:
    """The most a KV cache spread over `devices` could take: their free memory together, or the
    host's available memory for CPU devices (which all share it); None where neither is known."""
    if all(device.platform == "cpu" for device in devices):
        return host_available_bytes()
    free = [device_free_bytes([device]) for device in devices]
    return None if None in free else sum(f for f in free if f is not None)


def format_bytes(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def check_responses_fit(name: str, responses: int, max_new_tokens: int) -> None:
    """Refuse, before decoding, a request whose responses alone cannot fit in host memory (a lower
    bound: the request would be killed for memory after hours of work)."""
    available = host_available_bytes()
    needed = responses * (RESPONSE_BYTES + TOKEN_BYTES * max_new_tokens)
    if available is not None and needed > available:
        raise ValueError(
            f"{name}: {responses} responses of up to {max_new_tokens} tokens need at least "
            f"{format_bytes(needed)} of host memory; {format_bytes(available)} is available"
        )


def check_rows_fit(name: str, needed: int, devices: Sequence[jax.Device], advice: str) -> None:
    """Refuse, before allocating, KV caches of `needed` bytes that `devices` cannot hold."""
    available = available_bytes(devices)
    if available is not None and needed > available:
        raise ValueError(
            f"{name}: the KV caches need {format_bytes(needed)}, but the {devices[0].platform} has "
            f"{format_bytes(available)} available; {advice}"
        )
