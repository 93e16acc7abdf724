"""The batched sampler: processors, greedy, determinism across layouts, stops, compiles, exactness."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.stats
import torch
from compiles import XLA_CPU_DEFAULTS, compilations
from flax import nnx
from tiny import tiny_config, tiny_model
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

import jaxsr
from jaxsr.decoding import loop
from jaxsr.decoding.sampling import CDF_BLOCK, SamplingConfig, draw_from, process_logits, top_k
from jaxsr.decoding.steps import Controls, PlainSampling
from jaxsr.models.decoder import Decoder
from jaxsr.models.model import RewardModel

PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8], [9], [10, 11, 12, 13]]


@pytest.fixture(scope="module")
def lm():
    return tiny_model(seed=0)


@pytest.mark.parametrize(
    "config",
    [
        SamplingConfig(temperature=0.7, top_k=5, top_p=1.0),
        SamplingConfig(temperature=1.3, top_k=0, top_p=0.8),
        SamplingConfig(temperature=1.0, top_k=20, top_p=0.5),
        SamplingConfig(temperature=1.0, top_k=0, top_p=1.0),
        SamplingConfig(temperature=0.9, top_k=0, top_p=1.0, min_p=0.1),
        SamplingConfig(temperature=1.4, top_k=30, top_p=0.9, min_p=0.05),
    ],
)
def test_processors_keep_the_same_tokens_as_hugging_face(config):
    logits = np.random.default_rng(0).normal(size=(6, 97)).astype(np.float32) * 3
    ref = torch.tensor(logits)
    for warper in (
        TemperatureLogitsWarper(config.temperature),
        TopKLogitsWarper(config.top_k) if config.top_k else None,
        TopPLogitsWarper(config.top_p) if config.top_p < 1 else None,
        MinPLogitsWarper(config.min_p) if config.min_p > 0 else None,
    ):
        if warper is not None:
            ref = warper(None, ref)
    ref = ref.numpy()
    ours = np.asarray(process_logits(logits, config.compiled()))
    kept = ref > -np.inf
    # the kept set is a choice, compared exactly: no cumulative probability of these logits lies within
    # 1.4e-3 of top_p, far above float32 rounding; the kept values agree to a few ulps (jax vs torch)
    np.testing.assert_array_equal(ours > -1e29, kept)
    np.testing.assert_allclose(ours[kept], ref[kept], rtol=1e-6)


def test_greedy_equals_argmax_of_the_full_forward(lm):
    out = jaxsr.generate(lm, PROMPTS[:2], max_new_tokens=12, sampling=SamplingConfig(temperature=0))
    for prompt, result in zip(PROMPTS, out, strict=False):
        generated = result.samples[0].token_ids
        assert len(generated) == 12
        # teacher-forced: every generated token is the argmax after the tokens before it (tokens exactly;
        # cached decode and full forward could only disagree at a float32 near-tie)
        logits = np.asarray(lm.logits([prompt + generated]))[0]
        assert logits[len(prompt) - 1 : -1].argmax(-1).tolist() == generated


@pytest.mark.slow  # compiles generate at 3 row layouts (12, 1 and 4 rows a call), 5 runs
def test_same_seed_same_tokens_whatever_the_batch_layout(lm):
    cfg = SamplingConfig(temperature=1.0, top_k=0)
    whole = jaxsr.generate(lm, PROMPTS, max_new_tokens=10, num_samples=3, seed=7, sampling=cfg)
    for max_rows in (1, 4):
        other = jaxsr.generate(
            lm, PROMPTS, max_new_tokens=10, num_samples=3, seed=7, sampling=cfg, max_rows=max_rows
        )
        assert [[s.token_ids for s in r.samples] for r in other] == [
            [s.token_ids for s in r.samples] for r in whole
        ]
    # a prompt's streams depend on its global index, so a split job reproduces the whole one
    tail = jaxsr.generate(
        lm, PROMPTS[2:], max_new_tokens=10, num_samples=3, seed=7, sampling=cfg, prompt_offset=2
    )
    assert [s.token_ids for s in tail[0].samples] == [s.token_ids for s in whole[2].samples]
    different = jaxsr.generate(lm, PROMPTS, max_new_tokens=10, num_samples=3, seed=8, sampling=cfg)
    assert [s.token_ids for s in different[0].samples] != [s.token_ids for s in whole[0].samples]
    # the samples of one prompt differ from each other
    assert len({tuple(s.token_ids) for s in whole[0].samples}) == 3


@pytest.mark.slow  # compiles generate at 2 prompt buckets and runs 8 prompts in 4 calls, then 3 more runs
def test_prompts_are_batched_by_length_and_keep_their_streams(lm):
    """Two prompts a batch, in file order long and short alternate; batched shortest first, each batch
    pads to its own length's bucket (16 or 64 positions instead of 64 for all). Every prompt gets the
    tokens it gets alone (its streams are keyed by its index), also when a job lists the indices."""
    lengths = [3, 40, 4, 38, 5, 36, 6, 35]
    prompts = [[1 + (i + j) % 50 for j in range(n)] for i, n in enumerate(lengths)]
    results = jaxsr.generate(lm, prompts, max_new_tokens=6, seed=2, max_rows=2)
    positions = sum(r.stats["prefill_positions"] for r in results)
    assert [r.stats["prompt_tokens"] for r in results] == lengths
    assert positions == 2 * 16 + 2 * 16 + 2 * 64 + 2 * 64  # file order would run 8 × 64
    for i in (1, 2):
        alone = jaxsr.generate(lm, [prompts[i]], max_new_tokens=6, seed=2, prompt_offset=i)[0]
        assert alone.samples[0].token_ids == results[i].samples[0].token_ids
    listed = jaxsr.generate(lm, prompts[::-1], max_new_tokens=6, seed=2, prompt_offset=list(range(8))[::-1])
    assert [r.samples[0].token_ids for r in listed[::-1]] == [r.samples[0].token_ids for r in results]


@pytest.mark.slow  # compiles greedy decoding with and without a stop id, and with an EOS model
def test_stop_ids_end_a_row_and_are_not_returned(lm):
    greedy = SamplingConfig(temperature=0)
    free = jaxsr.generate(lm, [PROMPTS[0]], max_new_tokens=8, sampling=greedy)[0].samples[0]
    assert not free.finished and len(free.token_ids) == 8
    stop = free.token_ids[3]
    first = free.token_ids.index(stop)
    stopped = jaxsr.generate(lm, [PROMPTS[0]], max_new_tokens=8, sampling=greedy, stop_token_ids=[stop])
    sample = stopped[0].samples[0]
    assert sample.finished and sample.token_ids == free.token_ids[:first]
    eos_model = tiny_model(seed=0, eos_token_ids=(stop,))
    # the same weights, shapes and program, only the stop comes from the model: the whole Sample (its
    # float logprob included) is bitwise equal
    assert jaxsr.generate(eos_model, [PROMPTS[0]], max_new_tokens=8, sampling=greedy)[0].samples[0] == sample


@pytest.mark.slow  # compiles generate at 2 prompt buckets and 2 budget slabs
def test_second_call_with_the_same_buckets_compiles_nothing(lm):
    slab = {"empty_slab", "insert", "decode_loop"}
    first = jaxsr.generate(lm, [[1, 2, 3]], max_new_tokens=9, num_samples=2, seed=1)
    assert first[0].stats["compile_s"] >= 0
    with compilations() as compiled:  # another prompt length, budget and seed inside the same buckets
        jaxsr.generate(lm, [[5, 6, 7, 8, 9, 10]], max_new_tokens=14, num_samples=2, seed=2)
    assert not (slab | {"prefill"}) & set(compiled)
    with compilations() as compiled:  # a longer prompt bucket: its prefill, in the same slab
        jaxsr.generate(lm, [[5] * 20], max_new_tokens=14, num_samples=2, seed=2)
    assert "prefill" in compiled and not slab & set(compiled)
    with compilations() as compiled:  # a longer budget: another slab
        jaxsr.generate(lm, [[5] * 20], max_new_tokens=20, num_samples=2, seed=2)
    assert slab <= set(compiled) and "prefill" not in compiled


@pytest.mark.slow  # compiles prefill and the decode loop of 8 rows, reads its HLO
def test_the_compiled_decode_loop_updates_the_row_cache_in_place(lm):
    """No copy of a cache buffer per step: a step's cost must not grow with the cache capacity."""
    import re

    import jax.numpy as jnp

    logits, prompt = loop.prefill(lm.graph, lm.params, jnp.ones((1, 16), jnp.int32), jnp.ones((1, 16), bool))
    B, capacity, method = 8, 40, PlainSampling()
    controls = Controls(SamplingConfig().compiled())
    new = loop.NewRows(
        seed=np.uint32(0), prompt_ids=jnp.zeros(1, jnp.int32), sample_ids=jnp.arange(B, dtype=jnp.int32),
        alive=jnp.ones(B, bool), max_new_tokens=jnp.full(B, capacity, jnp.int32),
        stop_ids=jnp.full((B, 1), -1, jnp.int32),
    )  # fmt: skip
    state = loop.init_state((logits,), (prompt,), controls, new, method=method, capacity=capacity)
    hlo = loop.decode_loop.lower((lm.graph,), (lm.params,), state, (prompt,), controls, method=method)
    hlo = hlo.compile(XLA_CPU_DEFAULTS).as_text()
    K, D = lm.config.num_kv_heads, lm.config.head_dim
    shapes = {f"f32[{B},{K},{D},{capacity}]", f"f32[{B},{K},{capacity},{D}]"}
    scatters = [line for line in hlo.splitlines() if "scatter(" in line and any(s in line for s in shapes)]
    copies = [m.group(1) for m in re.finditer(r"= (f32\[[0-9,]+\])\{[^}]*\} copy\(", hlo)]
    assert len(scatters) == 2 * lm.config.num_layers  # the check looks at the right buffers
    assert not shapes & set(copies)


@pytest.mark.slow  # compiles prefill and a decode loop of 8 rows
def test_prompt_is_prefilled_once_for_all_samples(lm):
    result = jaxsr.generate(lm, [[1, 2, 3]], max_new_tokens=5, num_samples=8, seed=0)[0]
    # one prompt row of the 16-token bucket, then 4 decode steps of the 8 rows
    assert result.stats["token_forwards"]["generator"] == 16 + 4 * 8


@pytest.mark.slow  # per setting: compiles and draws 4000 rows in one call
@pytest.mark.parametrize(
    "cfg",
    [
        SamplingConfig(temperature=0.8, top_k=6, top_p=0.95),
        SamplingConfig(temperature=1.2, top_k=0, top_p=0.9),
        SamplingConfig(temperature=1.1, top_k=0, top_p=1.0, min_p=0.02),
        SamplingConfig(temperature=0.7, top_k=8, top_p=1.0, min_p=0.05),
    ],
)
def test_first_token_distribution_is_the_processed_softmax(lm, cfg):
    n = 4000
    out = jaxsr.generate(lm, [PROMPTS[1]], max_new_tokens=1, num_samples=n, seed=3, sampling=cfg, max_rows=n)
    counts = np.bincount([s.token_ids[0] for s in out[0].samples], minlength=lm.config.vocab_size)
    probs = np.asarray(jax_softmax(process_logits(lm.logits([PROMPTS[1]])[:, -1], cfg.compiled())))[0].astype(
        np.float64
    )
    support = probs > 1e-9
    assert counts[~support].sum() == 0 and support.sum() > 2
    expected = probs[support] / probs[support].sum() * n
    _, p_value = scipy.stats.chisquare(counts[support], expected)
    assert p_value > 1e-3


def test_draw_from_samples_a_many_block_distribution_exactly():
    """The blockwise inverse CDF over a vocabulary of several blocks (the last one partial), with empty
    blocks, zero tokens inside live blocks and mass at both ends; unnormalised weights."""
    import jax

    V, n = 3 * CDF_BLOCK + 37, 200_000
    rng = np.random.default_rng(0)
    weights = rng.gamma(0.5, size=V) * (rng.random(V) < 0.3)
    weights[CDF_BLOCK : 2 * CDF_BLOCK] = 0.0
    weights[[0, V - 1]] = 5.0
    keys = jax.random.split(jax.random.key(7), n)
    counts = np.bincount(np.asarray(jax.jit(jax.vmap(draw_from, (0, None)))(keys, weights)), minlength=V)
    support = weights > 0
    assert counts.size == V and counts[~support].sum() == 0
    expected = weights[support] / weights.sum() * n
    big = expected >= 5  # chi-square cells; the rare tokens are pooled into one
    observed = np.append(counts[support][big], counts[support][~big].sum())
    predicted = np.append(expected[big], expected[~big].sum())
    assert scipy.stats.chisquare(observed, predicted * observed.sum() / predicted.sum()).pvalue > 1e-3


@pytest.mark.parametrize(
    "shape,k", [((3, 49152), 50), ((2, 3, 5000), 7), ((4, 64 * 40 + 3), 20), ((2, 300), 50)]
)
def test_blocked_top_k_equals_lax_top_k(shape, k):
    """Values and indices as `lax.top_k`, with logits clustered so the top k crowd a few blocks, a
    top-k-masked row (many equal MASKED values below the top k) and a partial last block."""
    import jax

    rng = np.random.default_rng(k)
    x = rng.normal(size=shape).astype(np.float32)
    x[..., 100:140] += 6.0
    x.reshape(-1, shape[-1])[0, k:] = -1e9
    x.reshape(-1, shape[-1])[0, :k] = np.arange(k, 0, -1)
    values, index = jax.jit(top_k, static_argnums=1)(x, k)
    expected_values, expected_index = jax.lax.top_k(x, k)
    np.testing.assert_array_equal(values, expected_values)
    np.testing.assert_array_equal(index, expected_index)


def test_draw_from_a_point_mass_returns_that_token():
    import jax

    for token in (0, CDF_BLOCK - 1, CDF_BLOCK, 2 * CDF_BLOCK + 5):
        probs = np.zeros(2 * CDF_BLOCK + 6, np.float32)
        probs[token] = 1.0
        keys = jax.random.split(jax.random.key(token), 64)
        assert set(np.asarray(jax.vmap(draw_from, (0, None))(keys, probs)).tolist()) == {token}


def jax_softmax(x):
    import jax

    return jax.nn.softmax(x, axis=-1)


def test_self_likelihood_is_accumulated_from_the_sampling_logits(lm):
    sample = jaxsr.generate(lm, [PROMPTS[0]], max_new_tokens=6, seed=4)[0].samples[0]
    seq = PROMPTS[0] + sample.token_ids
    logp = np.asarray(jax_log_softmax(lm.logits([seq])))[0]
    expected = sum(logp[len(PROMPTS[0]) - 1 + i, t] for i, t in enumerate(sample.token_ids))
    # cached decode vs one full forward, f32 rounding of a 6-term sum
    assert sample.logprob == pytest.approx(expected, rel=1e-4, abs=1e-4)


def jax_log_softmax(x):
    import jax

    return jax.nn.log_softmax(x, axis=-1)


@pytest.mark.parametrize(
    ("kwargs", "error", "name"),
    [
        ({"prompts": []}, ValueError, "prompts"),
        ({"prompts": [[]]}, ValueError, "prompts[0]"),
        ({"prompts": ["  "]}, ValueError, "prompts[0]"),
        ({"prompts": "hello"}, TypeError, "prompts"),
        ({"prompts": [[1] * 250]}, ValueError, "context"),
        ({"prompts": [[99]]}, ValueError, "prompts[0]"),
        ({"max_new_tokens": 0}, ValueError, "max_new_tokens"),
        ({"num_samples": 0}, ValueError, "num_samples"),
        ({"seed": -1}, TypeError, "seed"),
        ({"sampling": {"temperature": 1}}, TypeError, "sampling"),
        ({"stop_token_ids": "ab"}, TypeError, "stop_token_ids"),
        ({"stop_token_ids": [1.5]}, ValueError, "stop_token_ids"),
        ({"stop_token_ids": [-5]}, ValueError, "stop_token_ids"),
        ({"stop_token_ids": [64]}, ValueError, "stop_token_ids"),
        ({"prompt_offset": -3}, ValueError, "prompt_offset"),
        ({"prompt_offset": 2**31 + 5}, ValueError, "prompt_offset"),
        ({"prompt_offset": "x"}, TypeError, "prompt_offset"),
        ({"prompts": [b"hello"]}, TypeError, "prompts[0]"),  # bytes are not token ids
        ({"chat": "no"}, TypeError, "chat"),  # a non-empty string would count as true
    ],
)
def test_bad_input_is_refused(lm, kwargs, error, name):
    args = {"prompts": [[1, 2]], "max_new_tokens": 8, **kwargs}
    with pytest.raises(error, match=name.replace("[", r"\[").replace("]", r"\]")):
        jaxsr.generate(lm, **args)


def test_a_reward_model_is_not_a_language_model():
    rm = RewardModel.from_module(Decoder(tiny_config(num_labels=1), rngs=nnx.Rngs(0)), name="tiny-rm")
    with pytest.raises(TypeError, match="model: a reward model"):
        jaxsr.generate(rm, [[1, 2]], max_new_tokens=4)


@pytest.mark.parametrize(
    ("kwargs", "error", "name"),
    [
        ({"top_p": 0.0}, ValueError, "top_p"),
        ({"top_p": 1.5}, ValueError, "top_p"),
        ({"top_k": -1}, ValueError, "top_k"),
        ({"top_k": 2.5}, TypeError, "top_k"),
        ({"temperature": float("nan")}, ValueError, "temperature"),
        ({"temperature": float("inf")}, ValueError, "temperature"),
        ({"temperature": -0.5}, ValueError, "temperature"),
        ({"temperature": 1e-38}, ValueError, "temperature"),  # below the floor: logits/T overflow
        ({"temperature": 0.99e-4}, ValueError, "temperature"),
    ],
)
def test_bad_sampling_config_is_refused(kwargs, error, name):
    with pytest.raises(error, match=name):
        SamplingConfig(**kwargs)


def test_the_smallest_temperature_still_samples_the_argmax(lm):
    """At the floor the processed logits stay finite: the draw is the greedy token, not token 0."""
    cold = jaxsr.generate(lm, PROMPTS[:2], max_new_tokens=6, sampling=SamplingConfig(temperature=1e-4))
    greedy = jaxsr.generate(lm, PROMPTS[:2], max_new_tokens=6, sampling=SamplingConfig(temperature=0))
    assert [r.samples[0].token_ids for r in cold] == [r.samples[0].token_ids for r in greedy]
