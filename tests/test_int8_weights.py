"""int8 weights (`DecoderConfig.weights_dtype="int8"`, `jaxsr.load_model(..., weights_dtype="int8")`).

The attention and MLP projections, the token embedding and the output layer are stored as int8 with a
scale per output channel; products take the int8 matrix converted to the activations' dtype and scale
their results. Checked here: the quantizer and the product arithmetic, the parameters' layout, bytes and
shardings, exact sampling of the quantized model by speculative and speculative contrastive decoding
(chi-square, greedy token equality), loading (checkpoints, GGUF Q8_0 tensors, reward models, meshes),
the parameter cache, saving, the job key and plans, and the quality of the quantized model's logits
against the float model's (tiny random models, and SmolLM2 on held-out responses).
"""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path

import gguf
import hf_fixtures as H
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import test_exactness as exactness
import test_int8_kv as int8_kv
from flax import nnx
from jax.sharding import PartitionSpec
from test_gguf import write_gguf
from test_int8_kv import compare, heldout_batch, teacher_forced
from test_plans import needs_libtpu
from test_speculative import perturbed
from tiny import tiny_config, tiny_model

import jaxsr
from jaxsr.decoding import loop
from jaxsr.jobs import methods
from jaxsr.jobs.config import LATER_KEYS, load_job_config
from jaxsr.loading import api, param_cache
from jaxsr.models.decoder import QUANTIZED, Decoder, quantized_axes, scale_path
from jaxsr.models.layers import contract, quantize_weight
from jaxsr.models.model import Model
from jaxsr.plans import Batch, abstract_model, bytes_per_device, hlo, plan_batch, target_mesh
from jaxsr.plans import target as plan_target
from jaxsr.plans.compiled import abstract_tokens
from jaxsr.plans.job import job_sampler
from jaxsr.sharding import PARAM_AXES, make_mesh, shard_model
from jaxsr.text import left_pad

GREEDY = jaxsr.SamplingConfig(temperature=0)
SAMPLING = jaxsr.SamplingConfig(temperature=1.0, top_k=20)
PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8], [9]]
BAD_VALUES = ["int4", "float16", 8, ""]


def flat(model: Model) -> dict[tuple, jax.Array]:
    """A model's parameters by path."""
    return {path: leaf.get_value() for path, leaf in nnx.to_flat_state(model.params)}


# -- the quantizer and the product arithmetic --------------------------------------------------------


@pytest.mark.parametrize(("shape", "contracted"), [((16, 3, 5), (0,)), ((3, 5, 16), (0, 1)), ((7, 9), (1,))])
def test_quantize_weight_keeps_each_output_channel_within_half_a_step(shape, contracted):
    rng = np.random.default_rng(0)
    out_shape = tuple(n for i, n in enumerate(shape) if i not in contracted)
    w = rng.standard_normal(shape).astype(np.float32)
    w = w * np.expand_dims(rng.uniform(1e-3, 10, out_shape), contracted).astype(np.float32)
    first = np.zeros(out_shape, bool)
    first.flat[0] = True
    w = np.where(np.expand_dims(first, contracted), np.float32(0), w)  # one all-zero channel
    q, scale = quantize_weight(w, contracted)
    assert isinstance(q, np.ndarray) and q.dtype == np.int8 and scale.dtype == np.float32
    assert scale.shape == out_shape
    step = np.expand_dims(scale, contracted)
    assert (np.abs(q.astype(np.float32) * step - w) <= 0.5 * step * (1 + 1e-5)).all()
    channel_max = np.abs(q).max(axis=contracted)
    assert (channel_max[scale > 0] == 127).all() and (scale == 0).sum() == 1 and channel_max[scale == 0] == 0
    q_jax, scale_jax = quantize_weight(jnp.asarray(w), contracted)  # XLA divides by 127 its own way
    assert isinstance(q_jax, jax.Array) and isinstance(scale_jax, jax.Array)
    np.testing.assert_allclose(scale_jax, scale, rtol=1e-6)
    assert np.abs(np.asarray(q_jax, np.int32) - q).max() <= 1


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize(
    ("spec", "x_shape", "w_shape", "contracted"),
    [("btd,dhk->bthk", (2, 3, 16), (16, 4, 8), (0,)), ("bthk,hkd->btd", (2, 3, 4, 8), (4, 8, 16), (0, 1))],
)
def test_contract_is_the_product_with_the_weight_the_int8_entries_stand_for(
    spec, x_shape, w_shape, contracted, dtype
):
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal(x_shape), dtype)
    q, scale = quantize_weight(rng.standard_normal(w_shape).astype(np.float32), contracted)
    got = contract(spec, x, nnx.Param(jnp.asarray(q)), nnx.Param(jnp.asarray(scale, dtype)))
    assert got.dtype == dtype
    dequantized = q.astype(np.float32) * np.expand_dims(
        np.asarray(jnp.asarray(scale, dtype), np.float32), contracted
    )
    expected = np.einsum(spec, np.asarray(x, np.float32), dequantized)
    tolerance = 1e-5 if dtype == jnp.float32 else 2e-2  # bfloat16: the result's one rounding
    np.testing.assert_allclose(np.asarray(got, np.float32), expected, atol=tolerance, rtol=tolerance)


# -- layout, bytes and shardings -----------------------------------------------------------------------


def _output_axes(path: tuple) -> tuple:
    """The logical axes of the matrix at `path` its products keep (its output channels)."""
    names = tuple(map(str, path))
    axes = PARAM_AXES.get(names[-2:], PARAM_AXES.get(names[-1:]))
    return tuple(a for i, a in enumerate(axes) if i not in quantized_axes(path))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("tied", [False, True])
def test_every_matrix_is_int8_beside_a_scale_over_its_output_channels(dtype, tied):
    """Each matrix `QUANTIZED` names is int8 with a scale in the parameters' dtype over its output axes,
    which the sharding rules table splits as it splits those axes of the matrix; everything else keeps
    the parameters' dtype."""
    model = Model.from_module(Decoder(tiny_config(tie_word_embeddings=tied), dtype=dtype, rngs=nnx.Rngs(0)))
    int8 = model.with_weights_dtype("int8")
    assert int8.config.weights_dtype == "int8" and int8.dtype == dtype
    params, floats = flat(int8), flat(model)
    matrices = [path for path in floats if quantized_axes(path) is not None]
    assert {tuple(map(str, p[-2:] if p[0] == "blocks" else p)) for p in matrices} == set(QUANTIZED) - (
        {("lm_head",)} if tied else set()
    )
    assert set(params) == set(floats) | {scale_path(p) for p in matrices}
    for path, x in params.items():
        if path in matrices:
            scale = params[scale_path(path)]
            assert x.dtype == jnp.int8 and x.shape == floats[path].shape, path
            assert scale.shape == tuple(n for i, n in enumerate(x.shape) if i not in quantized_axes(path))
            names = tuple(map(str, scale_path(path)))
            assert PARAM_AXES.get(names[-2:], PARAM_AXES.get(names[-1:])) == _output_axes(path), path
        elif path not in map(scale_path, matrices):
            np.testing.assert_array_equal(x, floats[path])  # norms (and biases) as they were
        assert x.dtype in (jnp.int8, dtype), path


def test_every_rules_table_entry_names_one_axis_a_dimension():
    """Each entry is a tuple of logical axes (the MLP biases' were strings, `("mlp")`, so the biases of
    an mlp_bias model stayed replicated); the gate and up biases split over `model` with their columns."""
    assert all(isinstance(axes, tuple) for axes in PARAM_AXES.values())
    sharded = shard_model(tiny_model(mlp_bias=True), make_mesh(data=4, model=2))
    mlp = flat(sharded)
    for name in ("gate_bias", "up_bias"):
        assert tuple(mlp[("blocks", 0, "mlp", name)].sharding.spec) == ("model",), name


def _parameter_bytes(model: Model) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(model.params))


@pytest.mark.slow  # per dtype: builds and quantizes a 2-layer decoder of SmolLM2's widths
@pytest.mark.parametrize(("dtype", "ratio"), [(jnp.float32, 3.97), (jnp.bfloat16, 1.99)])
def test_int8_weights_take_a_byte_a_weight_and_the_scales(dtype, ratio):
    """Bytes: every matrix a byte an entry plus its scales in the parameters' dtype; the rest as it was.
    For a decoder of SmolLM2's widths with 2 layers, 3.97× fewer bytes than float32 and 1.99× fewer than
    bfloat16 (the norms stay)."""
    cfg = tiny_config(
        vocab_size=4096, hidden_size=576, num_heads=9, num_kv_heads=3, head_dim=64, intermediate_size=1536
    )
    model = Model.from_module(Decoder(cfg, dtype=dtype, rngs=nnx.Rngs(0)))
    int8 = model.with_weights_dtype("int8")
    size = jnp.dtype(dtype).itemsize
    matrices = [x for path, x in flat(model).items() if quantized_axes(path) is not None]
    scales = sum(
        x.size // np.prod([x.shape[i] for i in quantized_axes(p)])
        for p, x in flat(model).items()
        if quantized_axes(p) is not None
    )
    others = _parameter_bytes(model) - sum(x.nbytes for x in matrices)
    assert _parameter_bytes(int8) == sum(x.size for x in matrices) + scales * size + others
    assert _parameter_bytes(model) / _parameter_bytes(int8) == pytest.approx(ratio, abs=0.005)


@pytest.mark.slow  # quantizes and dequantizes a tiny model, compiles logits of 3 variants
def test_dequantized_weights_give_the_int8_models_logits_and_values_are_checked():
    lm = tiny_model(seed=1)
    int8 = lm.with_weights_dtype("int8")
    back = int8.with_weights_dtype(None)
    assert (
        back.config == lm.config
        and back.with_weights_dtype(None) is back
        and int8.with_weights_dtype("int8") is int8
    )
    assert {x.dtype for x in jax.tree.leaves(back.params)} == {jnp.dtype(jnp.float32)}
    tokens = np.random.default_rng(0).integers(0, 64, (3, 20))
    np.testing.assert_allclose(back.logits(tokens), int8.logits(tokens), atol=2e-5, rtol=0)
    assert np.abs(np.asarray(lm.logits(tokens)) - np.asarray(int8.logits(tokens))).max() > 1e-3
    for bad in BAD_VALUES:
        with pytest.raises(
            ValueError,
            match=re.escape("weights_dtype: expected None (the model's dtype) or one of ('int8',)"),
        ):
            lm.with_weights_dtype(bad)


@pytest.mark.parametrize("bad", BAD_VALUES)
def test_a_bad_weights_dtype_is_refused_before_anything_loads(bad):
    expected = re.escape("weights_dtype: expected None (the model's dtype) or one of ('int8',)")
    with pytest.raises(ValueError, match=expected):
        jaxsr.load_model("/no/such/model", weights_dtype=bad)
    with pytest.raises(ValueError, match=expected):
        jaxsr.load_reward_model("/no/such/model", weights_dtype=bad)
    with pytest.raises(ValueError, match="weights_dtype: expected"):
        load_job_config(None, [f"weights_dtype={bad}"])
    with pytest.raises(ValueError, match="weights_dtype: expected"):
        tiny_config(weights_dtype=bad)


# -- quality: int8 weights against the float model, teacher-forced through the caches -----------------

QUALITY = dict(max=0.15, mean=0.02, argmax=0.97, ppl=0.02)
"""Tiny random models, 300 random tokens after 4 prompts, 20 a call: measured max |Δlogit| 0.071 (tiny)
and 0.062 (contextual), mean 0.010 and 0.008, argmax agreement 0.989 and 0.988, perplexity within
0.07%; with int8 caches as well (both models) the same to two digits."""


@pytest.mark.slow  # per model and cache: 300 tokens teacher-forced, float and int8 weights
@pytest.mark.parametrize("kv_dtype", [None, "int8"])
@pytest.mark.parametrize("model", ["tiny", "contextual"])
def test_int8_weight_logits_stay_close_to_the_float_models_over_300_tokens(model, kv_dtype):
    lm = tiny_model(seed=1) if model == "tiny" else exactness.contextual_model(1, vocab_size=64)
    lm = lm.with_kv_dtype(kv_dtype)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(1, 64, n).tolist() for n in (12, 7, 3, 9)]
    tokens, mask = left_pad(prompts, 4, 12)
    continuation = rng.integers(1, 64, (4, 300))
    z = {w: teacher_forced(lm.with_weights_dtype(w), tokens, mask, continuation, 20) for w in (None, "int8")}
    every = np.ones(continuation.shape, bool)
    got = compare(z[None], z["int8"], continuation, every, every)
    assert 0 < got["max"] <= QUALITY["max"] and got["mean"] <= QUALITY["mean"], got
    assert got["argmax"] >= QUALITY["argmax"], got
    assert got["ppl"][1] == pytest.approx(got["ppl"][0], rel=QUALITY["ppl"]), got


CHECKPOINT_QUALITY = dict(max=0.5, mean=0.05, argmax=0.95, ppl=0.02)
"""The tiny random Llama 2, Qwen2 (tied, biased projections) and Gemma 2 (soft-caps, sliding windows)
checkpoints of the parity tests, 200 random tokens after 4 prompts, 20 a call, against their float
models. Measured, int8 cache: max |Δlogit| 0.025 / 0.115 / 0.062, mean 0.0023 / 0.0078 / 0.0070,
argmax agreement 0.996 / 0.995 / 0.998; int8 weights: max 0.110 / 0.373 / 0.220, mean 0.013 / 0.035 /
0.026, argmax 0.979 / 0.978 / 0.998 (Llama 2 / Qwen2 / Gemma 2); perplexity within 0.23% in all six."""


@pytest.mark.slow  # 3 tiny HF families × int8 caches or weights, 200 tokens teacher-forced each
@pytest.mark.parametrize("family", ["llama2", "qwen2", "gemma2"])
@pytest.mark.parametrize("quantized", ["kv", "weights"])
def test_int8_logits_of_the_tiny_hf_checkpoints_stay_close_to_float(family, quantized, tmp_path_factory):
    directory, _ = H.checkpoint(family, tmp_path_factory)
    lm = jaxsr.load_model(str(directory))
    int8 = lm.with_kv_dtype("int8") if quantized == "kv" else lm.with_weights_dtype("int8")
    rng = np.random.default_rng(2)
    prompts = [rng.integers(3, H.VOCAB, n).tolist() for n in (12, 7, 3, 9)]
    tokens, mask = left_pad(prompts, 4, 12)
    continuation = rng.integers(3, H.VOCAB, (4, 200))
    z = [teacher_forced(m, tokens, mask, continuation, 20) for m in (lm, int8)]
    every = np.ones(continuation.shape, bool)
    got = compare(*z, continuation, every, every)
    assert 0 < got["max"] <= CHECKPOINT_QUALITY["max"] and got["mean"] <= CHECKPOINT_QUALITY["mean"], got
    assert got["argmax"] >= CHECKPOINT_QUALITY["argmax"], got
    assert got["ppl"][1] == pytest.approx(got["ppl"][0], rel=CHECKPOINT_QUALITY["ppl"]), got


SMOLLM2_QUALITY = dict(max=4.0, mean=0.3, argmax=0.93, ppl=0.02)
"""SmolLM2-135M (its GGUF: Q4_1 layers, a Q8_0 embedding), 4 chat sequences, 16 tokens prefilled and up
to 245 decoded 8 a call (432 positions, 149 of them response tokens), int8 weights against the GGUF's
dequantized weights: measured max |Δlogit| 3.22, mean 0.218, argmax agreement 0.951, response perplexity
8.806 → 8.858 (+0.6%). Leaving the embedding (the tied output layer) in float32: max 3.35, mean 0.208,
argmax 0.954, +0.7%, for 210 MiB of parameters instead of 129 (float32: 513). Both with int8 caches:
max 4.60, mean 0.261, argmax 0.933, 8.851 → 8.837. The shipped draft (bfloat16 safetensors, 84% of it
the embedding) on the same positions: max 0.84, mean 0.064, argmax 0.981, perplexity −0.6%, 60 → 15 MiB
(its embedding left in float32: mean 0.008, argmax 0.995, 51 MiB)."""


@pytest.mark.slow
def test_smollm2_int8_weights_keep_perplexity_on_heldout_responses_within_two_percent():
    """Also: the GGUF's Q8_0 token embedding is quantized again per row, within half a row's step."""
    from jaxsr.loading.gguf import smollm2_path

    lm = jaxsr.load_model(smollm2_path(), cache=False)
    int8 = jaxsr.load_model(smollm2_path(), weights_dtype="int8", cache=False)
    reader = gguf.GGUFReader(smollm2_path())
    assert {t.name: t.tensor_type.name for t in reader.tensors}["token_embd.weight"] == "Q8_0"
    table, q, scale = (
        np.asarray(m.params[k].get_value())
        for m, k in ((lm, "embed"), (int8, "embed"), (int8, "embed_scale"))
    )
    assert (np.abs(q * scale[:, None] - table) <= 0.5 * scale[:, None] * (1 + 1e-5)).all()
    assert _parameter_bytes(lm) / _parameter_bytes(int8) == pytest.approx(3.97, abs=0.01)
    prefix, continuation, valid, scored = heldout_batch()
    z = [teacher_forced(m, prefix, np.ones_like(prefix), continuation, 8) for m in (lm, int8)]
    got = compare(*z, continuation, valid, scored)
    assert got["max"] <= SMOLLM2_QUALITY["max"] and got["mean"] <= SMOLLM2_QUALITY["mean"], got
    assert got["argmax"] >= SMOLLM2_QUALITY["argmax"], got
    assert got["ppl"][1] == pytest.approx(got["ppl"][0], rel=SMOLLM2_QUALITY["ppl"]), got


# -- exact sampling of the quantized model -----------------------------------------------------------


@pytest.fixture(scope="module")
def target() -> Model:
    return tiny_model(seed=0).with_weights_dtype("int8")


@pytest.fixture(scope="module")
def draft() -> Model:
    return perturbed(tiny_model(seed=0), 0.3, seed=1).with_weights_dtype("int8")  # agrees in part


# test_int8_kv's greedy checks, on this module's `target` and `draft` (int8 weights, float caches): greedy
# SD is greedy decoding of the quantized target (the argmax of its full forward), greedy SCD is its CD
test_greedy_speculative_decoding_is_greedy_decoding_of_the_int8_weight_target = (
    int8_kv.test_greedy_speculative_decoding_is_greedy_decoding_of_the_int8_target
)
test_greedy_speculative_contrastive_decoding_is_contrastive_decoding_with_int8_weights = (
    int8_kv.test_greedy_speculative_contrastive_decoding_is_int8_contrastive_decoding
)


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "gamma"), [("SD", 3), ("SCD", 3)])
def test_empirical_joint_matches_the_exact_int8_target_joint(monkeypatch, kind, gamma):
    """test_exactness's chi-square test with int8 weights in both models: 10^5 rows of speculative
    (contrastive) decoding sample exactly the joint of the quantized target (of the contrast of the
    quantized models), enumerated from their full forward passes."""
    models = tuple(m.with_weights_dtype("int8") for m in exactness.models())
    monkeypatch.setattr(exactness, "models", lambda: models)
    cached = (exactness.decode, exactness.exact_joint)  # they may hold the float models' results
    for function in cached:
        function.cache_clear()
    try:
        exactness.test_empirical_joint_matches_the_exact_target_joint(
            kind, gamma, "two prompts, mixed budgets, padding rows"
        )
    finally:
        for function in cached:
            function.cache_clear()


@pytest.mark.slow  # compiles int8-weight decoding on one device and on a (4, 2) mesh
def test_int8_weight_decoding_is_the_same_on_a_mesh_and_scales_are_split_like_their_matrices(target):
    kwargs = dict(max_new_tokens=12, num_samples=8, sampling=SAMPLING, seed=3)
    reference = jaxsr.generate(target, PROMPTS, **kwargs)
    sharded = shard_model(target, make_mesh(data=4, model=2))
    on_mesh = jaxsr.generate(sharded, PROMPTS, **kwargs)
    tokens_of = lambda results: [[s.token_ids for s in r.samples] for r in results]
    assert tokens_of(on_mesh) == tokens_of(reference)
    _assert_scales_split_like_their_matrices(sharded)


def _assert_scales_split_like_their_matrices(model: Model) -> None:
    """Every scale is split over `model` exactly where its matrix's output axes are."""
    params = flat(model)
    split = 0
    for path, x in params.items():
        contracted = quantized_axes(path)
        if contracted is None:
            continue
        spec = tuple(x.sharding.spec) + (None,) * (x.ndim - len(x.sharding.spec))
        scale_spec = params[scale_path(path)].sharding.spec
        kept = tuple(s for i, s in enumerate(spec) if i not in contracted)
        assert tuple(scale_spec) + (None,) * (len(kept) - len(scale_spec)) == kept, path
        split += "model" in kept
    assert split >= 5  # embedding, q, k, v, gate, up (heads and columns over model=2)


# -- loading, the parameter cache and saving ---------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A tiny random Llama checkpoint with a byte tokenizer."""
    directory = tmp_path_factory.mktemp("byte-llama")
    return H.build_llama_with_tokenizer("LlamaForCausalLM", H.byte_tokenizer(), directory, 21)


def _assert_same_params(a: Model, b: Model) -> None:
    pa, pb = flat(a), flat(b)
    assert pa.keys() == pb.keys()
    for path, x in pa.items():
        assert x.dtype == pb[path].dtype and x.sharding == pb[path].sharding, path
        np.testing.assert_array_equal(x, pb[path], err_msg=str(path))


def test_load_model_quantizes_the_checkpoint_as_the_float_model_quantizes(checkpoint):
    """From the checkpoint's values, whatever the load dtype: in bfloat16 the same int8 entries, the
    scales rounded to bfloat16."""
    lm = jaxsr.load_model(checkpoint, cache=False)
    int8 = jaxsr.load_model(checkpoint, weights_dtype="int8", cache=False)
    assert int8.config.weights_dtype == "int8" and int8.dtype == np.float32
    _assert_same_params(int8, lm.with_weights_dtype("int8"))
    bf16 = jaxsr.load_model(checkpoint, dtype="bfloat16", weights_dtype="int8", cache=False)
    assert bf16.dtype == jnp.bfloat16
    for path, x in flat(bf16).items():
        np.testing.assert_array_equal(x, flat(int8)[path].astype(x.dtype), err_msg=str(path))
    tokens = np.random.default_rng(0).integers(0, lm.config.vocab_size, (2, 12))
    diff = np.abs(np.asarray(int8.logits(tokens)) - np.asarray(lm.logits(tokens)))
    assert 0 < diff.max() < 0.2


def test_load_model_places_the_scales_on_the_mesh_with_their_matrices(checkpoint):
    mesh = make_mesh(data=4, model=2)
    int8 = jaxsr.load_model(checkpoint, weights_dtype="int8", cache=False)
    sharded = jaxsr.load_model(checkpoint, weights_dtype="int8", mesh=mesh, cache=False)
    _assert_same_params(sharded, shard_model(int8, mesh))
    _assert_scales_split_like_their_matrices(sharded)
    tokens = np.random.default_rng(0).integers(0, int8.config.vocab_size, (8, 12))
    np.testing.assert_allclose(sharded.logits(tokens), int8.logits(tokens), atol=1e-5, rtol=0)


def test_save_model_refuses_int8_weights_and_saves_their_dequantized_values(checkpoint, tmp_path):
    int8 = jaxsr.load_model(checkpoint, weights_dtype="int8", cache=False)
    with pytest.raises(ValueError, match=r"model: its weights are int8 .* model\.with_weights_dtype\(None\)"):
        jaxsr.save_model(int8, tmp_path / "int8")
    assert not (tmp_path / "int8").exists()
    saved = jaxsr.save_model(int8.with_weights_dtype(None), tmp_path / "dequantized")
    reloaded = jaxsr.load_model(saved, cache=False)
    assert reloaded.config.weights_dtype is None
    tokens = np.random.default_rng(0).integers(0, int8.config.vocab_size, (2, 12))
    np.testing.assert_allclose(reloaded.logits(tokens), int8.logits(tokens), atol=2e-5, rtol=0)
    _assert_same_params(jaxsr.load_model(saved, weights_dtype="int8", cache=False), int8)  # a fixed point


def test_a_reward_model_loads_with_int8_weights_and_a_float_score_head(tmp_path):
    directory = H.build_llama_with_tokenizer(
        "LlamaForSequenceClassification", H.byte_tokenizer(), tmp_path / "rm", 21, num_labels=1
    )
    rm = jaxsr.load_reward_model(directory, cache=False)
    int8 = jaxsr.load_reward_model(directory, weights_dtype="int8", cache=False)
    assert isinstance(int8, jaxsr.RewardModel) and int8.config.weights_dtype == "int8"
    params = flat(int8)
    assert params[("score",)].dtype == jnp.float32 and params[("blocks", 0, "mlp", "up")].dtype == jnp.int8
    tokens = np.random.default_rng(0).integers(0, rm.config.vocab_size, (4, 12))
    np.testing.assert_allclose(int8.scores(tokens), rm.scores(tokens), atol=0.05, rtol=0)
    assert jaxsr.load_model(directory, weights_dtype="int8", cache=False).config.weights_dtype == "int8"


def _q8_0_gguf(path: Path) -> Path:
    """A tiny Llama GGUF whose matrices with 32-wide rows (all but the MLP's down projection, and the
    norms) are stored as Q8_0, as llama.cpp's converter writes them."""
    model = H.make_model("llama2", hidden_size=64, intermediate_size=80)
    add = gguf.GGUFWriter.add_tensor

    def add_q8_0(self, name, tensor, raw_shape=None, raw_dtype=None):
        if tensor.ndim == 2 and tensor.shape[1] % 32 == 0:
            q8 = gguf.quants.quantize(tensor, gguf.GGMLQuantizationType.Q8_0)
            return add(self, name, q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        return add(self, name, tensor, raw_shape, raw_dtype)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf.GGUFWriter, "add_tensor", add_q8_0)
        return write_gguf(model, path, "llama")


def test_q8_0_tensors_are_quantized_again_per_channel_within_half_a_step(tmp_path):
    path = _q8_0_gguf(tmp_path / "q8.gguf")
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}
    assert types["blk.0.attn_q.weight"] == types["token_embd.weight"] == "Q8_0"
    assert types["blk.0.ffn_down.weight"] == "F32"
    lm = jaxsr.load_model(path, cache=False)  # the Q8_0 values, dequantized
    int8 = jaxsr.load_model(path, weights_dtype="int8", cache=False)
    floats, params = flat(lm), flat(int8)
    for path_, w in floats.items():
        contracted = quantized_axes(path_)
        if contracted is not None:
            step = np.expand_dims(np.asarray(params[scale_path(path_)]), contracted)
            error = np.abs(np.asarray(params[path_], np.float32) * step - np.asarray(w))
            assert (error <= 0.5 * step * (1 + 1e-5)).all(), path_
    tokens = np.random.default_rng(0).integers(0, lm.config.vocab_size, (2, 12))
    assert np.abs(np.asarray(int8.logits(tokens)) - np.asarray(lm.logits(tokens))).max() < 0.2


def test_int8_weights_have_a_cache_entry_of_their_own(tmp_path, monkeypatch):
    """A GGUF loaded with float and with int8 weights leaves two entries; each is restored for its own
    weights only (what it stores, placed on the mesh), and an int8 entry under the float entry's name
    (or the reverse) is refused as damaged and rebuilt."""
    monkeypatch.setenv("JAXSR_CACHE_DIR", str(tmp_path / "cache"))
    source = _q8_0_gguf(tmp_path / "q8.gguf")
    mesh = make_mesh(data=4, model=2)
    reference = {w: jaxsr.load_model(source, weights_dtype=w, mesh=mesh, cache=False) for w in (None, "int8")}
    for w in (None, "int8"):
        jaxsr.load_model(source, weights_dtype=w)
    entries = {w: param_cache.entry_path(source, w) for w in (None, "int8")}
    assert entries[None] != entries["int8"] and all(e.is_dir() for e in entries.values())
    assert json.loads((entries["int8"] / "meta.json").read_text())["weights_dtype"] == "int8"
    assert "weights_dtype" not in json.loads((entries[None] / "meta.json").read_text())

    def refuse(*args, **kwargs):
        raise AssertionError("converted again instead of read from the cache")

    with monkeypatch.context() as patch:
        patch.setattr(api, "convert_hf_tensors", refuse)
        for w in (None, "int8"):
            _assert_same_params(jaxsr.load_model(source, weights_dtype=w, mesh=mesh), reference[w])
    # each entry under the other's name: refused, rebuilt from the file as its own weights
    entries[None].rename(tmp_path / "float-entry")
    entries["int8"].rename(entries[None])
    (tmp_path / "float-entry").rename(entries["int8"])
    for w in (None, "int8"):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loaded = jaxsr.load_model(source, weights_dtype=w, mesh=mesh)
        assert any("damaged entry" in str(c.message) for c in caught), w
        _assert_same_params(loaded, reference[w])


def test_an_entry_whose_layout_is_not_the_modules_weights_is_never_restored(tmp_path, monkeypatch):
    """An int8 entry whose meta.json claims float weights (its digest made to match) still holds int8
    arrays and scales: the float load refuses its layout, deletes it and converts the file again."""
    monkeypatch.setenv("JAXSR_CACHE_DIR", str(tmp_path / "cache"))
    source = _q8_0_gguf(tmp_path / "q8.gguf")
    jaxsr.load_model(source, weights_dtype="int8")
    entry, target = param_cache.entry_path(source, "int8"), param_cache.entry_path(source)
    meta = json.loads((entry / "meta.json").read_text())
    del meta["weights_dtype"]
    meta["digest"] = param_cache._meta_digest(meta["hf_config"], meta["arrays"], None)
    (entry / "meta.json").write_text(json.dumps(meta))
    entry.rename(target)
    with pytest.warns(UserWarning, match="stored parameters do not match the module"):
        loaded = jaxsr.load_model(source)
    _assert_same_params(loaded, jaxsr.load_model(source, cache=False))


# -- the job key and plans -----------------------------------------------------------------------------


def test_the_job_key_quantizes_the_model_and_the_draft_and_is_a_later_key(monkeypatch):
    overrides = ["method=speculative_decode", "draft=smollm2-draft"]
    config = load_job_config(None, [*overrides, "weights_dtype=int8"])
    assert config.weights_dtype == "int8" and "weights_dtype" in LATER_KEYS
    assert config.fingerprint() != load_job_config(None, overrides).fingerprint()
    loaded = {}

    def resolve(name, dtype, mesh, key, weights_dtype=None):  # the loader quantizes as it reads
        return loaded.setdefault((key, weights_dtype), tiny_model().with_weights_dtype(weights_dtype))

    monkeypatch.setattr(methods, "resolve_model", resolve)
    methods.build_solver(config)
    assert set(loaded) == {("model", "int8"), ("draft", "int8")}
    for key in ("model", "draft"):
        decoder = methods.load_decoder(config, key, None)
        assert decoder.config.weights_dtype == "int8"
        assert flat(decoder)[("blocks", 0, "attn", "q")].dtype == jnp.int8
    assert methods.load_decoder(load_job_config(None, overrides), "model", None).config.weights_dtype is None


LLAMA_31_8B_2_LAYERS = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
    "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256,
    "rope_theta": 500000.0, "num_hidden_layers": 2, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
    "hidden_act": "silu", "tie_word_embeddings": False,
}  # fmt: skip


def test_a_plan_holds_int8_weights_in_half_the_bytes_of_bfloat16(monkeypatch):
    """Llama-3.1-8B's widths (2 layers) split over model=8: one device's parameters take 2.0× fewer bytes
    with int8 weights than in bfloat16 (the embedding and LM head included); `jaxsr plan`'s sampler is
    built with the job's weights_dtype (abstract parameters, nothing allocated)."""
    mesh = make_mesh(data=1, model=8)
    per_device = {
        w: bytes_per_device(abstract_model(LLAMA_31_8B_2_LAYERS, mesh, "bfloat16", w).params)
        for w in (None, "int8")
    }
    assert per_device[None] / per_device["int8"] == pytest.approx(2.0, abs=0.01)
    monkeypatch.setattr("jaxsr.plans.job.hf_config_of", lambda source: LLAMA_31_8B_2_LAYERS)
    config = load_job_config(None, ["dtype=bfloat16", "weights_dtype=int8", "mesh_model=8"])
    sampler = job_sampler(config, mesh, None)
    assert bytes_per_device(sampler.params) == per_device["int8"]
    assert sampler.models[0].config.weights_dtype == "int8"


def _float_copies_of(shapes: set[tuple[int, ...]], text: str) -> list[str]:
    """Instructions outside fused computations (what a TPU writes to its memory) whose result is a
    floating-point array of one of `shapes`."""
    module, _ = hlo.computations(text)
    fused = set(
        hlo.reachable(
            module,
            [
                c
                for lines in module.values()
                for line in lines
                for c in re.findall(r"fusion\(.*calls=%([\w.\-]+)", line)
            ],
        )
    )
    found = []
    for name, lines in module.items():
        for line in lines if name not in fused else ():
            result = re.match(r"\s*(?:ROOT )?%[\w.\-]+ = (bf16|f32)\[([\d,]*)\]", line)
            if result and tuple(int(n) for n in result.group(2).split(",") if n) in shapes:
                found.append(line.strip()[:160])
    return found


@needs_libtpu
@pytest.mark.slow
def test_on_a_tpu_products_take_the_int8_weights_as_they_are():
    """Llama-3.1-8B's widths (2 layers) bf16 on a v5e-8 split model=8: the prefill writes no float copy of
    any weight (each product reads its int8 shard, converted and scaled inside its fusion), the token
    loop needs no more temporary memory than with bfloat16 weights and moves 40% fewer bytes a step.
    Measured: parameters 354.5 → 177.4 MiB a device; a decode step's bytes 532 → 322 MiB; temporaries
    4.0 → 4.2 MiB (the KV cache's and logits' working memory: an MLP weight's shard alone is 14 MiB)."""
    tpu = plan_target("v5e-8")
    mesh = target_mesh(tpu, data=1, model=8)
    models = {w: abstract_model(LLAMA_31_8B_2_LAYERS, mesh, "bfloat16", w) for w in (None, "int8")}
    int8 = models["int8"]
    shards = {
        tuple(x.sharding.shard_shape(x.shape)) for p, x in flat(int8).items() if quantized_axes(p) is not None
    }
    tokens = abstract_tokens(mesh, 1, 128, PartitionSpec())
    with jax.set_mesh(mesh):
        prefill = loop.prefill.lower(int8.graph, int8.params, tokens, tokens).compile()
    assert _float_copies_of(shards, prefill.as_text()) == []
    batch = Batch(prompts=1, rows=8, prompt_slots=128, max_new_tokens=32)
    loops = {w: plan_batch(m, tpu, batch).program("decode_loop") for w, m in models.items()}
    assert loops["int8"].temp_bytes <= loops[None].temp_bytes + 2**20
    assert loops["int8"].bytes_accessed < 0.7 * loops[None].bytes_accessed
