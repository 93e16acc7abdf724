"""Bad checkpoints and bad arguments are refused with a ValueError/TypeError that names the culprit."""

from __future__ import annotations

import json
import pickle
import shutil
import struct
from pathlib import Path

import hf_fixtures as H
import jax
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import jaxsr
from jaxsr.loading.files import CheckpointError
from jaxsr.loading.safetensors import SafetensorsCheckpoint
from jaxsr.sharding import make_mesh


@pytest.fixture(scope="session")
def llama(tmp_path_factory) -> Path:
    return H.checkpoint("llama2", tmp_path_factory)[0]


@pytest.fixture
def copy(llama, tmp_path):
    """A fresh copy of the llama checkpoint, optionally with config.json edited."""

    def make(edit=None, name="ckpt") -> Path:
        return H.copy_checkpoint(llama, tmp_path / name, edit)

    return make


def _rewrite(directory: Path, edit) -> None:
    """Load model.safetensors, let `edit` change the dict of tensors, and save it back."""
    file = directory / "model.safetensors"
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


def _refused(directory, exc=ValueError, loader=jaxsr.load_model, **kwargs) -> str:
    with pytest.raises(exc) as info:
        loader(directory, **kwargs)
    return str(info.value)


def test_sanity_the_copy_loads(copy):
    """The baseline every corruption below starts from does load."""
    model = jaxsr.load_model(copy())
    assert model.config.model_type == "llama"


def test_missing_tensor_is_named(copy):
    directory = copy()
    name = "model.layers.1.mlp.up_proj.weight"
    _rewrite(directory, lambda t: t.pop(name))
    message = _refused(directory)
    assert name in message and "missing" in message


def test_missing_lm_head_of_untied_model_is_named(copy):
    directory = copy()
    _rewrite(directory, lambda t: t.pop("lm_head.weight"))
    assert "lm_head.weight" in _refused(directory)


@pytest.mark.parametrize(
    "name, reshape",
    [
        ("model.layers.1.mlp.up_proj.weight", lambda w: w[:-1]),  # wrong size
        ("model.layers.0.mlp.up_proj.weight", lambda w: np.ascontiguousarray(w.T)),  # transposed
        ("model.layers.0.self_attn.q_proj.weight", lambda w: w[:, :16]),
        ("model.norm.weight", lambda w: w[:5]),
    ],
    ids=["short", "transposed", "q_proj", "norm"],
)
def test_misshaped_tensor_is_named(copy, name, reshape):
    directory = copy()
    _rewrite(directory, lambda t: t.__setitem__(name, reshape(t[name])))
    message = _refused(directory)
    assert name in message and "shape" in message


def test_unexpected_tensor_is_named(copy):
    directory = copy()
    name = "model.layers.0.self_attn.extra_proj.weight"
    _rewrite(directory, lambda t: t.__setitem__(name, np.zeros((4, 4), np.float32)))
    assert name in _refused(directory)


def test_truncated_file_is_named(copy):
    directory = copy()
    file = directory / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[: len(data) - 100])
    message = _refused(directory)
    assert str(file) in message and "truncated" in message


def test_file_shorter_than_its_header_size_is_named(copy):
    directory = copy()
    file = directory / "model.safetensors"
    file.write_bytes(file.read_bytes()[:5])
    assert str(file) in _refused(directory)


@pytest.mark.parametrize(
    "corrupt",
    [
        lambda header: b"{" + header[1:-5] + b"!!!!}",  # not JSON
        lambda header: b"[" + b" " * (len(header) - 2) + b"]",  # JSON, but not a table of tensors
        lambda header: b'{"a": 1}' + b" " * (len(header) - 8),  # a table of the wrong things
    ],
    ids=["not-json", "list", "bad-entries"],
)
def test_corrupt_header_is_named(copy, corrupt):
    directory = copy()
    file = directory / "model.safetensors"
    data = file.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = corrupt(data[8 : 8 + n])
    assert len(header) == n
    file.write_bytes(data[:8] + header + data[8 + n :])
    message = _refused(directory)
    assert str(file) in message and "corrupt" in message


def test_pickle_checkpoint_is_refused_and_never_unpickled(copy, tmp_path):
    directory = copy()
    (directory / "model.safetensors").unlink()
    sentinel = tmp_path / "unpickled"

    class Payload:
        def __reduce__(self):
            return (Path.touch, (sentinel,))

    (directory / "pytorch_model.bin").write_bytes(pickle.dumps(Payload()))
    message = _refused(directory)
    assert "pytorch_model.bin" in message and "safetensors" in message.lower()
    assert "convert" in message.lower()
    assert not sentinel.exists()


def test_unknown_model_type_is_named(copy):
    directory = copy(lambda c: c.update(model_type="mamba", architectures=["MambaForCausalLM"]))
    message = _refused(directory)
    assert "mamba" in message and "model_type" in message


@pytest.mark.parametrize(
    "edit",
    [
        lambda c: c.update(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}),
        lambda c: (c.pop("rope_parameters"), c.update(rope_theta=1e4, rope_scaling={"type": "dynamic"})),
    ],
    ids=["v5-yarn", "v4-dynamic"],
)
def test_unsupported_rope_type_is_named(copy, edit):
    message = _refused(copy(edit))
    assert "rope" in message and ("yarn" in message or "dynamic" in message)


def test_missing_config_is_refused(copy):
    directory = copy()
    (directory / "config.json").unlink()
    message = _refused(directory)
    assert "config.json" in message


def test_float16_dtype_is_refused(llama):
    message = _refused(llama, dtype="float16")
    assert "dtype" in message and "float16" in message


@pytest.mark.parametrize("mesh", ["data", (2, 4), jax.devices()], ids=["str", "tuple", "devices"])
def test_wrong_mesh_type_is_refused(llama, mesh):
    assert "mesh" in _refused(llama, exc=TypeError, mesh=mesh)


def test_reward_loader_refuses_causal_lm(llama):
    message = _refused(llama, loader=jaxsr.load_reward_model)
    assert "ForSequenceClassification" in message


def test_shard_listed_in_index_but_missing(tmp_path_factory, tmp_path):
    sharded, _ = H.checkpoint("llama2", tmp_path_factory, max_shard_size="10KB")
    directory = shutil.copytree(sharded, tmp_path / "sharded")
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1
    (directory / shards[1]).unlink()
    message = _refused(directory)
    assert shards[1] in message and "missing" in message


def test_tensor_listed_in_index_but_not_in_its_shard(tmp_path_factory, tmp_path):
    sharded, _ = H.checkpoint("llama2", tmp_path_factory, max_shard_size="10KB")
    directory = shutil.copytree(sharded, tmp_path / "sharded")
    index_file = directory / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    index["weight_map"]["model.layers.0.self_attn.ghost.weight"] = next(iter(index["weight_map"].values()))
    index_file.write_text(json.dumps(index))
    assert "model.layers.0.self_attn.ghost.weight" in _refused(directory)


def test_checkpoint_error_is_a_value_error():
    assert issubclass(CheckpointError, ValueError)


def test_empty_directory_is_refused(tmp_path):
    with pytest.raises(CheckpointError, match=r"no \*\.safetensors"):
        SafetensorsCheckpoint(tmp_path)


def test_mesh_of_the_right_type_is_accepted(llama):
    """The counterpart of the wrong-mesh test: a real Mesh loads."""
    model = jaxsr.load_model(llama, mesh=make_mesh(data=8, model=1))
    assert model.mesh is not None


@pytest.mark.parametrize("dtype", [np.int32, np.uint8, np.bool_])
def test_a_weight_that_is_not_float_is_named(copy, dtype):
    directory = copy()
    name = "model.layers.0.mlp.down_proj.weight"
    _rewrite(directory, lambda t: t.update({name: t[name].astype(dtype)}))
    message = _refused(directory)
    assert name in message and "float" in message


@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_a_weight_holding_nan_or_inf_is_named(copy, value):
    directory = copy()
    name = "model.layers.1.self_attn.o_proj.weight"

    def poison(tensors):
        tensors[name] = tensors[name].copy()
        tensors[name][0, 0] = value

    _rewrite(directory, poison)
    message = _refused(directory)
    assert name in message and "NaN or infinite" in message


@pytest.fixture(scope="module")
def tiny_lm():
    from tiny import tiny_model

    return tiny_model(seed=0)


@pytest.fixture(scope="module")
def tiny_encoder():
    from flax import nnx

    from jaxsr.models.encoder import Encoder, EncoderConfig, EncoderModel

    config = EncoderConfig(vocab_size=32, hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32)
    graph, params = nnx.split(Encoder(config, rngs=nnx.Rngs(0)))
    return EncoderModel(config=config, graph=graph, params=params)


@pytest.mark.parametrize(
    "token_ids",
    [[[2**32 + 3]], np.array([[2**32 + 3]], np.int64), np.array([[2**63]], np.uint64), [[2**63]], [[2**64]]],
    ids=["list-2**32+3", "int64-2**32+3", "uint64-2**63", "list-2**63", "list-2**64"],
)
def test_token_ids_past_int32_are_refused_not_wrapped(tiny_lm, tiny_encoder, token_ids):
    with pytest.raises(ValueError, match=r"token_ids: ids must lie in \[0, 64\)"):
        tiny_lm.logits(token_ids)
    with pytest.raises(ValueError, match=r"token_ids: ids must lie in \[0, 32\)"):
        tiny_encoder.hidden(token_ids)


def test_negative_id_beside_an_id_past_int64_is_refused(tiny_lm):
    with pytest.raises(ValueError, match="token_ids: ids must lie"):
        tiny_lm.logits([[-1, 2**63]])


@pytest.mark.parametrize("token_ids", [[[1.5, 2.0]], [[True, False]], np.ones((1, 2), bool)])
def test_token_ids_that_are_not_integers_are_refused(tiny_lm, token_ids):
    with pytest.raises(TypeError, match="token_ids"):
        tiny_lm.logits(token_ids)


def test_ragged_inputs_are_named(tiny_lm, tiny_encoder):
    rectangular = "expected a rectangular"
    with pytest.raises(ValueError, match=f"token_ids: {rectangular}"):
        tiny_lm.logits([[1, 2], [3]])
    with pytest.raises(ValueError, match=f"token_ids: {rectangular}"):
        tiny_encoder.hidden([[1, 2], [3]])
    with pytest.raises(ValueError, match=f"token_type_ids: {rectangular}"):
        tiny_encoder.hidden([[1, 2]], token_type_ids=[[0], [0, 1]])
    with pytest.raises(ValueError, match=f"attention_mask: {rectangular}"):
        tiny_encoder.hidden([[1, 2], [3, 4]], attention_mask=[[1], [1, 0]])


@pytest.mark.parametrize("mask", [[[2, -1]], [[1, 2]], [[0.5, 1.0]], [[1, 1, 1]], [[1], [1]]])
def test_bad_attention_masks_are_refused(tiny_lm, tiny_encoder, mask):
    with pytest.raises(ValueError, match="attention_mask"):
        tiny_lm.logits([[1, 2]], attention_mask=mask)
    with pytest.raises(ValueError, match="attention_mask"):
        tiny_encoder.hidden([[1, 2]], attention_mask=mask)


def test_token_type_ids_of_another_shape_or_range_are_refused(tiny_encoder):
    with pytest.raises(ValueError, match="token_type_ids: expected shape"):
        tiny_encoder.hidden([[1, 2]], token_type_ids=[[0, 1, 0]])
    with pytest.raises(ValueError, match=r"token_type_ids: ids must lie in \[0, 2\)"):
        tiny_encoder.hidden([[1, 2]], token_type_ids=[[0, 2**32]])


def test_valid_masks_and_ids_are_accepted(tiny_lm, tiny_encoder):
    ids = np.array([[1, 2]], np.int64)
    for mask in ([[0, 1]], np.array([[False, True]]), np.array([[0, 1]], np.uint8)):
        assert tiny_lm.logits(ids, attention_mask=mask).shape == (1, 2, 64)
    assert tiny_encoder.hidden([[1, 2]], attention_mask=[[1, 0]], token_type_ids=[[0, 1]]).shape == (1, 2, 16)
