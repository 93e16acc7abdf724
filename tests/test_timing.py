"""Stage timings with JAX's compiling told apart (`jaxsr.timing`)."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp

from jaxsr.timing import Stopwatch, compiling


def test_a_stage_that_compiles_tells_its_compiling_apart_and_a_second_run_compiles_nothing():
    @jax.jit
    def f(x):
        return jnp.sin(x) @ jnp.cos(x).T

    x = jnp.ones((37, 41))
    watch = Stopwatch()
    f(x).block_until_ready()
    running, compiled = watch.split()
    assert compiled > 0 and running >= 0
    assert running + compiled <= time.time() - watch.start + 1e-6
    watch = Stopwatch()
    f(x).block_until_ready()
    assert watch.split()[1] == 0.0


def test_compiling_counts_a_window_only_and_nested_spans_once(monkeypatch):
    spans = [(10.0, 20.0), (12.0, 15.0), (30.0, 31.0)]  # a trace inside a compile, then another compile
    monkeypatch.setattr("jaxsr.timing._spans", sorted(spans, key=lambda s: s[1]))
    assert compiling(0.0) == 11.0
    assert compiling(14.0, 30.5) == 6.5
    assert compiling(25.0) == 1.0
    assert compiling(40.0) == 0.0
