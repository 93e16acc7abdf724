"""Checkpoints that cannot be loaded are refused with a ValueError naming the file and the culprit:
config.json's fields; JSON that is invalid, nested too deeply or not UTF-8; shard indexes, their shard
paths kept inside the checkpoint; safetensors headers, byte ranges and shapes; tensors missing,
misshaped, not float or not finite; pickles, never unpickled; the encoder's files alike; and the
arguments load_model reads beside a checkpoint (dtype, mesh)."""

from __future__ import annotations

import json
import os
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
from jaxsr.loading.encoder import load_encoder, minilm_path
from jaxsr.loading.files import CheckpointError, inside, read_json
from jaxsr.loading.safetensors import SafetensorsCheckpoint, read_safetensors
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


def refused(directory: Path, exc=ValueError, loader=jaxsr.load_model, **kwargs) -> str:
    """The message of the `exc` that `loader` refuses `directory` with (load_model without its
    parameter cache)."""
    if loader is jaxsr.load_model:
        kwargs.setdefault("cache", False)
    with pytest.raises(exc) as info:
        loader(directory, **kwargs)
    return str(info.value)


def write_config(directory: Path, config) -> None:
    (directory / "config.json").write_text(json.dumps(config))


def test_sanity_the_copy_loads(copy):
    """The baseline every corruption below starts from does load."""
    model = jaxsr.load_model(copy())
    assert model.config.model_type == "llama"


# -- config.json and the other JSON files ----------------------------------------------------------


@pytest.mark.parametrize(
    ("edit", "named"),
    [
        (lambda c: ["not", "an", "object"], "expected an object"),
        (lambda c: {k: v for k, v in c.items() if k != "hidden_size"}, "'hidden_size' is missing"),
        (lambda c: c | {"hidden_size": "64"}, "'hidden_size': expected a positive integer"),
        (lambda c: c | {"num_hidden_layers": 0}, "'num_hidden_layers': expected a positive integer"),
        (lambda c: c | {"num_attention_heads": True}, "'num_attention_heads'"),
        (lambda c: c | {"rms_norm_eps": -1.0}, "'rms_norm_eps': expected a finite positive number"),
        (lambda c: c | {"rope_scaling": "llama3"}, "'rope_scaling': expected an object"),
        (lambda c: c | {"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "'low_freq_factor'"),
        (lambda c: c | {"eos_token_id": "</s>"}, "eos_token_id"),
        (lambda c: c | {"eos_token_id": 60000}, "eos_token_id must be a token id in [0, "),
        (lambda c: c | {"hidden_act": ["silu"]}, "hidden_act"),
        (lambda c: c | {"architectures": "LlamaForSequenceClassification"}, "'architectures'"),
        (lambda c: c | {"architectures": [1]}, "'architectures'"),
        (
            lambda c: c | {"architectures": ["LlamaForSequenceClassification"], "num_labels": 1.5},
            "num_labels",
        ),
        (lambda c: c | {"rope_parameters": c["rope_parameters"] | {"rope_theta": 1e-300}}, "'rope_theta'"),
        (lambda c: c | {"rms_norm_eps": 1e300}, "'rms_norm_eps'"),
        (lambda c: {"a": "[" * 100000}, "model_type"),
        (lambda c: c | {"max_position_embeddings": 2**40}, "'max_position_embeddings'"),
        (lambda c: c | {"tie_word_embeddings": 1}, "'tie_word_embeddings': expected true or false"),
    ],
    ids=[
        "list",
        "missing",
        "string",
        "zero",
        "bool",
        "negative-eps",
        "rope-string",
        "rope-partial",
        "eos",
        "eos-range",
        "act-list",
        "arch-string",
        "arch-int",
        "labels-float",
        "tiny-theta",
        "huge-eps",
        "junk",
        "huge-context",
        "tie-int",
    ],
)
def test_a_bad_config_field_names_the_file_and_the_field(llama, tmp_path, edit, named):
    directory = shutil.copytree(llama, tmp_path / "ckpt")
    write_config(directory, edit(json.loads((directory / "config.json").read_text())))
    message = refused(directory)
    assert str(directory / "config.json") in message and named in message


@pytest.mark.parametrize(
    "name", ["config.json", "generation_config.json", "model.safetensors.index.json", "tokenizer.json"]
)
def test_invalid_json_names_the_file_and_the_line(llama, tmp_path, name):
    directory = shutil.copytree(llama, tmp_path / "ckpt")
    (directory / name).write_text('{\n  "vocab_size": 128,\n  oops\n}')
    message = refused(directory)
    if name == "tokenizer.json":  # transformers words its own parse errors; the folder is named
        assert f"{directory}: the tokenizer files cannot be read" in message
    else:
        assert f"{directory / name}: invalid JSON at line 3" in message


def test_json_nested_beyond_recursion_is_named(llama, tmp_path):
    directory = shutil.copytree(llama, tmp_path / "ckpt")
    (directory / "config.json").write_text("[" * 200000 + "]" * 200000)
    assert "config.json: JSON nested too deeply" in refused(directory)


def test_a_file_that_is_not_utf8_is_named(llama, tmp_path):
    directory = shutil.copytree(llama, tmp_path / "ckpt")
    (directory / "config.json").write_bytes(b"\xff\xfe{}")
    assert "config.json: not UTF-8" in refused(directory)


def test_read_json_checks_the_kind_of_value(tmp_path):
    file = tmp_path / "x.json"
    file.write_text("[1, 2]")
    assert read_json(file, list) == [1, 2]
    with pytest.raises(CheckpointError, match=r"x.json: holds a JSON list, expected an object"):
        read_json(file)
    with pytest.raises(CheckpointError, match=r"not a regular file \(a directory\)"):
        read_json(tmp_path)
    with pytest.raises(CheckpointError, match="cannot be read"):
        read_json(tmp_path / "absent.json")


def test_missing_config_is_refused(copy):
    directory = copy()
    (directory / "config.json").unlink()
    message = refused(directory)
    assert "config.json" in message


def test_unknown_model_type_is_named(copy):
    directory = copy(lambda c: c.update(model_type="mamba", architectures=["MambaForCausalLM"]))
    message = refused(directory)
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
    message = refused(copy(edit))
    assert "rope" in message and ("yarn" in message or "dynamic" in message)


# -- shard indexes and the paths they name ---------------------------------------------------------


def test_shard_listed_in_index_but_missing(tmp_path_factory, tmp_path):
    sharded, _ = H.checkpoint("llama2", tmp_path_factory, max_shard_size="10KB")
    directory = shutil.copytree(sharded, tmp_path / "sharded")
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1
    (directory / shards[1]).unlink()
    message = refused(directory)
    assert shards[1] in message and "missing" in message


def test_tensor_listed_in_index_but_not_in_its_shard(tmp_path_factory, tmp_path):
    sharded, _ = H.checkpoint("llama2", tmp_path_factory, max_shard_size="10KB")
    directory = shutil.copytree(sharded, tmp_path / "sharded")
    index_file = directory / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    index["weight_map"]["model.layers.0.self_attn.ghost.weight"] = next(iter(index["weight_map"].values()))
    index_file.write_text(json.dumps(index))
    assert "model.layers.0.self_attn.ghost.weight" in refused(directory)


def test_an_index_without_a_weight_map_is_named(tmp_path_factory, tmp_path):
    sharded, _ = H.checkpoint("llama2", tmp_path_factory, max_shard_size="10KB")
    directory = shutil.copytree(sharded, tmp_path / "ckpt")
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}}))
    assert "weight_map" in refused(directory)


def test_a_shard_that_is_a_directory_is_named(tmp_path_factory, tmp_path):
    sharded, _ = H.checkpoint("llama2", tmp_path_factory, max_shard_size="10KB")
    directory = shutil.copytree(sharded, tmp_path / "ckpt")
    index_file = directory / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    index["weight_map"][next(iter(index["weight_map"]))] = "."
    index_file.write_text(json.dumps(index))
    assert "is missing" in refused(directory)


@pytest.mark.parametrize("escape", ["../outside.safetensors", "/etc/passwd", "sub/../../outside.safetensors"])
def test_a_shard_index_cannot_point_outside_its_directory(tmp_path_factory, tmp_path, escape):
    sharded, _ = H.checkpoint("llama2", tmp_path_factory, max_shard_size="10KB")
    directory = shutil.copytree(sharded, tmp_path / "ckpt")
    index_file = directory / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    first = next(iter(index["weight_map"]))
    shutil.copy(directory / index["weight_map"][first], tmp_path / "outside.safetensors")
    index["weight_map"][first] = escape
    index_file.write_text(json.dumps(index))
    message = refused(directory)
    assert "model.safetensors.index.json" in message and "points outside" in message


def test_a_symlinked_shard_inside_the_directory_is_followed(tmp_path_factory, tmp_path):
    """A hub snapshot's files are symlinks into the cache's blob folder: that must keep loading."""
    sharded, _ = H.checkpoint("llama2", tmp_path_factory, max_shard_size="10KB")
    blobs, directory = tmp_path / "blobs", tmp_path / "snapshot"
    shutil.copytree(sharded, blobs)
    directory.mkdir()
    for file in blobs.iterdir():
        (directory / file.name).symlink_to(file)
    assert jaxsr.load_model(directory, cache=False).config.model_type == "llama"


def test_inside_refuses_what_is_not_a_file_name(tmp_path):
    for name in (None, 3, ""):
        with pytest.raises(CheckpointError, match="expected a file name"):
            inside(tmp_path, name, tmp_path / "index.json")
    assert inside(tmp_path, "a/b.safetensors", tmp_path / "index.json") == tmp_path / "a" / "b.safetensors"


def test_a_checkpoint_reads_only_the_files_that_hold_its_tensors(tmp_path):
    from jaxsr.loading.files import CheckpointError
    from jaxsr.loading.safetensors import SafetensorsCheckpoint, write_safetensors

    right, wrong = np.ones(2, np.float32), np.full(2, 7, np.float32)
    write_safetensors(tmp_path / "model.safetensors", {"w": right})
    write_safetensors(tmp_path / "extra.safetensors", {"w": wrong})  # unindexed, the same name
    with pytest.raises(CheckpointError, match=r"2 weights files \(extra.safetensors, model.safetensors\)"):
        SafetensorsCheckpoint(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"w": "model.safetensors"}})
    )
    np.testing.assert_array_equal(SafetensorsCheckpoint(tmp_path)["w"], right)  # the index's file wins
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"w": "./model.safetensors", "v": "extra.safetensors"}})
    )
    with pytest.raises(CheckpointError, match="'v' is listed in the index but not in its shard"):
        SafetensorsCheckpoint(tmp_path)  # extra.safetensors is read, but only for `v`, which it lacks


# -- safetensors files -----------------------------------------------------------------------------


def test_checkpoint_error_is_a_value_error():
    assert issubclass(CheckpointError, ValueError)


def test_empty_directory_is_refused(tmp_path):
    with pytest.raises(CheckpointError, match=r"no \*\.safetensors"):
        SafetensorsCheckpoint(tmp_path)


def test_truncated_file_is_named(copy):
    directory = copy()
    file = directory / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[: len(data) - 100])
    message = refused(directory)
    assert str(file) in message and "truncated" in message


def test_file_shorter_than_its_header_size_is_named(copy):
    directory = copy()
    file = directory / "model.safetensors"
    file.write_bytes(file.read_bytes()[:5])
    assert str(file) in refused(directory)


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
    message = refused(directory)
    assert str(file) in message and "corrupt" in message


@pytest.mark.parametrize("shape", [[2**62, 0], [0] * 100])
def test_an_impossible_tensor_shape_names_the_file_and_tensor(tmp_path, shape):
    header = json.dumps({"w": {"dtype": "F32", "shape": shape, "data_offsets": [0, 0]}}).encode()
    file = tmp_path / "model.safetensors"
    file.write_bytes(len(header).to_bytes(8, "little") + header)
    with pytest.raises(CheckpointError, match=r"model.safetensors: tensor 'w' has an impossible shape"):
        read_safetensors(file)


def safetensors_bytes(header: dict, data: bytes) -> bytes:
    encoded = json.dumps(header).encode()
    return len(encoded).to_bytes(8, "little") + encoded + data


@pytest.mark.parametrize(
    "offsets, data, problem",
    [
        ({"a": [0, 8], "b": [4, 12]}, bytes(12), "overlaps or leaves a gap"),  # b reads a's last bytes
        ({"a": [0, 8], "b": [12, 20]}, bytes(20), "overlaps or leaves a gap"),
        ({"a": [0, 8], "b": [8, 16]}, bytes(24), "8 bytes after the last tensor's data"),
    ],
)
def test_safetensors_byte_ranges_must_tile_the_buffer(tmp_path, offsets, data, problem):
    from jaxsr.loading.files import CheckpointError
    from jaxsr.loading.safetensors import read_safetensors

    header = {name: {"dtype": "F32", "shape": [2], "data_offsets": span} for name, span in offsets.items()}
    path = tmp_path / "model.safetensors"
    path.write_bytes(safetensors_bytes(header, data))
    with pytest.raises(CheckpointError, match=problem):
        read_safetensors(path)
    header["b"]["data_offsets"] = [8, 16]  # the same tensors, tiled
    path.write_bytes(safetensors_bytes(header, bytes(16)))
    assert sorted(read_safetensors(path)) == ["a", "b"]


def test_pickle_checkpoint_is_refused_and_never_unpickled(copy, tmp_path):
    directory = copy()
    (directory / "model.safetensors").unlink()
    sentinel = tmp_path / "unpickled"

    class Payload:
        def __reduce__(self):
            return (Path.touch, (sentinel,))

    (directory / "pytorch_model.bin").write_bytes(pickle.dumps(Payload()))
    message = refused(directory)
    assert "pytorch_model.bin" in message and "safetensors" in message.lower()
    assert "convert" in message.lower()
    assert not sentinel.exists()


# -- tensors ---------------------------------------------------------------------------------------


def test_missing_tensor_is_named(copy):
    directory = copy()
    name = "model.layers.1.mlp.up_proj.weight"
    _rewrite(directory, lambda t: t.pop(name))
    message = refused(directory)
    assert name in message and "missing" in message


def test_missing_lm_head_of_untied_model_is_named(copy):
    directory = copy()
    _rewrite(directory, lambda t: t.pop("lm_head.weight"))
    assert "lm_head.weight" in refused(directory)


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
    message = refused(directory)
    assert name in message and "shape" in message


def test_unexpected_tensor_is_named(copy):
    directory = copy()
    name = "model.layers.0.self_attn.extra_proj.weight"
    _rewrite(directory, lambda t: t.__setitem__(name, np.zeros((4, 4), np.float32)))
    assert name in refused(directory)


def test_tensor_errors_name_the_checkpoint(llama, tmp_path):
    directory = shutil.copytree(llama, tmp_path / "ckpt")
    config = json.loads((directory / "config.json").read_text())
    write_config(directory, config | {"num_hidden_layers": config["num_hidden_layers"] + 1})
    message = refused(directory)
    assert message.startswith(str(directory)) and "missing tensor" in message


@pytest.mark.parametrize("dtype", [np.int32, np.uint8, np.bool_])
def test_a_weight_that_is_not_float_is_named(copy, dtype):
    directory = copy()
    name = "model.layers.0.mlp.down_proj.weight"
    _rewrite(directory, lambda t: t.update({name: t[name].astype(dtype)}))
    message = refused(directory)
    assert name in message and "float" in message


@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_a_weight_holding_nan_or_inf_is_named(copy, value):
    directory = copy()
    name = "model.layers.1.self_attn.o_proj.weight"

    def poison(tensors):
        tensors[name] = tensors[name].copy()
        tensors[name][0, 0] = value

    _rewrite(directory, poison)
    message = refused(directory)
    assert name in message and "NaN or infinite" in message


# -- what load_model reads beside a checkpoint -----------------------------------------------------


def test_float16_dtype_is_refused(llama):
    message = refused(llama, dtype="float16")
    assert "dtype" in message and "float16" in message


@pytest.mark.parametrize("mesh", ["data", (2, 4), jax.devices()], ids=["str", "tuple", "devices"])
def test_wrong_mesh_type_is_refused(llama, mesh):
    assert "mesh" in refused(llama, exc=TypeError, mesh=mesh)


def test_mesh_of_the_right_type_is_accepted(llama):
    """The counterpart of the wrong-mesh test: a real Mesh loads."""
    model = jaxsr.load_model(llama, mesh=make_mesh(data=8, model=1))
    assert model.mesh is not None


def test_reward_loader_refuses_causal_lm(llama):
    message = refused(llama, loader=jaxsr.load_reward_model)
    assert "ForSequenceClassification" in message


# -- encoder checkpoints (all-MiniLM-L6-v2's files) ------------------------------------------------


@pytest.fixture(scope="module")
def encoder_checkpoint() -> Path:
    return minilm_path()


@pytest.mark.parametrize(
    ("file", "content", "named"),
    [
        ("config.json", "{", "config.json: invalid JSON"),
        ("config.json", None, "'hidden_size' is missing"),
        ("modules.json", '{"a": 1}', "modules.json: holds a JSON dict, expected a list"),
        ("modules.json", '[{"type": "x.Pooling", "path": "../.."}]', "points outside"),
        ("sentence_bert_config.json", '{"max_seq_length": "long"}', "max_seq_length"),
        ("sentence_bert_config.json", '{"max_seq_length": true}', "max_seq_length"),
        ("modules.json", '[{"type": "sentence_transformers.models.Dense", "path": "2_Dense"}]', "Dense"),
    ],
    ids=["config-json", "config-field", "modules-kind", "modules-escape", "seq-str", "seq-bool", "dense"],
)
def test_encoder_files_are_named(encoder_checkpoint, tmp_path, file, content, named):
    # links to the installed files (90 MB of weights), the edited one replaced by a real file
    directory = shutil.copytree(encoder_checkpoint, tmp_path / "encoder", copy_function=os.symlink)
    if content is None:
        config = json.loads((directory / file).read_text())
        del config["hidden_size"]
        content = json.dumps(config)
    (directory / file).unlink()
    (directory / file).write_text(content)
    message = refused(directory, loader=load_encoder)
    assert file in message and named in message


@pytest.mark.parametrize("damage", ["nan", "int"])
def test_encoder_weights_are_checked_like_the_decoder_s(encoder_checkpoint, tmp_path, damage):
    directory = shutil.copytree(encoder_checkpoint, tmp_path / "encoder", copy_function=os.symlink)
    tensors = load_file(encoder_checkpoint / "model.safetensors")
    name = next(n for n in tensors if n.endswith("attention.self.query.weight"))
    tensors[name] = tensors[name].copy()
    if damage == "nan":
        tensors[name][0, 0] = np.nan
    else:
        tensors[name] = tensors[name].astype(np.int32)
    (directory / "model.safetensors").unlink()
    save_file(tensors, directory / "model.safetensors")
    message = refused(directory, loader=load_encoder)
    assert name in message and ("NaN" in message if damage == "nan" else "int32" in message)


def test_an_encoder_epsilon_that_flattens_everything_is_refused(encoder_checkpoint, tmp_path):
    directory = shutil.copytree(encoder_checkpoint, tmp_path / "encoder", copy_function=os.symlink)
    config = json.loads((directory / "config.json").read_text()) | {"layer_norm_eps": 1e300}
    (directory / "config.json").unlink()
    (directory / "config.json").write_text(json.dumps(config))
    assert "'layer_norm_eps'" in refused(directory, loader=load_encoder)
