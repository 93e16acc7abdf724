"""Gemma 2 and Gemma 3 (text) as transformers computes them.

Where the rest is tested: test_parity compares every Gemma family's logits (gemma2, gemma3 and the
multimodal gemma3_multimodal) and gemma2_rm's rewards with torch; test_sliding_window runs gemma2 and
gemma3 (W = 16) through prefill past the window, cached decoding one token at a time and multi-token
decode calls across it, and greedy and speculative generation. Here: how config.json is read, that
every Gemma switch is needed for parity (each guard breaks it), the multimodal checkpoint,
save_model round trips through transformers, and Gemma 2 and Gemma 3 GGUF files as llama.cpp writes them.
"""

from __future__ import annotations

import dataclasses
import json
import string
from typing import Any

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


def _gguf_tokens(n: int) -> list[str]:
    """A SentencePiece vocabulary of `n` tokens with Gemma's special ids (pad 0, eos 1, bos 2, unk 3)."""
    letters = string.ascii_lowercase + string.ascii_uppercase + string.digits
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", "\u2581", *letters]
    tokens += ["\u2581" + c for c in string.ascii_lowercase] + list(".,!?;:'\"()-")
    assert len(tokens) >= n
    return tokens[:n]


GGUF_ARCH = {"gemma2": "gemma2", "gemma3_text": "gemma3"}
"""Hugging Face model_type → GGUF architecture."""


def _write_gemma_gguf(
    model,
    path,
    quantized: tuple[str, ...] = (),
    *,
    raw: dict[str, tuple[np.ndarray, object]] | None = None,
    tokenizer: bool = False,
) -> None:
    """`model` (Gemma 2 or Gemma 3) as llama.cpp's converter writes it: the metadata its Gemma2Model /
    Gemma3Model write, its tensor names, norm weights with the +1 added, the `quantized` projections in
    Q8_0 and the tensors of `raw` (HF name → (blocks, GGML type)) as given. `tokenizer` adds a minimal
    SentencePiece vocabulary as llama.cpp stores Gemma's (transformers' GGUF reader takes the vocabulary
    size from it)."""
    import gguf

    cfg = model.config
    arch = GGUF_ARCH[cfg.model_type]
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], cfg.num_hidden_layers)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    rope = cfg.rope_parameters
    if arch == "gemma2":  # both soft-caps; no RoPE base (llama.cpp's default 10000 is Gemma 2's)
        assert rope == {"rope_type": "default", "rope_theta": 10000.0}, rope
        writer.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        writer.add_final_logit_softcapping(cfg.final_logit_softcapping)
    else:
        writer.add_rope_freq_base(rope["full_attention"]["rope_theta"])
        writer.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
        if rope["full_attention"]["rope_type"] == "linear":  # as llama.cpp's converter, only when scaled
            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(rope["full_attention"]["factor"])
    writer.add_sliding_window(cfg.sliding_window)
    if tokenizer:
        tokens = _gguf_tokens(cfg.vocab_size)
        writer.add_tokenizer_model("llama")
        writer.add_tokenizer_pre("default")
        writer.add_token_list(tokens)
        writer.add_token_scores([-float(i) for i in range(len(tokens))])
        control, unknown, normal = gguf.TokenType.CONTROL, gguf.TokenType.UNKNOWN, gguf.TokenType.NORMAL
        writer.add_token_types([control] * 3 + [unknown] + [normal] * (len(tokens) - 4))
        writer.add_pad_token_id(0)
        writer.add_eos_token_id(1)
        writer.add_bos_token_id(2)
        writer.add_unk_token_id(3)
        writer.add_add_bos_token(True)
    raw = raw or {}
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight":  # tied
            continue
        base, suffix = name.rsplit(".", 1)
        w = tensor.numpy().astype(np.float32)
        if name.endswith("norm.weight"):
            w = w + 1
        gguf_name = f"{names.get_name(base)}.{suffix}"
        if name in raw:
            blocks, kind = raw[name]
            writer.add_tensor(gguf_name, blocks, raw_dtype=kind)
        elif quantized and base.endswith(quantized):
            q8 = gguf.GGMLQuantizationType.Q8_0
            writer.add_tensor(gguf_name, gguf.quants.quantize(w, q8), raw_dtype=q8)
        else:
            writer.add_tensor(gguf_name, np.ascontiguousarray(w))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@torch.no_grad()
@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_a_gemma_gguf_matches_torch_within_its_quantisation(tmp_path, monkeypatch, family):
    """F32: within 1e-4 of torch. Q8_0: within 1e-4 of torch run on the dequantised weights, and
    off the exact logits by quantisation error only. Gemma 2's soft-caps (5 and 8, not llama.cpp's
    defaults 50 and 30) and window come from the file's metadata."""
    import gguf

    monkeypatch.setenv("JAXSR_CACHE_DIR", str(tmp_path / "param-cache"))
    # llama.cpp takes query_pre_attn_scalar to be head_dim (for all but the 27B)
    model = H.make_model(family, query_pre_attn_scalar=16)
    tokens, mask = _batch()
    expected = H.torch_logits(model, tokens, mask)
    _write_gemma_gguf(model, tmp_path / "f32.gguf")
    lm = jaxsr.load_model(tmp_path / "f32.gguf", cache=False)
    cfg = lm.config
    if family == "gemma2":
        assert (cfg.sliding_window, cfg.sliding_layers, cfg.local_rope_theta) == (W, (0, 2), None)
        assert (cfg.attn_logit_softcapping, cfg.final_logit_softcapping) == (5.0, 8.0) and not cfg.qk_norm
    else:
        assert cfg.sliding_layers == (0, 1, 2, 3, 4) and cfg.local_rope_theta == 20.0
    assert _max_diff_on_real(lm.logits(tokens, mask), expected, mask) < TOL

    _write_gemma_gguf(model, tmp_path / "q8.gguf", QUANTIZED)
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


def _random_k_blocks(rng: np.random.Generator, shape: tuple[int, int], kind, std: float) -> np.ndarray:
    """Random valid K-quant blocks (`gguf.quants.quantize` has no K-quants) for a [rows, cols]
    weight: random quants and sub-block scales, super-block scales (f16) sized so that the
    dequantised weights have a standard deviation of about `std`."""
    import gguf

    Q = gguf.GGMLQuantizationType
    block, size = gguf.GGML_QUANT_SIZES[kind]
    rows, cols = shape
    n = rows * cols // block
    blocks = rng.integers(0, 256, (n, size), dtype=np.uint8)
    if kind == Q.Q6_K:  # ql[128] qh[64] scales[16] (int8) d (f16): w = d · scale · (q - 32)
        blocks[:, 192:208] = rng.integers(-32, 32, (n, 16)).astype(np.int8).view(np.uint8)
        blocks[:, 208:210] = np.full((n, 1), std / 340, np.float16).view(np.uint8)
    elif kind == Q.Q4_K:  # d (f16) dmin (f16) scales[12] (6-bit scales and mins) qs[128]: w = d·s·q - dmin·m
        d = np.full((n, 1), std / 260, np.float16)
        blocks[:, 0:2] = d.view(np.uint8)
        blocks[:, 2:4] = (d * 7.5).astype(np.float16).view(np.uint8)
    else:
        raise ValueError(kind)
    return blocks.reshape(rows, cols // block * size)


@torch.no_grad()
def _quantise_in_place(model, kinds: dict[str, object], seed: int = 0) -> dict[str, tuple[np.ndarray, Any]]:
    """Write the projections named by `kinds` (suffix → GGML type) as that type: Q8_0 by gguf's
    quantiser, K-quants as random blocks. The torch weights become the dequantised ones; returns
    `_write_gemma_gguf`'s `raw`."""
    import gguf

    Q = gguf.GGMLQuantizationType
    rng = np.random.default_rng(seed)
    raw = {}
    for name, p in model.named_parameters():
        kind = next((k for suffix, k in kinds.items() if name.endswith(f"{suffix}.weight")), None)
        if kind is None:
            continue
        w = p.numpy()
        if kind in (Q.Q4_K, Q.Q6_K):
            blocks = _random_k_blocks(rng, w.shape, kind, 1 / np.sqrt(w.shape[1]))
        else:
            blocks = gguf.quants.quantize(w, kind)
        dequantised = gguf.quants.dequantize(blocks, kind)
        assert dequantised.shape == w.shape and 0.5 < dequantised.std() * np.sqrt(w.shape[1]) < 2, name
        p.copy_(torch.as_tensor(dequantised))
        raw[name] = (blocks, kind)
    return raw


def _shaped_for_transformers(family: str):
    """A file that says all transformers' GGUF reader needs, with MLP 256 wide and o_proj 1024 in (so
    down_proj and o_proj rows are whole K-quant blocks). Gemma 3 1B's attention shape (head_dim 256 =
    query_pre_attn_scalar, one KV head, the local RoPE base 10000, no RoPE scaling); Gemma 2 2B/9B's
    (head_dim 256 = query_pre_attn_scalar, the soft-caps 50 and 30 of every released Gemma 2)."""
    kwargs = dict(head_dim=256, query_pre_attn_scalar=256, num_key_value_heads=1, intermediate_size=256)
    if family == "gemma2":
        return H.make_model("gemma2", attn_logit_softcapping=50.0, final_logit_softcapping=30.0, **kwargs)
    rope = {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "default", "rope_theta": 1000.0},
    }
    return H.make_model("gemma3", rope_parameters=rope, **kwargs)


def _gguf_kinds(name: str) -> dict[str, object]:
    import gguf

    Q = gguf.GGMLQuantizationType
    if name == "f32":
        return {}
    # as a Q4_K_M file mixes them: 8-bit attention inputs and gate/up, Q4_K o_proj, Q6_K down_proj
    return {p: Q.Q8_0 for p in QUANTIZED} | {"self_attn.o_proj": Q.Q4_K, "mlp.down_proj": Q.Q6_K}


def _transformers_gguf(path, **config):
    """transformers' own reading of a GGUF file (its GGUF loader, dequantised to float32)."""
    with torch.no_grad():
        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, attn_implementation="eager", **config
        )
    assert model.dtype == torch.float32
    return model.eval()


@pytest.mark.parametrize("kinds", ["f32", "q8_0+q4_k+q6_k"])
@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_transformers_reads_a_gemma_gguf_as_jaxsr_does(tmp_path, monkeypatch, family, kinds):
    """The offline stand-in for "a real Gemma 2 / Gemma 3 GGUF loads and its logits match
    transformers' reading of the same file": a 2B / 1B-shaped file (F32, and one with Q8_0, Q4_K and
    Q6_K tensors) read by jaxsr and by transformers' GGUF loader, which shares no code with jaxsr's
    reader but gguf's dequantisation. Both are also checked against torch on the (dequantised) weights."""
    import gguf

    monkeypatch.setenv("JAXSR_CACHE_DIR", str(tmp_path / "param-cache"))
    model = _shaped_for_transformers(family)
    raw = _quantise_in_place(model, _gguf_kinds(kinds))
    path = tmp_path / f"{family}.gguf"
    _write_gemma_gguf(model, path, raw=raw, tokenizer=True)
    types = {t.tensor_type.name for t in gguf.GGUFReader(path).tensors}
    assert types == {"F32"} | {k.name for k in _gguf_kinds(kinds).values()}

    tokens, mask = _batch()
    expected = H.torch_logits(model, tokens, mask)
    lm = jaxsr.load_model(path, cache=False)
    theirs = _transformers_gguf(path)
    reference = H.torch_logits(theirs, tokens, mask)
    assert _max_diff_on_real(reference, expected, mask) < 1e-6  # transformers read the file as written
    assert _max_diff_on_real(lm.logits(tokens, mask), reference, mask) < TOL
    assert lm.tokenizer is not None and lm.tokenizer.pad_token_id == theirs.config.pad_token_id == 0
    assert lm.tokenizer("ab").input_ids == [2, 5 + 0, 5 + 1]  # <bos> a b


# What transformers' GGUF reader (GGUF_CONFIG_MAPPING[arch]) does not read from a Gemma file.
# Gemma 3: gemma3.rope.freq_base_swa and gemma3.rope.scaling.* (it keeps Gemma3TextConfig's local base
# 10000 and no scaling: Gemma 3 4B/12B/27B files have linear ×8 scaling), and llama.cpp's
# query_pre_attn_scalar rule (it keeps 256, which is not the 27B's 168).
# Gemma 2: gemma2.attn_logit_softcapping and gemma2.final_logit_softcapping (it keeps Gemma2Config's
# 50 and 30, which every released Gemma 2 has), and llama.cpp's query_pre_attn_scalar rule (it keeps
# 256, which is not the 27B's 144).
TRANSFORMERS_GGUF_UNREAD = {
    "gemma2": {"query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping"},
    "gemma3": {"rope_parameters", "query_pre_attn_scalar"},
}


def _same(a, b) -> bool:
    """Equal, floats up to the float32 rounding of GGUF metadata."""
    if isinstance(a, float) and isinstance(b, float):
        return bool(np.isclose(a, b, rtol=1e-6, atol=0))
    return a == b


@pytest.mark.parametrize("family", ["gemma2", "gemma3"])
def test_transformers_gguf_reader_misses_only_known_gemma_fields(tmp_path, monkeypatch, family):
    """Gemma 3: a 4B-shaped file (linear global RoPE scaling, local base 20, head_dim 16); Gemma 2:
    soft-caps 5 and 8, head_dim 16. transformers' config differs from the one it was written from in
    the known fields only, and given those its logits are jaxsr's. Without them they are not (the
    fields matter)."""
    monkeypatch.setenv("JAXSR_CACHE_DIR", str(tmp_path / "param-cache"))
    model = H.make_model(family, query_pre_attn_scalar=16)  # llama.cpp's rule: head_dim
    path = tmp_path / f"{family}.gguf"
    _write_gemma_gguf(model, path, tokenizer=True)
    unread = TRANSFORMERS_GGUF_UNREAD[family]
    theirs = _transformers_gguf(path)
    keys = ("rope_parameters", "query_pre_attn_scalar", "layer_types", "sliding_window", "head_dim")
    keys += ("hidden_activation", "rms_norm_eps", "attn_logit_softcapping", "final_logit_softcapping")
    differ = {k for k in keys if not _same(getattr(theirs.config, k), getattr(model.config, k))}
    assert differ <= unread, differ

    tokens, mask = _batch()
    got = jaxsr.load_model(path, cache=False).logits(tokens, mask)
    if differ:
        assert _max_diff_on_real(got, H.torch_logits(theirs, tokens, mask), mask) > 1e-2
    told = _transformers_gguf(path, **{k: getattr(model.config, k) for k in unread})
    assert _max_diff_on_real(got, H.torch_logits(told, tokens, mask), mask) < TOL


def _gemma2_metadata_only(path, layers: int = 4, **extra) -> None:
    """A Gemma 2 file with only the keys llama.cpp requires (no soft-caps, window or RoPE base) and
    the token embedding, plus the `extra` float keys (`gemma2.` + name)."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "gemma2")
    writer.add_block_count(layers)
    writer.add_context_length(8192)
    writer.add_embedding_length(64)
    writer.add_feed_forward_length(128)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_key_length(32)
    writer.add_value_length(32)
    writer.add_layer_norm_rms_eps(1e-6)
    for name, value in extra.items():
        writer.add_float32(f"gemma2.{name}", value)
    writer.add_tensor("token_embd.weight", np.zeros((H.VOCAB, 64), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_a_gemma2_gguf_without_metadata_gets_llama_cpps_values(tmp_path):
    """What a Gemma 2 file does not store is what llama.cpp assumes: soft-caps 50 and 30, a window of
    4096 on every other layer from layer 0, RoPE base 10000, and query_pre_attn_scalar = head_dim but
    for the 46-layer 27B (hidden/heads)."""
    from jaxsr.loading.gguf import read_gguf

    _gemma2_metadata_only(tmp_path / "small.gguf")
    hf, _, _ = read_gguf(tmp_path / "small.gguf")
    cfg = decoder_config_from_hf(hf)
    assert (cfg.attn_logit_softcapping, cfg.final_logit_softcapping) == (50.0, 30.0)
    assert (cfg.sliding_window, cfg.sliding_layers) == (4096, (0, 2))
    assert (cfg.rope_theta, cfg.rope_scaling, cfg.local_rope_theta) == (10000.0, None, None)
    assert (cfg.query_pre_attn_scalar, cfg.model_type, cfg.tie_word_embeddings) == (32, "gemma2", True)
    _gemma2_metadata_only(tmp_path / "27b.gguf", layers=46)
    assert read_gguf(tmp_path / "27b.gguf")[0]["query_pre_attn_scalar"] == 64 // 4
    _gemma2_metadata_only(tmp_path / "swa.gguf", **{"rope.freq_base_swa": 20.0})
    with pytest.raises(ValueError, match="separate RoPE base for its local layers"):
        read_gguf(tmp_path / "swa.gguf")
