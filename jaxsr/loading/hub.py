"""Hugging Face hub downloads (online use only): safetensors, configs and tokenizer files, pinned."""

from __future__ import annotations

from pathlib import Path

from jaxsr.loading.files import MissingFileError

PATTERNS = ["*.json", "*.safetensors", "tokenizer.model", "*.txt", "*.jinja"]


def download(repo_id: str, revision: str | None = None) -> Path:
    """Snapshot of `repo_id` (weights as safetensors only; no code, no pickles). A source the hub cannot
    provide (no such repository or revision, gated, offline or unreachable with no cached copy) names
    nothing, as a missing local path does: MissingFileError (a ValueError) saying what was tried. Other
    failures (a full disk, the hub's own errors) stay OSErrors."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HFValidationError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    tried = f"source: {repo_id!r} names no local file or directory, and the hub could not provide it:"
    try:
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=PATTERNS))
    except HFValidationError:
        raise ValueError(f"source: {repo_id!r} is neither an existing path nor a valid hub id") from None
    except GatedRepoError:
        raise MissingFileError(f"{tried} the repository is gated (accept its terms and log in)") from None
    except RepositoryNotFoundError:
        raise MissingFileError(f"{tried} no such repository (or it is private: log in)") from None
    except RevisionNotFoundError:
        raise MissingFileError(
            f"revision: the hub repository {repo_id!r} has no revision {revision!r}"
        ) from None
    except LocalEntryNotFoundError as e:
        cause = e.__cause__
        why = (
            "hub access is off (HF_HUB_OFFLINE)"
            if isinstance(cause, OfflineModeIsEnabled) or cause is None
            else f"it was unreachable ({type(cause).__name__})"
        )
        pinned = f" at revision {revision!r}" if revision is not None else ""
        raise MissingFileError(f"{tried} {why} and its local cache holds no complete copy{pinned}") from None
    except Exception as e:  # a full disk, the hub's own failures: not the argument's fault
        raise OSError(
            f"source: could not download hub id {repo_id!r} (revision={revision}): {type(e).__name__}: {e}"
        ) from None
