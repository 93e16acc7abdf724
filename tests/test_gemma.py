"""Gemma 2 and Gemma 3 (text) as transformers computes them.

Where the rest is tested: test_parity compares every Gemma family's logits (gemma2, gemma3 and the
multimodal gemma3_multimodal) and gemma2_rm's rewards with torch; test_sliding_window runs gemma2 and
gemma3 (W = 16) through prefill past the window, cached decoding one token at a time and multi-token
decode calls across it, and greedy and speculative generation. Here: how config.json is read, that
every Gemma switch is needed for parity (each guard breaks it), the multimodal checkpoint, and
save_model round trips through transformers.
"""

from __future__ import annotations

import dataclasses
import json

import hf_fixtures as H
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from safetensors.numpy import load_file

import jaxsr
from jaxsr.loading.hf_config import decoder_config_from_hf, hf_config_from_decoder
from jaxsr.models.config import LinearRopeScaling
from jaxsr.models.decoder import Decoder

TOL = 1e-4
"""As test_parity: two float32 implementations of logits of O(1–10)."""
W = 16


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    """family → (checkpoint directory, jaxsr model, torch model)."""

    def load(family):
        directory, torch_model = H.checkpoint(family, tmp_path_factory)
        return directory, jaxsr.load_model(directory, cache=False), torch_model

    return load


def _batch():
    """Left-padded rows longer than, as long as and shorter than the window."""
    return H.left_padded_batch(0, lengths=(W + 8, W + 3, W, 9, 1))


def _max_diff_on_real(a, b, mask) -> float:
    real = np.asarray(mask).astype(bool)
    return float(np.abs(np.asarray(a)[real] - np.asarray(b)[real]).max())


# -- config.json --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("config", "sliding"),
    [
        (transformers.Gemma2Config(num_hidden_layers=5), (0, 2, 4)),
        (transformers.Gemma3TextConfig(num_hidden_layers=13), (0, 1, 2, 3, 4, 6, 7, 8, 9, 10, 12)),
    ],
    ids=["gemma2", "gemma3"],
)
def test_local_layers_are_read_as_transformers_lays_them_out(config, sliding):
    """Gemma 2 alternates local and global layers, Gemma 3 has 5 local ones per global one; configs
    without `layer_types` get transformers' default pattern."""
    hf = config.to_dict()
    cfg = decoder_config_from_hf(hf)
    assert (cfg.sliding_window, cfg.sliding_layers) == (config.sliding_window, sliding)
    hf.pop("layer_types")
    assert decoder_config_from_hf(hf) == cfg
    saved = hf_config_from_decoder(cfg)
    assert decoder_config_from_hf(saved) == cfg
    reread = type(config)(**saved)
    assert reread.layer_types == config.layer_types
    assert reread.rope_parameters == config.rope_parameters


def test_gemma2_defaults_are_transformers_defaults():
    hf = transformers.Gemma2Config().to_dict()
    for key in ("attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar"):
        hf.pop(key)
    cfg = decoder_config_from_hf(hf)
    assert (cfg.attn_logit_softcapping, cfg.final_logit_softcapping) == (50.0, 30.0)
    assert cfg.query_pre_attn_scalar == 256 and cfg.tie_word_embeddings and not cfg.qk_norm
    uncapped = decoder_config_from_hf(hf | {"attn_logit_softcapping": None, "final_logit_softcapping": None})
    assert (uncapped.attn_logit_softcapping, uncapped.final_logit_softcapping) == (None, None)


def test_gemma3_rope_in_transformers4_spelling(gemma):
    """v4 configs (Gemma 3 4B and up) give the global base as rope_theta with its linear
    rope_scaling, and the local base as rope_local_base_freq."""
    directory, lm, _ = gemma("gemma3")
    cfg = lm.config
    assert (cfg.rope_theta, cfg.rope_scaling, cfg.local_rope_theta) == (1000.0, LinearRopeScaling(2.0), 20.0)
    assert cfg.qk_norm and cfg.attn_logit_softcapping is None and cfg.final_logit_softcapping is None
    hf = json.loads((directory / "config.json").read_text())
    hf.pop("rope_parameters")
    v4 = hf | {
        "rope_theta": 1000.0,
        "rope_local_base_freq": 20.0,
        "rope_scaling": {"rope_type": "linear", "factor": 2.0},
    }
    assert decoder_config_from_hf(v4) == cfg


def test_the_multimodal_checkpoint_loads_its_text_decoder(gemma):
    directory, lm, _ = gemma("gemma3_multimodal")
    _, text_lm, _ = gemma("gemma3")
    assert lm.config == text_lm.config  # the same text config, read from `text_config`
    names = load_file(str(directory / "model.safetensors")).keys()
    assert any(n.startswith("vision_tower.") for n in names)  # present, and not loaded
    prefixes = ("language_model.model.", "vision_tower.", "multi_modal_projector.")
    assert all(n.startswith(prefixes) for n in names)


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        (lambda c: c | {"use_bidirectional_attention": True}, "use_bidirectional_attention"),
        (lambda c: c | {"layer_types": ["sliding_attention", "chunked_attention"]}, "layer_types"),
        (lambda c: c | {"query_pre_attn_scalar": 0}, "query_pre_attn_scalar"),
        (lambda c: c | {"attn_logit_softcapping": "50"}, "attn_logit_softcapping"),
        (
            lambda c: c | {"rope_parameters": {"sliding_attention": {"rope_type": "linear", "factor": 2.0}}},
            "rope_parameters",
        ),
    ],
)
def test_bad_gemma_fields_are_named(edit, field):
    hf = transformers.Gemma3TextConfig(num_hidden_layers=2).to_dict()
    with pytest.raises(ValueError, match=field):
        decoder_config_from_hf(edit(hf))


def test_a_multimodal_config_without_a_text_config_is_named():
    with pytest.raises(ValueError, match="text_config"):
        decoder_config_from_hf({"model_type": "gemma3", "text_config": "gemma3_text"})


# -- every switch matters -----------------------------------------------------------------------


def _variant(lm: jaxsr.Model, **changes) -> jaxsr.Model:
    """`lm`'s parameters run by the decoder of its config with `changes`."""
    config = dataclasses.replace(lm.config, **changes)
    graph, _ = nnx.split(nnx.eval_shape(lambda: Decoder(config, rngs=nnx.Rngs(0))))
    return jaxsr.Model(config=config, graph=graph, params=lm.params)


_COMMON_GUARDS = {
    "norms without (1 + w)": dict(norm_unit_offset=False),
    "unscaled embeddings": dict(scale_embeddings=False),
    "head_dim attention scale": dict(query_pre_attn_scalar=None),
    "window W + 1": dict(sliding_window=W + 1),
    "window W - 1": dict(sliding_window=W - 1),
    "no window": dict(sliding_window=None),
}
GUARDS = [("gemma2", name, changes) for name, changes in _COMMON_GUARDS.items()]
GUARDS += [
    ("gemma2", "no attention soft-cap", dict(attn_logit_softcapping=None)),
    ("gemma2", "no final soft-cap", dict(final_logit_softcapping=None)),
]
GUARDS += [("gemma3", name, changes) for name, changes in _COMMON_GUARDS.items()]
GUARDS += [
    ("gemma3", "one RoPE base", dict(local_rope_theta=None)),
    ("gemma3", "no linear RoPE scaling", dict(rope_scaling=None)),
]


@pytest.mark.parametrize(("family", "name", "changes"), GUARDS, ids=[f"{f}: {n}" for f, n, _ in GUARDS])
def test_each_gemma_switch_is_needed_for_parity(gemma, family, name, changes):
    """The parity of test_parity/test_sliding_window is not vacuous: with any one Gemma switch
    changed, logits are clearly off. The window guards pin transformers' convention (a query sees W
    keys, itself included) numerically."""
    _, lm, torch_model = gemma(family)
    tokens, mask = _batch()
    expected = H.torch_logits(torch_model, tokens, mask)
    assert _max_diff_on_real(_variant(lm).logits(tokens, mask), expected, mask) < TOL
    assert _max_diff_on_real(_variant(lm, **changes).logits(tokens, mask), expected, mask) > 1e-2


# -- save_model ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("family", "torch_class"),
    [
        ("gemma2", "Gemma2ForCausalLM"),
        ("gemma3", "Gemma3ForCausalLM"),
        ("gemma3_multimodal", "Gemma3ForCausalLM"),  # saved text-only
        ("gemma2_rm", "Gemma2ForSequenceClassification"),
    ],
)
def test_saved_checkpoint_has_the_original_tensors_and_transformers_computes_the_same(
    gemma, family, torch_class, tmp_path
):
    """save_model writes the norm weights w in transformers' convention (it adds 1 at use): the
    saved tensors are the original ones, bit for bit, under text-only names."""
    directory, lm, torch_model = gemma(family)
    saved = jaxsr.save_model(lm, tmp_path / "saved", pad_token_id=H.PAD_ID)
    original = load_file(str(directory / "model.safetensors"))
    original = {n.removeprefix("language_model."): t for n, t in original.items() if "vision" not in n}
    original = {n: t for n, t in original.items() if not n.startswith("multi_modal_projector.")}
    written = load_file(str(saved / "model.safetensors"))
    assert written.keys() == original.keys()
    for name, tensor in written.items():
        np.testing.assert_array_equal(tensor, original[name], err_msg=name)

    reloaded = getattr(transformers, torch_class).from_pretrained(str(saved), attn_implementation="eager")
    tokens, mask = _batch()
    expected = H.torch_logits(torch_model, tokens, mask)
    got = H.torch_logits(reloaded.float().eval(), tokens, mask)
    again = jaxsr.load_model(saved, cache=False)
    assert again.config == lm.config
    if lm.config.is_reward_model:
        np.testing.assert_allclose(got, expected, atol=1e-6, rtol=0)
        np.testing.assert_allclose(np.asarray(again.scores(tokens, mask)), expected[:, 0], atol=TOL, rtol=0)
    else:
        assert _max_diff_on_real(got, expected, mask) < 1e-6
        assert _max_diff_on_real(again.logits(tokens, mask), expected, mask) < TOL


# -- GGUF ---------------------------------------------------------------------------------------

QUANTIZED = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
"""Projections written as Q8_0 (their rows of 32 inputs are whole Q8_0 blocks)."""


def _write_gemma3_gguf(model, path, quantized: tuple[str, ...] = ()) -> None:
    """`model` as llama.cpp's converter writes a Gemma 3 GGUF: its tensor names, norm weights with
    the +1 added, and the `quantized` projections in Q8_0."""
    import gguf

    cfg = model.config
    rope = cfg.rope_parameters
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA3, cfg.num_hidden_layers)
    writer = gguf.GGUFWriter(str(path), "gemma3")
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(rope["full_attention"]["rope_theta"])
    writer.add_float32("gemma3.rope.freq_base_swa", rope["sliding_attention"]["rope_theta"])
    writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
    writer.add_rope_scaling_factor(rope["full_attention"]["factor"])
    writer.add_sliding_window(cfg.sliding_window)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight":  # tied
            continue
        base, suffix = name.rsplit(".", 1)
        w = tensor.numpy().astype(np.float32)
        if name.endswith("norm.weight"):
            w = w + 1
        gguf_name = f"{names.get_name(base)}.{suffix}"
        if quantized and base.endswith(quantized):
            q8 = gguf.GGMLQuantizationType.Q8_0
            writer.add_tensor(gguf_name, gguf.quants.quantize(w, q8), raw_dtype=q8)
        else:
            writer.add_tensor(gguf_name, np.ascontiguousarray(w))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@torch.no_grad()
def test_a_gemma3_gguf_matches_torch_within_its_quantisation(tmp_path, monkeypatch):
    """F32: within 1e-4 of torch. Q8_0: within 1e-4 of torch run on the dequantised weights, and
    off the exact logits by quantisation error only."""
    import gguf

    monkeypatch.setenv("JAXSR_CACHE_DIR", str(tmp_path / "param-cache"))
    # llama.cpp takes query_pre_attn_scalar to be head_dim (for all but the 27B)
    model = H.make_model("gemma3", query_pre_attn_scalar=16)
    tokens, mask = _batch()
    expected = H.torch_logits(model, tokens, mask)
    _write_gemma3_gguf(model, tmp_path / "f32.gguf")
    lm = jaxsr.load_model(tmp_path / "f32.gguf", cache=False)
    assert lm.config.sliding_layers == (0, 1, 2, 3, 4) and lm.config.local_rope_theta == 20.0
    assert _max_diff_on_real(lm.logits(tokens, mask), expected, mask) < TOL

    _write_gemma3_gguf(model, tmp_path / "q8.gguf", QUANTIZED)
    quantized = jaxsr.load_model(tmp_path / "q8.gguf", cache=False)
    q8 = gguf.GGMLQuantizationType.Q8_0
    for name, p in model.named_parameters():
        if name.removesuffix(".weight").endswith(QUANTIZED):
            p.copy_(torch.as_tensor(gguf.quants.dequantize(gguf.quants.quantize(p.numpy(), q8), q8)))
    dequantized = H.torch_logits(model, tokens, mask)
    got = quantized.logits(tokens, mask)
    assert _max_diff_on_real(got, dequantized, mask) < TOL
    error = _max_diff_on_real(got, expected, mask)
    assert 1e-3 < error < 0.05 * np.abs(expected).max(), error
