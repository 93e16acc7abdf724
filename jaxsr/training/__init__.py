"""Training on what jaxsr generates: fine-tuning on a job's results (`sft(SFTConfig(...))`, or
`jaxsr train sft CONFIG.yaml`) and distilling a draft from a teacher's samples (`distill(DistillConfig(...))`,
or `jaxsr train distill CONFIG.yaml`)."""

from jaxsr.training.distill import DistillConfig, distill, load_distill_config
from jaxsr.training.sft import SFTConfig, load_sft_config, sft

__all__ = ["DistillConfig", "SFTConfig", "distill", "load_distill_config", "load_sft_config", "sft"]
