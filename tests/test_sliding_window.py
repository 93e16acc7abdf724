"""Sliding attention windows (Mistral v0.1, Qwen2/3 with use_sliding_window, Gemma 2/3's local
layers): jaxsr reads the window
from config.json, keeps it through save_model, and applies it as transformers does (key k is visible to
query q iff k <= q and q - k < W) in prefill, in cached decoding one token at a time, in multi-token
decode calls (speculative verification) and so in generation, past the window.

The windowed families have W = 16 (mistral_window: every layer; qwen2_window: layer 1 only; gemma2:
layers 0 and 2 of 4; gemma3: layers 0-4 of 6)."""

from __future__ import annotations

import hf_fixtures as H
import jax
import numpy as np
import pytest
import test_decoder_cache as cached
import torch
import transformers
from tiny import tiny_model

import jaxsr
from jaxsr.decoding.loop import prefill
from jaxsr.decoding.steps import forward
from jaxsr.loading.hf_config import decoder_config_from_hf, hf_config_from_decoder
from jaxsr.models.cache import RowCache
from jaxsr.text import left_pad

TOL = 1e-4
"""As test_parity: two float32 implementations of logits of O(1–10)."""
WINDOWED = ["mistral_window", "qwen2_window", "gemma2", "gemma3"]


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        (transformers.MistralConfig(sliding_window=4096), (4096, 0)),
        (transformers.MistralConfig(sliding_window=None), (None, 0)),
        (transformers.Qwen2Config(use_sliding_window=False, sliding_window=4096), (None, 0)),
        (
            transformers.Qwen2Config(use_sliding_window=True, sliding_window=512, max_window_layers=20),
            (512, 20),
        ),
        (
            transformers.Qwen3Config(use_sliding_window=True, sliding_window=256, max_window_layers=0),
            (256, 0),
        ),
        (transformers.LlamaConfig(), (None, 0)),
    ],
)
def test_the_window_and_its_first_layer_are_read_as_transformers_applies_them(config, expected):
    cfg = decoder_config_from_hf(config.to_dict())
    window, first = expected
    layers = tuple(range(first, config.num_hidden_layers)) if window else ()
    assert (cfg.sliding_window, cfg.sliding_layers) == (window, layers)
    assert cfg.context == config.max_position_embeddings  # the window does not shorten the context
    saved = hf_config_from_decoder(cfg)
    assert decoder_config_from_hf(saved) == cfg
    reread = type(config)(**saved)
    assert getattr(reread, "layer_types", None) == getattr(config, "layer_types", None)


@pytest.fixture(scope="module")
def windowed(tmp_path_factory):
    """family → (checkpoint directory, jaxsr model, torch model)."""

    def load(family):
        directory, torch_model = H.checkpoint(family, tmp_path_factory)
        lm = jaxsr.load_model(directory, cache=False)
        assert lm.config.sliding_window == 16
        return directory, lm, torch_model

    return load


def _max_diff_on_real(a, b, mask) -> float:
    real = np.asarray(mask).astype(bool)
    return float(np.abs(np.asarray(a)[real] - np.asarray(b)[real]).max())


def _drop_window(config: dict) -> None:
    """Full attention in every layer: no window, or for Gemma (whose local layers keep their own RoPE
    base in Gemma 3) a window as long as the context."""
    if config["model_type"].startswith("gemma"):
        config["sliding_window"] = config["max_position_embeddings"]
        return
    config["sliding_window"] = None
    config["use_sliding_window"] = False
    config.pop("layer_types", None)


@pytest.mark.parametrize("family", WINDOWED)
def test_logits_of_a_left_padded_batch_longer_than_the_window_match_torch(windowed, family, tmp_path):
    directory, lm, torch_model = windowed(family)
    W = lm.config.sliding_window
    tokens, mask = H.left_padded_batch(0, lengths=(W + 8, W + 3, W, 9, 1))
    expected = H.torch_logits(torch_model, tokens, mask)
    assert _max_diff_on_real(lm.logits(tokens, mask), expected, mask) < TOL

    # not vacuous: the same weights with full attention agree inside the window only
    full = jaxsr.load_model(H.copy_checkpoint(directory, tmp_path / "full", _drop_window), cache=False)
    assert full.config.sliding_window in (None, full.config.context)
    full_logits = full.logits(tokens, mask)
    inside = mask.astype(bool) & (np.cumsum(mask, axis=1) <= W)
    assert _max_diff_on_real(full_logits, expected, inside) < TOL
    assert _max_diff_on_real(full_logits, expected, mask.astype(bool) & ~inside) > 1e-2


# -- cached decoding: prompts shorter than the window, rows decoded past it --------------------------

G = 2
"""Rows per prompt: the rows of a prompt share its cache and decode different tokens."""
PROMPT_LENGTHS = (10, 7)
PROMPT_SLOTS = 12
"""The prompt buffer: both prompts left-padded (by 2 and 5 slots)."""
_forward = jax.jit(forward, static_argnums=0)


def _prompt_cache(lm: jaxsr.Model, seed: int):
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(1, H.VOCAB, n).tolist() for n in PROMPT_LENGTHS]
    tokens, mask = left_pad(prompts, len(prompts), PROMPT_SLOTS)
    _, cache = prefill(lm.graph, lm.params, tokens, mask)
    return prompts, cache


def _garbage_rows(lm: jaxsr.Model, rows: int, capacity: int) -> RowCache:
    """A row cache whose unwritten slots hold large random values (never to be attended to)."""
    rng = np.random.default_rng(7)
    cfg = lm.config
    noise = lambda *shape: (10.0 * rng.standard_normal(shape)).astype(np.float32)
    K, D, layers = cfg.num_kv_heads, cfg.head_dim, range(cfg.num_layers)
    return RowCache(
        k=tuple(noise(rows, K, D, capacity) for _ in layers),
        v=tuple(noise(rows, K, capacity, D) for _ in layers),
        length=np.zeros((rows,), np.int32),
    )


def _torch_continuations(torch_model, prompts, continuations) -> list[np.ndarray]:
    """Torch logits [len(c), V] of row b's continuation c (after its prompt, prompts[b // G]), all rows
    in one left-padded full forward."""
    seqs = [prompts[b // G] + list(c) for b, c in enumerate(continuations)]
    width = max(map(len, seqs))
    tokens, mask = left_pad(seqs, len(seqs), width)
    logits = H.torch_logits(torch_model, tokens.astype(np.int64), mask.astype(np.int64))
    return [logits[b, width - len(c) :] for b, c in enumerate(continuations)]


@pytest.mark.slow  # 4 windowed HF families: 24 single-token decode calls each, against torch
@pytest.mark.parametrize("family", WINDOWED)
def test_decoding_token_by_token_across_the_window_matches_torch(windowed, family):
    """From positions 10 and 7 to 33 and 30: past W (the first prompt keys leave the window) and past
    L + W (the row's own first keys leave it too)."""
    _, lm, torch_model = windowed(family)
    prompts, cache = _prompt_cache(lm, seed=1)
    B, N = G * len(prompts), 24
    generated = np.random.default_rng(2).integers(1, H.VOCAB, (B, N))
    rows = _garbage_rows(lm, B, N)
    got = []
    for n in range(N):
        index = np.full((B, 1), n, np.int32)
        logits, rows = _forward(lm.graph, lm.params, generated[:, n : n + 1], index, cache, rows)
        got.append(np.asarray(logits)[:, 0])
    got = np.stack(got, axis=1)
    expected = _torch_continuations(torch_model, prompts, generated)
    for b in range(B):
        np.testing.assert_allclose(got[b], expected[b], atol=TOL, rtol=0)
    assert np.abs(got[0] - got[1]).max() > 0.1  # rows of one prompt differ


@pytest.mark.slow  # per family and width: compiles 24- and T-token decode calls, against torch
@pytest.mark.parametrize("T", [3, 5])
@pytest.mark.parametrize("family", WINDOWED)
def test_a_multi_token_decode_call_across_the_window_matches_torch(windowed, family, T):
    """T tokens per row in one call (speculative verification, T = γ + 1) from a different slot per row
    after rolling back, their queries straddling position W (15 | 16), then far past it."""
    _, lm, torch_model = windowed(family)
    prompts, cache = _prompt_cache(lm, seed=3)
    B = G * len(prompts)
    rng = np.random.default_rng(4)
    first = rng.integers(1, H.VOCAB, (B, 24))
    rows = _garbage_rows(lm, B, 32)
    _, rows = _forward(lm.graph, lm.params, first, np.broadcast_to(np.arange(24), (B, 24)), cache, rows)
    lengths = np.repeat(PROMPT_LENGTHS, G)
    for starts in (np.array([4, 5, 7, 8]), np.array([18, 20, 21, 19])):
        if starts[0] < 10:
            positions = (lengths + starts)[:, None] + np.arange(T)
            assert ((positions == 15).any(1) & (positions == 16).any(1)).all()
        new = rng.integers(1, H.VOCAB, (B, T))
        index = starts[:, None] + np.arange(T)
        logits, _ = _forward(lm.graph, lm.params, new, index, cache, rows)
        kept = [np.concatenate([first[b, : starts[b]], new[b]]) for b in range(B)]
        expected = _torch_continuations(torch_model, prompts, kept)
        for b in range(B):
            np.testing.assert_allclose(np.asarray(logits)[b], expected[b][-T:], atol=TOL, rtol=0)


# -- generation ----------------------------------------------------------------------------------

GREEDY = jaxsr.SamplingConfig(temperature=0)


@pytest.mark.slow  # per pair: compiles generate and SD of windowed HF models, 24 tokens, and torch's
@pytest.mark.parametrize(("family", "draft"), [WINDOWED[:2], WINDOWED[1::-1], ("gemma3", "gemma2")])
def test_greedy_generation_past_the_window_matches_torch_generate(windowed, family, draft):
    """jaxsr.generate and greedy speculative decoding (γ = 4: verify calls of 5 tokens, the draft
    windowed as well) give transformers' greedy tokens, 24 past prompts of 10 and 5."""
    _, lm, torch_model = windowed(family)
    _, draft_lm, _ = windowed(draft)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, H.VOCAB, n).tolist() for n in (10, 5)]
    N = 24
    ours = jaxsr.generate(lm, prompts, max_new_tokens=N, sampling=GREEDY)
    speculative = jaxsr.speculative_decode(lm, draft_lm, prompts, gamma=4, max_new_tokens=N, sampling=GREEDY)
    for prompt, result, spec in zip(prompts, ours, speculative, strict=True):
        with torch.no_grad():
            out = torch_model.generate(
                torch.as_tensor([prompt]), max_new_tokens=N, do_sample=False, eos_token_id=2, pad_token_id=0
            )
        theirs = out[0, len(prompt) :].tolist()
        sample = result.samples[0]
        assert sample.token_ids + [2] * sample.finished == theirs
        assert len(prompt) + len(theirs) > lm.config.sliding_window + 8  # well past the window
        assert spec.samples[0].token_ids == sample.token_ids


@pytest.mark.slow  # compiles greedy decoding of a windowed tiny model and two full forwards
def test_a_tiny_windowed_model_generates_past_its_window():
    lm = tiny_model(sliding_window=8)
    assert lm.config.context == lm.config.max_position_embeddings
    prompt = [1, 2, 3, 4, 5]
    [result] = jaxsr.generate(lm, [prompt], max_new_tokens=12, sampling=GREEDY)
    ids = result.samples[0].token_ids
    assert len(ids) == 12
    logits = np.asarray(lm.logits([prompt + ids]))[0]
    assert ids == logits[len(prompt) - 1 : -1].argmax(-1).tolist()  # greedy from full forwards
    full = np.asarray(tiny_model().logits([prompt + ids]))[0]  # the same weights, no window
    np.testing.assert_allclose(full[:8], logits[:8], atol=TOL, rtol=0)
    assert np.abs(full[8:] - logits[8:]).max() > 1e-2


# -- int8 caches ---------------------------------------------------------------------------------------

INT8_VS_FLOAT = 0.1
"""int8-cache logits against torch's float32 ones on these checkpoints: measured at most 0.055 (Gemma 2) and
0.037 (Mistral)."""


@pytest.mark.slow  # per family: 24 int8-cache decode calls, a verify call, full forwards and torch's
@pytest.mark.parametrize("family", ["gemma2", "mistral_window"])
def test_int8_caches_decode_across_the_window_as_the_int8_full_forward(windowed, family):
    """Gemma 2 (soft-capped, layers 0 and 2 windowed) and Mistral (every layer) with int8 caches:
    decoding token by token past the window, then 5 tokens in one call after rolling back to another
    slot per row (speculative verification), gives the int8 model's full-forward logits (to
    test_decoder_cache.INT8_TOL: both attend to the keys as stored), close to torch's float ones."""
    _, lm, torch_model = windowed(family)
    lm8 = lm.with_kv_dtype("int8")
    prompts, cache = _prompt_cache(lm8, seed=1)
    B, N, T = G * len(prompts), 24, 5
    rng = np.random.default_rng(2)
    generated, new = rng.integers(1, H.VOCAB, (B, N)), rng.integers(1, H.VOCAB, (B, T))
    rows = cached._garbage_rows(lm8.config, B, N + T)
    got = []
    for n in range(N):
        logits, rows = _forward(
            lm8.graph, lm8.params, generated[:, n : n + 1], np.full((B, 1), n), cache, rows
        )
        got.append(np.asarray(logits)[:, 0])
    starts = np.array([18, 20, 21, 19])
    verified, _ = _forward(lm8.graph, lm8.params, new, starts[:, None] + np.arange(T), cache, rows)
    continuations = [*generated, *(np.concatenate([generated[b, : starts[b]], new[b]]) for b in range(B))]
    seqs = [prompts[(b % B) // G] + list(c) for b, c in enumerate(continuations)]
    tokens, mask = left_pad(seqs, len(seqs), max(map(len, seqs)))
    full = np.asarray(lm8.logits(tokens, mask))
    cached._assert_int8_close(np.stack(got, axis=1), full[:B, -N:])
    cached._assert_int8_close(np.asarray(verified), full[B:, -T:])
    torch_float = np.stack(_torch_continuations(torch_model, prompts, list(generated)))
    assert np.abs(np.stack(got, axis=1) - torch_float).max() < INT8_VS_FLOAT
