"""Prefill attends in blocks of queries (`jaxsr.models.attention.attend_blocks`), so its memory grows
linearly in the prompt length S, not quadratically.

Checked here: blocked prefill equals one block over all keys (`query_block >= S`, the program short
prompts compile to) on every real slot, hidden states, last logits and the prompt cache, for tiny
random models with and without grouped-query attention, with a sliding window and Gemma 2's soft-cap,
and with an int8 cache; left-padded prompts, S not a multiple of the block, one loop and several; and
gradients through it (training). And the compiled prefill's temporaries: linear in S at the default
block, and below one block's.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from tiny import tiny_model

from jaxsr.decoding.loop import prefill
from jaxsr.models.attention import PREFILL_BLOCK

TOL = 1e-5
"""Blocked vs one block, float32: a key range that ends earlier sums the same nonzero terms in another
order (measured within 1e-6 on hidden states and logits of O(1-10))."""
MODELS = {
    "mha": dict(num_kv_heads=4),
    "gqa": dict(num_kv_heads=1),
    # Gemma-2-like: a window of 5 slots in layer 0, soft-capped scores, a query scale of its own
    "window-softcap": dict(
        sliding_window=5, sliding_layers=(0,), attn_logit_softcapping=5.0, query_pre_attn_scalar=16
    ),
    "int8-kv": dict(kv_dtype="int8"),
}
S = 37
LENGTHS = (S, S - 9, 4)
"""One unpadded prompt, one left-padded by 9 slots (past block boundaries), one mostly padding."""


@partial(jax.jit, static_argnums=(0, 4))
def _prefill(graph: nnx.GraphDef, params: nnx.State, tokens, mask, query_block: int):
    module = nnx.merge(graph, params)
    hidden, cache = module.prefill(tokens, mask, query_block)
    return hidden, module.logits(hidden[:, -1]), cache


def _prompts(S: int, lengths: tuple[int, ...]) -> tuple[jax.Array, jax.Array]:
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, 64, (len(lengths), S))
    mask = np.arange(S)[None, :] >= S - np.asarray(lengths)[:, None]
    return jnp.asarray(tokens, jnp.int32), jnp.asarray(mask)


def _slots_first(cache) -> dict[str, list[np.ndarray]]:
    """The cache's arrays per layer with [prompts, slots] leading (keys are stored [P, K, D, S], values
    and scales [P, K, S, ...])."""
    slot_axis = dict(k=3, v=2, k_scale=2, v_scale=2)
    return {
        name: [np.moveaxis(np.asarray(x), axis, 1) for x in getattr(cache, name)]
        for name, axis in slot_axis.items()
    }


@pytest.mark.slow  # 4 models × 3 blocks: compiles prefill blocked and as one block
@pytest.mark.parametrize("block", [4, 8, 16])  # S = 37: 10 blocks in 4 loops, 5 in 2, 3 in 1
@pytest.mark.parametrize("model", MODELS)
def test_blocked_prefill_equals_one_block_on_real_slots(model, block):
    lm = tiny_model(**MODELS[model])
    tokens, mask = _prompts(S, LENGTHS)
    hidden, logits, cache = _prefill(lm.graph, lm.params, tokens, mask, block)
    hidden_1, logits_1, cache_1 = _prefill(lm.graph, lm.params, tokens, mask, S)
    real = np.asarray(mask)
    np.testing.assert_allclose(np.asarray(hidden)[real], np.asarray(hidden_1)[real], atol=TOL, rtol=0)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(logits_1), atol=TOL, rtol=0)
    assert (np.asarray(cache.mask) == real).all() and (np.asarray(cache.length) == LENGTHS).all()
    got, want = _slots_first(cache), _slots_first(cache_1)
    assert [len(x) for x in got.values()] == [len(x) for x in want.values()]
    for name in got:
        for layer, (a, b) in enumerate(zip(got[name], want[name], strict=True)):
            if a.dtype == np.int8:  # a rounding apart, a value may round to the next int8 step
                steps = np.abs(a[real].astype(int) - b[real])
                assert steps.max() <= 1 and steps.mean() < 0.01, (name, layer, steps.mean())
            else:
                np.testing.assert_allclose(a[real], b[real], atol=TOL, rtol=0, err_msg=f"{name} {layer}")


@pytest.mark.slow  # compiles the gradient of prefill twice (blocked and one block)
def test_blocked_prefill_has_the_gradients_of_one_block():
    """Training differentiates through prefill (`jaxsr.training`)."""
    lm = tiny_model(**MODELS["window-softcap"])
    tokens, mask = _prompts(S, LENGTHS)

    @partial(jax.jit, static_argnums=1)
    def grads(params: nnx.State, query_block: int) -> nnx.State:
        def loss(params: nnx.State) -> jax.Array:
            hidden, _ = nnx.merge(lm.graph, params).prefill(tokens, mask, query_block)
            return jnp.sum(jnp.where(mask[..., None], hidden, 0.0) ** 2)

        return jax.grad(loss)(params)

    blocked, one = jax.tree.leaves(grads(lm.params, 8)), jax.tree.leaves(grads(lm.params, S))
    for a, b in zip(blocked, one, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-4 * np.abs(b).max())


def test_prompts_of_at_most_a_block_compile_to_one_block():
    lm = tiny_model()
    tokens, mask = _prompts(S, LENGTHS)
    lower = lambda block: _prefill.lower(lm.graph, lm.params, tokens, mask, block).as_text()
    assert lower(S) == lower(S + 1) and "while" not in lower(S)
    assert "while" in lower(S - 1)


def _temporaries(lm, S: int, query_block: int | None = None) -> int:
    """Bytes of temporaries of the compiled prefill of two prompts of S slots: the job's program
    (`jaxsr.decoding.loop.prefill`, the default block), or with `query_block` queries per block."""
    tokens, mask = _prompts(S, (S, S // 2))
    if query_block is None:
        compiled = prefill.lower(lm.graph, lm.params, tokens, mask).compile()
    else:
        compiled = _prefill.lower(lm.graph, lm.params, tokens, mask, query_block).compile()
    return compiled.memory_analysis().temp_size_in_bytes


LONG = (2048, 4096)
"""4 and 8 blocks of `PREFILL_BLOCK`: at these lengths one block's scores, 2·2·(512·2)·S float32 for
the tiny model, outweigh everything else prefill holds."""


@pytest.fixture(scope="module")
def long_model():
    return tiny_model(max_position_embeddings=max(LONG))


def test_prefill_temporaries_grow_linearly_in_the_prompt_length(long_model):
    assert min(LONG) > PREFILL_BLOCK
    short, long = (_temporaries(long_model, S) for S in LONG)
    assert long / short < 2.5, (short, long)  # twice the slots: 2x (linear), not 4x (the [S, S] scores)


def test_blocked_prefill_holds_less_than_one_block_over_all_keys(long_model):
    S = max(LONG)
    blocked, one = _temporaries(long_model, S), _temporaries(long_model, S, query_block=S)
    assert blocked < one / 3, (blocked, one)
