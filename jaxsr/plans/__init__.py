"""Plans: jaxsr's programs compiled for accelerators this machine does not have (TPU slices through
libtpu's topology descriptions), from a model's config alone — per-device memory, work and collectives
before anything is rented.

    slice_ = target("v5e-8")
    model = abstract_model(hf_config, target_mesh(slice_, data=1, model=8))
    plan = plan_batch(model, slice_, Batch(prompts=1, rows=8, prompt_slots=128, max_new_tokens=64))
"""

from jaxsr.plans.abstract import abstract_model, bytes_per_device
from jaxsr.plans.compiled import Batch, Plan, Program, plan_batch
from jaxsr.plans.targets import CHIPS, Chip, Target, target, target_devices, target_mesh

__all__ = [
    "CHIPS",
    "Batch",
    "Chip",
    "Plan",
    "Program",
    "Target",
    "abstract_model",
    "bytes_per_device",
    "plan_batch",
    "target",
    "target_devices",
    "target_mesh",
]
