"""`decode`, the driver of plain decoding calls (`generate`, the two-model methods, Best-of-N's samples):
continuous batching at prompt granularity.

A call's prompts are sorted by length and cut into length classes (the power-of-two bucket their
prefill pads to). Each class streams through a slab of its own: `slots` prompt slots of `rows` rows
(a chunk's samples plus the mesh's padding), row caches for the call's token budget and one prompt
cache per slot. Prompts are prefilled `prefill` at a time and started in free slots (`loop.insert`:
each row with its first token); the token loop runs until enough slots are free to take the next
prefill — a slot is free when every row in it is done — or until every row is done; the finished
prompts' rows go to the host, the next prompts take their slots, and the loop goes on. A prompt whose
rows all end early (EOS) hands its slot on instead of idling until the longest row beside it ends, and
each prompt is handed over (`on_prompt`) as soon as its rows are done.

Shapes: per class, one prefill, one insert, one token loop, whatever the number of prompts (a class's
last prefill is padded, not compiled smaller). A row's random stream is keyed by (seed, prompt index,
sample index, token index), so its tokens do not depend on the slot it takes, on the prompts beside
it, or on when it started; floats that depend on a batch's shape (prefill matmuls) may differ in the
last bits from another schedule's.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jaxsr.decoding import loop
from jaxsr.decoding.driver import (
    DEFAULT_MAX_ROWS,
    INPUTS_LOCK,
    Layout,
    Prefill,
    Run,
    Sampler,
    outputs,
    padded,
)
from jaxsr.decoding.inputs import Request
from jaxsr.decoding.state import DecodeState, concat_rows, take_rows, to_host
from jaxsr.ladder import bucket
from jaxsr.sharding import padded_rows
from jaxsr.timing import Stopwatch

MIN_SLAB_LENGTH = 256
"""Fewest prompt slots of a slab: prompts of up to this many tokens (most chat prompts) decode in one
slab whatever their own length bucket, so a job compiles one token loop for all of them. A row's step
then attends to up to this many prompt slots, most of them masked: for a model of width d with V/layers
vocabulary columns per layer, about 2·256 / (12·d + V/layers) of a step's work (6% for SmolLM2-135M,
1% for Llama-3.1-8B)."""
PREFILL_TOKENS = 4096
"""Prompt slots (prompts × their slab's length) a prefill call takes at most, unless one prompt is
longer: enough tokens per call to keep an accelerator's matmuls busy, few enough that a length
bucket's last, padded prefill wastes little."""
REFILL_PARTS = 4
"""A prefill takes at most this fraction of a slab's slots, so a slab refills when that many of its
prompts are done rather than waiting for all of them."""

OnDone = Callable[[list[tuple[int, DecodeState, dict[str, Any]]]], None]
"""Takes the prompts whose rows are done as soon as they are, several at a time (those that ended in
one run of the token loop): (its index in the request, its rows on the host by sample index, its
stats) each."""


@dataclasses.dataclass(frozen=True)
class SlabShape:
    """What a length class's programs are compiled for: `slots` prompt slots of `rows` rows each
    (`live` samples plus the mesh's padding) and `length` prompt slots each; its prompts prefilled
    `prefill` at a time, padded to their own length bucket (one of `prefill_lengths`)."""

    length: int
    slots: int
    rows: int
    live: int
    prefill: int
    prefill_lengths: tuple[int, ...]


def slab_length(tokens: int, least: int = MIN_SLAB_LENGTH) -> int:
    """The prompt slots of the slab that a prompt of `tokens` tokens decodes in (its length class): its
    length bucket, at least `least` (1 where memory is budgeted: no slot beyond the bucket)."""
    return max(least, bucket(tokens))


def length_classes(
    lengths: Sequence[int],
    num_samples: int,
    max_rows: int,
    mesh: Mesh | None = None,
    least: int = MIN_SLAB_LENGTH,
) -> list[tuple[SlabShape, list[int]]]:
    """Each length class of prompts of these token `lengths` (`slab_length(n, least)`), shortest first:
    its slab's shape and its prompts (by index, shortest first). A slab holds at most `max_rows` rows
    (plus mesh padding), G = min(num_samples, max_rows) a slot; a prompt with more samples takes
    several slots' turns."""
    G = min(num_samples, max_rows)
    turns = -(-num_samples // G)
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    classes = []
    for length, group in itertools.groupby(order, key=lambda i: slab_length(lengths[i], least)):
        indices = list(group)
        slots = min(_floor_power(max(1, max_rows // G)), bucket(len(indices) * turns, 1))
        prefill = _floor_power(max(1, min(slots // REFILL_PARTS, PREFILL_TOKENS // length)))
        rows = padded_rows(G, mesh, groups=slots)
        buckets = tuple(sorted({bucket(lengths[i]) for i in indices}))
        classes.append((SlabShape(length, slots, rows, G, prefill, buckets), indices))
    return classes


def _floor_power(n: int) -> int:
    """The largest power of two not above n ≥ 1."""
    return 1 << (n.bit_length() - 1)


def decode(
    sampler: Sampler,
    request: Request,
    *,
    num_samples: int,
    max_rows: int = DEFAULT_MAX_ROWS,
    on_done: OnDone | None = None,
    least_slots: int = MIN_SLAB_LENGTH,
) -> Run:
    """`num_samples` continuations of each prompt of `request`; each prompt is prefilled once per model.

    Per prompt, stats: `prefill_s` (its share of its prefill call), `decode_s` (its share of the
    slab's running time while it was in a slot, its rows' set-up included), `compile_s`,
    `token_forwards` by role (its share of its prefill's positions and of the slab's steps, every
    slot's rows counted: fixed shapes run them all), `prefill_positions` (padding included),
    `prompt_tokens`, `batch_rows` and `kv_slots` (prompt + row cache slots of one model) of its slab.
    With `on_done`, prompts are handed over as they end and the run keeps none of them. `least_slots`:
    a slab's fewest prompt slots (`slab_length`)."""
    sampler = sampler.with_sampling(request.sampling)
    run = Run([], [], 0.0, num_samples, max_rows, least_slots)
    done: dict[int, tuple[DecodeState, dict]] = {}
    keep = on_done or (lambda finished: done.update((i, (rows, stats)) for i, rows, stats in finished))
    lengths = [len(ids) for ids in request.encoded]
    with sampler.on_mesh():
        for shape, indices in length_classes(lengths, num_samples, max_rows, sampler.mesh, least_slots):
            slab = Slab(sampler, request, shape, num_samples, keep)
            slab.run(indices)
            run.decode_s += slab.decode_s
            run.shapes = slab.shapes
    for i in sorted(done):
        run.rows.append(done[i][0])
        run.stats.append(done[i][1])
    return run


class Turn(NamedTuple):
    """One prompt's turn in a slot: the prompt (by position in its prefill unit) and its first sample."""

    unit: int
    position: int
    first_sample: int


@dataclasses.dataclass
class Ledger:
    """What one prompt has spent so far, and its rows back from the slots it took."""

    turns: int
    """Turns not yet back."""
    forwards: np.ndarray
    prefill_positions: float = 0.0
    timings: dict[str, float] = dataclasses.field(
        default_factory=lambda: dict.fromkeys(("prefill_s", "compile_s", "decode_s"), 0.0)
    )
    parts: list[DecodeState] = dataclasses.field(default_factory=list)

    def add(self, stage: str, seconds: tuple[float, float]) -> None:
        self.timings[stage] += seconds[0]
        self.timings["compile_s"] += seconds[1]


class Slab:
    """One length class's prompts streaming through a batch of prompt slots (see the module docstring):
    `run(indices)` decodes them all, handing prompts to `on_done` as they end."""

    def __init__(
        self, sampler: Sampler, request: Request, shape: SlabShape, num_samples: int, on_done: OnDone
    ):
        self.sampler, self.request, self.shape = sampler, request, shape
        self.num_samples, self.on_done = num_samples, on_done
        self.occupant: list[tuple[int, int] | None] = [None] * shape.slots
        """Per slot: (the prompt's request index, the turn's first sample), None when free."""
        self.units: list[tuple[int, ...]] = []
        self.prefilled: dict[int, Prefill] = {}
        """Prefill of each unit that has turns still to start."""
        self.pending: deque[Turn] = deque()
        self.ledgers: dict[int, Ledger] = {}
        self.decode_s = 0.0
        self.shapes: Any = None
        self._state, self._caches, self._forwards = None, None, np.zeros(len(sampler.models), np.int64)

    def run(self, indices: list[int]) -> None:
        shape, G = self.shape, self.shape.live
        size = lambda i: bucket(len(self.request.encoded[i]))
        self.units = [
            tuple(same[k : k + shape.prefill])
            for _, group in itertools.groupby(indices, key=size)
            for same in [list(group)]
            for k in range(0, len(same), shape.prefill)
        ]  # a unit's prompts share a length bucket: its prefill pads little
        firsts = range(0, self.num_samples, G)
        self.pending = deque(
            Turn(u, k, first)
            for u, unit in enumerate(self.units)
            for first in firsts
            for k in range(len(unit))
        )
        models = len(self.sampler.models)
        for i in indices:
            self.ledgers[i] = Ledger(len(firsts), np.zeros(models, np.int64))
        while self.pending or any(o is not None for o in self.occupant):
            self._fill()
            self._decode()
        self.shapes = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), (self._state.rows, self._caches)
        )
        self._state = self._caches = None

    def _empty(self, prefill: Prefill) -> None:
        """The slab with every slot free, its prompt caches shaped as `prefill`'s."""
        watch = Stopwatch()
        empty = self._new_rows((), 0)
        self._state, self._caches = self.sampler.empty_slab(prefill.caches, empty, self.request)
        self.decode_s += watch.split()[0]

    def _new_rows(self, unit: tuple[int, ...], first_sample: int, groups: int | None = None) -> loop.NewRows:
        groups = self.shape.slots if groups is None else groups
        layout = Layout(unit, groups, self.shape.rows, self.shape.live, first_sample, self.num_samples)
        return layout.new_rows(self.sampler.target, self.request)

    def _fill(self) -> None:
        """Start pending turns in the free slots, one `insert` per (unit, first sample) run of them."""
        free = [s for s, o in enumerate(self.occupant) if o is None]
        while free and self.pending:
            head = self.pending[0]
            taken = []
            while self.pending and len(taken) < len(free) and self.pending[0][::2] == head[::2]:
                taken.append(self.pending.popleft().position)
            self._insert(head.unit, head.first_sample, taken, free[: len(taken)])
            free = free[len(taken) :]

    def _prefill(self, u: int) -> Prefill:
        """Unit `u`'s prefill (run on its first turn, dropped when its last has started)."""
        if u not in self.prefilled:
            watch = Stopwatch()
            unit = self.units[u]
            ids = [self.request.encoded[i] for i in unit]
            prefill = self.sampler.prefill_prompts(ids, self.shape.prefill, slots=self.shape.length)
            jax.block_until_ready(prefill.logits)
            seconds = watch.split()
            for i in unit:
                ledger = self.ledgers[i]
                ledger.add("prefill_s", tuple(x / len(unit) for x in seconds))
                ledger.prefill_positions += prefill.positions / len(unit)
                ledger.forwards += prefill.positions // len(unit)
            self.prefilled[u] = prefill
            if self._state is None:
                self._empty(prefill)
        return self.prefilled[u]

    def _insert(self, u: int, first_sample: int, positions: list[int], slots: list[int]) -> None:
        """Start the turns of unit `u`'s prompts at `positions` (first sample `first_sample`) in `slots`."""
        prefill = self._prefill(u)
        watch = Stopwatch()
        source = np.full(self.shape.slots, -1, np.int32)
        source[slots] = positions
        new = self._new_rows(self.units[u], first_sample, self.shape.prefill)
        self._state, self._caches = self.sampler.insert(self._state, self._caches, prefill, new, source)
        seconds = watch.split()
        for slot, k in zip(slots, positions, strict=True):
            self.occupant[slot] = (self.units[u][k], first_sample)
            self.ledgers[self.units[u][k]].add("decode_s", tuple(x / len(slots) for x in seconds))
        self.decode_s += seconds[0]
        if not any(turn.unit == u for turn in itertools.islice(self.pending, 1)):
            self.prefilled.pop(u, None)  # no turn of it is left to start

    def _decode(self) -> None:
        """Run the token loop until the next prefill's worth of slots is free (every row done when no
        prompt is pending), then take the done slots' rows back."""
        shape, sampler = self.shape, self.sampler
        occupied = [s for s, o in enumerate(self.occupant) if o is not None]
        wanted = shape.slots - len(occupied) + min(shape.prefill, len(self.pending))
        pause = loop.Pause(free=np.int32(wanted) if self.pending else loop.NO_PAUSE)
        watch = Stopwatch()
        compiled = sampler.compiled_loop(self._state, self._caches, slots=True)
        self._state = compiled(sampler.params, self._state, self._caches, sampler.controls, pause=pause)
        host = to_host(self._state)
        seconds = watch.split()
        self.decode_s += seconds[0]
        work = (host.forwards.astype(np.int64) - self._forwards) * shape.slots * shape.rows
        self._forwards = host.forwards.astype(np.int64)
        for s in occupied:
            ledger = self.ledgers[self.occupant[s][0]]
            ledger.add("decode_s", tuple(x / len(occupied) for x in seconds))
            ledger.forwards += work // len(occupied)
        finished = []
        for s in occupied:
            group = np.arange(s * shape.rows, (s + 1) * shape.rows)
            if host.done[group].all():
                finished += self._take_back(s, take_rows(host, group[host.alive[group]]))
        if finished:
            self.on_done(finished)

    def _take_back(self, slot: int, rows: DecodeState) -> list[tuple[int, DecodeState, dict[str, Any]]]:
        """A slot's finished turn: its rows to its prompt, which is done (and returned) once all are."""
        i = self.occupant[slot][0]
        self.occupant[slot] = None
        ledger = self.ledgers[i]
        ledger.parts.append(rows)
        ledger.turns -= 1
        if ledger.turns:
            return []
        del self.ledgers[i]
        rows = concat_rows(ledger.parts)
        return [(i, take_rows(rows, np.argsort(rows.sample_id, kind="stable")), self._stats(i, ledger))]

    def _stats(self, i: int, ledger: Ledger) -> dict[str, Any]:
        shape, sampler = self.shape, self.sampler
        row_slots = shape.slots * shape.rows * sampler.cache_slots(bucket(self.request.max_new_tokens))
        return {
            **ledger.timings,
            "token_forwards": {role: int(n) for role, n in zip(sampler.roles, ledger.forwards, strict=True)},
            "prefill_positions": ledger.prefill_positions,
            "prompt_tokens": len(self.request.encoded[i]),
            "batch_rows": shape.slots * shape.rows,
            "kv_slots": shape.slots * shape.length + row_slots,
        }


def slab_programs(sampler: Sampler, request: Request, shape: SlabShape) -> dict[Hashable, Callable[[], None]]:
    """What compiles the programs a slab of `shape` runs, without running them: each model's prefill at
    each of its prompts' length buckets, and (with the first bucket's prefill, whose outputs it is
    shaped as) the empty slab, the rows' insert and the token loop. The entries are independent (for
    threads compiling ahead of the calls, each its own); from inputs as abstract as the slab's are
    concrete, so that the slab finds each in jax's caches. `request` is any request with the call's
    options (its prompts are not read)."""
    others = shape.prefill_lengths[1:]  # the first is compiled with the slab
    programs: dict[Hashable, Callable[[], None]] = {
        (shape, "slab"): partial(compile_slab, sampler, request, shape)
    }
    for length in others:
        programs[(shape, length)] = partial(compile_prefills, sampler, shape, length)
    return programs


def compile_prefills(sampler: Sampler, shape: SlabShape, length: int) -> tuple:
    """Each model's prefill of a slab's prefill call at prompts of `length` slots, compiled (see
    `slab_programs`): their (logits, caches) outputs, abstract."""
    with sampler.on_mesh():
        with INPUTS_LOCK:
            tokens, mask = padded([], shape.prefill, length)
        prefills = [
            loop.prefill.lower(m.graph, m.params, tokens, mask, slots=shape.length).compile()
            for m in sampler.models
        ]
        placed = (sampler.params, tokens, mask)
        return tuple(outputs(tuple(c.out_info[i] for c in prefills), sampler, placed) for i in (0, 1))


def compile_slab(sampler: Sampler, request: Request, shape: SlabShape) -> None:
    """A slab's first prefill, empty slab, insert and token loop, compiled (see `slab_programs`)."""
    logits, caches = compile_prefills(sampler, shape, shape.prefill_lengths[0])
    with sampler.on_mesh():
        with INPUTS_LOCK:
            layout = Layout((0,), shape.prefill, shape.rows, shape.live)
            new = layout.new_rows(sampler.target, request)
            empty = Layout((), shape.slots, shape.rows, shape.live).new_rows(sampler.target, request)
            source = jnp.full((shape.slots,), -1, jnp.int32)
        slab = loop.empty_slab.lower(caches, empty, **sampler.capacities(request)).compile()
        state, held = outputs(slab.out_info, sampler, (caches, empty))  # the slots' prompt caches
        insert = loop.insert.lower(
            state, held, (logits, caches), sampler.controls, new, source, method=sampler.method
        ).compile()
        state, held = outputs(insert.out_info, sampler, (state, held))
        sampler.compiled_loop(state, held, slots=True)
