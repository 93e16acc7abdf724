"""Tiny random Hugging Face checkpoints (transformers + torch) used as parity oracles.

`build_checkpoint(family, directory)` writes a `save_pretrained` directory (config.json +
model.safetensors) for one of `FAMILIES` and returns it with the torch model that wrote it.
`checkpoint(family, tmp_path_factory)` caches that per test session, so every test module shares the
same directories and torch models.

Every tensor is re-drawn from a seeded normal after construction: transformers initialises biases to
zero and norm scales to one, which would let a dropped bias or a mis-mapped norm go unnoticed. Weights
get a standard deviation of about 1/sqrt(fan_in) so logits are O(1–10) and a 1e-4 tolerance means
something.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

VOCAB = 96
HIDDEN = 32
LAYERS = 2
PAD_ID = 0
"""pad_token_id of the reward checkpoints; real tokens in tests are drawn from [1, VOCAB)."""

_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}


def _llama_kwargs(**overrides: Any) -> dict[str, Any]:
    kw: dict[str, Any] = dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=48,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    kw.update(overrides)
    return kw


def _gpt2_kwargs(**overrides: Any) -> dict[str, Any]:
    kw: dict[str, Any] = dict(
        vocab_size=VOCAB,
        n_embd=HIDDEN,
        n_layer=LAYERS,
        n_head=4,
        n_positions=64,
        bos_token_id=1,
        eos_token_id=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    kw.update(overrides)
    return kw


def _gemma_kwargs(**overrides: Any) -> dict[str, Any]:
    """Gemma with windows of 16 (as the other `test_sliding_window` families), head_dim 16 with
    query_pre_attn_scalar 24 (so the attention scale is neither head_dim's nor hidden/heads')."""
    kw: dict[str, Any] = dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=48,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        query_pre_attn_scalar=24,
        sliding_window=16,
        max_position_embeddings=128,
        rms_norm_eps=1e-6,
        bos_token_id=1,
        eos_token_id=2,
    )
    kw.update(overrides)
    return kw


# Gemma 2 with small soft-caps, so that their tanh is far from linear on O(1–10) scores and logits.
_GEMMA2 = _gemma_kwargs(num_hidden_layers=4, attn_logit_softcapping=5.0, final_logit_softcapping=8.0)
# Gemma 3: 5 local layers then a global one (transformers' default pattern), local and global RoPE
# bases far apart and a linear scaling of the global one (as Gemma 3 4B+).
_GEMMA3 = _gemma_kwargs(
    num_hidden_layers=6,
    rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 20.0},
        "full_attention": {"rope_type": "linear", "rope_theta": 1000.0, "factor": 2.0},
    },
)
_SIGLIP = dict(
    model_type="siglip_vision_model",
    hidden_size=16,
    intermediate_size=16,
    num_hidden_layers=1,
    num_attention_heads=2,
    image_size=28,
    patch_size=14,
)


def _spec(config: str, model: str, **kwargs: Any) -> tuple[str, str, dict[str, Any]]:
    return config, model, kwargs


# family → (config class, model class, config kwargs)
_SPECS: dict[str, tuple[str, str, dict[str, Any]]] = {
    # Llama 2 style: default RoPE, untied head, grouped-query attention.
    "llama2": _spec("LlamaConfig", "LlamaForCausalLM", **_llama_kwargs()),
    # Llama 3 style: frequency-dependent RoPE scaling, tied embeddings (as Llama 3.2 1B/3B).
    "llama3": _spec(
        "LlamaConfig",
        "LlamaForCausalLM",
        **_llama_kwargs(rope_parameters=dict(_LLAMA3_ROPE), tie_word_embeddings=True),
    ),
    "llama_bias": _spec(
        "LlamaConfig", "LlamaForCausalLM", **_llama_kwargs(attention_bias=True, mlp_bias=True)
    ),
    # head_dim 16 while hidden/heads = 8.
    "llama_head_dim": _spec("LlamaConfig", "LlamaForCausalLM", **_llama_kwargs(head_dim=16)),
    "llama_tied": _spec("LlamaConfig", "LlamaForCausalLM", **_llama_kwargs(tie_word_embeddings=True)),
    "mistral": _spec("MistralConfig", "MistralForCausalLM", **_llama_kwargs(sliding_window=None)),
    # sliding attention windows of 16 (test_sliding_window decodes past them)
    "mistral_window": _spec("MistralConfig", "MistralForCausalLM", **_llama_kwargs(sliding_window=16)),
    "qwen2": _spec("Qwen2Config", "Qwen2ForCausalLM", **_llama_kwargs(tie_word_embeddings=True)),
    "qwen2_window": _spec(
        "Qwen2Config",
        "Qwen2ForCausalLM",
        **_llama_kwargs(use_sliding_window=True, sliding_window=16, max_window_layers=1),
    ),
    "qwen2_untied": _spec("Qwen2Config", "Qwen2ForCausalLM", **_llama_kwargs()),
    "qwen3": _spec("Qwen3Config", "Qwen3ForCausalLM", **_llama_kwargs(head_dim=16, tie_word_embeddings=True)),
    "gpt2": _spec("GPT2Config", "GPT2LMHeadModel", **_gpt2_kwargs()),
    "gemma2": _spec("Gemma2Config", "Gemma2ForCausalLM", **_GEMMA2),
    "gemma3": _spec("Gemma3TextConfig", "Gemma3ForCausalLM", **_GEMMA3),
    # the multimodal checkpoint: text decoder under `language_model.`, a tiny SigLIP tower beside it
    "gemma3_multimodal": _spec(
        "Gemma3Config",
        "Gemma3ForConditionalGeneration",
        text_config=_GEMMA3,
        vision_config=_SIGLIP,
        mm_tokens_per_image=4,
    ),
}
_REWARD = {
    "llama": ("LlamaConfig", "LlamaForSequenceClassification", _llama_kwargs()),
    "mistral": ("MistralConfig", "MistralForSequenceClassification", _llama_kwargs(sliding_window=None)),
    "qwen2": ("Qwen2Config", "Qwen2ForSequenceClassification", _llama_kwargs()),
    "qwen3": ("Qwen3Config", "Qwen3ForSequenceClassification", _llama_kwargs(head_dim=16)),
    "gpt2": ("GPT2Config", "GPT2ForSequenceClassification", _gpt2_kwargs()),
    "gemma2": ("Gemma2Config", "Gemma2ForSequenceClassification", _GEMMA2),
}
for _name, (_cfg, _cls, _kw) in _REWARD.items():
    _SPECS[f"{_name}_rm"] = _spec(_cfg, _cls, **_kw, num_labels=1, pad_token_id=PAD_ID)

LM_FAMILIES = tuple(name for name in _SPECS if not name.endswith("_rm"))
REWARD_FAMILIES = tuple(name for name in _SPECS if name.endswith("_rm"))
FAMILIES = LM_FAMILIES + REWARD_FAMILIES


def _seed(family: str) -> int:
    return sum(ord(c) * (i + 1) for i, c in enumerate(family)) % 10_000


@torch.no_grad()
def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Re-draw every parameter from a seeded normal.

    Embeddings ~ N(0, 0.5²); projection matrices ~ N(0, 1/fan_in); norm scales ~ 1 + N(0, 0.1²);
    biases (including LayerNorm shifts) ~ N(0, 0.1²). Gemma's RMSNorms multiply by (1 + weight), so
    their weights ~ N(0, 0.1²): the same scales, and a dropped or doubled 1 is of the order of the logits.
    """
    gen = torch.Generator().manual_seed(seed)
    offset_norms = {
        f"{name}.weight"
        for name, m in model.named_modules()
        if type(m).__name__.startswith("Gemma") and type(m).__name__.endswith("RMSNorm")
    }
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
        if p.ndim == 1:
            is_scale = name.endswith("weight") and ("norm" in name or ".ln_" in name)
            p.copy_(1.0 + 0.1 * noise if is_scale and name not in offset_norms else 0.1 * noise)
        elif any(k in name for k in ("embed_tokens", "wte", "wpe")):
            p.copy_(0.5 * noise)
        else:
            # torch Linear weights are [out, in]; GPT-2's Conv1D weights are [in, out].
            fan_in = p.shape[0] if ".c_" in name else p.shape[1]
            p.copy_(noise / np.sqrt(fan_in))


def make_model(family: str, **overrides: Any) -> torch.nn.Module:
    """The seeded random torch model of `family` (float32, eval mode, eager attention), its config
    kwargs updated with `overrides`."""
    import transformers

    if family not in _SPECS:
        raise KeyError(f"unknown family {family!r}; expected one of {FAMILIES}")
    config_cls, model_cls, kwargs = _SPECS[family]
    config = getattr(transformers, config_cls)(**(kwargs | overrides))
    torch.manual_seed(_seed(family))
    model = getattr(transformers, model_cls)(config)
    _randomize(model, _seed(family))
    model.config._attn_implementation = "eager"
    return model.float().eval()


def build_checkpoint(
    family: str, directory: Path, *, max_shard_size: str | None = None
) -> tuple[Path, torch.nn.Module]:
    """Save the random `family` model to `directory` (safetensors) and return (directory, model)."""
    model = make_model(family)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(str(directory), **kwargs)
    return directory, model


def build_llama_with_tokenizer(
    model: str, tokenizer: Any, directory: Path, seed: int, **overrides: Any
) -> Path:
    """A seeded random Llama (`transformers.<model>`) over `tokenizer`'s vocabulary, saved with it."""
    import transformers

    kwargs = _llama_kwargs(
        vocab_size=len(tokenizer),
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **overrides,
    )
    torch.manual_seed(seed)
    built = getattr(transformers, model)(transformers.LlamaConfig(**kwargs))
    _randomize(built, seed)
    built.save_pretrained(str(directory))
    tokenizer.save_pretrained(str(directory))
    return Path(directory)


_CACHE: dict[tuple[str, str, str | None], tuple[Path, torch.nn.Module]] = {}


def checkpoint(family: str, tmp_path_factory, *, max_shard_size: str | None = None):
    """`build_checkpoint` once per session (shared by all test modules)."""
    key = (str(tmp_path_factory.getbasetemp()), family, max_shard_size)
    if key not in _CACHE:
        suffix = f"-sharded-{max_shard_size}" if max_shard_size else ""
        directory = tmp_path_factory.mktemp(f"hf-{family}{suffix}")
        _CACHE[key] = build_checkpoint(family, directory, max_shard_size=max_shard_size)
    return _CACHE[key]


def copy_checkpoint(src: Path, dst: Path, edit: Callable[[dict[str, Any]], None] | None = None) -> Path:
    """Copy a checkpoint directory, optionally editing its config.json in place."""
    shutil.copytree(src, dst)
    if edit is not None:
        config_file = dst / "config.json"
        config = json.loads(config_file.read_text())
        edit(config)
        config_file.write_text(json.dumps(config, indent=2))
    return dst


# -- inputs and the torch reference ------------------------------------------------------------


def left_padded_batch(seed: int = 0, lengths=(9, 6, 3, 1), width: int | None = None, pad: int = PAD_ID):
    """int64 tokens and 0/1 mask [B, width]: row b has lengths[b] real tokens, padded on the left.

    Real tokens are drawn from [1, VOCAB) so they never equal the pad id.
    """
    rng = np.random.default_rng(seed)
    width = width or max(lengths)
    tokens = np.full((len(lengths), width), pad, np.int64)
    mask = np.zeros((len(lengths), width), np.int64)
    for b, n in enumerate(lengths):
        tokens[b, width - n :] = rng.integers(1, VOCAB, n)
        mask[b, width - n :] = 1
    return tokens, mask


def torch_positions(mask: np.ndarray) -> np.ndarray:
    return np.clip(np.cumsum(mask, axis=-1) - 1, 0, None)


@torch.no_grad()
def torch_logits(model: torch.nn.Module, tokens: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """HF logits with explicit position_ids = clip(cumsum(mask) - 1, 0): [B, T, V] (or [B, labels])."""
    out = model(
        input_ids=torch.as_tensor(tokens),
        attention_mask=torch.as_tensor(mask),
        position_ids=torch.as_tensor(torch_positions(mask)),
        use_cache=False,
    )
    return out.logits.float().numpy()


SPECIALS = ["<pad>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def byte_tokenizer() -> Any:
    """Byte-level BPE without merges (259 ids: 3 specials + 256 bytes) and a ChatML template."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {s: i for i, s in enumerate(SPECIALS)}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(SPECIALS)
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="<|im_end|>"
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer
