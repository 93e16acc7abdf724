"""Cached decoding (`Decoder.prefill` + `Decoder.decode` with a `RowCache`) equals the full forward.

Layouts: one row per prompt and the grouped layout (G rows share one prompt's `PromptCache`, each row
generating different tokens); one token per call and chunks of T=3 (speculative verification);
rolling a row back by its `length` and decoding different tokens.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import hf_fixtures as H
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxsr
from jaxsr.models.cache import PromptCache, RowCache, key_slot_axis
from jaxsr.models.config import DecoderConfig
from jaxsr.models.decoder import Decoder

TOL = 1e-4
"""Cached vs full forward (or torch) logits of O(1–10): float32 rounding of two computations, measured
within 6e-6 on AVX2, AVX and SSE4.2."""
VOCAB = H.VOCAB  # prompts come from H.left_padded_batch, ids in [1, H.VOCAB)

CONFIGS = {
    # Llama/Qwen3-like: RMSNorm, RoPE, grouped-query attention, q/k/v biases, q/k norm, head_dim ≠ d/H.
    "rope": DecoderConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        intermediate_size=48,
        max_position_embeddings=64,
        qkv_bias=True,
        qk_norm=True,
    ),
    # GPT-2-like: LayerNorm, learned positions, plain GELU MLP, all biases, tied head.
    "learned": DecoderConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_layers=2,
        num_heads=4,
        num_kv_heads=4,
        head_dim=8,
        intermediate_size=64,
        max_position_embeddings=64,
        norm="layer",
        norm_eps=1e-5,
        position="learned",
        mlp="plain",
        activation="gelu_tanh",
        qkv_bias=True,
        out_bias=True,
        mlp_bias=True,
        tie_word_embeddings=True,
        model_type="gpt2",
    ),
}


def _random_module(cfg: DecoderConfig, seed: int = 0) -> tuple[nnx.GraphDef, nnx.State]:
    """The graph of `Decoder(cfg, rngs=...)` with parameters drawn at a scale where attention matters.

    The default init (std 0.02) makes attention outputs so small that attending to the wrong keys would
    hardly move the logits; here matrices get std 1/sqrt(d), embeddings 0.5, norms 1 ± 0.1. Values come
    from numpy into the abstract module (as the loader does): eager JAX init compiles one random op per
    parameter shape, which costs seconds.
    """
    graph, abstract = nnx.split(nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(seed))))
    rng = np.random.default_rng(seed)
    leaves = []
    for path, variable in nnx.to_flat_state(abstract):
        noise = rng.standard_normal(variable.shape).astype(np.float32)
        name = path[-1]
        if name == "scale":
            value = 1.0 + 0.1 * noise
        elif "bias" in name:
            value = 0.1 * noise
        elif name in ("embed", "pos_embed"):
            value = 0.5 * noise
        else:
            value = noise / np.sqrt(cfg.hidden_size)
        leaves.append((path, variable.replace(jnp.asarray(value))))
    return graph, nnx.from_flat_state(leaves)


@partial(jax.jit, static_argnums=0)
def _prefill(graph, params, tokens, mask) -> tuple[jax.Array, PromptCache]:
    module = nnx.merge(graph, params)
    hidden, cache = module.prefill(tokens, mask)
    return module.logits(hidden), cache


@partial(jax.jit, static_argnums=0)
def _decode(graph, params, tokens, positions, prompt, rows) -> tuple[jax.Array, RowCache]:
    module = nnx.merge(graph, params)
    hidden, rows = module.decode(tokens, positions, prompt, rows)
    return module.logits(hidden), rows


def _garbage_rows(cfg: DecoderConfig, rows: int, capacity: int, seed: int = 7) -> RowCache:
    """An empty RowCache whose slots hold large random values (must never be attended)."""
    if cfg.quantized_kv:
        return _garbage_int8_rows(cfg, rows, capacity, seed)
    rng = np.random.default_rng(seed)
    noise = lambda *shape: jnp.asarray(10.0 * rng.standard_normal(shape), jnp.float32)
    K, D, layers = cfg.num_kv_heads, cfg.head_dim, range(cfg.num_layers)
    keys = (rows, K, D, capacity) if key_slot_axis(D, False) == 3 else (rows, K, capacity, D)
    return RowCache(
        k=tuple(noise(*keys) for _ in layers),
        v=tuple(noise(rows, K, capacity, D) for _ in layers),
        length=jnp.zeros((rows,), jnp.int32),
    )


def _prompts(num: int, seed: int = 0):
    lengths = (7, 4, 2, 5)[:num]
    return H.left_padded_batch(seed, lengths=lengths, width=8)


FULL_WIDTH = 16  # one padded width for every full forward, so each shape compiles once


def _full_batch(prompt_tokens, prompt_mask, continuations: list[np.ndarray], group: int):
    """Each row's whole sequence (its prompt's real tokens, then its continuation), left-padded."""
    seqs = [
        np.concatenate([prompt_tokens[b // group][prompt_mask[b // group].astype(bool)], c])
        for b, c in enumerate(continuations)
    ]
    width = FULL_WIDTH
    assert max(len(s) for s in seqs) <= width
    tokens = np.zeros((len(seqs), width), np.int64)
    mask = np.zeros((len(seqs), width), np.int64)
    for b, s in enumerate(seqs):
        tokens[b, width - len(s) :] = s
        mask[b, width - len(s) :] = 1
    return tokens, mask


CAPACITY = 12


def _cached_logits(graph, params, cfg, prompt_tokens, prompt_mask, generated, group, step, capacity=CAPACITY):
    """Prefill the prompts once, then decode `generated` [B, N] `step` tokens per call."""
    logits_prompt, prompt = _prefill(graph, params, prompt_tokens, prompt_mask)
    B, N = generated.shape
    assert N % step == 0 and prompt_tokens.shape[0] * group == B
    rows = _garbage_rows(cfg, B, capacity)
    start = np.repeat(np.asarray(prompt.length), group)
    out = []
    for j in range(0, N, step):
        positions = start[:, None] + j + np.arange(step)[None, :]
        logits, rows = _decode(graph, params, generated[:, j : j + step], positions, prompt, rows)
        rows = rows.replace(length=rows.length + step)
        out.append(np.asarray(logits))
    assert np.array_equal(np.asarray(rows.length), np.full(B, N))
    return np.asarray(logits_prompt), np.concatenate(out, axis=1)


def _check_against_full(graph, params, cfg, *, num_prompts, group, step, seed=0):
    prompt_tokens, prompt_mask = _prompts(num_prompts, seed)
    rng = np.random.default_rng(seed + 100)
    B, N = num_prompts * group, 6
    generated = rng.integers(1, cfg.vocab_size, (B, N))
    # Rows of one prompt generate different tokens (otherwise the grouped check proves less).
    assert len({tuple(r) for r in generated}) == B
    logits_prompt, cached = _cached_logits(
        graph, params, cfg, prompt_tokens, prompt_mask, generated, group, step
    )
    full_tokens, full_mask = _full_batch(prompt_tokens, prompt_mask, list(generated), group)
    full, _ = _prefill(graph, params, full_tokens, full_mask)
    full = np.asarray(full)
    np.testing.assert_allclose(cached, full[:, -N:], atol=TOL, rtol=0)
    # The prompt pass itself agrees with the full pass on the prompt's real tokens.
    for b in range(B):
        p = b // group
        n = int(prompt_mask[p].sum())
        np.testing.assert_allclose(logits_prompt[p, -n:], full[b, -N - n : -N], atol=TOL, rtol=0)
    # Rows sharing a prompt diverge: the comparison is not vacuous.
    if group > 1:
        assert np.abs(cached[0, 1:] - cached[1, 1:]).max() > 0.1
    return cached


@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(CONFIGS))
@pytest.mark.parametrize("step", [1, 3], ids=["T1", "T3"])
@pytest.mark.parametrize("group", [1, 2], ids=["G1", "G2"])
def test_cached_decode_matches_full_forward(kind, step, group):
    """4 rows: 4 prompts × 1 row, or 2 prompts × 2 rows sharing their prompt's cache."""
    cfg = CONFIGS[kind]
    graph, params = _random_module(cfg)
    _check_against_full(graph, params, cfg, num_prompts=4 // group, group=group, step=step)


def test_wrong_positions_are_detected():
    """Control for the tests above: decoding at shifted positions gives clearly different logits."""
    cfg = CONFIGS["rope"]
    graph, params = _random_module(cfg)
    prompt_tokens, prompt_mask = _prompts(4)
    _, prompt = _prefill(graph, params, prompt_tokens, prompt_mask)
    token = np.array([[5], [9], [13], [17]])
    rows = _garbage_rows(cfg, 4, CAPACITY)
    right, _ = _decode(graph, params, token, np.asarray(prompt.length)[:, None], prompt, rows)
    wrong, _ = _decode(graph, params, token, np.asarray(prompt.length)[:, None] + 1, prompt, rows)
    assert np.abs(np.asarray(right) - np.asarray(wrong)).max() > 1e-2


@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_rollback_ignores_stale_slots(kind):
    """Decode 3 tokens per row, keep a different number per row (like speculative verification), then
    decode 3 other tokens: the logits are those of the new sequence, not of one with the stale tokens."""
    cfg = CONFIGS[kind]
    graph, params = _random_module(cfg)
    num_prompts, group = 2, 2
    B = num_prompts * group
    prompt_tokens, prompt_mask = _prompts(num_prompts, seed=5)
    rng = np.random.default_rng(11)
    first = rng.integers(1, cfg.vocab_size, (B, 3))
    second = rng.integers(1, cfg.vocab_size, (B, 3))
    kept = np.array([3, 1, 0, 2])

    _, prompt = _prefill(graph, params, prompt_tokens, prompt_mask)
    start = np.repeat(np.asarray(prompt.length), group)
    rows = _garbage_rows(cfg, B, CAPACITY)
    _, rows = _decode(graph, params, first, start[:, None] + np.arange(3), prompt, rows)
    rows = rows.replace(length=jnp.asarray(kept, jnp.int32))  # roll back to what was accepted
    positions = (start + kept)[:, None] + np.arange(3)
    got, rows = _decode(graph, params, second, positions, prompt, rows)
    got = np.asarray(got)

    sequences = [np.concatenate([first[b, : kept[b]], second[b]]) for b in range(B)]
    full, _ = _prefill(graph, params, *_full_batch(prompt_tokens, prompt_mask, sequences, group))
    np.testing.assert_allclose(got, np.asarray(full)[:, -3:], atol=TOL, rtol=0)

    # Control: had the stale tokens been kept, rows that rolled back would see different logits.
    stale = [np.concatenate([first[b], second[b]]) for b in range(B)]
    full_stale, _ = _prefill(graph, params, *_full_batch(prompt_tokens, prompt_mask, stale, group))
    rolled_back = kept < 3
    assert np.abs(got[rolled_back] - np.asarray(full_stale)[rolled_back, -3:]).max() > 1e-2

    # The overwritten cache keeps working: one more token after the new ones.
    rows = rows.replace(length=rows.length + 3)
    nxt = rng.integers(1, cfg.vocab_size, (B, 1))
    got2, _ = _decode(graph, params, nxt, positions[:, -1:] + 1, prompt, rows)
    sequences2 = [np.concatenate([s, nxt[b]]) for b, s in enumerate(sequences)]
    full2, _ = _prefill(graph, params, *_full_batch(prompt_tokens, prompt_mask, sequences2, group))
    np.testing.assert_allclose(np.asarray(got2)[:, 0], np.asarray(full2)[:, -1], atol=TOL, rtol=0)


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    return lambda family: H.checkpoint(family, tmp_path_factory)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3", "gpt2"])
def test_loaded_hf_model_cached_decode(hf, family):
    """The same check on a loaded HF checkpoint, and the cached logits also match torch."""
    directory, torch_model = hf(family)
    model = jaxsr.load_model(directory)
    cfg, group, N = model.config, 2, 6
    prompt_tokens, prompt_mask = _prompts(2, seed=3)
    rng = np.random.default_rng(4)
    generated = rng.integers(1, cfg.vocab_size, (2 * group, N))
    for step in (1, 3):
        _, cached = _cached_logits(
            model.graph, model.params, cfg, prompt_tokens, prompt_mask, generated, group, step
        )
        full_tokens, full_mask = _full_batch(prompt_tokens, prompt_mask, list(generated), group)
        expected = H.torch_logits(torch_model, full_tokens, full_mask)[:, -N:]
        np.testing.assert_allclose(cached, expected, atol=TOL, rtol=0)


# -- int8 caches (`DecoderConfig.kv_dtype`) -----------------------------------------------------------

INT8_TOL = 0.05
"""Cached vs full forward of one int8-cache model: both attend to int8 keys/values, so they agree to
float32 rounding (as TOL) except where a projection's rounding puts one element on the other side of an
int8 rounding boundary, one quantum apart: measured at most 0.016 (mean 5.6e-4) on these models. A key
read at a wrong slot, a scale misapplied or a garbage slot attended moves logits by O(1)."""
INT8_MEAN_TOL = 2e-3
"""The mean |difference| over all logits, for the same comparison (the float model's logits differ from
the int8 model's by a mean of 5e-3 to 8e-3)."""


def _int8(cfg: DecoderConfig) -> DecoderConfig:
    return dataclasses.replace(cfg, kv_dtype="int8")


def _garbage_int8_rows(cfg: DecoderConfig, rows: int, capacity: int, seed: int = 7) -> RowCache:
    """An empty int8 RowCache whose slots hold random int8 values and large scales (never attended)."""
    rng = np.random.default_rng(seed)
    ints = lambda *shape: jnp.asarray(rng.integers(-127, 128, shape), jnp.int8)
    scales = lambda: jnp.asarray(rng.uniform(0.5, 2.0, (rows, cfg.num_kv_heads, capacity)), jnp.float32)
    K, D, layers = cfg.num_kv_heads, cfg.head_dim, range(cfg.num_layers)
    keys = (rows, K, D, capacity) if key_slot_axis(D, True) == 3 else (rows, K, capacity, D)
    return RowCache(
        k=tuple(ints(*keys) for _ in layers),
        v=tuple(ints(rows, K, capacity, D) for _ in layers),
        length=jnp.zeros((rows,), jnp.int32),
        k_scale=tuple(scales() for _ in layers),
        v_scale=tuple(scales() for _ in layers),
    )


def _assert_int8_close(got: np.ndarray, expected: np.ndarray) -> None:
    diff = np.abs(np.asarray(got) - np.asarray(expected))
    assert diff.max() <= INT8_TOL and diff.mean() <= INT8_MEAN_TOL, (diff.max(), diff.mean())


@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(CONFIGS))
@pytest.mark.parametrize("step", [1, 3], ids=["T1", "T3"])
def test_int8_cached_decode_matches_the_int8_full_forward(kind, step):
    """2 prompts × 2 rows: prefill, then decode `step` tokens per call into int8 row caches whose free
    slots hold garbage; the logits are the int8 model's full forward's (which attends to its keys as
    stored), and the keys decoding writes are those the full forward stores for the same tokens."""
    cfg = _int8(CONFIGS[kind])
    graph, params = _random_module(cfg)
    prompt_tokens, prompt_mask = _prompts(2)
    B, N, group = 4, 6, 2
    generated = np.random.default_rng(100).integers(1, cfg.vocab_size, (B, N))
    logits_prompt, cached = _cached_logits(
        graph, params, cfg, prompt_tokens, prompt_mask, generated, group, step
    )
    full_tokens, full_mask = _full_batch(prompt_tokens, prompt_mask, list(generated), group)
    full, full_cache = _prefill(graph, params, full_tokens, full_mask)
    _assert_int8_close(cached, np.asarray(full)[:, -N:])
    for b in range(B):
        n = int(prompt_mask[b // group].sum())
        _assert_int8_close(logits_prompt[b // group, -n:], np.asarray(full)[b, -N - n : -N])

    _, prompt = _prefill(graph, params, prompt_tokens, prompt_mask)
    P, S = prompt_mask.shape
    assert prompt.k[0].dtype == jnp.int8 and prompt.k_scale[0].shape == (P, cfg.num_kv_heads, S)
    positions = np.repeat(np.asarray(prompt.length), group)[:, None] + np.arange(N)
    _, rows = _decode(graph, params, generated, positions, prompt, _garbage_rows(cfg, B, CAPACITY))
    for layer in range(cfg.num_layers):  # row slots [0, N) hold the last N positions of the full pass
        written = np.asarray(rows.k[layer][..., :N], np.int32)
        stored = np.asarray(full_cache.k[layer][..., -N:], np.int32)
        assert np.abs(written - stored).max() <= 1 and (written != stored).mean() < 0.01
        np.testing.assert_allclose(
            rows.v_scale[layer][..., :N], full_cache.v_scale[layer][..., -N:], rtol=1e-5
        )
    float_full, _ = _prefill(*_random_module(CONFIGS[kind]), full_tokens, full_mask)
    assert np.abs(np.asarray(float_full) - np.asarray(full)).max() > 1e-2  # the int8 model is another


@pytest.mark.slow
@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_int8_rollback_ignores_stale_slots(kind):
    """As test_rollback_ignores_stale_slots, with int8 caches: stale keys and their scales are never
    read after a row rolls back by its `length`."""
    cfg = _int8(CONFIGS[kind])
    graph, params = _random_module(cfg)
    prompt_tokens, prompt_mask = _prompts(2, seed=5)
    rng = np.random.default_rng(11)
    first, second = rng.integers(1, cfg.vocab_size, (4, 3)), rng.integers(1, cfg.vocab_size, (4, 3))
    kept = np.array([3, 1, 0, 2])
    _, prompt = _prefill(graph, params, prompt_tokens, prompt_mask)
    start = np.repeat(np.asarray(prompt.length), 2)
    _, rows = _decode(
        graph, params, first, start[:, None] + np.arange(3), prompt, _garbage_int8_rows(cfg, 4, 8)
    )
    rows = rows.replace(length=jnp.asarray(kept, jnp.int32))
    got, _ = _decode(graph, params, second, (start + kept)[:, None] + np.arange(3), prompt, rows)
    sequences = [np.concatenate([first[b, : kept[b]], second[b]]) for b in range(4)]
    full, _ = _prefill(graph, params, *_full_batch(prompt_tokens, prompt_mask, sequences, 2))
    _assert_int8_close(np.asarray(got), np.asarray(full)[:, -3:])
    stale = [np.concatenate([first[b], second[b]]) for b in range(4)]
    full_stale, _ = _prefill(graph, params, *_full_batch(prompt_tokens, prompt_mask, stale, 2))
    rolled_back = kept < 3
    assert np.abs(np.asarray(got)[rolled_back] - np.asarray(full_stale)[rolled_back, -3:]).max() > 0.1


@pytest.mark.parametrize("kind", ["float", "int8"])
def test_keys_stored_as_values_decode_as_transposed_keys(monkeypatch, kind):
    """A TPU's cache layout for float heads of 128 or more (`key_slot_axis` 2: keys stored as values
    are; int8 keys stay transposed), forced on CPU: its full forward gives the transposed layout's
    logits, and cached decoding of 1 and 3 tokens a call into row caches whose free slots hold garbage
    gives the full forward's."""
    cfg = dataclasses.replace(CONFIGS["rope"], head_dim=128)
    cfg = cfg if kind == "float" else _int8(cfg)
    graph, params = _random_module(cfg)
    tokens, mask = _prompts(2)
    transposed = np.asarray(_prefill(graph, params, tokens, mask)[0])
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    jax.clear_caches()  # traced anew, for a TPU's layout
    try:
        assert key_slot_axis(cfg.head_dim, False) == 2 and key_slot_axis(64, False) == 3
        assert key_slot_axis(cfg.head_dim, True) == 3
        _, prompt = _prefill(graph, params, tokens, mask)
        assert (prompt.k[0].shape == prompt.v[0].shape) == (kind == "float")
        np.testing.assert_allclose(_prefill(graph, params, tokens, mask)[0], transposed, atol=TOL, rtol=0)
        if kind == "float":
            for step in (1, 3):
                _check_against_full(graph, params, cfg, num_prompts=2, group=2, step=step)
        else:  # 2 prompts × 2 rows, 3 tokens a call, against the int8 model's full forward
            generated = np.random.default_rng(100).integers(1, cfg.vocab_size, (4, 6))
            _, cached = _cached_logits(graph, params, cfg, tokens, mask, generated, 2, 3)
            full_tokens, full_mask = _full_batch(tokens, mask, list(generated), 2)
            _assert_int8_close(cached, np.asarray(_prefill(graph, params, full_tokens, full_mask)[0])[:, -6:])
    finally:
        jax.clear_caches()
