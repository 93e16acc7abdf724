"""KV memory budgets: token slots of one model's cache, from an int, a size string, or the device."""

from __future__ import annotations

import re

import jax
from jax.sharding import Mesh

from jaxsr.checks import available_bytes, device_free_bytes, format_bytes, is_int

_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}
MAX_BYTES = 2**62  # a budget past this is a typo: no machine holds it, and sizes must stay int64
DEVICE_HEADROOM = 0.9  # share of free accelerator memory the KV cache may take


def parse_bytes(text: str) -> int:
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", text)
    if not match or match.group(2).upper() not in _UNITS:
        raise ValueError(
            f"memory_budget: cannot read {text!r}; expected e.g. '4GiB', '512MB' or a slot count"
        )
    size = float(match.group(1)) * _UNITS[match.group(2).upper()]
    if not size < MAX_BYTES:
        raise ValueError(f"memory_budget: {text!r} is beyond any machine (more than 2**62 bytes)")
    return int(size)


def budget_slots(
    memory_budget: int | str | None,
    slot_bytes: int,
    fallback_slots: int | None = None,
    mesh: Mesh | None = None,
    copies: int = 1,
) -> int:
    """The budget as token slots of `slot_bytes` each (one position in every cache of the decoder).
    `None` derives it from free device memory (parameters are already resident, so they are excluded):
    the device's, or on a `mesh` the fullest device's — not yet times the `data` shards: the budget
    does not count a batch's mesh padding rows nor the prompt cache each shard holds. Where the device
    cannot tell (CPU), `fallback_slots` is used. A budget held `copies` times at once (prompts searched
    together) that the devices cannot hold is refused before anything is allocated."""
    devices = jax.local_devices()[:1] if mesh is None else list(mesh.local_devices)
    if memory_budget is None:
        free = device_free_bytes(devices)
        if free is not None:
            return int(free * DEVICE_HEADROOM) // slot_bytes
        if fallback_slots is None:
            raise ValueError(
                "memory_budget: required on CPU (the device reports no free memory); "
                "give token slots (int) or bytes ('2GiB')"
            )
        slots = fallback_slots
    elif is_int(memory_budget):
        if not 1 <= memory_budget < MAX_BYTES:
            shown = str(memory_budget)[:24]
            raise ValueError(f"memory_budget: expected a slot count in [1, 2**62), got {shown}")
        slots = int(memory_budget)
    elif isinstance(memory_budget, str):
        slots = parse_bytes(memory_budget) // slot_bytes
    else:
        raise TypeError(
            f"memory_budget: expected an int, a size string or None, got {type(memory_budget).__name__}"
        )
    available, needed = available_bytes(devices), slots * slot_bytes * copies
    if available is not None and needed > available:
        asked = "every row at once (no memory_budget given)" if memory_budget is None else repr(memory_budget)
        times = f" x {copies} prompts in flight" if copies > 1 else ""
        raise ValueError(
            f"memory_budget: {asked}{times} needs {format_bytes(needed)} of KV cache, but the "
            f"{devices[0].platform} has {format_bytes(available)} available; give a smaller memory_budget"
        )
    return slots
