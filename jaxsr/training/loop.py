"""What every training run shares: the optimiser, the jitted train step around a loss, batch
placement, and the resumable loop (checkpoints, progress bar, evaluations at checkpoints).

The train state is the float32 (master) parameters and the optimiser state; with `param_dtype:
bfloat16` the forward and backward passes run on a bfloat16 copy made inside the step, while updates
and Adam's moments stay in float32. One step is one optimiser update over the batch's micro-batches
(axis 0, scanned, gradients summed), its loss the loss summed over the step divided by its count (e.g.
tokens). A run checkpoints every `save_every` steps; started again with the same config it resumes from
the newest complete checkpoint and ends with the parameters an uninterrupted run ends with.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar, Protocol

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from tqdm.auto import tqdm

from jaxsr.configs import content_fingerprint
from jaxsr.loading.api import DTYPES
from jaxsr.sharding import logical_to_spec, on_mesh
from jaxsr.training.checkpoints import Checkpoints
from jaxsr.training.data import stream_indices

Batch = dict[str, jax.Array]
Metrics = dict[str, jax.Array]
TrainStep = Callable[[nnx.State, optax.OptState, Batch], tuple[nnx.State, optax.OptState, Metrics]]
Loss = Callable[[nnx.Module, Batch], tuple[jax.Array, jax.Array]]
"""(module, micro-batch) → (summed loss, count); a step's loss is Σ loss / Σ count over its micro-batches."""


class RunKeys:
    """What SFT and distillation configs derive alike from their fields: the run's identity and the
    examples each step reads. A subclass names the keys that only place the run (`placement_keys`)."""

    placement_keys: ClassVar[tuple[str, ...]]
    batch_size: int
    grad_accum: int
    seed: int

    def fingerprint(self) -> str:
        """Identifies what the run computes (everything but where it writes and runs)."""
        return content_fingerprint(self, self.placement_keys)

    @property
    def examples_per_step(self) -> int:
        return self.batch_size * self.grad_accum

    def step_indices(self, count: int, step: int) -> np.ndarray:
        """The examples (of `count`) step `step` (0-based) reads: the next ones of the seed's stream."""
        return stream_indices(count, self.seed, step * self.examples_per_step, self.examples_per_step)


class RunConfig(Protocol):
    """The fields of a training config the shared machinery reads."""

    steps: int
    max_length: int
    learning_rate: float
    end_learning_rate: float
    warmup_steps: int
    weight_decay: float
    max_grad_norm: float
    param_dtype: str
    save_every: int
    seed: int

    def fingerprint(self) -> str: ...


def check_run_keys(config: RunConfig) -> None:
    """Refuse (ValueError naming the key) the shared keys out of range: lengths, schedule, optimiser."""
    if config.max_length < 2:
        raise ValueError(f"max_length: expected an int >= 2 (prompt + response), got {config.max_length}")
    if not config.learning_rate > 0:
        raise ValueError(f"learning_rate: expected a number > 0, got {config.learning_rate}")
    if not 0 <= config.end_learning_rate <= config.learning_rate:
        raise ValueError(
            f"end_learning_rate: expected a number in [0, learning_rate], got {config.end_learning_rate}"
        )
    if not 0 <= config.warmup_steps < config.steps:
        raise ValueError(f"warmup_steps: expected an int in [0, steps), got {config.warmup_steps}")
    if not config.weight_decay >= 0:
        raise ValueError(f"weight_decay: expected a number >= 0, got {config.weight_decay}")
    if not config.max_grad_norm > 0:
        raise ValueError(f"max_grad_norm: expected a number > 0, got {config.max_grad_norm}")
    if config.param_dtype not in DTYPES:
        raise ValueError(f"param_dtype: expected one of {DTYPES}, got {config.param_dtype!r}")


def make_optimizer(config: RunConfig) -> optax.GradientTransformation:
    """Global-norm clipping, then AdamW along a linear warm-up + cosine decay, no decay on vectors."""
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, config.learning_rate, config.warmup_steps, config.steps, end_value=config.end_learning_rate
    )
    matrices = lambda params: jax.tree.map(lambda p: p.ndim > 1, params)
    return optax.chain(
        optax.clip_by_global_norm(config.max_grad_norm),
        optax.adamw(schedule, weight_decay=config.weight_decay, mask=matrices),
    )


def make_train_step(
    graph: nnx.GraphDef, optimizer: optax.GradientTransformation, param_dtype: str, loss: Loss
) -> TrainStep:
    """The jitted `train_step(params, opt_state, batch) -> (params, opt_state, metrics)`, a pure
    function of its arguments (the first two donated). `batch` holds [micro_batches, rows, ...] arrays;
    `metrics` the step's mean loss, its count and the gradient's norm."""
    compute_dtype = jnp.dtype(param_dtype)

    def summed_loss(params: nnx.State, micro: Batch) -> tuple[jax.Array, jax.Array]:
        return loss(nnx.merge(graph, jax.tree.map(lambda p: p.astype(compute_dtype), params)), micro)

    gradient = jax.value_and_grad(summed_loss, has_aux=True)

    def train_step(params: nnx.State, opt_state: optax.OptState, batch: Batch):
        def accumulate(grads: nnx.State, micro: Batch):
            (total, count), micro_grads = gradient(params, micro)
            return jax.tree.map(jnp.add, grads, micro_grads), (total, count)

        grads, (total, count) = jax.lax.scan(accumulate, jax.tree.map(jnp.zeros_like, params), batch)
        count = jnp.maximum(count.sum(), 1.0)
        grads = jax.tree.map(lambda g: g / count, grads)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        metrics = {"loss": total.sum() / count, "tokens": count, "grad_norm": optax.tree.norm(grads)}
        return optax.apply_updates(params, updates), opt_state, metrics

    return jax.jit(train_step, donate_argnums=(0, 1))


def place_batch(mesh: Mesh | None, batch: dict[str, np.ndarray]) -> Batch:
    """The batch on the devices, its rows (axis 1) split over `data` when they divide."""
    if mesh is None:
        return {name: jnp.asarray(x) for name, x in batch.items()}

    def spec(x: np.ndarray) -> NamedSharding:
        axes = (None, "batch") + (None,) * (x.ndim - 2)
        return NamedSharding(mesh, logical_to_spec(axes, x.shape, mesh))

    return {name: jax.device_put(x, spec(x)) for name, x in batch.items()}


@dataclasses.dataclass
class Run:
    """One resumable run: what it trains, on which batches, and where it checkpoints."""

    config: RunConfig
    model: Any
    """The `jaxsr.Model` trained (its graph, params and mesh)."""
    loss: Loss
    batch: Callable[[int], dict[str, np.ndarray]]
    """The host batch of step `step` (0-based; `tokens`, `mask`, `targets` and whatever the loss reads):
    a pure function of the step, so a resumed run reads the batches an uninterrupted one does."""
    examples: int
    """How many examples the batches are drawn from (a resumed run must see the same data)."""
    checkpoints: Path
    name: str = "train"
    evaluate: Callable[[nnx.State], dict[str, float]] | None = None
    """Measures the parameters at each checkpoint; the results join the run's `history`."""
    progress: bool = True


def train(run: Run) -> tuple[nnx.State, list[dict[str, Any]]]:
    """Train `run.model` for `run.config.steps` steps, resuming from the newest checkpoint; returns the
    final float32 parameters and the history of every checkpoint: step, loss, `tokens` (target tokens
    trained on so far) and the evaluations."""
    config, model = run.config, run.model
    optimizer = make_optimizer(config)
    train_step = make_train_step(model.graph, optimizer, config.param_dtype, run.loss)
    state = (model.params, jax.jit(optimizer.init)(model.params))
    with Checkpoints(run.checkpoints) as checkpoints:  # closed (its last save awaited) however this ends
        return _train_steps(run, train_step, state, checkpoints)


def _train_steps(run: Run, train_step: Any, state: tuple, checkpoints: Checkpoints) -> tuple[Any, list]:
    """`train`'s steps from the newest checkpoint on: (final parameters, history)."""
    config, model = run.config, run.model
    step, history, tokens = checkpoints.latest() or 0, [], 0
    if step:
        record = checkpoints.progress(step)
        _check_resumable(record, config, run.examples, run.checkpoints)
        history, tokens = record["history"], record["tokens"]
        state = checkpoints.restore(step, state)
    bar = tqdm(total=config.steps, initial=step, disable=not run.progress, unit="step", desc=run.name)
    shown: tuple[Metrics, int] | None = None  # a dispatched step's metrics and batch tokens
    clock = time.perf_counter()

    def show(metrics: Metrics, batch_tokens: int) -> float:
        """Read a step's loss (waiting for it) and advance the bar."""
        nonlocal clock
        loss, now = float(metrics["loss"]), time.perf_counter()
        bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{batch_tokens / (now - clock):.0f}")
        bar.update(1)
        clock = now
        return loss

    try:
        with on_mesh(model):
            while step < config.steps:
                batch = run.batch(step)
                params, opt_state, metrics = train_step(*state, place_batch(model.mesh, batch))
                state, step = (params, opt_state), step + 1
                tokens += int(batch["targets"].sum())  # the tokens the loss is taken on
                # the previous step's loss is read once this one is queued, so the host prepares the
                # next batch while the device works instead of waiting on every step
                if shown is not None:
                    show(*shown)
                shown = (metrics, int(batch["mask"].sum()))
                if step % config.save_every == 0 or step == config.steps:
                    loss, shown = show(*shown), None
                    entry = {"step": step, "loss": loss, "tokens": tokens}
                    history.append({**entry, **(run.evaluate(state[0]) if run.evaluate else {})})
                    record = {**entry, "history": history, "examples": run.examples}
                    checkpoints.save(step, state, _progress(config, record))
    finally:
        bar.close()
    return state[0], history


def _progress(config: RunConfig, record: dict[str, Any]) -> dict[str, Any]:
    """What a checkpoint records besides the arrays: enough to check and continue the run."""
    config_record = dataclasses.asdict(config)
    return {"fingerprint": config.fingerprint(), "seed": config.seed, **record, "config": config_record}


def _check_resumable(record: dict[str, Any], config: RunConfig, examples: int, directory: Path) -> None:
    """Refuse to continue another run's checkpoints (a different config, or data that changed)."""
    if record.get("fingerprint") != config.fingerprint() or record.get("examples") != examples:
        raise ValueError(
            f"output_dir: {directory.parent} holds checkpoints of a different run (config "
            f"{record.get('fingerprint')} with {record.get('examples')} examples; this run is "
            f"{config.fingerprint()} with {examples}); choose another output_dir or remove it"
        )


def write_report(path: Path, record: dict[str, Any]) -> None:
    """Write a run's JSON report whole or not at all (a temporary name, then a rename)."""
    temporary = path.with_name(path.name + ".partial")
    temporary.write_text(json.dumps(record, indent=2) + "\n")
    os.replace(temporary, path)
