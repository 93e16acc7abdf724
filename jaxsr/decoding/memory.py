"""KV memory of a decoding call: budgets as token slots (from an int, a size string, or the
device's free memory) and the rows a batch of n samples a prompt decodes within one — Best-of-N's
and plain decoding's alike (`call_rows`). A search's own plans build on it (`jaxsr.search.memory`)."""

from __future__ import annotations

import re
from typing import Any

from jax.sharding import Mesh

from jaxsr.checks import available_bytes, device_free_bytes, format_bytes, is_int
from jaxsr.decoding.continuous import MIN_SLAB_LENGTH
from jaxsr.decoding.driver import Sampler, default_rows
from jaxsr.ladder import bucket
from jaxsr.sharding import data_shards, local_devices_of, padded_over

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
    the device's, or on a `mesh` the fullest device's (one device's: `mesh_budget` counts the shards
    for a search). Where the device
    cannot tell (CPU), `fallback_slots` is used. A budget held `copies` times at once (prompts searched
    together) that the devices cannot hold is refused before anything is allocated."""
    devices = local_devices_of(mesh)
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


def row_reserve(sampler: Sampler, from_device: bool) -> int:
    """Slots a row holds beyond its segment: the sampler's look-ahead and `work_slots`."""
    return sampler.headroom + work_slots(sampler, from_device)


def work_slots(sampler: Sampler, from_device: bool) -> int:
    """Where the budget is the device's own memory (`from_device`), the decode step's working memory
    per row (`Sampler.row_work_bytes`) in slots; else 0 — a budget the user gives counts KV only."""
    return -(-sampler.row_work_bytes // sampler.slot_bytes) if from_device else 0


def derived(sampler: Sampler, memory_budget: Any) -> bool:
    """Whether a budget comes from the devices' free memory (None given, a device that tells)."""
    return memory_budget is None and device_free_bytes(local_devices_of(sampler.mesh)) is not None


def call_rows(
    sampler: Sampler,
    memory_budget: int | str | None,
    encoded: list[list[int]],
    n: int,
    max_new_tokens: int,
    max_rows: int | None = None,
) -> tuple[int, int]:
    """A call's most rows decoded together and its slabs' fewest prompt slots, n samples a prompt:
    within a budget (given, or a GPU's or TPU's free memory when none is), the rows it holds
    (`budget_rows`) up to `max_rows`, and no prompt slot beyond a prompt's own bucket (the budget
    counts them); else (CPU, no budget) `max_rows` as given (default: `default_rows`) and
    `MIN_SLAB_LENGTH`."""
    least = least_slots(sampler, memory_budget)
    if not budgeted(sampler, memory_budget):
        return default_rows(sampler) if max_rows is None else max_rows, least
    rows = budget_rows(sampler, memory_budget, encoded, n, max_new_tokens)
    return rows if max_rows is None else min(rows, max_rows), least


def budgeted(sampler: Sampler, memory_budget: int | str | None) -> bool:
    """Whether a call's rows come from a memory budget: one given, or the devices' free memory."""
    return memory_budget is not None or derived(sampler, memory_budget)


def least_slots(sampler: Sampler, memory_budget: int | str | None) -> int:
    """A call's slabs' fewest prompt slots (`continuous.slab_length`): none beyond a prompt's own
    bucket within a memory budget (the budget counts them), else `MIN_SLAB_LENGTH`."""
    return 1 if budgeted(sampler, memory_budget) else MIN_SLAB_LENGTH


def budget_rows(
    sampler: Sampler, memory_budget: Any, encoded: list[list[int]], n: int, max_new_tokens: int
) -> int:
    """The rows one batch of n samples a prompt may decode within `memory_budget`, prompt caches
    included: n samples of a prompt in chunks when a batch cannot hold them all, several prompts (each
    with its own prompt cache) when it holds more. `None` (on a device that tells) is the fullest
    device's free memory on every `data` shard, each row's decode-step working memory counted, as
    `jaxsr plan` counts it; a budget given is one pool of KV slots."""
    slots = budget_slots(memory_budget, sampler.slot_bytes, mesh=sampler.mesh)
    prompt_slots, from_device = bucket(max(map(len, encoded))), derived(sampler, memory_budget)
    return budget_rows_in(sampler, slots, prompt_slots, n, max_new_tokens, from_device)


def budget_rows_in(
    sampler: Sampler, slots: int, prompt_slots: int, n: int, max_new_tokens: int, from_device: bool
) -> int:
    """`budget_rows` within `slots` already known (a plan's chip): a budget `from_device` is each
    `data` shard's and counts each row's working memory; a budget given is one pool of KV slots."""
    per_row = sampler.cache_slots(bucket(max_new_tokens)) + work_slots(sampler, from_device)
    shards = data_shards(sampler.mesh) if from_device else 1
    return rows_within(slots, prompt_slots, per_row, n, shards)


def rows_within(slots: int, prompt_slots: int, per_row: int, n: int, shards: int = 1) -> int:
    """`budget_rows` for `slots` KV slots on each of `shards` `data` shards, prompts of
    `prompt_slots` and rows of `per_row` (the arithmetic alone: a plan's devices cannot be asked for
    free memory). Every prompt's cache counts on every shard (replicated unless the batch's prompts
    divide over them); the rows split over the shards, mesh padding counted."""
    room = slots - prompt_slots
    if room < per_row:
        raise ValueError(
            f"memory_budget: {slots} KV slots (given, or the devices' free memory where it is None) "
            f"cannot hold one row ({prompt_slots + per_row})"
        )
    max_rows = 1 << (room // per_row * shards).bit_length() - 1
    samples = min(n, max_rows)
    fits = lambda prompts: prompts * prompt_slots + shard_rows(prompts, samples, shards) * per_row <= slots
    prompts = 1
    while fits(2 * prompts):
        prompts *= 2
    return min(max_rows, samples * prompts)


def shard_rows(prompts: int, samples: int, shards: int) -> int:
    """Rows on each of `shards` `data` shards of a batch of `prompts` prompts' `samples` rows, padded
    as the driver pads them to split over the shards (`sharding.padded_rows`)."""
    return prompts * padded_over(samples, shards, prompts) // shards
