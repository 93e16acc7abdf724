"""`save_model` writes checkpoints that jaxsr and transformers read back to the same model."""

from __future__ import annotations

import json
import struct
from pathlib import Path

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


@pytest.fixture(scope="module")
def tiny_lm():
    from tiny import tiny_model

    return tiny_model(seed=0, eos_token_ids=(3,))


def _listing(root) -> list[str]:
    """Every path under `root`, so a test sees anything a failed save left behind."""
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def test_save_model_to_a_file_is_refused_and_leaves_nothing(tiny_lm, tmp_path):
    (tmp_path / "weights").write_text("not a directory")
    before = _listing(tmp_path)
    with pytest.raises(ValueError, match=r"directory: .*weights exists and is not a directory"):
        jaxsr.save_model(tiny_lm, tmp_path / "weights")
    with pytest.raises(ValueError, match=r"directory: .*weights/sub cannot be created"):
        jaxsr.save_model(tiny_lm, tmp_path / "weights" / "sub")
    assert _listing(tmp_path) == before and (tmp_path / "weights").read_text() == "not a directory"


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")
def test_save_model_to_an_uncreatable_directory_is_refused(tiny_lm):
    with pytest.raises(ValueError, match="directory: /proc/jaxsr_out cannot be created"):
        jaxsr.save_model(tiny_lm, "/proc/jaxsr_out")
    assert not Path("/proc/jaxsr_out").exists()


def test_save_model_where_config_json_is_a_directory_leaves_nothing_half_written(tiny_lm, tmp_path):
    target = tmp_path / "ckpt"
    (target / "config.json").mkdir(parents=True)
    before = _listing(tmp_path)
    with pytest.raises(ValueError, match=r"directory: .*config.json is a directory"):
        jaxsr.save_model(tiny_lm, target)
    assert _listing(tmp_path) == before


def test_failed_save_removes_the_parents_it_created(tiny_lm, tmp_path, monkeypatch):
    from jaxsr.loading import api

    def broken(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(api, "write_safetensors", broken)
    with pytest.raises(OSError, match="No space left"):
        jaxsr.save_model(tiny_lm, tmp_path / "a" / "b" / "ckpt")
    assert _listing(tmp_path) == []


def test_save_model_refuses_leftovers_of_another_checkpoint(tmp_path):
    from tiny import tiny_model

    target = tmp_path / "ckpt"
    jaxsr.save_model(tiny_model(seed=0, eos_token_ids=(3,)), target)
    before = _listing(tmp_path)
    # Saved beside the old generation_config.json, the new model would load with the old one's eos id.
    with pytest.raises(ValueError, match=r"directory: .*generation_config.json"):
        jaxsr.save_model(tiny_model(seed=1), target)
    assert _listing(tmp_path) == before


def test_save_into_an_existing_directory_keeps_other_files_and_loads(tiny_lm, tmp_path):
    target = tmp_path / "ckpt"
    target.mkdir()
    (target / "README.md").write_text("my notes")
    jaxsr.save_model(tiny_lm, target)
    jaxsr.save_model(tiny_lm, target)  # saving again replaces the files it wrote
    assert (target / "README.md").read_text() == "my notes"
    assert _listing(tmp_path) == [
        "ckpt",
        "ckpt/README.md",
        "ckpt/config.json",
        "ckpt/generation_config.json",
        "ckpt/model.safetensors",
    ]
    again = jaxsr.load_model(target, cache=False)
    assert again.config == tiny_lm.config and again.eos_token_ids == (3,)
    for path, value in _flat(tiny_lm).items():
        np.testing.assert_array_equal(_flat(again)[path], value)


@pytest.mark.parametrize(
    "kwargs, exc, name",
    [
        (dict(directory=5), TypeError, "directory"),
        (dict(directory=b"/tmp/x"), TypeError, "directory"),
        (dict(pad_token_id="0"), TypeError, "pad_token_id"),
        (dict(pad_token_id=True), TypeError, "pad_token_id"),
        (dict(pad_token_id=2.0), TypeError, "pad_token_id"),
        (dict(pad_token_id=10**6), ValueError, "pad_token_id"),
    ],
)
def test_save_model_argument_types_are_named(tiny_lm, tmp_path, kwargs, exc, name):
    kwargs = {"directory": tmp_path / "ckpt", **kwargs}
    with pytest.raises(exc, match=name):
        jaxsr.save_model(tiny_lm, kwargs.pop("directory"), **kwargs)
    assert _listing(tmp_path) == []
