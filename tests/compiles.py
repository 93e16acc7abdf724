"""Which jitted functions XLA compiles inside a block (from JAX's compile log)."""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Iterator

import jax

FINISHED = re.compile(r"Finished XLA compilation of jit\((\w+)\)")


@contextlib.contextmanager
def compilations() -> Iterator[list[str]]:
    """Yields a list that fills with the names of the functions compiled inside the block."""
    names: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: names.extend(FINISHED.findall(record.getMessage()))
    logger = logging.getLogger("jax")
    logger.addHandler(handler)
    try:
        with jax.log_compiles():
            yield names
    finally:
        logger.removeHandler(handler)


XLA_CPU_DEFAULTS = {"xla_backend_optimization_level": 3, "xla_cpu_use_fusion_emitters": True}
"""The options a user's XLA:CPU compiles with, for tests that read what it makes of a program (conftest
turns both down for the suite's speed): `lowered.compile(XLA_CPU_DEFAULTS)`."""
