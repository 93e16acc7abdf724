"""Static top-k against top-k traced up to a static maximum: the cost of the choice `SamplingConfig`
makes (top-k is part of the compiled program; temperature, top-p, min-p and penalties are traced).

The traced variant takes the `maximum` best logits (a static top-k) and masks those past a traced k
before the draw, so a sweep over k ≤ maximum shares one program. Both draw one token per row from
SmolLM2-sized logits (49,152 ids) through `jaxsr.decoding.sampling.draw`'s top-k path; each is jitted
once, then timed alternately, the fastest of `--repeats` rounds of `--calls` calls counting.

    python -m benchmarks.bench_top_k [--rows 8 64 256] [--k 50] [--maximum 64 256] [--repeats 5]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from functools import partial

import jax
import jax.numpy as jnp

from benchmarks.common import table, write_result
from jaxsr.decoding.sampling import SamplingConfig, draw, top_k

VOCAB = 49152


@partial(jax.jit, static_argnames=("maximum",))
def traced_draw(keys: jax.Array, logits: jax.Array, k: jax.Array, *, maximum: int) -> jax.Array:
    """A top-k draw whose k is traced: the `maximum` best, those past k masked."""
    values, index = top_k(logits, maximum)
    values = jnp.where(jnp.arange(maximum) < k, values, -jnp.inf)
    choice = jax.vmap(jax.random.categorical)(keys, values)
    return jnp.take_along_axis(index, choice[:, None], axis=-1)[:, 0]


def seconds(call, calls: int) -> float:
    """Seconds per call of `calls` calls, after the result is ready."""
    start = time.perf_counter()
    for _ in range(calls):
        out = call()
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / calls


def variants(B: int, args) -> dict[str, Callable[[], jax.Array]]:
    """The static draw and each traced one over the same [B, VOCAB] logits, by name."""
    logits = jax.random.normal(jax.random.PRNGKey(0), (B, VOCAB)) * 3
    keys = jax.random.split(jax.random.PRNGKey(1), B)
    sampling = SamplingConfig(top_k=args.k).compiled()
    static = jax.jit(lambda keys, logits: draw(keys, logits, sampling))  # arguments, not constants
    calls = {"static": partial(static, keys, logits)}
    for m in args.maximum:
        calls[f"traced ≤ {m}"] = partial(traced_draw, keys, logits, jnp.int32(args.k), maximum=m)
    return calls


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, nargs="+", default=[8, 64, 256])
    parser.add_argument("--k", type=int, default=50)
    parser.add_argument("--maximum", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--calls", type=int, default=20)
    args = parser.parse_args()
    rows = []
    for B in args.rows:
        calls = variants(B, args)
        for call in calls.values():
            jax.block_until_ready(call())  # compile
        times: dict[str, list[float]] = {name: [] for name in calls}
        for _ in range(args.repeats):  # alternating, so drift hits every variant alike
            for name, call in calls.items():
                times[name].append(seconds(call, args.calls))
        best = {name: min(t) for name, t in times.items()}
        for name, s in best.items():
            rows.append({"rows": B, "variant": name, "ms": 1e3 * s, "vs_static": s / best["static"]})
    print(table(rows, ["rows", "variant", "ms", "vs_static"]))
    path = write_result("top_k", {"vocab": VOCAB, "k": args.k, "args": vars(args), "rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
