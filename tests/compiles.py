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
