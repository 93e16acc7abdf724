"""Hugging Face hub downloads (online use only): safetensors, configs and tokenizer files, pinned."""

from __future__ import annotations

from pathlib import Path

PATTERNS = ["*.json", "*.safetensors", "tokenizer.model", "*.txt", "*.jinja"]


def download(repo_id: str, revision: str | None = None) -> Path:
    """Snapshot of `repo_id` (weights as safetensors only; no code, no pickles)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError

    try:
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=PATTERNS))
    except HFValidationError:
        raise ValueError(f"source: {repo_id!r} is neither an existing path nor a valid hub id") from None
    except Exception as e:  # offline, unknown repo, gated repo, ...
        raise OSError(
            f"source: could not download hub id {repo_id!r} (revision={revision}): {type(e).__name__}: {e}"
        ) from None
