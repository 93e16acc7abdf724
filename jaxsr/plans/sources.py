"""A model's `config.json` alone, from whatever a job config names: what a plan needs, no weights.

`smollm2` / `smollm2-draft` are the embedded checkpoints; an existing directory gives its config.json
and a `.gguf` file its metadata (as `load_model` reads them); a hub id this package ships a config for
(SHIPPED) needs no network; any other hub id downloads its config.json only.

The files under `jaxsr/plans/configs/` are copies of the models' public config.json files on the
Hugging Face hub (their values only), so that the shipped job configs plan offline.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from jaxsr.loading.api import resolve_source
from jaxsr.loading.files import CheckpointError, MissingFileError, read_json

SHIPPED = Path(__file__).resolve().parent / "configs"
"""`<owner>--<name>.json` for the hub id `<owner>/<name>`."""


def shipped_config(hub_id: str) -> Path | None:
    """The copy of `hub_id`'s config.json this package ships, or None."""
    path = SHIPPED / f"{hub_id.replace('/', '--')}.json"
    return path if "/" in hub_id and path.is_file() else None


def hf_config_of(source: str) -> dict[str, Any]:
    """The Hugging Face config of the model `source` names (a job's `model`, `draft` or `reward`)."""
    if source in ("smollm2", "smollm2-draft"):
        from jaxsr.loading.embedded import smollm2_draft_path
        from jaxsr.loading.gguf import smollm2_path

        return checkpoint_config(smollm2_path() if source == "smollm2" else smollm2_draft_path())
    path = Path(source).expanduser()
    if path.exists() or str(source).endswith(".gguf") or str(source).startswith((".", "/", "~")):
        return checkpoint_config(resolve_source(source))  # a missing path: resolve_source says so
    shipped = shipped_config(source)
    return read_json(shipped if shipped is not None else download_config(source))


def checkpoint_config(path: Path) -> dict[str, Any]:
    """A checkpoint directory's config.json, or a GGUF file's metadata as one."""
    if path.is_file() and path.suffix == ".gguf":
        from jaxsr.loading.gguf import read_gguf

        return read_gguf(path)[0]
    if not (path / "config.json").is_file():
        raise CheckpointError(f"{path}: no config.json (expected a checkpoint directory or a .gguf file)")
    return read_json(path / "config.json")


def download_config(hub_id: str) -> Path:
    """`hub_id`'s config.json from the Hugging Face hub (or its local cache); a hub that cannot provide
    it (offline, no such repository, gated) is a MissingFileError saying so."""
    from huggingface_hub import hf_hub_download

    try:
        return Path(hf_hub_download(hub_id, "config.json"))
    except Exception as e:  # the hub's many errors (offline, gated, missing, invalid id): one message
        raise MissingFileError(
            f"source: {hub_id!r} names no local file or directory, jaxsr ships no config for it, and the "
            f"hub could not provide its config.json ({type(e).__name__}: {str(e).splitlines()[0][:200]})"
        ) from None
