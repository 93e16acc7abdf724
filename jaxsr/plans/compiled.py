"""Compile a job's programs for a target without running them: the prefill, the rows' set-up and the
token loop of one decode batch, each lowered with abstract inputs (an `abstract_model`'s parameters,
the caches and state the previous program returns) through the driver's own functions, and measured
per device from XLA's analyses: memory, work, and the collectives it runs (per step of the loop). On a
GPU, whose compiler neither analyses cost nor refuses a program too big for the device, the work is
counted from the compiled program (`hlo.flops`, `hlo.bytes_accessed`) and the refusal is the plan's."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxsr.decoding import loop
from jaxsr.decoding.driver import Layout, Prefill, Sampler, as_sampler
from jaxsr.decoding.inputs import Request
from jaxsr.decoding.sampling import SamplingConfig
from jaxsr.decoding.state import PER_ROW, DecodeState, compact
from jaxsr.models.model import Model, RewardModel, _scores
from jaxsr.plans import gpus, hlo
from jaxsr.plans.abstract import bytes_per_device
from jaxsr.plans.targets import GIB, Target
from jaxsr.sharding import batch_sharding, on_mesh


@dataclasses.dataclass(frozen=True)
class Batch:
    """One decode batch as the driver lays it out (`driver.Layout`): `prompts` prompts of up to
    `prompt_slots` tokens, `rows` rows each, decoding up to `max_new_tokens` tokens into row caches of
    `segment` slots (None: as many; a Speculative Rejection rung's are shorter). With `next_rows`, a
    search's decision then compacts one prompt's rows to that many, with row caches of `next_segment`
    slots (Speculative Rejection's next rung)."""

    prompts: int
    rows: int
    prompt_slots: int
    max_new_tokens: int
    segment: int | None = None
    next_rows: int | None = None
    next_segment: int | None = None
    rungs: tuple[tuple[int, int], ...] = ()
    """Speculative Rejection's later rungs, (rows, segment) each: every prompt's survivors decoded
    together in a decode loop of their own shape."""


@dataclasses.dataclass(frozen=True)
class Program:
    """One compiled program, per device."""

    name: str
    compile_s: float
    """Lowering and compiling."""
    argument_bytes: int
    """Inputs: parameters, caches, state."""
    output_bytes: int
    alias_bytes: int
    """Outputs written over donated inputs (counted once)."""
    temp_bytes: int
    code_bytes: int
    flops: float
    """XLA's cost analysis (a loop's body counted once); on a GPU counted from the compiled program
    (`hlo.flops`: dots, convolutions, floating-point arithmetic)."""
    bytes_accessed: float
    """XLA's cost analysis; on a GPU its kernels' traffic counted from the compiled program
    (`hlo.bytes_accessed`)."""
    collectives: dict[str, int]
    """Collective instructions by kind in the whole program."""
    step_collectives: dict[str, int] | None
    """Those in the condition and body of the program's loop (one decode step), or None without one."""
    gathered: tuple[str, ...]
    """Result shapes of the program's all-gathers."""
    step_copied: tuple[str, ...]
    """Result shapes of the copies (layout changes) one step of the program's loop runs."""

    @property
    def peak_bytes(self) -> int:
        """Memory the program holds at once: arguments, outputs not aliased to them, temporaries, code."""
        return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes + self.code_bytes


@dataclasses.dataclass(frozen=True)
class Plan:
    """A decode batch compiled for a target."""

    target: Target
    batch: Batch
    parameter_bytes: int
    """One device's shards of the parameters, as the sharding rules place them."""
    programs: tuple[Program, ...]
    """prefill (and the second model's), start (the rows' first tokens), decode_loop, and with the
    batch's `next_rows` compact (a decision's gather of one prompt's survivors)."""
    row_cache_bytes: int
    """One device's shards of the rows' keys and values (every model's) the token loop writes."""

    def program(self, name: str) -> Program:
        return next(p for p in self.programs if p.name == name)

    @property
    def fits(self) -> bool:
        """Every program within the memory XLA gives one program on the target's chip."""
        return all(p.peak_bytes <= self.target.chip.usable_bytes for p in self.programs)


def measure(name: str, compiled: Any, seconds: float) -> Program:
    """A compiled program's figures per device."""
    memory = compiled.memory_analysis()
    module, entry = hlo.computations(compiled.as_text())
    cost = compiled.cost_analysis() or {
        "flops": hlo.flops(module, entry),
        "bytes accessed": hlo.bytes_accessed(module, entry),
    }
    step = hlo.loop_step(module, entry)
    return Program(
        name=name,
        compile_s=seconds,
        argument_bytes=memory.argument_size_in_bytes,
        output_bytes=memory.output_size_in_bytes,
        alias_bytes=memory.alias_size_in_bytes,
        temp_bytes=memory.temp_size_in_bytes,
        code_bytes=memory.generated_code_size_in_bytes,
        flops=float(cost.get("flops", 0.0)),
        bytes_accessed=float(cost.get("bytes accessed", 0.0)),
        collectives=hlo.collectives(module, [entry]),
        step_collectives=hlo.collectives(module, step) if step else None,
        gathered=tuple(hlo.gathered_shapes(module, [entry])),
        step_copied=tuple(hlo.copied_shapes(module, step)),
    )


def compile_for(target: Target, name: str, compile_: Callable[[], Any]) -> tuple[Any, Program]:
    """`compile_()`'s compiled program and its figures; a program too big for the chip's memory is a
    ValueError naming the target and its memory (XLA's refusal appended on a TPU; on a GPU, whose
    compiler refuses nothing, the program's peak)."""
    start = time.perf_counter()
    try:
        compiled = compile_()
    except jax.errors.JaxRuntimeError as e:
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        raise ValueError(f"{name} does not fit {target.name}: {too_big(target)} ({e})") from None
    program = measure(name, compiled, time.perf_counter() - start)
    if target.chip.platform == "cuda" and program.peak_bytes > target.chip.usable_bytes:
        raise ValueError(
            f"{name} does not fit {target.name}: {too_big(target)} (its peak: "
            f"{program.peak_bytes / GIB:.2f} GiB per device)"
        )
    return compiled, program


def too_big(target: Target) -> str:
    """What a program too big for `target` exceeds: the memory one program may use of a chip's."""
    chip, usable = target.chip, f"more than the {target.chip.usable_bytes / GIB:.2f} GiB a program may use"
    if chip.platform == "cuda":
        share = f"{gpus.JAX_MEMORY_FRACTION:.0%} of its {chip.hbm_bytes / GIB:.2f} GiB"
        return f"{usable} on an {chip.kind} (JAX's default {share})"
    return f"{usable} of a {chip.kind} chip's {chip.hbm_bytes / GIB:.0f} GiB HBM"


def placeholder_request(batch: Batch) -> Request:
    """A request with the batch's budget: the rows' set-up reads only its seed, ids and stops."""
    prompts = tuple(range(batch.prompts))
    encoded = [[0] * batch.prompt_slots for _ in prompts]
    return Request(prompts, encoded, batch.max_new_tokens, SamplingConfig(), 0, (), prompts)


def plan_batch(model: Model | Sampler, target: Target, batch: Batch) -> Plan:
    """Compile `batch`'s prefills (one per model), row set-up and token loop for plain sampling from
    `model`, or for a `Sampler` as it samples (e.g. of `abstract_model`s on `target_mesh(target, ...)`).
    A decoding job's slab (`continuous.decode`) runs a token loop of the batch's shapes; it starts its
    rows a prefill at a time, which holds no more than this batch's start. The second model's prefill
    is `prefill_<its role>`."""
    sampler = as_sampler(model, None)  # a sampler as it samples; a model with the defaults
    tokens = abstract_tokens(sampler.mesh, batch.prompts, batch.prompt_slots, PartitionSpec())
    names = ["prefill", *(f"prefill_{role}" for role in sampler.roles[1:])]
    prefill = lambda m: lambda: loop.prefill.lower(m.graph, m.params, tokens, tokens).compile()
    with sampler.on_mesh():
        prefills = [compile_for(target, n, prefill(m)) for n, m in zip(names, sampler.models, strict=True)]
        logits, caches = (tuple(c.out_info[i] for c, _ in prefills) for i in (0, 1))
        start = lambda: _start(sampler, batch).lower(logits, caches).compile()
        start_c, started = compile_for(target, "start", start)
        state = start_c.out_info
        after = {"decode_loop": lambda: sampler.compiled_loop(state, caches)}
        if batch.next_rows is not None:
            after["compact"] = lambda: _compaction(sampler, batch, one_prompt(state, batch.rows))
        after |= later_rungs(sampler, batch, state, caches)
        decoding = [compile_for(target, name, compile_)[1] for name, compile_ in after.items()]
    programs = (*(p for _, p in prefills), started, *decoding)
    rows = bytes_per_device([cache.replace(length=()) for cache in state.rows])  # scales too
    return Plan(target, batch, bytes_per_device(sampler.params), programs, rows)


def later_rungs(
    sampler: Sampler, batch: Batch, state: DecodeState, caches: tuple
) -> dict[str, Callable[[], Any]]:
    """The decode loop of each of `batch.rungs` (`decode_loop_rung2`, ...) to compile, its state shaped
    as the decisions' compaction leaves it from the first rung's `state`."""
    rung = lambda rows, segment: rung_state(state, batch.prompts * rows, segment + sampler.headroom)
    loop_at = lambda rows, segment: lambda: sampler.compiled_loop(rung(rows, segment), caches)
    return {f"decode_loop_rung{n}": loop_at(*shape) for n, shape in enumerate(batch.rungs, start=2)}


def rung_state(state: DecodeState, rows: int, capacity: int) -> DecodeState:
    """An abstract decode state of `rows` rows with row caches of `capacity` slots, as `compact` leaves
    one from `state` (and placed as its fields are)."""
    index = jax.ShapeDtypeStruct((rows,), jnp.int32)
    alive = jax.ShapeDtypeStruct((rows,), jnp.bool_)
    shaped = jax.eval_shape(partial(compact, cache_capacity=capacity), state, index, alive)
    placed = lambda x, like: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=like.sharding)
    return jax.tree.map(placed, shaped, state)


def one_prompt(state: DecodeState, rows: int) -> DecodeState:
    """An abstract decode state of one prompt's `rows` rows, cut from a batch's (the scheduler compacts
    each prompt's rows on their own): its per-row fields and row caches, whose leaves lead with rows."""

    def cut(x: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct((rows, *x.shape[1:]), x.dtype, sharding=x.sharding)

    per_row = {name: jax.tree.map(cut, getattr(state, name)) for name in PER_ROW}  # None stays None
    return state.replace(**per_row, rows=jax.tree.map(cut, state.rows))


def _compaction(sampler: Sampler, batch: Batch, state: DecodeState) -> Any:
    """`state.compact` of one prompt's rows to `batch.next_rows`, compiled."""
    placed = NamedSharding(sampler.mesh, PartitionSpec())
    index = jax.ShapeDtypeStruct((batch.next_rows,), jnp.int32, sharding=placed)
    alive = jax.ShapeDtypeStruct((batch.next_rows,), jnp.bool_, sharding=placed)
    capacity = batch.next_segment + sampler.headroom
    return compact.lower(state, index, alive, cache_capacity=capacity).compile()


def plan_scores(model: RewardModel, target: Target, rows: int, length: int) -> Program:
    """The reward model's scoring program (`RewardModel.scores`' jitted function) for a batch of `rows`
    responses of `length` tokens, its rows split over the mesh's `data` shards as jaxsr places them."""
    tokens = abstract_tokens(model.mesh, rows, length, batch_sharding(model.mesh, (rows, length)).spec)
    with on_mesh(model):
        return compile_for(
            target,
            "reward_scores",
            lambda: _scores.lower(model.graph, model.params, tokens, tokens).compile(),
        )[1]


def abstract_tokens(mesh: Mesh, rows: int, length: int, spec: PartitionSpec) -> jax.ShapeDtypeStruct:
    """A [rows, length] int32 batch (ids or a mask) placed on `mesh` by `spec`."""
    return jax.ShapeDtypeStruct((rows, length), jnp.int32, sharding=NamedSharding(mesh, spec))


def _start(sampler: Sampler, batch: Batch) -> Any:
    """`Sampler.start` of the batch's layout as one jitted program of the prefills' outputs."""
    layout = Layout(tuple(range(batch.prompts)), batch.prompts, batch.rows, batch.rows)
    request = placeholder_request(batch)
    return jax.jit(
        lambda logits, caches: sampler.start(Prefill(logits, caches, 0), layout, request, batch.segment)
    )
