"""The shipped SmolLM2 draft (jaxsr/assets/smollm2-draft): it loads, shares SmolLM2's tokenizer, and its
next-token distributions overlap SmolLM2's on held-out SmolLM2 responses far more than an untrained
model of the same shape does."""

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxsr
from jaxsr.loading.embedded import smollm2_draft_path
from jaxsr.loading.gguf import smollm2_path
from jaxsr.loading.resolve import resolve_model
from jaxsr.models.decoder import Decoder

# SmolLM2's sampled responses (T=1, top_k=50) to alpaca_farm_100 prompts, which the draft never saw.
FIXTURE = Path(__file__).parent / "data" / "draft_heldout.json"
MIN_ACCEPTANCE = 0.2  # the shipped draft measures 0.29 on this fixture, an untrained one 0.03


@pytest.fixture(scope="module")
def draft() -> jaxsr.Model:
    return jaxsr.load_model(smollm2_draft_path())


def acceptance(p_logits: jax.Array, q_logits: jax.Array) -> float:
    """Mean over positions of Σ_x min(p(x), q(x))."""
    return float(jnp.minimum(jax.nn.softmax(p_logits), jax.nn.softmax(q_logits)).sum(-1).mean())


def response_logits(model: jaxsr.Model, tokens: np.ndarray, mask: np.ndarray, prompt_lengths) -> jax.Array:
    """Logits predicting each response token of the right-padded rows."""
    logits = model.logits(tokens, mask)
    lengths = mask.sum(1)
    return jnp.concatenate([logits[r, n - 1 : lengths[r] - 1] for r, n in enumerate(prompt_lengths)], axis=0)


def test_draft_shape_and_tokenizer(draft: jaxsr.Model) -> None:
    from transformers import AutoTokenizer

    path = smollm2_path()
    smollm2_tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    cfg = draft.config
    assert cfg.vocab_size == 49152 and cfg.tie_word_embeddings and cfg.model_type == "llama"
    assert draft.dtype == jnp.float32
    text = "Speculative decoding: the draft proposes, SmolLM2 disposes. 12345 ünïcödé 🙂"
    assert draft.tokenizer(text)["input_ids"] == smollm2_tokenizer(text)["input_ids"]
    chat = [{"role": "user", "content": "Hi!"}]
    assert draft.tokenizer.apply_chat_template(chat, tokenize=False) == smollm2_tokenizer.apply_chat_template(
        chat, tokenize=False
    )
    assert set(draft.eos_token_ids) >= {smollm2_tokenizer.convert_tokens_to_ids("<|im_end|>")}
    assert resolve_model("smollm2-draft", "float32").config == cfg


@pytest.mark.slow
def test_draft_acceptance_beats_untrained(draft: jaxsr.Model) -> None:
    rows = json.loads(FIXTURE.read_text())
    width = max(len(r["tokens"]) for r in rows)
    tokens = np.zeros((len(rows), width), np.int32)
    mask = np.zeros_like(tokens)
    for i, r in enumerate(rows):
        tokens[i, : len(r["tokens"])], mask[i, : len(r["tokens"])] = r["tokens"], 1
    prompt_lengths = [r["prompt_length"] for r in rows]
    smollm2 = jaxsr.load_model(smollm2_path())
    p = response_logits(smollm2, tokens, mask, prompt_lengths)
    untrained = jaxsr.Model.from_module(Decoder(draft.config, rngs=nnx.Rngs(0)))
    trained_lambda = acceptance(p, response_logits(draft, tokens, mask, prompt_lengths))
    untrained_lambda = acceptance(p, response_logits(untrained, tokens, mask, prompt_lengths))
    assert trained_lambda > MIN_ACCEPTANCE > untrained_lambda, (trained_lambda, untrained_lambda)
