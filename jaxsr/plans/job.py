"""A job's plan: the programs `jaxsr run CONFIG.yaml` would run, compiled for a target from the models'
configs alone (`sources.hf_config_of`), at the batch jaxsr itself would pick there — the widest
decoding or Best-of-N batch or Speculative Rejection first batch `memory_budget=None` derives from the
chip's memory beside every model's parameters — with the reward model's scoring program beside them."""

from __future__ import annotations

import dataclasses
from typing import Any

from jax.sharding import Mesh

from jaxsr.checks import check_positive_int, is_int
from jaxsr.decoding.driver import Sampler, as_sampler, batches
from jaxsr.decoding.memory import DEVICE_HEADROOM, budget_rows_in, parse_bytes
from jaxsr.jobs.config import BUILT_IN_REWARDS, DECODER_OPTIONS, PAIR_METHODS, JobConfig
from jaxsr.jobs.methods import DECODER_BUILDERS
from jaxsr.ladder import bucket, fine_bucket
from jaxsr.models.model import Model, RewardModel
from jaxsr.plans.abstract import abstract_model, bytes_per_device
from jaxsr.plans.compiled import Batch, Plan, Program, plan_batch, plan_scores
from jaxsr.plans.sources import hf_config_of
from jaxsr.plans.targets import GIB, Target, target_mesh
from jaxsr.search.memory import MemoryPlan, device_share, row_layout
from jaxsr.sharding import padded_rows

REWARD_ACCELERATED_BATCH = 32
"""`ClassifierReward`'s responses per scoring call on an accelerator (`reward_batch`)."""


@dataclasses.dataclass(frozen=True)
class JobPlan:
    """A job's programs compiled for a target, per device."""

    config: JobConfig
    target: Target
    mesh: dict[str, int]
    """The mesh's axes: `data`, `model`."""
    prompt_tokens: int
    """The prompt length planned for (padded to its bucket)."""
    layers: int | None
    """Every model cut to this many layers (a quick look), or None."""
    parameter_bytes: dict[str, int]
    """One device's parameters of each model: `model` (with `draft`), `reward`."""
    budget_slots: int
    """KV slots (in every cache of the sampler) of the budget the batch was sized by."""
    decode: Plan
    reward: Program | None
    """The reward model's scoring of `reward_rows` responses of `reward_length` tokens, or None."""
    reward_rows: int = 0
    reward_length: int = 0
    skipped_rungs: tuple[tuple[int, int], ...] = ()
    """Speculative Rejection's later rungs (rows per prompt, segment) not compiled (`dominated`)."""

    @property
    def rows(self) -> int:
        """Rows the planned batch decodes at once (mesh padding included)."""
        return self.decode.batch.prompts * self.decode.batch.rows

    @property
    def kv_bytes_per_row(self) -> int:
        """One row's caches (every model's, the rung's length) on the device holding it."""
        return self.decode.row_cache_bytes * self.mesh["data"] // self.rows

    def peaks(self) -> dict[str, int]:
        """Each program's peak on one device with what stays resident beside it: the reward model's
        parameters while decoding; the decoder's parameters, caches and state while scoring."""
        reward = self.parameter_bytes.get("reward", 0)
        peaks = {p.name: p.peak_bytes + reward for p in self.decode.programs}
        if self.reward is not None:
            held = self.decode.program("decode_loop").argument_bytes
            peaks[self.reward.name] = self.reward.peak_bytes + held
        return peaks

    @property
    def fits(self) -> bool:
        return max(self.peaks().values()) <= self.target.chip.usable_bytes

    def step(self) -> dict[str, float]:
        """A decode step's roofline on one chip: its work against the peak FLOP/s, its HBM traffic
        against the bandwidth; the larger is a lower bound on the step's time. Tokens/s are one host's
        and, for a job over the target's hosts, all of theirs."""
        loop, chip = self.decode.program("decode_loop"), self.target.chip
        compute, memory = loop.flops / chip.bf16_flops, loop.bytes_accessed / chip.hbm_bytes_per_s
        seconds = max(compute, memory)
        tokens_per_s = self.rows / seconds if seconds else 0.0
        return {
            "flops": loop.flops,
            "bytes": loop.bytes_accessed,
            "compute_s": compute,
            "memory_s": memory,
            "step_s": seconds,
            "tokens_per_s": tokens_per_s,
            "job_tokens_per_s": tokens_per_s * self.target.hosts,
        }

    def loop_all_gathers(self) -> int:
        """All-gathers in one step of the token loop (each moves a tensor whole onto every device)."""
        return (self.decode.program("decode_loop").step_collectives or {}).get("all-gather", 0)


def plan_job(
    config: JobConfig,
    target: Target,
    prompt_tokens: int = 128,
    layers: int | None = None,
    all_rungs: bool = False,
) -> JobPlan:
    """Compile `config`'s programs for `target` at the batch jaxsr would decode there, for prompts of
    `prompt_tokens` tokens; `layers` cuts every model to that many layers (quick, for a look);
    `all_rungs` compiles every Speculative Rejection rung's decode loop (else `dominated` ones are
    left out)."""
    check_positive_int("prompt_tokens", prompt_tokens)
    if layers is not None:
        check_positive_int("layers", layers)
    mesh = target_mesh(target, config.mesh_data or 1, config.mesh_model)
    sampler = job_sampler(config, mesh, layers)
    reward = job_reward_model(config, mesh, layers)
    parameters = {"model": bytes_per_device(sampler.params)}
    if reward is not None:
        parameters["reward"] = bytes_per_device(reward.params)
    resident = sum(parameters.values())
    if resident > target.chip.usable_bytes:
        raise ValueError(
            f"parameters: {resident / GIB:.2f} GiB per device ({', '.join(parameters)}) exceed the "
            f"{target.chip.usable_bytes / GIB:.2f} GiB a {target.name} program may use; a larger mesh_model "
            "splits them over more chips"
        )
    prompt_slots, budget = bucket(prompt_tokens), job_budget(config, target, resident, sampler.slot_bytes)
    batch = job_batch(config, sampler, budget, prompt_slots)
    batch, skipped = dominated(batch, sampler.headroom, all_rungs)
    decode = plan_batch(sampler, target, batch)
    program, rows, length = reward_scoring(reward, config, target, prompt_slots)
    return JobPlan(
        config, target, dict(mesh.shape), prompt_slots, layers, parameters, budget, decode, program,
        rows, length, skipped,
    )  # fmt: skip


def job_budget(config: JobConfig, target: Target, resident: int, slot_bytes: int) -> int:
    """A device's KV budget in slots of `slot_bytes`: the job's `memory_budget`, or what `resident`
    parameter bytes leave of one of `target`'s chips (DEVICE_HEADROOM of it)."""
    budget = given_slots(config.memory_budget, slot_bytes)
    if budget is None:
        budget = int((target.chip.usable_bytes - resident) * DEVICE_HEADROOM) // slot_bytes
    return budget


def reward_scoring(
    reward: RewardModel | None, config: JobConfig, target: Target, prompt_slots: int
) -> tuple[Program | None, int, int]:
    """The reward model's scoring program compiled for the job's responses, with its batch's rows and
    length (None, 0, 0 without a reward model)."""
    if reward is None:
        return None, 0, 0
    rows = padded_rows(fine_bucket(REWARD_ACCELERATED_BATCH), reward.mesh)
    length = min(fine_bucket(prompt_slots + bucket(config.max_new_tokens), 16), reward.config.context)
    return plan_scores(reward, target, rows, length), rows, length


def dominated(batch: Batch, headroom: int, all_rungs: bool) -> tuple[Batch, tuple[tuple[int, int], ...]]:
    """`batch` with only the later rungs a plan compiles, and the rungs it leaves out (none with
    `all_rungs`). A program's buffers grow with a rung's rows (state, working memory) or with its
    cache slots in all (rows × (segment + `headroom`): caches, attention), so its memory is at most the
    larger of two rungs' where a mix of theirs has as many rows and slots: only the rungs at the
    corners of the upper-right convex hull of (rows, slots), first rung included, are compiled."""
    if not batch.rungs:
        return batch, ()
    points = [
        (rows, rows * (segment + headroom)) for rows, segment in ((batch.rows, batch.segment), *batch.rungs)
    ]
    corners = upper_right_hull(points)
    kept = [
        rung for rung, point in zip(batch.rungs, points[1:], strict=True) if all_rungs or point in corners
    ]
    skipped = tuple(rung for rung in batch.rungs if rung not in kept)
    return dataclasses.replace(batch, rungs=tuple(kept)), skipped


def upper_right_hull(points: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The corners of the convex hull of `points` that a weighted sum with weights ≥ 0 can peak at: the
    upper hull from its highest point to its rightmost."""
    hull: list[tuple[int, int]] = []
    for x, y in sorted(set(points)):
        while len(hull) >= 2 and _turn(hull[-2], hull[-1], (x, y)) >= 0:
            hull.pop()  # on or under the chord from hull[-2] to (x, y)
        hull.append((x, y))
    top = max(range(len(hull)), key=lambda i: (hull[i][1], hull[i][0]))
    return hull[top:]


def _turn(o: tuple[int, int], a: tuple[int, int], b: tuple[int, int]) -> int:
    """> 0 where o → a → b turns left (counter-clockwise)."""
    return (a[0] - o[0]) * (b[1] - o[1]) - (a[1] - o[1]) * (b[0] - o[0])


def cut(hf_config: dict[str, Any], layers: int | None) -> dict[str, Any]:
    """The config cut to `layers` layers (as given when None; a model with fewer keeps its own: a cut
    never plans layers a model does not have)."""
    if layers is None or not is_int(hf_config.get("num_hidden_layers")):
        return hf_config
    return {**hf_config, "num_hidden_layers": min(layers, hf_config["num_hidden_layers"])}


def abstract_from(
    source: str, config: JobConfig, mesh: Mesh, layers: int | None, key: str, weights_dtype: str | None = None
) -> Model:
    """The abstract model `source` (a job's `key`) names, its weights `weights_dtype`; errors name the
    key."""
    try:
        return abstract_model(cut(hf_config_of(source), layers), mesh, config.dtype, weights_dtype)
    except (ValueError, TypeError, OSError) as e:
        raise ValueError(f"{key}: {e}") from e


def job_sampler(config: JobConfig, mesh: Mesh, layers: int | None) -> Sampler:
    """The sampler the job decodes with (`build_solver`'s): plain sampling of `model`, or the pair
    method / `decoder` over (`model`, `draft`), their weights stored as `weights_dtype` and their caches
    as `kv_dtype`."""
    decoder = lambda key: abstract_from(
        getattr(config, key), config, mesh, layers, key, config.weights_dtype
    ).with_kv_dtype(config.kv_dtype)
    model = decoder("model")
    kind = PAIR_METHODS.get(config.method, config.decoder)
    sampling = config.sampling()
    if kind is None:
        return as_sampler(model, sampling)
    draft = decoder("draft")
    options = {name: getattr(config, name) for name in DECODER_OPTIONS[kind]}
    return as_sampler(DECODER_BUILDERS[kind](model, draft, **options), sampling)


def job_reward_model(config: JobConfig, mesh: Mesh, layers: int | None) -> RewardModel | None:
    """The job's reward model (a *ForSequenceClassification config), or None for a built-in reward."""
    if config.reward is None or config.reward in BUILT_IN_REWARDS:
        return None
    model = abstract_from(config.reward, config, mesh, layers, "reward")
    if not isinstance(model, RewardModel):
        raise ValueError(
            f"reward: {config.reward} is a {model.config.model_type} language model, not a "
            "*ForSequenceClassification reward model"
        )
    return model


def given_slots(memory_budget: int | str | None, slot_bytes: int) -> int | None:
    """A job's own `memory_budget` in slots (`budget_slots`' reading of it), or None to derive one."""
    if memory_budget is None:
        return None
    return memory_budget if is_int(memory_budget) else parse_bytes(memory_budget) // slot_bytes


def job_batch(config: JobConfig, sampler: Sampler, budget: int, prompt_slots: int) -> Batch:
    """The first batch the job decodes: Speculative Rejection's first rung of every prompt in flight,
    TreeBoN's n rows of every prompt in flight, or a decoding or Best-of-N call's widest batch in
    `budget` slots (a derived budget: on each `data` shard, as `call_rows` sizes it) up to `max_rows`."""
    mesh, new = sampler.mesh, config.max_new_tokens
    if config.method == "speculative_rejection":
        return first_rung(config, sampler, budget, prompt_slots)
    if config.method == "tree_best_of_n":
        return Batch(config.concurrent_prompts, padded_rows(config.n, mesh), prompt_slots, new)
    samples = config.n if config.method == "best_of_n" else config.num_samples
    rows = budget_rows_in(sampler, budget, prompt_slots, samples, new, config.memory_budget is None)
    rows = min(rows, config.max_rows or rows)
    layout = next(batches([[0] * prompt_slots] * rows, samples, rows, mesh))[0]
    return Batch(layout.prompts, layout.rows, prompt_slots, new)


def first_rung(config: JobConfig, sampler: Sampler, budget: int, prompt_slots: int) -> Batch:
    """Speculative Rejection's first rows of `concurrent_prompts` searches in one batch, each within
    its share of `budget` (`device_share`: a derived budget counts every `data` shard), with the
    later rungs' shapes (`Batch.rungs`, each once)."""
    copies = config.concurrent_prompts
    if config.memory_budget is None:
        budget = device_share(sampler, budget, prompt_slots, config.max_new_tokens, copies)
    memory = MemoryPlan(
        budget, prompt_slots, config.max_new_tokens, config.n, config.rejection_rate,
        config.min_first_segment, row_layout(sampler, config.memory_budget is None),
    )  # fmt: skip
    first, *later = memory.ladder
    rows, new = padded_rows(first, sampler.mesh), config.max_new_tokens
    rungs = tuple(dict.fromkeys((padded_rows(r, sampler.mesh), memory.capacity(r)) for r in later))
    batch = Batch(copies, rows, prompt_slots, new, memory.capacity(first), rungs=rungs)
    if not later:
        return batch
    # the first decision: one prompt's survivors gathered into the next rung
    survivors = padded_rows(later[0], sampler.mesh)
    return dataclasses.replace(batch, next_rows=survivors, next_segment=memory.capacity(later[0]))
