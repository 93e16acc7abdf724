"""GGUF loading: SmolLM2 against PyTorch, synthetic GGUFs of each architecture, bad files, q/k order.

Synthetic GGUFs are written from the tiny random torch models of `hf_fixtures` the way llama.cpp's
converter writes them: names from gguf-py's own HF→GGUF name map (independent of jaxsr's reverse table)
and, for Llama, q/k rows interleaved per head. The torch model is then the parity oracle.
"""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
from pathlib import Path

import gguf
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from hf_fixtures import left_padded_batch, make_model, torch_logits

import jaxsr
from jaxsr.loading.files import CheckpointError
from jaxsr.loading.gguf import hf_tensor_name, read_gguf, smollm2_path, unpermute_qk
from jaxsr.models.layers import apply_rope, rope_inverse_frequencies

QUESTION = "What are three tips for staying healthy?"
COMMON_WORDS = {"the", "and", "to", "of", "a", "your", "is", "for", "you", "in", "can", "be", "it", "that"}


# -- synthetic GGUF files --------------------------------------------------------------------------


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's HF → GGUF q/k order: within a head, row p*D/2 + j moves to row 2j + p."""
    half = w.shape[0] // heads // 2
    return w.reshape(heads, 2, half, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(
    model: torch.nn.Module, path: Path, arch: str, extra_tensors: dict | None = None, *, label=None, **meta
) -> Path:
    """Write `model` as an F32 GGUF laid out for `arch` (declared as `label`, default `arch`).

    `meta` adds `{label}.{key}` integers or strings; `extra_tensors` adds raw tensors.
    """
    cfg = model.config
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    names = gguf.get_tensor_name_map(next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch), 64)
    writer = gguf.GGUFWriter(str(path), label or arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_eos_token_id(cfg.eos_token_id)
    for key, value in meta.items():
        add = writer.add_string if isinstance(value, str) else writer.add_uint32
        add(f"{writer.arch}.{key}", value)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        base, suffix = name.rsplit(".", 1)
        gguf_name = f"{names.get_name(base)}.{suffix}"
        w = tensor.numpy().astype(np.float32)
        if arch == "llama" and ".attn_q." in gguf_name:
            w = llama_cpp_permute(w, heads)
        elif arch == "llama" and ".attn_k." in gguf_name:
            w = llama_cpp_permute(w, kv_heads)
        writer.add_tensor(gguf_name, np.ascontiguousarray(w))
    for name, w in (extra_tensors or {}).items():
        writer.add_tensor(name, w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    """Never touch the real parameter cache."""
    monkeypatch.setenv("JAXSR_CACHE_DIR", str(tmp_path / "param-cache"))
    return tmp_path / "param-cache"


@pytest.mark.parametrize(
    "family, arch",
    [
        ("llama2", "llama"),
        ("llama_tied", "llama"),
        ("llama_bias", "llama"),
        ("llama_head_dim", "llama"),
        ("qwen2", "qwen2"),
        ("qwen2_untied", "qwen2"),
        ("qwen3", "qwen3"),
    ],
)
def test_synthetic_gguf_matches_torch(family, arch, tmp_path):
    model = make_model(family)
    path = write_gguf(model, tmp_path / f"{family}.gguf", arch)
    lm = jaxsr.load_model(path, cache=False)
    assert lm.tokenizer is None  # no tokenizer metadata in the file
    assert lm.config.model_type == arch
    assert lm.config.tie_word_embeddings == model.config.tie_word_embeddings
    assert lm.eos_token_ids == (model.config.eos_token_id,)
    tokens, mask = left_padded_batch()
    # jax against torch in float32 on logits of O(1–10): measured within 7e-6 on AVX2, AVX and SSE4.2
    np.testing.assert_allclose(
        np.asarray(lm.logits(tokens, mask))[mask.astype(bool)],
        torch_logits(model, tokens, mask)[mask.astype(bool)],
        atol=1e-4,
        rtol=0,
    )


def test_hf_names_cover_gguf_py_names():
    """jaxsr's GGUF → HF table inverts gguf-py's HF → GGUF map for every tensor jaxsr loads."""
    for arch in ("llama", "qwen2", "qwen3"):
        model = make_model({"llama": "llama_bias", "qwen2": "qwen2_untied", "qwen3": "qwen3"}[arch])
        names = gguf.get_tensor_name_map(next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch), 64)
        for name in model.state_dict():
            base, suffix = name.rsplit(".", 1)
            assert hf_tensor_name(f"{names.get_name(base)}.{suffix}") == name


@pytest.mark.parametrize(
    "label, meta, extra, message",
    [
        ("phi3", {}, {}, "unknown GGUF architecture 'phi3'"),
        ("llama", {"expert_count": 4}, {}, "mixture-of-experts"),
        ("llama", {}, {"rope_freqs.weight": np.ones(4, np.float32)}, "rope_freqs"),
        ("llama", {}, {"blk.0.attn_gate.weight": np.ones((4, 4), np.float32)}, "blk.0.attn_gate.weight"),
    ],
)
def test_unsupported_gguf_is_refused(label, meta, extra, message, tmp_path):
    path = write_gguf(make_model("llama2"), tmp_path / "model.gguf", "llama", extra, label=label, **meta)
    with pytest.raises(ValueError, match=re.escape(message)):
        read_gguf(path)


@pytest.mark.parametrize("value", ["four", 0])
def test_a_metadata_count_of_the_wrong_type_names_the_file_and_key(value, tmp_path, monkeypatch):
    monkeypatch.setattr(gguf.GGUFWriter, "add_block_count", lambda self, n: None)  # written below instead
    path = write_gguf(make_model("llama2"), tmp_path / "model.gguf", "llama", block_count=value)
    with pytest.raises(
        ValueError, match=r"model.gguf: metadata 'llama.block_count' must be a positive integer"
    ):
        read_gguf(path)


@pytest.mark.parametrize("keep", [0, 3, 200, 0.5, -1])
def test_truncated_synthetic_gguf_names_the_file(keep, tmp_path, private_cache):
    data = write_gguf(make_model("llama2"), tmp_path / "full.gguf", "llama").read_bytes()
    cut = int(len(data) * keep) if isinstance(keep, float) else keep % len(data)
    path = tmp_path / "cut.gguf"
    path.write_bytes(data[:cut])
    with pytest.raises(CheckpointError, match=re.escape(str(path))):
        jaxsr.load_model(path)
    assert not private_cache.exists() or not any(private_cache.iterdir())


def test_garbage_gguf_names_the_file(tmp_path):
    path = tmp_path / "garbage.gguf"
    path.write_bytes(b"NOPE" + bytes(4096))
    with pytest.raises(CheckpointError, match=re.escape(str(path))):
        jaxsr.load_model(path)


# -- q/k order -------------------------------------------------------------------------------------


def test_unpermute_qk_matches_index_formula():
    heads, D, d_in = 3, 8, 5
    gguf_rows = np.random.default_rng(0).normal(size=(heads * D, d_in))
    hf = unpermute_qk(gguf_rows, heads)
    for h in range(heads):
        for p in (0, 1):
            for j in range(D // 2):
                np.testing.assert_array_equal(hf[h * D + p * D // 2 + j], gguf_rows[h * D + 2 * j + p])
    bias = np.arange(heads * D, dtype=np.float32)
    np.testing.assert_array_equal(unpermute_qk(bias, heads), unpermute_qk(bias[:, None], heads)[:, 0])
    np.testing.assert_array_equal(unpermute_qk(llama_cpp_permute(gguf_rows, heads), heads), gguf_rows)


def test_unpermuted_rotate_half_rope_equals_interleaved_rope():
    """Attention scores of llama.cpp's interleaved RoPE on GGUF rows equal jaxsr's RoPE on unpermuted rows."""
    heads, D, d_in, T = 2, 8, 6, 5
    rng = np.random.default_rng(1)
    wq, wk = (rng.normal(size=(heads * D, d_in)).astype(np.float32) for _ in range(2))
    x = rng.normal(size=(T, d_in)).astype(np.float32)
    positions = np.arange(T)
    inv = rope_inverse_frequencies(D, 10000.0, None)

    def interleaved(v):  # [T, heads, D]: pairs (2j, 2j+1) rotate by position * inv[j]
        angle = positions[:, None, None] * inv[None, None, :]
        a, b = v[..., 0::2], v[..., 1::2]
        out = np.empty_like(v)
        out[..., 0::2] = a * np.cos(angle) - b * np.sin(angle)
        out[..., 1::2] = b * np.cos(angle) + a * np.sin(angle)
        return out

    def scores(q, k):
        return np.einsum("thd,shd->hts", q, k)

    q_gguf, k_gguf = (interleaved((x @ w.T).reshape(T, heads, D)) for w in (wq, wk))

    def rotate_half(w):
        v = jnp.asarray((x @ unpermute_qk(w, heads).T).reshape(1, T, heads, D))
        return np.asarray(apply_rope(v, jnp.asarray(positions)[None], inv))[0]

    # numpy float64 rotations against jax float32 ones on scores of O(10): f32 rounding, measured 4e-6
    np.testing.assert_allclose(scores(q_gguf, k_gguf), scores(rotate_half(wq), rotate_half(wk)), atol=1e-4)


# -- SmolLM2 (the real Q4_1 GGUF) ------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2():
    """(jaxsr model, PyTorch HF model) of SmolLM2 built from the same GGUF; loaded once (slow)."""
    from transformers import AutoModelForCausalLM

    path = smollm2_path()
    lm = jaxsr.load_model(path, cache=False)
    hf = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    return lm, hf


def chat_ids(tokenizer, question: str) -> list[int]:
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
    )
    return tokenizer(text, add_special_tokens=False).input_ids


def left_pad(rows: list[list[int]], pad: int, width: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    width = width or max(map(len, rows))
    tokens = np.full((len(rows), width), pad, np.int64)
    mask = np.zeros((len(rows), width), np.int64)
    for b, row in enumerate(rows):
        tokens[b, width - len(row) :] = row
        mask[b, width - len(row) :] = 1
    return tokens, mask


# SmolLM2's GGUF tokenizer as a process without torch prints it (transformers' GGUF reader imports torch)
WITHOUT_TORCH = """
import hashlib, json, sys
sys.modules["torch"] = None  # any import of torch now fails
from jaxsr.loading.gguf import read_gguf, smollm2_path
_, _, tokenizer = read_gguf(smollm2_path())
messages = [{"role": "user", "content": "Hi"}]
print(json.dumps({
    "backend": hashlib.sha256(tokenizer.backend_tokenizer.to_str().encode()).hexdigest(),
    "specials": [tokenizer.bos_token, tokenizer.eos_token, tokenizer.unk_token, tokenizer.pad_token],
    "add_bos_token": tokenizer.add_bos_token,
    "chat": tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
    "name": tokenizer.name_or_path,
}))
"""


@pytest.mark.slow  # reads SmolLM2's 49k-token vocabulary twice: without torch, and by transformers
def test_a_gguf_tokenizer_is_read_without_torch_as_transformers_reads_it():
    from transformers import AutoTokenizer

    path = smollm2_path()
    done = subprocess.run([sys.executable, "-c", WITHOUT_TORCH], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    ours = json.loads(done.stdout.strip().splitlines()[-1])
    theirs = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    messages = [{"role": "user", "content": "Hi"}]
    assert ours == {
        "backend": hashlib.sha256(theirs.backend_tokenizer.to_str().encode()).hexdigest(),
        "specials": [theirs.bos_token, theirs.eos_token, theirs.unk_token, theirs.pad_token],
        "add_bos_token": theirs.add_bos_token,
        "chat": theirs.apply_chat_template(messages, add_generation_prompt=True, tokenize=False),
        "name": str(path),  # errors name the file
    }


@pytest.mark.slow
def test_smollm2_config(smollm2):
    lm, _ = smollm2
    c = lm.config
    assert (c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.vocab_size) == (30, 576, 9, 3, 49152)
    assert c.tie_word_embeddings and c.model_type == "llama"
    assert lm.tokenizer.eos_token == "<|im_end|>" and lm.eos_token_ids == (2,)


@pytest.mark.slow
def test_smollm2_logits_match_pytorch(smollm2):
    """Left-padded batch of two chat prompts against transformers' model of the same GGUF.

    SmolLM2's residual stream reaches ~2e4 at the first token, so float32 itself is only good to about
    1e-4 on its logits (|logit| ≲ 30): against a float64 run of the same model, PyTorch float32 is off by
    up to 1.2e-4 (mean 1.1e-5) and jaxsr by up to 1.8e-4 (mean 2.8e-5, XLA limited to AVX). How far the
    two float32 runs are apart depends on the processor and on the instruction set each library picks:
    measured on one AVX2 CPU with XLA at AVX2, AVX and SSE4.2 and torch at AVX2 and its baseline, up to
    2.1e-4 (mean 2.6e-5). Hence 5e-4 on the maximum and 6e-5 on the mean, about twice the worst seen; a
    mapping mistake (wrong q/k order, norm, tied head) moves logits by O(1). The argmax is exact: its
    smallest top-2 gap on these prompts is 0.036.
    """
    lm, hf = smollm2
    rows = [chat_ids(lm.tokenizer, "What is the capital of France?"), chat_ids(lm.tokenizer, "Hi")]
    tokens, mask = left_pad(rows, lm.tokenizer.pad_token_id)
    assert mask[1, 0] == 0  # the second row really is padded
    ours = np.asarray(lm.logits(tokens, mask))[mask.astype(bool)]
    with torch.no_grad():
        theirs = torch_logits(hf, tokens, mask)[mask.astype(bool)]
    diff = np.abs(ours - theirs)
    assert diff.max() < 5e-4, diff.max()
    assert diff.mean() < 6e-5, diff.mean()
    np.testing.assert_array_equal(ours.argmax(-1), theirs.argmax(-1))


@pytest.mark.slow
def test_smollm2_greedy_answer_is_coherent(smollm2):
    """~40 greedy tokens answering a chat question: English, and PyTorch's argmax at every step."""
    lm, hf = smollm2
    prompt = chat_ids(lm.tokenizer, QUESTION)
    new = 40
    generated: list[int] = []
    for _ in range(new):  # fixed width (left padding) so the forward pass compiles once
        tokens, mask = left_pad([prompt + generated], lm.tokenizer.pad_token_id, len(prompt) + new)
        token = int(np.argmax(np.asarray(lm.logits(tokens, mask))[0, -1]))
        if token in lm.eos_token_ids:
            break
        generated.append(token)
    text = lm.tokenizer.decode(generated, skip_special_tokens=True)
    words = re.findall(r"[a-z]+", text.lower())
    assert len(generated) >= 20, text
    assert len(set(words) & COMMON_WORDS) >= 3, text
    assert sum(c.isascii() for c in text) / len(text) > 0.95, text
    # Teacher-forced through PyTorch: every token we chose is its argmax (up to float32 ties).
    with torch.no_grad():
        hf_logits = hf(input_ids=torch.tensor([prompt + generated])).logits[0].numpy()
    steps = hf_logits[len(prompt) - 1 : -1]
    chosen = steps[np.arange(len(generated)), generated]
    np.testing.assert_array_less(steps.max(-1) - chosen, 1e-3)


@pytest.mark.slow
def test_truncated_smollm2_names_the_file(tmp_path):
    path = tmp_path / "SmolLM2-truncated.gguf"
    with smollm2_path().open("rb") as f:
        path.write_bytes(f.read(1_000_000))
    with pytest.raises(CheckpointError, match=re.escape(str(path))):
        read_gguf(path)
