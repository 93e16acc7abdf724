"""int8 KV caches (`DecoderConfig.kv_dtype="int8"`, `jaxsr.load_model(..., kv_dtype="int8")`).

Keys and values are stored as int8 with a float32 scale per token and KV head; attention applies the
scales per slot. Checked here: the quantizer and the attention arithmetic, the bytes a slot takes and what
a memory budget buys (Speculative Rejection's first batch), exact sampling of the quantized model by
speculative and speculative contrastive decoding (chi-square, greedy token equality), compaction and
meshes, the public API and job key, and the quality of the quantized model's logits against the float
cache's, teacher-forced through the caches (tiny random models, and SmolLM2 on held-out responses).
Cached decoding against the full forward is in test_decoder_cache.py, sliding windows in
test_sliding_window.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import hf_fixtures as H
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import test_decoder_cache as cached
import test_exactness as exactness
import yaml
from compiles import compilations
from flax import nnx
from test_speculative import perturbed
from tiny import tiny_config, tiny_model

import jaxsr
from jaxsr.cli import main
from jaxsr.decoding import loop
from jaxsr.decoding.driver import Sampler, as_sampler
from jaxsr.decoding.speculative import SpeculativeContrastiveDecoding, SpeculativeDecoding
from jaxsr.jobs import methods
from jaxsr.jobs.config import load_job_config
from jaxsr.models.attention import Segment, attend
from jaxsr.models.cache import KV, RowCache, cache_layout, quantize
from jaxsr.models.decoder import Decoder
from jaxsr.models.model import Model
from jaxsr.rewards import SelfLikelihood
from jaxsr.sharding import make_mesh, shard_model
from jaxsr.text import left_pad

GREEDY = jaxsr.SamplingConfig(temperature=0)
SAMPLING = jaxsr.SamplingConfig(temperature=1.0, top_k=20)
PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8], [9]]


# -- the quantizer and the attention arithmetic ------------------------------------------------------


def test_quantize_keeps_each_vector_within_half_a_step():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 5, 2, 16)).astype(np.float32) * rng.uniform(0.01, 100, (3, 5, 2, 1))
    x[0, 0, 0] = 0.0  # an all-zero vector: scale 0, values 0
    q, scale = quantize(jnp.asarray(x))
    assert q.dtype == jnp.int8 and scale.dtype == jnp.float32 and scale.shape == x.shape[:-1]
    q, scale = np.asarray(q, np.int32), np.asarray(scale)
    assert np.abs(q).max() == 127 and (np.abs(q).max(-1)[scale > 0] == 127).all()  # each range is used
    assert (q[0, 0, 0] == 0).all() and scale[0, 0, 0] == 0
    assert (np.abs(q * scale[..., None] - x) <= 0.5 * scale[..., None] * (1 + 1e-5)).all()


def _segments(quantized: bool, seed: int = 0):
    """A shared prompt segment (2 prompts, per-query masks as a sliding window makes them) and the rows'
    own segment, int8 with scales or as their dequantized float32 values; and the queries."""
    rng = np.random.default_rng(seed)
    P, G, T, K, R, D, S, C = 2, 2, 3, 2, 2, 8, 5, 4
    B = P * G

    def layer(n: int, s: int) -> KV:
        k, v = (jnp.asarray(rng.standard_normal((n, s, K, D)) * 3, jnp.float32) for _ in range(2))
        kv = cache_layout(k, v, quantized=True)
        if quantized:
            return kv
        return KV(kv.k * kv.k_scale[:, :, None, :], kv.v * kv.v_scale[..., None])  # what int8 stands for

    prompt_mask = jnp.asarray(rng.random((P, G, T, S)) < 0.7)
    own_mask = jnp.asarray(rng.random((B, T, C)) < 0.7)
    q = jnp.asarray(rng.standard_normal((B, T, K * R, D)), jnp.float32)
    return q, [Segment.of(layer(P, S), prompt_mask, shared=True), Segment.of(layer(B, C), own_mask)]


def test_attention_over_int8_segments_is_attention_over_their_dequantized_values():
    """Key scales applied to the scores and value scales folded into the probabilities give the
    attention of the float values the int8 entries stand for (shared and own segments, per-query masks,
    soft-capping)."""
    q, int8 = _segments(quantized=True)
    _, dequantized = _segments(quantized=False)
    assert int8[0].k.dtype == jnp.int8 and int8[1].v_scale is not None
    for softcap in (None, 5.0):
        got = attend(q, int8, 0.35, softcap)
        expected = attend(q, dequantized, 0.35, softcap)
        np.testing.assert_allclose(got, expected, atol=2e-6, rtol=0)


# -- bytes and what a budget buys --------------------------------------------------------------------


def _cache_bytes_per_slot(model: Model, rows: int = 2, capacity: int = 8) -> float:
    """Bytes of a real row cache of `model` per (row, slot)."""
    tokens = jnp.ones((1, 4), jnp.int32)
    _, prompt = loop.prefill(model.graph, model.params, tokens, jnp.ones_like(tokens))
    empty = RowCache.empty_like(prompt, rows, capacity)
    leaves = jax.tree.leaves((empty.k, empty.v, empty.k_scale, empty.v_scale))
    return sum(x.nbytes for x in leaves) / (rows * capacity)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_a_slot_counts_the_int8_entries_and_their_scales(dtype):
    cfg = tiny_config(head_dim=64)
    model = Model.from_module(Decoder(cfg, dtype=dtype, rngs=nnx.Rngs(0)))
    int8 = model.with_kv_dtype("int8")
    L, K, D = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim
    assert model.kv_slot_bytes == 2 * L * K * D * jnp.dtype(dtype).itemsize == _cache_bytes_per_slot(model)
    assert int8.kv_slot_bytes == 2 * L * K * (D + 4) == _cache_bytes_per_slot(int8)
    ratio = model.kv_slot_bytes / int8.kv_slot_bytes  # 4·64/68 and 2·64/68
    assert ratio == pytest.approx(4 * D / (D + 4) if dtype == jnp.float32 else 2 * D / (D + 4))
    assert int8.with_kv_dtype(None).config == model.config and model.with_kv_dtype(None) is model
    built = Model.from_module(
        Decoder(tiny_config(head_dim=64, kv_dtype="int8"), dtype=dtype, rngs=nnx.Rngs(0))
    )
    assert built.kv_slot_bytes == int8.kv_slot_bytes  # a decoder built with the option


@pytest.mark.slow  # compiles SR's rungs with float32 and with int8 caches (head_dim 64)
def test_speculative_rejection_starts_wider_in_the_same_memory():
    """At one byte budget the int8 cache holds 3.76× the slots of float32 (head_dim 64), and SR's first
    batch grows accordingly (the prompt's slots come off the budget first)."""
    lm = tiny_model(seed=0, head_dim=64)
    int8 = lm.with_kv_dtype("int8")
    budget = 256 * 2**10
    kwargs = dict(rejection_rate=0.5, max_new_tokens=16, memory_budget=f"{budget}B", sampling=SAMPLING)
    stats = {}
    for name, model in (("float32", lm), ("int8", int8)):
        [result] = jaxsr.speculative_rejection(model, SelfLikelihood(), PROMPTS[:1], **kwargs)
        slots = budget // model.kv_slot_bytes
        assert result.stats["memory_budget_slots"] == slots
        assert result.stats["initial_batch"] == (slots - 16) // 16  # a 16-slot prompt, 16-token segments
        stats[name] = result.stats
    assert (stats["float32"]["initial_batch"], stats["int8"]["initial_batch"]) == (7, 29)


# -- exact sampling of the quantized model -----------------------------------------------------------


@pytest.fixture(scope="module")
def target() -> Model:
    return tiny_model(seed=0).with_kv_dtype("int8")


@pytest.fixture(scope="module")
def draft() -> Model:
    return perturbed(tiny_model(seed=0), 0.3, seed=1).with_kv_dtype("int8")  # agrees in part


@pytest.mark.slow  # per γ: compiles greedy decoding and SD of an int8 target
@pytest.mark.parametrize("gamma", [1, 3])
def test_greedy_speculative_decoding_is_greedy_decoding_of_the_int8_target(target, draft, gamma):
    """Token for token: greedy SD with int8 caches is greedy plain decoding with them, and both are the
    argmax of the int8 model's full forward (which attends to its keys as stored)."""
    plain = jaxsr.generate(target, PROMPTS, max_new_tokens=12, sampling=GREEDY)
    spec = jaxsr.speculative_decode(target, draft, PROMPTS, gamma=gamma, max_new_tokens=12, sampling=GREEDY)
    assert [r.samples[0].token_ids for r in spec] == [r.samples[0].token_ids for r in plain]
    for prompt, result in zip(PROMPTS, plain, strict=True):
        generated = result.samples[0].token_ids
        logits = np.asarray(target.logits([prompt + generated]))[0]
        assert logits[len(prompt) - 1 : -1].argmax(-1).tolist() == generated
    assert 0 < spec[0].stats["acceptance_rate"] < 1  # both paths of the verify step ran


@pytest.mark.slow  # compiles greedy CD and SCD of an int8 target
def test_greedy_speculative_contrastive_decoding_is_int8_contrastive_decoding(target, draft):
    kwargs = dict(max_new_tokens=12, sampling=GREEDY, alpha=0.1, beta=0.5)
    cd = jaxsr.contrastive_decode(target, draft, PROMPTS, **kwargs)
    scd = jaxsr.speculative_contrastive_decode(target, draft, PROMPTS, gamma=3, **kwargs)
    assert [r.samples[0].token_ids for r in scd] == [r.samples[0].token_ids for r in cd]


def test_a_second_int8_call_in_the_same_buckets_compiles_nothing(target, draft):
    kwargs = dict(gamma=2, max_new_tokens=10, sampling=SAMPLING)
    jaxsr.speculative_decode(target, draft, PROMPTS, **kwargs)
    with compilations() as compiled:
        jaxsr.speculative_decode(target, draft, PROMPTS, seed=5, **kwargs)
    assert compiled == []


CHI_SQUARE_CASES = [
    ("SD", 3, "two prompts, mixed budgets, padding rows"),
    ("SCD", 5, "eos, processed sampling"),
]


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "gamma", "comp"), CHI_SQUARE_CASES, ids=["SD-g3", "SCD-g5"])
def test_empirical_joint_matches_the_exact_int8_target_joint(monkeypatch, kind, gamma, comp):
    """test_exactness's chi-square test with both models' caches in int8: 10^5 rows sample exactly the
    joint of the quantized target (SD) or of the contrast of the quantized models (SCD), enumerated from
    their full forward passes."""
    models = tuple(m.with_kv_dtype("int8") for m in exactness.models())
    monkeypatch.setattr(exactness, "models", lambda: models)
    c = exactness.COMPOSITIONS[comp]
    method = SpeculativeDecoding if kind == "SD" else SpeculativeContrastiveDecoding
    weights = None if kind == "SD" else exactness.CONTRAST
    sampler = Sampler(models, method(gamma=gamma), weights, c["sampling"])
    prompt_index, sample_ids, tokens, lengths, _ = exactness.run(sampler, comp)
    for prompt, budget, rows in exactness.groups(comp, prompt_index, sample_ids, lengths):
        # the uncached enumeration: the cached one holds the float models' joints
        joint, _ = exactness.exact_joint.__wrapped__(kind, prompt, budget, c["stop"], c["sampling"])
        codes = exactness.encode(tokens[rows], lengths[rows], budget)
        p_value, tv, bound = exactness.check_joint(codes, joint, budget)
        assert p_value > 1e-3, (prompt, budget, p_value)
        assert tv <= bound, (prompt, budget, tv, bound)


# -- compaction and meshes ---------------------------------------------------------------------------


def test_take_gathers_the_scales_with_their_rows_and_changes_the_capacity(target):
    tokens = jnp.asarray([[1, 2, 3, 4]], jnp.int32)
    _, prompt = loop.prefill(target.graph, target.params, tokens, jnp.ones_like(tokens))
    rng = np.random.default_rng(0)
    rows = RowCache.empty_like(prompt, 4, 6)
    rows = jax.tree.map(lambda x: jnp.asarray(rng.integers(1, 100, x.shape), x.dtype), rows)
    index = jnp.asarray([2, 0, 2])
    for capacity in (4, 9):
        taken = rows.take(index, capacity)
        keep = min(capacity, 6)
        for old, new in zip(rows.k_scale + rows.v_scale, taken.k_scale + taken.v_scale, strict=True):
            assert new.shape == (3, old.shape[1], capacity)
            np.testing.assert_array_equal(new[..., :keep], np.asarray(old)[[2, 0, 2]][..., :keep])
            assert not np.asarray(new[..., keep:]).any()
        np.testing.assert_array_equal(taken.length, np.asarray(rows.length)[[2, 0, 2]])
        assert taken.k[0].dtype == jnp.int8 and taken.v[0].shape[2] == capacity


def _new_rows(prompts: int, samples: int, max_new_tokens: int) -> loop.NewRows:
    B = prompts * samples
    return loop.NewRows(
        seed=np.uint32(0), prompt_ids=jnp.arange(prompts, dtype=jnp.int32),
        sample_ids=jnp.tile(jnp.arange(samples), prompts), alive=jnp.ones(B, bool),
        max_new_tokens=jnp.full(B, max_new_tokens, jnp.int32), stop_ids=jnp.full((B, 1), -1, jnp.int32),
    )  # fmt: skip


@pytest.mark.slow  # compiles SCD's decode loop with int8 caches, paused, compacted and resumed
def test_pausing_and_compacting_int8_caches_do_not_change_the_tokens(target, draft):
    """As test_speculative's: decode to a pause point, gather rows into another order (one masked) with a
    larger cache, finish: the survivors' tokens are those of an uninterrupted run."""
    sampler = jaxsr.speculative_contrastive_decoder(target, draft, gamma=3).with_sampling(SAMPLING)
    tokens, mask = map(jnp.asarray, left_pad(PROMPTS, 4, 16))
    prefilled = sampler.prefill(tokens, mask)

    def run(pause_at, state=None):
        if state is None:
            state = sampler.init_state(prefilled, _new_rows(4, 2, 16), capacity=16, cache_capacity=20)
        return sampler.decode_loop(state, prefilled[1], jnp.int32(pause_at))

    full = jax.device_get(run(loop.NO_PAUSE))
    paused = run(6)
    assert paused.rows[0].k_scale[0].shape[-1] == 20
    keep = np.array([1, 0, 3, 2, 5, 4, 7, 6])
    alive = keep != 0
    small = jax.device_get(run(loop.NO_PAUSE, sampler.compact(paused, keep, jnp.asarray(alive), 24)))
    np.testing.assert_array_equal(small.tokens[alive], full.tokens[keep[alive]])


@pytest.mark.slow  # compiles int8-cache decoding on one device and on a (4, 2) mesh, and a compaction
def test_int8_decoding_is_the_same_on_a_mesh_and_scales_are_split_like_their_cache(target):
    kwargs = dict(max_new_tokens=12, num_samples=8, sampling=SAMPLING, seed=3)
    reference = jaxsr.generate(target, PROMPTS, **kwargs)
    sharded = shard_model(target, make_mesh(data=4, model=2))
    assert sharded.config.kv_dtype == "int8"
    on_mesh = jaxsr.generate(sharded, PROMPTS, **kwargs)
    tokens_of = lambda results: [[s.token_ids for s in r.samples] for r in results]
    assert tokens_of(on_mesh) == tokens_of(reference)
    sampler = as_sampler(sharded, SAMPLING)
    tokens = jnp.ones((4, 8), jnp.int32)
    with sampler.on_mesh():
        prefilled = sampler.prefill(tokens, jnp.ones_like(tokens))
        state = sampler.init_state(prefilled, _new_rows(4, 2, 16), capacity=16)
        state = sampler.decode_loop(state, prefilled[1], None)
        index = jnp.asarray([1, 3, 5, 7, 0, 2, 4, 6], jnp.int32)
        compacted = sampler.compact(state, index, jnp.ones(8, bool), 16)  # rows move between shards
    for cache in (prefilled[1][0], state.rows[0], compacted.rows[0]):  # prompts (4 over data=4), rows
        for k, v, k_scale, v_scale in zip(cache.k, cache.v, cache.k_scale, cache.v_scale, strict=True):
            specs = {tuple(x.sharding.spec)[:2] for x in (k, v, k_scale, v_scale)}
            assert specs == {("data", "model")}, specs  # rows over data, KV heads over model
    before, after = state.rows[0], compacted.rows[0]
    for old, new in zip(jax.tree.leaves(before), jax.tree.leaves(after), strict=True):
        np.testing.assert_array_equal(new, np.asarray(old)[np.asarray(index)])


# -- quality: the int8 cache against the float cache, teacher-forced through the caches ----------------


def teacher_forced(
    model: Model, prompt_tokens, prompt_mask, continuation: np.ndarray, step: int
) -> np.ndarray:
    """Logits [B, N, V] predicting continuation[:, i] after each row's prompt and continuation[:, :i]:
    the prompts prefilled, the continuation decoded `step` tokens a call through the row caches."""
    last, decoded = cached._cached_logits(
        model.graph, model.params, model.config, prompt_tokens, prompt_mask, continuation, 1, step,
        capacity=continuation.shape[1],
    )  # fmt: skip
    return np.concatenate([last[:, -1:], decoded[:, :-1]], axis=1)


def compare(a: np.ndarray, b: np.ndarray, targets: np.ndarray, valid: np.ndarray, scored: np.ndarray) -> dict:
    """max and mean |a − b| and argmax agreement over `valid` positions; perplexity of `targets` under
    a and b over `scored` positions."""

    def perplexity(z: np.ndarray) -> float:
        logp = np.asarray(jax.nn.log_softmax(jnp.asarray(z), axis=-1))
        return float(np.exp(-np.take_along_axis(logp, targets[..., None], -1)[..., 0][scored].mean()))

    diff = np.abs(a - b)[valid]
    agree = (a.argmax(-1) == b.argmax(-1))[valid].mean()
    return dict(max=diff.max(), mean=diff.mean(), argmax=agree, ppl=(perplexity(a), perplexity(b)))


QUALITY = dict(max=0.1, mean=0.01, argmax=0.97, ppl=0.02)
"""Tiny random models, 300 random tokens after 4 prompts, 20 a call: measured max |Δlogit| 0.014 (tiny)
and 0.039 (contextual), mean 0.0009 and 0.0048, argmax agreement 1.0 and 0.99, perplexity within
0.05%."""


@pytest.mark.parametrize("model", ["tiny", "contextual"])
def test_int8_logits_stay_close_to_the_float_caches_over_300_tokens(model):
    lm = tiny_model(seed=1) if model == "tiny" else exactness.contextual_model(1, vocab_size=64)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(1, 64, n).tolist() for n in (12, 7, 3, 9)]
    tokens, mask = left_pad(prompts, 4, 12)
    continuation = rng.integers(1, 64, (4, 300))
    z = {kv: teacher_forced(lm.with_kv_dtype(kv), tokens, mask, continuation, 20) for kv in (None, "int8")}
    every = np.ones(continuation.shape, bool)
    got = compare(z[None], z["int8"], continuation, every, every)
    assert got["max"] <= QUALITY["max"] and got["mean"] <= QUALITY["mean"], got
    assert got["argmax"] >= QUALITY["argmax"], got
    assert got["ppl"][1] == pytest.approx(got["ppl"][0], rel=QUALITY["ppl"]), got
    assert got["max"] > 0  # the caches differ


HELDOUT = Path(__file__).parent / "data" / "draft_heldout.json"
"""SmolLM2's sampled responses to 4 alpaca_farm_100 prompts (test_draft.py)."""
SMOLLM2_QUALITY = dict(max=4.0, mean=0.15, argmax=0.95, ppl=0.02)
"""SmolLM2-135M, 4 chat sequences, 16 tokens prefilled and up to 245 decoded 8 a call (432 positions,
149 of them response tokens): measured max |Δlogit| 2.26, mean 0.097, argmax agreement 0.979, response
perplexity 8.806 → 8.851 (+0.5%). Over 16 of its responses to alpaca_farm_100 of up to 256 tokens,
decoded one a call (3071 positions): max 2.13, mean 0.087, argmax 0.981, perplexity 6.703 → 6.707."""


def heldout_batch(first: int = 16, decoded: int = 248) -> tuple[np.ndarray, ...]:
    """SmolLM2's held-out chat sequences as (prefix [4, first], continuation [4, decoded], valid,
    scored): the continuation's positions that hold tokens, and those of them in a response."""
    rows = json.loads(HELDOUT.read_text())
    tokens = np.zeros((len(rows), first + decoded), np.int32)
    for i, r in enumerate(rows):
        tokens[i, : len(r["tokens"])] = r["tokens"]
    position = first + np.arange(decoded)[None, :]
    valid = position < np.array([len(r["tokens"]) for r in rows])[:, None]
    scored = valid & (position >= np.array([r["prompt_length"] for r in rows])[:, None])
    return tokens[:, :first], tokens[:, first:], valid, scored


@pytest.mark.slow
def test_smollm2_int8_perplexity_on_heldout_responses_is_within_two_percent():
    from jaxsr.loading.gguf import smollm2_path

    lm = jaxsr.load_model(smollm2_path())
    prefix, continuation, valid, scored = heldout_batch()
    z = {
        kv: teacher_forced(lm.with_kv_dtype(kv), prefix, np.ones_like(prefix), continuation, 8)
        for kv in (None, "int8")
    }
    got = compare(z[None], z["int8"], continuation, valid, scored)
    assert got["max"] <= SMOLLM2_QUALITY["max"] and got["mean"] <= SMOLLM2_QUALITY["mean"], got
    assert got["argmax"] >= SMOLLM2_QUALITY["argmax"], got
    assert got["ppl"][1] == pytest.approx(got["ppl"][0], rel=SMOLLM2_QUALITY["ppl"]), got


# -- the public API and jobs -------------------------------------------------------------------------


@pytest.mark.parametrize("bad", ["int4", "float16", 8, ""])
def test_a_bad_kv_dtype_is_refused_before_anything_loads(bad):
    with pytest.raises(
        ValueError, match=r"kv_dtype: expected None \(the model's dtype\) or one of \('int8',\)"
    ):
        jaxsr.load_model("/no/such/model", kv_dtype=bad)
    with pytest.raises(ValueError, match="kv_dtype"):
        tiny_model().with_kv_dtype(bad)
    with pytest.raises(ValueError, match="kv_dtype: expected"):
        load_job_config(None, [f"kv_dtype={bad}"])


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A tiny random Llama checkpoint with a byte tokenizer."""
    directory = tmp_path_factory.mktemp("byte-llama")
    return H.build_llama_with_tokenizer(
        "LlamaForCausalLM", H.byte_tokenizer(), directory, 21, rms_norm_eps=1e-6
    )


def test_load_model_stores_the_cache_as_asked_and_save_model_ignores_it(checkpoint, tmp_path):
    lm = jaxsr.load_model(checkpoint, cache=False)
    int8 = jaxsr.load_model(checkpoint, kv_dtype="int8", cache=False)
    assert lm.config.kv_dtype is None and int8.config.kv_dtype == "int8"
    assert int8.kv_slot_bytes < lm.kv_slot_bytes
    saved = {name: jaxsr.save_model(model, tmp_path / name) for name, model in (("f", lm), ("q", int8))}
    files = sorted(p.name for p in saved["f"].iterdir())
    assert files == sorted(p.name for p in saved["q"].iterdir())
    for name in files:  # the cache is no part of the checkpoint
        assert (saved["f"] / name).read_bytes() == (saved["q"] / name).read_bytes(), name
    assert jaxsr.load_model(saved["q"], cache=False).config.kv_dtype is None


def test_a_reward_model_keeps_a_float_cache(tmp_path):
    directory = H.build_llama_with_tokenizer(
        "LlamaForSequenceClassification", H.byte_tokenizer(), tmp_path / "rm", 21, num_labels=1
    )
    with pytest.raises(ValueError, match="kv_dtype: a reward model"):
        jaxsr.load_model(directory, kv_dtype="int8", cache=False)


def test_the_job_key_sets_the_cache_of_the_model_and_the_draft(monkeypatch):
    config = load_job_config(None, ["method=speculative_decode", "draft=smollm2-draft", "kv_dtype=int8"])
    assert config.kv_dtype == "int8"
    assert (
        config.fingerprint()
        != load_job_config(None, ["method=speculative_decode", "draft=smollm2-draft"]).fingerprint()
    )
    loaded = {}
    monkeypatch.setattr(
        methods, "resolve_model", lambda name, dtype, mesh, key, **kw: loaded.setdefault(key, tiny_model())
    )
    solver = methods.build_solver(config)
    assert solver.prompts_per_call is None  # a call takes a whole length class
    assert set(loaded) == {"model", "draft"}
    assert methods.load_decoder(config, "draft", None).config.kv_dtype == "int8"


@pytest.mark.slow
def test_a_speculative_rejection_job_with_an_int8_cache_starts_wider(checkpoint, tmp_path):
    """The same byte budget buys the job with kv_dtype=int8 the slots of its model's int8 slot (12 bytes
    a KV head and layer at head_dim 8, against float32's 32), and it starts that much wider (the
    prompt's slots come off first)."""
    data = tmp_path / "prompts.json"
    data.write_text(json.dumps([{"prompt": "Say hi."}]))
    lm = jaxsr.load_model(checkpoint, cache=False)
    first = {}
    for kv in (None, "int8"):
        output = tmp_path / f"{kv}.jsonl"
        config = dict(
            method="speculative_rejection", model=str(checkpoint), data=str(data), output=str(output),
            reward="self_likelihood", rejection_rate=0.5, max_new_tokens=16, memory_budget="64KiB",
        )  # fmt: skip
        path = tmp_path / f"{kv}.yaml"
        path.write_text(yaml.safe_dump(config | ({} if kv is None else {"kv_dtype": kv})))
        assert main(["run", str(path), "--no-progress"]) == 0
        [record] = [json.loads(line) for line in output.read_text().splitlines()]
        assert record["stats"]["memory_budget_slots"] == 2**16 // lm.with_kv_dtype(kv).kv_slot_bytes
        first[kv] = record["stats"]["initial_batch"]
    assert first["int8"] > 2.5 * first[None] > 0, first
