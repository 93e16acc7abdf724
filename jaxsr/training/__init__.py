"""Fine-tuning on the results of `jaxsr run`: `sft(SFTConfig(...))`, or `jaxsr train sft CONFIG.yaml`."""

from jaxsr.training.sft import SFTConfig, load_sft_config, sft

__all__ = ["SFTConfig", "load_sft_config", "sft"]
