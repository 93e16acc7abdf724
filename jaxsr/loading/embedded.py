"""Checkpoints shipped inside the jaxsr package itself."""

from __future__ import annotations

from pathlib import Path

SMOLLM2_DRAFT = "smollm2-draft"


def smollm2_draft_path() -> Path:
    """The draft/amateur distilled from SmolLM2-135M-Instruct (same tokenizer) for SD/SCD and CD; it is
    built by `jaxsr train distill configs/train/distill_smollm2_draft.yaml` and shipped as an HF
    checkpoint directory (bfloat16 weights)."""
    path = Path(__file__).resolve().parent.parent / "assets" / SMOLLM2_DRAFT
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path}: the shipped SmolLM2 draft checkpoint is missing")
    return path
