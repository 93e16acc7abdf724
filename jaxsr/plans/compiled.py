"""Compile a job's programs for a target without running them: the prefill, the rows' set-up and the
token loop of one decode batch, each lowered with abstract inputs (an `abstract_model`'s parameters,
the caches and state the previous program returns) through the driver's own functions, and measured
per device from XLA's analyses: memory, work, and the collectives it runs (per step of the loop)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from jaxsr.decoding import loop
from jaxsr.decoding.driver import Layout, Prefill, Sampler, as_sampler
from jaxsr.decoding.inputs import Request
from jaxsr.decoding.sampling import SamplingConfig
from jaxsr.models.model import Model
from jaxsr.plans import hlo
from jaxsr.plans.abstract import bytes_per_device
from jaxsr.plans.targets import GIB, Target


@dataclasses.dataclass(frozen=True)
class Batch:
    """One decode batch as the driver lays it out (`driver.Layout`): `prompts` prompts of up to
    `prompt_slots` tokens, `rows` rows each, decoding up to `max_new_tokens` tokens."""

    prompts: int
    rows: int
    prompt_slots: int
    max_new_tokens: int


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
    """XLA's cost analysis (a loop's body counted once)."""
    bytes_accessed: float
    collectives: dict[str, int]
    """Collective instructions by kind in the whole program."""
    step_collectives: dict[str, int] | None
    """Those in the condition and body of the program's loop (one decode step), or None without one."""
    gathered: tuple[str, ...]
    """Result shapes of the program's all-gathers."""

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
    """prefill, start (the rows' first tokens), decode_loop."""

    def program(self, name: str) -> Program:
        return next(p for p in self.programs if p.name == name)

    @property
    def fits(self) -> bool:
        """Every program within the memory XLA gives one program on the target's chip."""
        return all(p.peak_bytes <= self.target.chip.usable_bytes for p in self.programs)


def measure(name: str, compiled: Any, seconds: float) -> Program:
    """A compiled program's figures per device."""
    memory = compiled.memory_analysis()
    cost = compiled.cost_analysis() or {}
    module, entry = hlo.computations(compiled.as_text())
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
    )


def compile_for(target: Target, name: str, compile_: Callable[[], Any]) -> tuple[Any, Program]:
    """`compile_()`'s compiled program and its figures; a program too big for the chip's memory is a
    ValueError naming the target and its HBM (XLA's message appended)."""
    start = time.perf_counter()
    try:
        compiled = compile_()
    except jax.errors.JaxRuntimeError as e:
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        raise ValueError(
            f"{name} does not fit {target.name}: more than the {target.chip.usable_bytes / GIB:.2f} GiB "
            f"a program may use of a {target.chip.kind} chip's {target.chip.hbm_bytes / GIB:.0f} GiB HBM "
            f"({e})"
        ) from None
    return compiled, measure(name, compiled, time.perf_counter() - start)


def placeholder_request(batch: Batch) -> Request:
    """A request with the batch's budget: the rows' set-up reads only its seed, ids and stops."""
    prompts = tuple(range(batch.prompts))
    encoded = [[0] * batch.prompt_slots for _ in prompts]
    return Request(prompts, encoded, batch.max_new_tokens, SamplingConfig(), 0, (), prompts)


def plan_batch(model: Model, target: Target, batch: Batch) -> Plan:
    """Compile `batch`'s prefill, row set-up and token loop for plain sampling from `model` (e.g. an
    `abstract_model` on `target_mesh(target, ...)`), as `driver.decode_batch` runs them."""
    sampler = as_sampler(model, SamplingConfig())
    tokens = jax.ShapeDtypeStruct(
        (batch.prompts, batch.prompt_slots), jnp.int32, sharding=NamedSharding(model.mesh, PartitionSpec())
    )
    with sampler.on_mesh():
        prefill_c, prefill = compile_for(
            target, "prefill", lambda: loop.prefill.lower(model.graph, model.params, tokens, tokens).compile()
        )
        logits, cache = prefill_c.out_info
        start_c, start = compile_for(
            target, "start", lambda: _start(sampler, batch).lower(logits, cache).compile()
        )
        _, decode = compile_for(
            target, "decode_loop", lambda: sampler.compiled_loop(start_c.out_info, (cache,))
        )
    return Plan(target, batch, bytes_per_device(model.params), (prefill, start, decode))


def _start(sampler: Sampler, batch: Batch) -> Any:
    """`Sampler.start` of the batch's layout as one jitted program of the prefill's outputs."""
    layout = Layout(tuple(range(batch.prompts)), batch.prompts, batch.rows, batch.rows)
    request = placeholder_request(batch)
    return jax.jit(lambda logits, cache: sampler.start(Prefill((logits,), (cache,), 0), layout, request))
