"""Plans: jaxsr's programs compiled for accelerators this machine does not have (TPU slices through
libtpu's topology descriptions, NVIDIA GPU hosts through jax's CUDA plugin given each GPU's figures:
`h100x8`), from a model's config alone — per-device memory, work and collectives before anything is
rented.

    slice_ = target("v5e-8")
    model = abstract_model(hf_config, target_mesh(slice_, data=1, model=8))
    plan = plan_batch(model, slice_, Batch(prompts=1, rows=8, prompt_slots=128, max_new_tokens=64))

A job's plan (`jaxsr plan CONFIG.yaml --target v5e-8`): `plan_job(load_job_config(path), target(name))`,
printed by `plan_table`, as JSON by `plan_dict`.
"""

from jaxsr.plans.abstract import abstract_model, bytes_per_device
from jaxsr.plans.compiled import Batch, Plan, Program, plan_batch, plan_scores
from jaxsr.plans.job import JobPlan, plan_job
from jaxsr.plans.report import plan_dict, plan_table
from jaxsr.plans.sources import hf_config_of
from jaxsr.plans.targets import CHIPS, Chip, Target, target, target_devices, target_mesh

__all__ = [
    "CHIPS",
    "Batch",
    "Chip",
    "JobPlan",
    "Plan",
    "Program",
    "Target",
    "abstract_model",
    "bytes_per_device",
    "hf_config_of",
    "plan_batch",
    "plan_dict",
    "plan_job",
    "plan_scores",
    "plan_table",
    "target",
    "target_devices",
    "target_mesh",
]
