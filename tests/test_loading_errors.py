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
