"""A search's KV memory: one prompt's budget among the prompts in flight and the `data` shards, and
Speculative Rejection's plan within it (first batch, batch ladder, each rung's cache length). Budgets
and a call's rows within one: `jaxsr.decoding.memory`."""

from __future__ import annotations

from typing import Any, NamedTuple

from jaxsr.decoding.driver import Sampler
from jaxsr.decoding.memory import budget_slots, derived, row_reserve, work_slots
from jaxsr.ladder import bucket, round_up
from jaxsr.sharding import data_shards

SLOT_ALIGN = 8  # the first rung's segment is a multiple of this (fewer shapes across budgets)


def prompt_budget(
    sampler: Sampler, memory_budget: Any, prompt_slots: int, max_new_tokens: int, n: int | None, copies: int
) -> int:
    """One prompt's search budget in slots of all of the sampler's caches, `copies` prompts in flight:
    `memory_budget` as given; or (on CPU) n full rows; or derived from the fullest device's free
    memory, shared by the prompts in flight and counting every `data` shard (`mesh_budget`)."""
    fallback = None if n is None else prompt_slots + n * sampler.cache_slots(bucket(max_new_tokens))
    budget = budget_slots(memory_budget, sampler.slot_bytes, fallback, sampler.mesh, copies=copies)
    if derived(sampler, memory_budget):
        return device_share(sampler, budget, prompt_slots, max_new_tokens, copies)
    return budget


def device_share(
    sampler: Sampler, per_device: int, prompt_slots: int, max_new_tokens: int, copies: int
) -> int:
    """One of `copies` prompts' search budget within `per_device` slots of each device's memory, over
    every `data` shard (`mesh_budget`; rows reserve the decode step's working memory too)."""
    row = sampler.cache_slots(bucket(max_new_tokens)) + work_slots(sampler, True)
    return mesh_budget(per_device // copies, prompt_slots, row, data_shards(sampler.mesh))


def mesh_budget(per_device: int, prompt_slots: int, row: int, shards: int) -> int:
    """A search budget over `shards` data shards that puts at most `per_device` slots on any device.
    The prompt's cache is on every shard, and a rung of R rows puts ceil(R/shards) on each (mesh
    padding), each of at most `row` slots: so per device ≤ prompt + (budget − prompt)/shards + row,
    which stays within `per_device` for budget = prompt + shards·(per_device − prompt − row). One
    device's own share is always safe (a rung's rows on one device never exceed its budget)."""
    return max(per_device, prompt_slots + shards * (per_device - prompt_slots - row))


class RowLayout(NamedTuple):
    """What a row holds beside its segment (`MemoryPlan`): `headroom` slots in all (`row_reserve`),
    `lookahead` of them in its cache, and the `align` its cache is best a multiple of
    (`Sampler.slot_tile`)."""

    headroom: int = 0
    lookahead: int = 0
    align: int = 1


BARE_ROWS = RowLayout()  # nothing beside the segment, no tiles


def row_layout(sampler: Sampler, from_device: bool) -> RowLayout:
    """The `RowLayout` of `sampler`'s rows, working memory counted where the budget is the device's
    (`from_device`)."""
    return RowLayout(row_reserve(sampler, from_device), sampler.headroom, sampler.slot_tile)


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
    segment (`capacity`). A row of a rung takes its segment plus `rows.headroom` slots (`RowLayout`:
    look-ahead, and working memory where the budget is the device's). Where row caches are best whole
    tiles (`rows.align` > 1), each rung's cache, segment + look-ahead, is whole tiles where that cuts
    no row short; else the first rung's segment is a multiple of SLOT_ALIGN (`capacity`)."""

    def __init__(
        self,
        budget: int,
        prompt_slots: int,
        max_new_tokens: int,
        n: int | None,
        rate: float,
        min_segment: int,
        rows: RowLayout = BARE_ROWS,
    ):
        headroom, align = rows.headroom, rows.align
        self.budget, self.prompt_slots, self.headroom, self.align = budget, prompt_slots, headroom, align
        self.max_new_tokens, self.max_slots = max_new_tokens, bucket(max_new_tokens)
        # what is aligned: the segment, or where caches are tiled the cache (segment + look-ahead)
        self.offset = offset = rows.lookahead if align > 1 else 0
        self.first_align = first_align = max(SLOT_ALIGN, align)
        # the widest segment a rung needs: max_new_tokens' bucket, its cache rounded up to whole tiles
        self.top = round_up(self.max_slots + offset, align) - offset
        room = budget - prompt_slots
        # the first segment is a whole multiple of its alignment (see `capacity`): round the minimum up
        # (a tiled cache, look-ahead included, at least one whole tile)
        if align > 1 or min_segment > first_align:
            widest = round_up(self.max_slots + offset, first_align)
            min_segment = min(round_up(min_segment + offset, first_align), widest) - offset
        per_row = min_segment + headroom
        if room < per_row:
            raise ValueError(
                f"memory_budget: {budget} KV slots (given, or the devices' free memory where it is None) "
                f"cannot hold one row (prompt {prompt_slots} + "
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
        self._capacities = self._rung_capacities()

    def capacity(self, rows: int) -> int:
        """Segment slots per row at the rung of `rows` rows (the headroom comes on top). The first
        rung's segment (its cache, where caches are tiled) is a multiple of SLOT_ALIGN (fewer compiled
        shapes across budgets) and of `align`; later rungs take every slot the budget allows, so that
        rows kept there grow whenever the memory can hold them, their caches rounded down to a multiple
        of `align` only where that still holds the tokens rows arriving from the rung above can have (a
        decision that keeps every row of an aligned rung then stops them at most a tile earlier than the
        memory would)."""
        return self._capacities[rows]

    def _rung_capacities(self) -> dict[int, int]:
        """`capacity` of each rung of the ladder, widest first (aligned as `offset` + segment)."""
        capacities: dict[int, int] = {}
        above = None  # the capacity of the rung above
        for rows in self.ladder:
            room = (self.budget - self.prompt_slots) // rows - self.headroom + self.offset
            if above is None:
                align = self.first_align
                room = room // align * align if room >= align else room
            else:
                aligned = room // self.align * self.align
                # a row arrives with at most the rung above's slots + 1 tokens (+ look-ahead overshoot)
                room = aligned if aligned - self.offset >= above + 1 + self.headroom else room
            above = capacities[rows] = min(self.top, room - self.offset)
        return capacities

    def next_rung(self, survivors: int, generated: int) -> int | None:
        """Smallest rung ≥ survivors whose cache can grow past `generated`; else the widest that can."""
        fitting = [b for b in self.ladder if self.capacity(b) >= generated]
        if not fitting:
            return None
        wide_enough = [b for b in fitting if b >= survivors]
        return min(wide_enough) if wide_enough else max(fitting)
