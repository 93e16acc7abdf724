"""KV memory: budgets as token slots (from an int, a size string, or the device) and what a search
does with them — Speculative Rejection's plan (first batch, batch ladder, each rung's cache length) and
the rows a Best-of-N batch may take."""

from __future__ import annotations

import re
from typing import Any

import jax
from jax.sharding import Mesh

from jaxsr.checks import available_bytes, device_free_bytes, format_bytes, is_int
from jaxsr.decoding.driver import Sampler
from jaxsr.ladder import bucket
from jaxsr.sharding import data_shards, padded_over

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
SLOT_ALIGN = 8  # the first rung's row-cache length is a multiple of this (fewer shapes across budgets)


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


def row_reserve(sampler: Sampler, from_device: bool) -> int:
    """Slots a row holds beyond its segment: the sampler's look-ahead, and where the budget is the
    device's own memory (`from_device`) the decode step's working memory per row
    (`Sampler.row_work_bytes`, in slots) — a budget the user gives counts KV only."""
    work = -(-sampler.row_work_bytes // sampler.slot_bytes) if from_device else 0
    return sampler.headroom + work


def derived(sampler: Sampler, memory_budget: Any) -> bool:
    """Whether a search budget comes from the devices' free memory (None given, a device that tells)."""
    mesh = sampler.mesh
    devices = jax.local_devices()[:1] if mesh is None else list(mesh.local_devices)
    return memory_budget is None and device_free_bytes(devices) is not None


def prompt_budget(
    sampler: Sampler, memory_budget: Any, prompt_slots: int, max_new_tokens: int, n: int | None, copies: int
) -> int:
    """One prompt's search budget in slots of all of the sampler's caches, `copies` prompts in flight:
    `memory_budget` as given; or (on CPU) n full rows; or derived from the fullest device's free
    memory, shared by the prompts in flight and counting every `data` shard (`mesh_budget`)."""
    mesh = sampler.mesh
    fallback = None if n is None else prompt_slots + n * (bucket(max_new_tokens) + sampler.headroom)
    budget = budget_slots(memory_budget, sampler.slot_bytes, fallback, mesh, copies=copies)
    if derived(sampler, memory_budget):
        row = bucket(max_new_tokens) + row_reserve(sampler, True)
        budget = mesh_budget(budget // copies, prompt_slots, row, data_shards(mesh))
    return budget


def mesh_budget(per_device: int, prompt_slots: int, row: int, shards: int) -> int:
    """A search budget over `shards` data shards that puts at most `per_device` slots on any device.
    The prompt's cache is on every shard, and a rung of R rows puts ceil(R/shards) on each (mesh
    padding), each of at most `row` slots: so per device ≤ prompt + (budget − prompt)/shards + row,
    which stays within `per_device` for budget = prompt + shards·(per_device − prompt − row). One
    device's own share is always safe (a rung's rows on one device never exceed its budget)."""
    return max(per_device, prompt_slots + shards * (per_device - prompt_slots - row))


def batch_ladder(first: int, rejection_rate: float) -> list[int]:
    """B0, round((1-α)·B0), … down to 1: the rows the keep rule leaves when no response has finished.
    Where the rule would not shrink a rung (small rungs, small α) the next is one row less; α=0 is
    one rung."""
    rungs = [first]
    while rungs[-1] > 1 and rejection_rate > 0:
        rungs.append(min(rungs[-1] - 1, max(1, round((1 - rejection_rate) * rungs[-1]))))
    return rungs


class MemoryPlan:
    """Memory plan for one prompt's Speculative Rejection: first batch, ladder, and each rung's
    row-cache length. A row of a rung takes `capacity(rows)` slots for its segment plus `headroom`
    slots (`row_reserve`: look-ahead, and working memory where the budget is the device's)."""

    def __init__(
        self,
        budget: int,
        prompt_slots: int,
        max_new_tokens: int,
        n: int | None,
        rate: float,
        min_segment: int,
        headroom: int = 0,
    ):
        self.budget, self.prompt_slots, self.headroom = budget, prompt_slots, headroom
        self.max_new_tokens, self.max_slots = max_new_tokens, bucket(max_new_tokens)
        room = budget - prompt_slots
        # the first segment is a whole multiple of SLOT_ALIGN (see `capacity`): round the minimum up
        if min_segment > SLOT_ALIGN:
            min_segment = min(-(-min_segment // SLOT_ALIGN) * SLOT_ALIGN, max(self.max_slots, SLOT_ALIGN))
        per_row = min_segment + headroom
        if room < per_row:
            raise ValueError(
                f"memory_budget: {budget} KV slots cannot hold one row (prompt {prompt_slots} + "
                f"first segment {min_segment} + {headroom} reserved: look-ahead, and working memory where "
                "the budget is the device's)"
            )
        first = n if n is not None else room // per_row
        if first * per_row > room:
            raise ValueError(
                f"memory_budget: {budget} KV slots cannot start n={first} rows "
                f"({prompt_slots} prompt + {first}×{per_row} first-segment and reserved slots)"
            )
        self.ladder = batch_ladder(first, rate)

    def capacity(self, rows: int) -> int:
        """Segment slots per row at a rung of `rows` rows (the headroom comes on top). The first rung's
        is a multiple of SLOT_ALIGN (fewer compiled shapes across budgets); later rungs take every slot
        the budget allows, so that rows kept there grow whenever the memory can hold them."""
        room = (self.budget - self.prompt_slots) // rows - self.headroom
        if rows == self.ladder[0] and room >= SLOT_ALIGN:
            room = room // SLOT_ALIGN * SLOT_ALIGN
        return min(self.max_slots, room)

    def next_rung(self, survivors: int, generated: int) -> int | None:
        """Smallest rung ≥ survivors whose cache can grow past `generated`; else the widest that can."""
        fitting = [b for b in self.ladder if self.capacity(b) >= generated]
        if not fitting:
            return None
        wide_enough = [b for b in fitting if b >= survivors]
        return min(wide_enough) if wide_enough else max(fitting)


def best_of_n_rows(
    sampler: Sampler, memory_budget: Any, encoded: list[list[int]], n: int, max_new_tokens: int
) -> int:
    """The rows one Best-of-N batch may decode within `memory_budget`, prompt caches included: n
    samples of a prompt in chunks when a batch cannot hold them all, several prompts (each with its
    own prompt cache) when it holds more. `None` (on a device that tells) is the fullest device's free
    memory on every `data` shard, each row's decode-step working memory counted, as `jaxsr plan`
    counts it; a budget given is one pool of KV slots."""
    slots = budget_slots(memory_budget, sampler.slot_bytes, mesh=sampler.mesh)
    prompt_slots, from_device = bucket(max(map(len, encoded))), derived(sampler, memory_budget)
    return best_of_n_rows_in(sampler, slots, prompt_slots, n, max_new_tokens, from_device)


def best_of_n_rows_in(
    sampler: Sampler, slots: int, prompt_slots: int, n: int, max_new_tokens: int, from_device: bool
) -> int:
    """`best_of_n_rows` within `slots` already known (a plan's chip): a budget `from_device` is each
    `data` shard's and counts each row's working memory; a budget given is one pool of KV slots."""
    per_row = bucket(max_new_tokens) + row_reserve(sampler, from_device)
    shards = data_shards(sampler.mesh) if from_device else 1
    return rows_within(slots, prompt_slots, per_row, n, shards)


def rows_within(slots: int, prompt_slots: int, per_row: int, n: int, shards: int = 1) -> int:
    """`best_of_n_rows` for `slots` KV slots on each of `shards` `data` shards, prompts of
    `prompt_slots` and rows of `per_row` (the arithmetic alone: a plan's devices cannot be asked for
    free memory). Every prompt's cache counts on every shard (replicated unless the batch's prompts
    divide over them); the rows split over the shards, mesh padding counted."""
    room = slots - prompt_slots
    if room < per_row:
        raise ValueError(f"memory_budget: {slots} KV slots cannot hold one row ({prompt_slots + per_row})")
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
