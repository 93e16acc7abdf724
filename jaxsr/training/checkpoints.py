"""Training checkpoints with orbax: the train state (parameters, optimiser state) and a JSON record of
the run's progress (step, data position, seed, config fingerprint) under one step directory.

orbax writes each step into a temporary directory and renames it when complete, so a run killed
mid-save leaves the previous checkpoints as they were and `latest()` only ever names a complete one.
Saves are asynchronous: training goes on while the last one is written.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

KEEP = 2
"""Checkpoints kept: the newest, and the one before it while the newest is being written."""


class Checkpoints:
    """The checkpoints of one run, in `directory` (created on the first save)."""

    def __init__(self, directory: str | Path):
        options = ocp.CheckpointManagerOptions(max_to_keep=KEEP, create=True)
        self.manager = ocp.CheckpointManager(Path(directory).resolve(), options=options)

    def latest(self) -> int | None:
        """The step of the newest complete checkpoint, None when there is none."""
        return self.manager.latest_step()

    def save(self, step: int, state: Any, progress: dict[str, Any]) -> None:
        """Start writing `state` (a pytree of arrays) and `progress` (JSON) as checkpoint `step`."""
        items = ocp.args.Composite(state=ocp.args.StandardSave(state), progress=ocp.args.JsonSave(progress))
        self.manager.save(step, args=items)

    def progress(self, step: int) -> dict[str, Any]:
        """The progress record of checkpoint `step`."""
        items = ocp.args.Composite(progress=ocp.args.JsonRestore())
        return self.manager.restore(step, args=items)["progress"]

    def restore(self, step: int, like: Any) -> Any:
        """The state of checkpoint `step`, each array placed (sharded) as its counterpart in `like`."""
        target = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
        items = ocp.args.Composite(state=ocp.args.StandardRestore(target))
        return self.manager.restore(step, args=items)["state"]

    def close(self) -> None:
        """Wait for the last save to be complete, then release the manager."""
        self.manager.wait_until_finished()
        self.manager.close()
