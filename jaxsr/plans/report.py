"""A job plan as `jaxsr plan` prints it (a table per device) and writes it (`--json`)."""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxsr.checks import format_bytes
from jaxsr.plans.gpus import JAX_MEMORY_FRACTION
from jaxsr.plans.job import JobPlan
from jaxsr.plans.targets import Chip


def plan_dict(plan: JobPlan) -> dict[str, Any]:
    """Everything the table shows, in bytes, FLOPs and seconds (JSON-ready)."""
    chip = plan.target.chip
    return {
        "target": {
            "name": plan.target.name,
            **dataclasses.asdict(chip),
            "chips": plan.target.chips,
            "hosts": plan.target.hosts,
        },
        "method": plan.config.method,
        "models": {"model": plan.config.model, "draft": plan.config.draft, "reward": plan.config.reward},
        "dtype": plan.config.dtype,
        "mesh": plan.mesh,
        "prompt_tokens": plan.prompt_tokens,
        "layers": plan.layers,
        "skipped_rungs": plan.skipped_rungs,
        "parameter_bytes": plan.parameter_bytes,
        "budget_slots": plan.budget_slots,
        "batch": dataclasses.asdict(plan.decode.batch),
        "rows": plan.rows,
        "kv_bytes_per_row": plan.kv_bytes_per_row,
        "programs": [dataclasses.asdict(p) for p in (*plan.decode.programs, *filter(None, [plan.reward]))],
        "reward_batch": {"rows": plan.reward_rows, "length": plan.reward_length} if plan.reward else None,
        "peak_bytes": plan.peaks(),
        "fits": plan.fits,
        "decode_step": plan.step(),
        "loop_all_gathers": plan.loop_all_gathers(),
    }


def plan_table(plan: JobPlan) -> str:
    """The plan per device, one line per figure."""
    chip, batch, step = plan.target.chip, plan.decode.batch, plan.step()
    loop = plan.decode.program("decode_loop")
    cut = f", every model cut to {plan.layers} layers" if plan.layers else ""
    kind = "Speculative Rejection first batch" if plan.config.method == "speculative_rejection" else "batch"
    segment = f", row caches of {batch.segment} slots" if batch.segment else ""
    lines = [
        f"{plan.config.method} on {plan.target.name} ({plan.target.chips} × {chip.kind}, "
        f"{usable_memory(chip)}), mesh data={plan.mesh['data']} × "
        f"model={plan.mesh['model']}, {plan.config.dtype}, prompts of {plan.prompt_tokens} tokens{cut}",
        *hosts_line(plan),
        "per device:",
        *(f"  parameters ({name}): {format_bytes(n)}" for name, n in plan.parameter_bytes.items()),
        f"  KV cache per row: {format_bytes(plan.kv_bytes_per_row)} (the batch's row caches, every model's)",
        f"  {kind}: {plan.rows} rows ({batch.prompts} prompts × {batch.rows}{segment}) in a budget of "
        f"{plan.budget_slots} KV slots",
    ]
    for name, peak in plan.peaks().items():
        program = next(p for p in (*plan.decode.programs, plan.reward) if p and p.name == name)
        lines.append(
            f"  {name}: peak {format_bytes(peak)} of {format_bytes(chip.usable_bytes)} "
            f"({peak / chip.usable_bytes:.0%}; temporaries {format_bytes(program.temp_bytes)}), "
            f"compiled in {program.compile_s:.1f} s"
        )
    lines += rungs_lines(plan)
    if plan.reward is not None:
        lines.append(f"  reward scoring batch: {plan.reward_rows} responses × {plan.reward_length} tokens")
    lines += [
        f"  fits: {'yes' if plan.fits else 'NO'}",
        f"collectives per decode step: {_counts(loop.step_collectives or {})}",
    ]
    if plan.loop_all_gathers():
        lines.append(
            f"  all-gathers inside the token loop, shapes {', '.join(loop.gathered)} (a vocabulary split "
            "over `model` gathers each shard's top-k candidates, k per row; a cache, or rows gathered "
            "over the data shards, would be a fault to report)"
        )
    lines.append(
        f"decode step (roofline, a lower bound on time): {step['flops'] / 1e9:.1f} GFLOP, "
        f"{format_bytes(int(step['bytes']))} of HBM traffic -> {step['step_s'] * 1e3:.2f} ms "
        f"({'memory' if step['memory_s'] >= step['compute_s'] else 'compute'}-bound), "
        f"at most {step['tokens_per_s']:,.0f} tokens/s over {plan.rows} rows"
        + (
            f" a host, {step['job_tokens_per_s']:,.0f} on all {plan.target.hosts}"
            if plan.target.hosts > 1
            else ""
        )
    )
    return "\n".join(lines)


def rungs_lines(plan: JobPlan) -> list[str]:
    """Speculative Rejection's later rungs: their shapes, and those left out (`job.dominated`)."""
    batch = plan.decode.batch
    if not batch.rungs and not plan.skipped_rungs:
        return []
    shapes = lambda rungs: ", ".join(f"{rows}×{segment}" for rows, segment in rungs)
    lines = [f"  later rungs compiled (rows a prompt × slots a row): {shapes(batch.rungs) or 'none'}"]
    if plan.skipped_rungs:
        lines.append(
            f"  later rungs not compiled (--all-rungs compiles them): {shapes(plan.skipped_rungs)}; a mix "
            "of two compiled rungs has as many rows and cache slots as each, so it needs no more memory"
        )
    return lines


def hosts_line(plan: JobPlan) -> list[str]:
    """How a slice of several hosts runs the job (nothing for one host)."""
    target = plan.target
    if target.hosts == 1:
        return []
    return [
        f"{target.hosts} hosts of {target.host.chips} chips: each runs a job process on its own chips with "
        "its share of the prompts (dealt out by token count); the figures below are one host's"
    ]


def usable_memory(chip: Chip) -> str:
    """What one program may use of a chip's memory, and why."""
    if chip.platform == "cuda":
        share = f"JAX's default {JAX_MEMORY_FRACTION:.0%} of {format_bytes(chip.hbm_bytes)}"
        return f"{format_bytes(chip.usable_bytes)} usable per GPU: {share}"
    return f"{format_bytes(chip.usable_bytes)} usable HBM per chip"


def _counts(collectives: dict[str, int]) -> str:
    return ", ".join(f"{n} {kind}" for kind, n in collectives.items() if n) or "none"
