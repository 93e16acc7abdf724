"""Training checkpoints with orbax: the train state (parameters, optimiser state) and a JSON record of
the run's progress (step, data position, seed, config fingerprint) under one step directory.

orbax writes each step into a temporary directory and renames it when complete, so a run killed
mid-save leaves the previous checkpoints as they were and `latest()` only ever names a complete one.
Saves are asynchronous: training goes on while the last one is written.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

KEEP = 2
"""Checkpoints kept: the newest, and the one before it while the newest is being written."""


class Checkpoints:
    """The checkpoints of one run, in `directory` (created on the first save).

    A save that fails (a full disk) is one ValueError naming the directory, raised by the next save or
    by `close`; its temporary directory is removed. orbax's writer threads report such a failure
    several times over (error logs with tracebacks, and callbacks into its closed event loop): while
    the checkpoints are open those reports are dropped, the ValueError says it once."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory).resolve()
        options = ocp.CheckpointManagerOptions(max_to_keep=KEEP, create=True)
        self.manager = ocp.CheckpointManager(self.directory, options=options)
        self._quiet = contextlib.ExitStack()
        self._quiet.enter_context(_writer_reports_dropped())

    def latest(self) -> int | None:
        """The step of the newest complete checkpoint, None when there is none."""
        return self.manager.latest_step()

    def save(self, step: int, state: Any, progress: dict[str, Any]) -> None:
        """Start writing `state` (a pytree of arrays) and `progress` (JSON) as checkpoint `step`."""
        items = ocp.args.Composite(state=ocp.args.StandardSave(state), progress=ocp.args.JsonSave(progress))
        with self._failure_named():  # the previous save's failure surfaces here
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

    def __enter__(self) -> Checkpoints:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Wait for the last save to be complete, then release the manager."""
        try:
            with self._failure_named():
                self.manager.wait_until_finished()
        finally:
            self.manager.close()
            self._quiet.close()

    @contextlib.contextmanager
    def _failure_named(self) -> Iterator[None]:
        """A failed save as a ValueError naming the directory, its temporary directory removed."""
        try:
            yield
        except Exception as e:  # orbax and tensorstore raise several types for one failed write
            for partial in self.directory.glob(f"*{TEMPORARY}*"):
                shutil.rmtree(partial, ignore_errors=True)
            raise ValueError(
                f"checkpoints: cannot write a checkpoint in {self.directory} ({_reason(e)})"
            ) from e


def _reason(error: Exception) -> str:
    """A failed write's cause in a few words: the operating system's, where tensorstore's message
    carries its error code (`[os_error_code='28']`), else the message's first line."""
    code = re.search(r"os_error_code='(\d+)'", str(error))
    if code:
        return os.strerror(int(code.group(1)))
    return (str(error).splitlines() or [type(error).__name__])[0][:300]


TEMPORARY = ".orbax-checkpoint-tmp"
"""What orbax appends to a checkpoint directory's name until it is complete."""


class _OrbaxErrors(logging.Filter):
    """Drops orbax's own error reports (a failed save is raised as one ValueError instead)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.levelno >= logging.ERROR and "orbax" in record.pathname)


class _OrbaxTasks(logging.Filter):
    """Drops asyncio's reports of orbax writer tasks whose failure nobody read (a failed save's)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.levelno >= logging.ERROR and "orbax" in record.getMessage())


_ABANDONED_TASKS = _OrbaxTasks()
"""Installed on asyncio's logger for good: a failed save's abandoned tasks are reported when they are
collected, which can be after the checkpoints are closed."""


@contextlib.contextmanager
def _writer_reports_dropped() -> Iterator[None]:
    """Inside: orbax's error logs, and its writer callbacks' 'Event loop is closed' errors after a
    failed save, are not printed (every other report is)."""
    logger, errors, previous = logging.getLogger("absl"), _OrbaxErrors(), sys.unraisablehook

    def unraisable(report: Any) -> None:
        if not (
            isinstance(report.exc_value, RuntimeError) and "Event loop is closed" in str(report.exc_value)
        ):
            previous(report)

    logger.addFilter(errors)
    logging.getLogger("asyncio").addFilter(_ABANDONED_TASKS)  # once: a filter is added only once
    sys.unraisablehook = unraisable
    try:
        yield
    finally:
        logger.removeFilter(errors)
        if sys.unraisablehook is unraisable:  # another hook set since stays
            sys.unraisablehook = previous
