"""A reduced output layer (`DecoderConfig.head_token_ids`): the model scores only K vocabulary ids and
gives the others -inf. Its logits, its checkpoints (save/load, the parameter cache, malformed configs),
the sampling code with -inf logits, and where it may decode: a speculative draft (exactly), a target
or plain model (only its K ids), never a contrastive expert or amateur."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import test_exactness as E
from compiles import compilations
from flax import nnx
from safetensors.numpy import load_file
from test_param_cache import assert_same_params, forbid_conversion
from tiny import tiny_config

import jaxsr
from jaxsr.decoding.driver import Sampler
from jaxsr.decoding.sampling import SamplingConfig, draw, probabilities, process_logits, token_statistics
from jaxsr.decoding.speculative import SpeculativeDecoding, next_distribution
from jaxsr.loading import param_cache
from jaxsr.models.decoder import Decoder
from jaxsr.models.model import Model

V = 512
IDS = (0, 3, 4, 17, 100, 101, 255, 300, 511)
PROMPTS = [[1, 2, 3], [7, 8, 9, 10, 11]]
GREEDY = SamplingConfig(temperature=0)
SAMPLINGS = [
    SamplingConfig(),  # top_k=50 > K
    SamplingConfig(top_k=0),
    SamplingConfig(top_k=3),
    SamplingConfig(temperature=0.7, top_k=0, top_p=0.8),
    SamplingConfig(temperature=1.3, top_k=20, top_p=0.9),
    GREEDY,
]


def full_and_reduced(**overrides) -> tuple[Model, Model]:
    """A full-head model and a reduced one with the same body whose head is the full head's columns
    at IDS (one seed draws the same body: lm_head is the last parameter either module draws)."""
    full = Decoder(tiny_config(vocab_size=V, **overrides), rngs=nnx.Rngs(0))
    reduced = Decoder(tiny_config(vocab_size=V, head_token_ids=IDS, **overrides), rngs=nnx.Rngs(0))
    full.lm_head[...] = full.lm_head[...] * 15.0
    reduced.lm_head[...] = full.lm_head[...][:, np.asarray(IDS)]
    body = {p: v for p, v in nnx.to_flat_state(nnx.state(full)) if p != ("lm_head",)}
    for path, value in nnx.to_flat_state(nnx.state(reduced)):
        if path != ("lm_head",):
            np.testing.assert_array_equal(value.get_value(), body[path].get_value(), err_msg=str(path))
    return Model.from_module(full, name="full"), Model.from_module(reduced, name="reduced")


@pytest.fixture(scope="module")
def pair() -> tuple[Model, Model]:
    return full_and_reduced()


def batch(prompts: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    width = max(map(len, prompts))
    tokens, mask = np.zeros((len(prompts), width), np.int32), np.zeros((len(prompts), width), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, width - len(p) :], mask[i, width - len(p) :] = p, 1
    return tokens, mask


def head_and_logits(model: Model, tokens: np.ndarray, mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`head_logits` and `logits` of the module, from the same hidden states."""
    module = nnx.merge(model.graph, model.params)
    hidden, _ = module.prefill(jnp.asarray(tokens), jnp.asarray(mask))
    return np.asarray(module.head_logits(hidden)), np.asarray(module.logits(hidden))


# -- config and logits --------------------------------------------------------------------------------


def test_config_normalises_and_refuses_ids():
    cfg = tiny_config(vocab_size=V, head_token_ids=[np.int64(2), 5])
    assert cfg.head_token_ids == (2, 5) and all(type(i) is int for i in cfg.head_token_ids)
    assert cfg.head_size == 2 and tiny_config(vocab_size=V).head_size == V
    for bad in ([], [5, 2], [2, 2], [-1], [V], [True], [1.0], "ab", 3):
        with pytest.raises(ValueError, match="head_token_ids"):
            tiny_config(vocab_size=V, head_token_ids=bad)
    with pytest.raises(ValueError, match=r"head_token_ids.*tied"):
        tiny_config(head_token_ids=[1], tie_word_embeddings=True)
    with pytest.raises(ValueError, match=r"head_token_ids.*reward"):
        tiny_config(head_token_ids=[1], num_labels=1)


@pytest.mark.slow  # per cap: compiles logits and head-only forwards of a full and a reduced-head model
@pytest.mark.parametrize("cap", [None, 2.0], ids=["plain", "soft-capped"])
def test_logits_are_the_full_heads_at_the_ids_and_minus_inf_elsewhere(cap):
    full, reduced = full_and_reduced(final_logit_softcapping=cap)
    tokens, mask = batch(PROMPTS)
    z_full, z = np.asarray(full.logits(tokens, mask)), np.asarray(reduced.logits(tokens, mask))
    assert z.shape == z_full.shape == (2, 5, V) and z.dtype == np.float32
    outside = np.setdiff1d(np.arange(V), IDS)
    assert np.isneginf(z[..., outside]).all()
    np.testing.assert_allclose(z[..., IDS], z_full[..., IDS], rtol=0, atol=1e-6)
    if cap is not None:
        assert np.abs(z[..., IDS]).max() < cap
    head, logits = head_and_logits(reduced, tokens, mask)
    assert head.shape == (2, 5, len(IDS)) and head.dtype == np.float32
    np.testing.assert_array_equal(head, logits[..., IDS])
    head, logits = head_and_logits(full, tokens, mask)
    np.testing.assert_array_equal(head, logits)  # a full head: the logits


# -- sampling with -inf logits ------------------------------------------------------------------------


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=str)
def test_sampling_is_nan_free_and_draws_only_scored_ids(sampling):
    z = (
        jnp.full((64, V), -jnp.inf)
        .at[:, np.asarray(IDS)]
        .set(3.0 * jax.random.normal(jax.random.PRNGKey(0), (64, len(IDS))))
    )
    keys = jax.random.split(jax.random.PRNGKey(1), 64)
    assert not np.isnan(np.asarray(process_logits(z, sampling.compiled()))).any()
    p = np.asarray(probabilities(z, sampling.compiled()))
    assert not np.isnan(p).any() and (p[:, np.setdiff1d(np.arange(V), IDS)] == 0).all()
    np.testing.assert_allclose(p.sum(-1), 1.0, atol=1e-6)
    tokens = np.asarray(draw(keys, z, sampling.compiled()))
    assert np.isin(tokens, IDS).all()
    logp, certainty = token_statistics(z, jnp.asarray(tokens))
    assert np.isfinite(np.asarray(logp)).all()
    assert np.isneginf(np.asarray(token_statistics(z, jnp.ones(64, jnp.int32))[0])).all()  # 1 is not scored
    # self-certainty of the raw logits over the scored ids only: KL from the uniform distribution over IDS
    raw = np.asarray(z, np.float64)[:, IDS]
    raw_logp = raw - raw.max(-1, keepdims=True)
    raw_logp -= np.log(np.exp(raw_logp).sum(-1, keepdims=True))
    expected = -np.log(len(IDS)) - raw_logp.mean(-1)
    np.testing.assert_allclose(np.asarray(certainty), expected, rtol=1e-4, atol=1e-5)
    # the speculative residual where the draft (here: these logits) covers only IDS and the target all
    q = jnp.asarray(p)[:, None]
    target = probabilities(jax.random.normal(jax.random.PRNGKey(2), (64, V)), sampling.compiled())
    r = np.asarray(next_distribution(target[:, None], q, target, jnp.zeros(64, jnp.int32)))
    assert not np.isnan(r).any() and np.allclose(r.sum(-1), 1.0, atol=1e-5)


# -- checkpoints --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def saved(pair, tmp_path_factory):
    model = jaxsr.Model.from_module(nnx.merge(pair[1].graph, pair[1].params), eos_token_ids=(3,))
    return model, jaxsr.save_model(model, tmp_path_factory.mktemp("reduced") / "checkpoint")


def test_save_load_round_trips_bitwise(saved):
    model, directory = saved
    hf = json.loads((directory / "config.json").read_text())
    assert hf["jaxsr_head_token_ids"] == list(IDS)
    assert load_file(directory / "model.safetensors")["lm_head.weight"].shape == (len(IDS), 32)
    loaded = jaxsr.load_model(directory, cache=False)
    assert loaded.config == model.config and loaded.config.head_token_ids == IDS
    assert_same_params(model, loaded)
    tokens, mask = batch(PROMPTS)
    np.testing.assert_array_equal(loaded.logits(tokens, mask), model.logits(tokens, mask))


def test_the_parameter_cache_serves_a_reduced_head(saved, tmp_path, monkeypatch):
    model, directory = saved
    monkeypatch.setenv("JAXSR_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(param_cache, "MIN_DIRECTORY_BYTES", 0)
    first = jaxsr.load_model(directory)
    forbid_conversion(monkeypatch)
    cached = jaxsr.load_model(directory)
    assert cached.config == model.config
    assert_same_params(first, cached)
    assert_same_params(model, cached)


@pytest.mark.parametrize(
    "value", ["0,3", {"ids": [0]}, [], [0, 3.0], [True], [3, 0], [3, 3], [-1, 3], [0, V]], ids=repr
)
def test_a_malformed_head_key_is_refused_naming_the_file_and_key(saved, tmp_path, value):
    with pytest.raises(ValueError, match=r"config\.json.*jaxsr_head_token_ids"):
        jaxsr.load_model(edited_copy(saved[1], tmp_path, jaxsr_head_token_ids=value), cache=False)


def test_a_head_key_beside_tied_embeddings_is_refused(saved, tmp_path):
    with pytest.raises(ValueError, match=r"config\.json.*jaxsr_head_token_ids.*tied"):
        jaxsr.load_model(edited_copy(saved[1], tmp_path, tie_word_embeddings=True), cache=False)


def edited_copy(directory, tmp_path, **fields):
    """`directory`'s checkpoint with `fields` changed in its config.json."""
    copy = tmp_path / "copy"
    copy.mkdir()
    (copy / "model.safetensors").symlink_to(directory / "model.safetensors")
    hf = json.loads((directory / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps(hf | fields))
    return copy


# -- where it decodes ---------------------------------------------------------------------------------


def test_contrastive_decoders_refuse_it_naming_the_argument(pair):
    full, reduced = pair
    for make in (jaxsr.contrastive_decoder, jaxsr.speculative_contrastive_decoder):
        with pytest.raises(ValueError, match=r"amateur: contrastive decoding.*head_token_ids"):
            make(full, reduced)
        with pytest.raises(ValueError, match=r"expert: contrastive decoding.*head_token_ids"):
            make(reduced, full)
    with pytest.raises(ValueError, match="amateur"):
        jaxsr.contrastive_decode(full, reduced, PROMPTS, max_new_tokens=4)
    jaxsr.speculative_decoder(full, reduced)  # as a draft, and as a target: allowed
    jaxsr.speculative_decoder(reduced, full)


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=str)
def test_generate_emits_only_scored_ids(pair, sampling):
    _, reduced = pair
    results = jaxsr.generate(reduced, PROMPTS, max_new_tokens=12, num_samples=4, sampling=sampling, seed=5)
    for result in results:
        for sample in result.samples:
            assert len(sample.token_ids) == 12 and set(sample.token_ids) <= set(IDS)
            assert np.isfinite(sample.logprob)


@pytest.mark.slow  # compiles greedy decoding of the reduced-head model and a full forward
def test_greedy_generate_follows_the_argmax_over_the_scored_ids(pair):
    full, reduced = pair
    (sample,) = jaxsr.generate(reduced, [PROMPTS[1]], max_new_tokens=6, sampling=GREEDY)[0].samples
    z = np.asarray(full.logits(*batch([PROMPTS[1] + sample.token_ids[:-1]])))[0]
    start = len(PROMPTS[1]) - 1
    assert sample.token_ids == [IDS[int(np.argmax(z[start + j, IDS]))] for j in range(6)]


@pytest.mark.slow  # compiles plain decoding and 3 speculative decoders (greedy, sampled, reduced target)
def test_speculative_decode_with_a_reduced_draft_runs_and_greedy_equals_the_target(pair):
    full, reduced = pair
    kwargs = dict(max_new_tokens=10, num_samples=2, sampling=GREEDY)
    plain = jaxsr.generate(full, PROMPTS, **kwargs)
    sd = jaxsr.speculative_decode(full, reduced, PROMPTS, gamma=3, **kwargs)
    for a, b in zip(plain, sd, strict=True):
        assert [s.token_ids for s in a.samples] == [s.token_ids for s in b.samples]
        assert b.stats["gamma"] == 3 and b.stats["acceptance_rate"] is not None
    sampled = jaxsr.speculative_decode(full, reduced, PROMPTS, gamma=3, max_new_tokens=10, seed=2)
    assert all(len(s.token_ids) == 10 for r in sampled for s in r.samples)
    # a reduced-head target samples only its ids, whatever the draft proposes
    out = jaxsr.speculative_decode(reduced, full, PROMPTS, gamma=2, max_new_tokens=10, num_samples=3)
    assert all(set(s.token_ids) <= set(IDS) for r in out for s in r.samples)


@pytest.mark.slow  # compiles SD with a reduced-head draft and the reduced model's plain decoding
def test_repeated_calls_compile_the_decode_loop_once(pair):
    full, reduced = pair
    ours = {"prefill", "empty_slab", "insert", "decode_loop"}
    sampling = SamplingConfig(top_k=0)
    jaxsr.speculative_decode(full, reduced, PROMPTS, gamma=3, max_new_tokens=9, sampling=sampling)
    jaxsr.generate(reduced, PROMPTS, max_new_tokens=9)
    others = [[5, 6], [1, 2, 3, 4]]
    with compilations() as compiled:  # other prompts, budget and seed inside the same buckets
        jaxsr.speculative_decode(full, reduced, others, gamma=3, max_new_tokens=7, sampling=sampling, seed=3)
        jaxsr.generate(reduced, others, max_new_tokens=7, seed=3)
    assert not ours & set(compiled)


# -- exactness of speculative sampling with a reduced draft -----------------------------------------

HEAD = (0, 2, 3, 5, 6)
"""The draft's scored ids among test_exactness's 8 (EOS = 5 among them; 1, 4 and 7 only the target
proposes)."""


@pytest.mark.slow
@pytest.mark.parametrize(("gamma", "comp"), [(3, "one prompt"), (2, "eos, processed sampling")])
def test_speculative_sampling_with_a_reduced_draft_is_exact(gamma, comp):
    """test_exactness's harness: 10^5 rows' empirical joint over whole sequences against the exact
    joint of its target (chi-square p > 1e-3, TV within what as many exact draws show)."""
    c = E.COMPOSITIONS[comp]
    target, _ = E.models()
    draft = E.contextual_model(4, head_token_ids=HEAD)
    sampler = Sampler((target, draft), SpeculativeDecoding(gamma=gamma), sampling=c["sampling"])
    prompt_index, sample_ids, tokens, lengths, accepted = E.run(sampler, comp)
    generated = np.arange(tokens.shape[1])[None, :] < lengths[:, None]
    assert np.isin(tokens[generated], [1, 4, 7]).any()  # the target's own tokens come from the residual
    assert 0 < accepted.sum() < (lengths - 1).clip(0).sum()
    for prompt, budget, rows in E.groups(comp, prompt_index, sample_ids, lengths):
        joint, _ = E.exact_joint("SD", prompt, budget, c["stop"], c["sampling"])
        p_value, tv, bound = E.check_joint(E.encode(tokens[rows], lengths[rows], budget), joint, budget)
        assert p_value > 1e-3, (prompt, budget, p_value)
        assert tv <= bound, (prompt, budget, tv, bound)
