"""`save_model` writes checkpoints that jaxsr and transformers read back to the same model."""

from __future__ import annotations

import json
import struct

import hf_fixtures as H
import numpy as np
import pytest
import torch
from flax import nnx

import jaxsr
from jaxsr.loading.hf_config import decoder_config_from_hf, hf_config_from_decoder


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    return lambda family: H.checkpoint(family, tmp_path_factory)


def _flat(model: jaxsr.Model) -> dict:
    return {path: np.asarray(leaf.get_value()) for path, leaf in nnx.to_flat_state(model.params)}


@pytest.mark.parametrize("family", H.FAMILIES)
def test_config_round_trip(hf, family):
    model = jaxsr.load_model(hf(family)[0], cache=False)
    assert decoder_config_from_hf(hf_config_from_decoder(model.config)) == model.config


@pytest.mark.parametrize("family", ["llama3", "llama_bias", "qwen2_untied", "qwen3", "gpt2", "llama_rm"])
def test_saved_checkpoint_reloads_identically_in_jaxsr_and_torch(hf, family, tmp_path):
    import transformers

    directory, torch_model = hf(family)
    model = jaxsr.load_model(directory, cache=False)
    saved = jaxsr.save_model(model, tmp_path / "saved", pad_token_id=H.PAD_ID)
    again = jaxsr.load_model(saved, cache=False)
    assert type(again) is type(model) and again.config == model.config
    before, after = _flat(model), _flat(again)
    assert before.keys() == after.keys()
    for path in before:
        np.testing.assert_array_equal(after[path], before[path], err_msg="/".join(map(str, path)))
    # transformers reads it too, and computes what the original torch model computes.
    cls = getattr(transformers, type(torch_model).__name__)
    reloaded = cls.from_pretrained(str(saved), attn_implementation="eager").float().eval()
    tokens, mask = H.left_padded_batch(0, lengths=(5, 5))
    with torch.no_grad():
        a = torch_model(input_ids=torch.as_tensor(tokens), attention_mask=torch.as_tensor(mask))
        b = reloaded(input_ids=torch.as_tensor(tokens), attention_mask=torch.as_tensor(mask))
    np.testing.assert_allclose(b.logits.numpy(), a.logits.numpy(), atol=1e-6)


def test_bfloat16_models_are_saved_in_bfloat16(hf, tmp_path):
    model = jaxsr.load_model(hf("llama3")[0], dtype="bfloat16", cache=False)
    saved = jaxsr.save_model(model, tmp_path / "bf16")
    blob = (saved / "model.safetensors").read_bytes()
    header = json.loads(blob[8 : 8 + struct.unpack("<Q", blob[:8])[0]])
    assert {info["dtype"] for name, info in header.items() if name != "__metadata__"} == {"BF16"}
    again = jaxsr.load_model(saved, dtype="bfloat16", cache=False)
    for path, value in _flat(model).items():
        np.testing.assert_array_equal(_flat(again)[path], value)


def test_save_model_refuses_non_models(tmp_path):
    with pytest.raises(TypeError, match="model"):
        jaxsr.save_model("not a model", tmp_path)
