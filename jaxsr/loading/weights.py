"""Map Hugging Face tensor names onto the decoder's parameters (one set per layer).

Each rule names the HF tensor(s) it reads, the parameter path it fills, and how to reshape an HF
`Linear` weight ([out, in]) or GPT-2 `Conv1D` weight ([in, out]) into the module's layout. Every
checkpoint tensor must be used and every parameter filled; otherwise the error names the tensor.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

import jax.numpy as jnp
import numpy as np

from jaxsr.loading.files import CheckpointError
from jaxsr.models.config import DecoderConfig
from jaxsr.models.decoder import quantize_arrays

Transform = Callable[[np.ndarray], np.ndarray]
Path = tuple[str | int, ...]

# Buffers some checkpoints carry that are not parameters.
IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias", "rotary_emb.inv_freq")
# Head tensors sit outside the `model.`/`transformer.` prefix in HF checkpoints.
HEAD_PREFIXES = ("lm_head.", "score.")
# Gemma3ForConditionalGeneration keeps its text decoder under one of these prefixes (the original
# layout, which transformers 5 writes, or transformers 4.5x's), beside the vision tensors named here,
# which a text-only decoder does not load.
MULTIMODAL_PREFIXES = {
    "language_model.model.": ("vision_tower.", "multi_modal_projector.", "language_model.lm_head."),
    "model.language_model.": ("model.vision_tower.", "model.multi_modal_projector."),
}


@dataclasses.dataclass(frozen=True)
class Rule:
    hf_name: str
    """Name with `{i}` standing for the layer index when `per_layer`."""
    path: Path
    """Parameter path; a per-layer rule's path continues after `(i)`."""
    transform: Transform
    per_layer: bool = True
    shape: tuple[int, ...] | None = None
    """The tensor's shape in the checkpoint; checked before `transform` so that a wrong (or transposed)
    tensor is reported by name instead of being silently reshaped."""


def _identity(w: np.ndarray) -> np.ndarray:
    return w


def _linear(*shape: int) -> Transform:
    return lambda w: w.T.reshape(shape)


def _columns(part: int, parts: int, *shape: int) -> Transform:
    """Slice `part` of `parts` equal blocks along the last axis (GPT-2's fused c_attn)."""

    def take(w: np.ndarray) -> np.ndarray:
        n = w.shape[-1] // parts
        return w[..., part * n : (part + 1) * n].reshape(shape)

    return take


def llama_rules(cfg: DecoderConfig) -> list[Rule]:
    d, H, K, D, F = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
    a, m = "layers.{i}.self_attn.", "layers.{i}.mlp."
    rules = [
        Rule("embed_tokens.weight", ("embed",), _identity, per_layer=False, shape=(cfg.vocab_size, d)),
        Rule("norm.weight", ("final_norm", "scale"), _identity, per_layer=False, shape=(d,)),
        Rule("layers.{i}.input_layernorm.weight", ("attn_norm", "scale"), _identity, shape=(d,)),
        # Gemma's post_attention_layernorm norms the attention output; Llama's is the MLP's pre-norm
        Rule(
            "layers.{i}.post_attention_layernorm.weight",
            ("attn_out_norm" if cfg.sandwich_norm else "mlp_norm", "scale"),
            _identity,
            shape=(d,),
        ),
        Rule(a + "q_proj.weight", ("attn", "q"), _linear(d, H, D), shape=(H * D, d)),
        Rule(a + "k_proj.weight", ("attn", "k"), _linear(d, K, D), shape=(K * D, d)),
        Rule(a + "v_proj.weight", ("attn", "v"), _linear(d, K, D), shape=(K * D, d)),
        Rule(a + "o_proj.weight", ("attn", "o"), _linear(H, D, d), shape=(d, H * D)),
        Rule(m + "gate_proj.weight", ("mlp", "gate"), _linear(d, F), shape=(F, d)),
        Rule(m + "up_proj.weight", ("mlp", "up"), _linear(d, F), shape=(F, d)),
        Rule(m + "down_proj.weight", ("mlp", "down"), _linear(F, d), shape=(d, F)),
    ]
    if cfg.qkv_bias:
        rules += [
            Rule(a + "q_proj.bias", ("attn", "q_bias"), _linear(H, D), shape=(H * D,)),
            Rule(a + "k_proj.bias", ("attn", "k_bias"), _linear(K, D), shape=(K * D,)),
            Rule(a + "v_proj.bias", ("attn", "v_bias"), _linear(K, D), shape=(K * D,)),
        ]
    if cfg.out_bias:
        rules.append(Rule(a + "o_proj.bias", ("attn", "o_bias"), _identity, shape=(d,)))
    if cfg.mlp_bias:
        rules += [
            Rule(m + "gate_proj.bias", ("mlp", "gate_bias"), _identity, shape=(F,)),
            Rule(m + "up_proj.bias", ("mlp", "up_bias"), _identity, shape=(F,)),
            Rule(m + "down_proj.bias", ("mlp", "down_bias"), _identity, shape=(d,)),
        ]
    if cfg.sandwich_norm:
        rules += [
            Rule("layers.{i}.pre_feedforward_layernorm.weight", ("mlp_norm", "scale"), _identity, shape=(d,)),
            Rule(
                "layers.{i}.post_feedforward_layernorm.weight",
                ("mlp_out_norm", "scale"),
                _identity,
                shape=(d,),
            ),
        ]
    if cfg.qk_norm:
        rules += [
            Rule(a + "q_norm.weight", ("attn", "q_norm", "scale"), _identity, shape=(D,)),
            Rule(a + "k_norm.weight", ("attn", "k_norm", "scale"), _identity, shape=(D,)),
        ]
    return rules


def gpt2_rules(cfg: DecoderConfig) -> list[Rule]:
    d, H, D, F = cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.intermediate_size
    h = "h.{i}."
    # GPT-2's Conv1D weights are stored [in, out].
    rules = [
        Rule("wte.weight", ("embed",), _identity, per_layer=False, shape=(cfg.vocab_size, d)),
        Rule(
            "wpe.weight", ("pos_embed",), _identity, per_layer=False, shape=(cfg.max_position_embeddings, d)
        ),
        Rule("ln_f.weight", ("final_norm", "scale"), _identity, per_layer=False, shape=(d,)),
        Rule("ln_f.bias", ("final_norm", "bias"), _identity, per_layer=False, shape=(d,)),
        Rule(h + "ln_1.weight", ("attn_norm", "scale"), _identity, shape=(d,)),
        Rule(h + "ln_1.bias", ("attn_norm", "bias"), _identity, shape=(d,)),
        Rule(h + "ln_2.weight", ("mlp_norm", "scale"), _identity, shape=(d,)),
        Rule(h + "ln_2.bias", ("mlp_norm", "bias"), _identity, shape=(d,)),
        Rule(h + "attn.c_proj.weight", ("attn", "o"), lambda w: w.reshape(H, D, d), shape=(H * D, d)),
        Rule(h + "attn.c_proj.bias", ("attn", "o_bias"), _identity, shape=(d,)),
        Rule(h + "mlp.c_fc.weight", ("mlp", "up"), _identity, shape=(d, F)),
        Rule(h + "mlp.c_fc.bias", ("mlp", "up_bias"), _identity, shape=(F,)),
        Rule(h + "mlp.c_proj.weight", ("mlp", "down"), _identity, shape=(F, d)),
        Rule(h + "mlp.c_proj.bias", ("mlp", "down_bias"), _identity, shape=(d,)),
    ]
    for part, name in enumerate("qkv"):
        rules.append(
            Rule(
                h + "attn.c_attn.weight",
                ("attn", name),
                _columns(part, 3, d, H, D),
                shape=(d, 3 * H * D),
            )
        )
        rules.append(
            Rule(
                h + "attn.c_attn.bias",
                ("attn", f"{name}_bias"),
                _columns(part, 3, H, D),
                shape=(3 * H * D,),
            )
        )
    return rules


def model_rules(cfg: DecoderConfig) -> list[Rule]:
    """The body's rules plus the output head (a reward `score`, or an untied `lm_head`: one row per
    scored id, [head_size, hidden])."""
    rules = gpt2_rules(cfg) if cfg.model_type == "gpt2" else llama_rules(cfg)
    d = cfg.hidden_size
    if cfg.is_reward_model:
        rules.append(
            Rule("score.weight", ("score",), np.transpose, per_layer=False, shape=(cfg.num_labels, d))
        )
    elif not cfg.tie_word_embeddings:
        rules.append(
            Rule("lm_head.weight", ("lm_head",), np.transpose, per_layer=False, shape=(cfg.head_size, d))
        )
    return rules


def check_weight(name: str, tensor: np.ndarray) -> np.ndarray:
    """`tensor`, which must hold finite floats: an integer, boolean or NaN weight would load and then
    decode garbage."""
    if not jnp.issubdtype(tensor.dtype, jnp.floating):
        raise CheckpointError(f"tensor {name!r} is stored as {tensor.dtype}, expected a float type")
    if not np.isfinite(tensor).all():
        raise CheckpointError(f"tensor {name!r} holds NaN or infinite values")
    return tensor


def convert_hf_tensors(cfg: DecoderConfig, tensors: Mapping[str, np.ndarray]) -> dict[Path, np.ndarray]:
    """HF-named tensors → {parameter path: array}, checking that every name is accounted for. With int8
    weights (`cfg.weights_dtype`) each matrix is quantized as it is converted (`quantize_arrays`), so the
    host never holds more than one of them in float."""
    rules = model_rules(cfg)
    anchor = rules[0].hf_name
    prefixes = ("model.", "transformer.", *MULTIMODAL_PREFIXES, "")
    prefix = next((p for p in prefixes if p + anchor in tensors), None)
    if prefix is None:
        raise CheckpointError(f"missing tensor {anchor!r} (the token embedding)")
    ignored_prefixes = MULTIMODAL_PREFIXES.get(prefix, ())

    used: set[str] = set()

    def fetch(name: str, rule: Rule) -> np.ndarray:
        full = name if name.startswith(HEAD_PREFIXES) else prefix + name
        if full not in tensors:
            raise CheckpointError(f"missing tensor {full!r}")
        used.add(full)
        tensor = check_weight(full, tensors[full])
        if rule.shape is not None and tuple(tensor.shape) != rule.shape:
            raise CheckpointError(
                f"tensor {full!r} has shape {tuple(tensor.shape)}, expected {rule.shape} for this "
                f"{cfg.model_type} config (parameter {'/'.join(rule.path)})"
            )
        return rule.transform(tensor)

    params: dict[Path, np.ndarray] = {}

    def put(path: Path, value: np.ndarray) -> None:
        params.update(quantize_arrays({path: value}) if cfg.quantized_weights else {path: value})

    for rule in rules:
        if rule.per_layer:
            for i in range(cfg.num_layers):
                put(("blocks", i, *rule.path), fetch(rule.hf_name.format(i=i), rule))
        else:
            put(rule.path, fetch(rule.hf_name, rule))
    ignorable = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
    unexpected = [
        n
        for n in tensors
        if n not in used
        and n not in ignorable
        and not n.endswith(IGNORED_SUFFIXES)
        and not n.startswith(ignored_prefixes)
    ]
    if unexpected:
        raise CheckpointError(f"unexpected tensor {sorted(unexpected)[0]!r} (not part of {cfg.model_type})")
    return params


def export_hf_tensors(cfg: DecoderConfig, params: Mapping[Path, np.ndarray]) -> dict[str, np.ndarray]:
    """The inverse of `convert_hf_tensors`: parameters → HF-named tensors (as `save_pretrained` names them).

    Every rule is a pure rearrangement of its tensor, so it is inverted by pushing an index array through
    the same transform; a fused tensor (GPT-2's c_attn: several rules, one name) is assembled from its parts.
    """
    prefix = "transformer." if cfg.model_type == "gpt2" else "model."
    tensors: dict[str, np.ndarray] = {}
    for rule in model_rules(cfg):
        assert rule.shape is not None
        index = rule.transform(np.arange(int(np.prod(rule.shape))).reshape(rule.shape))
        name = rule.hf_name if rule.hf_name.startswith(HEAD_PREFIXES) else prefix + rule.hf_name
        for i in range(cfg.num_layers) if rule.per_layer else [None]:
            value = np.asarray(params[rule.path if i is None else ("blocks", i, *rule.path)])
            tensor = tensors.setdefault(name.format(i=i), np.zeros(rule.shape, value.dtype))
            tensor.reshape(-1)[index] = value
    return tensors
