"""Every malformed file is refused with a ValueError that names the file (and the field or line); shard
paths stay inside their checkpoint; chat templates that fail or never finish are stopped and named."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import hf_fixtures as H
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import jaxsr
from jaxsr import chat_template, text
from jaxsr.data import read_prompts
from jaxsr.loading.embedded import smollm2_draft_path
from jaxsr.loading.encoder import load_encoder, minilm_path
from jaxsr.loading.files import CheckpointError, inside, read_json
from jaxsr.loading.safetensors import read_safetensors


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    return H.checkpoint("llama2", tmp_path_factory)[0]


def refused(directory: Path, loader=jaxsr.load_model) -> str:
    with pytest.raises(ValueError) as info:
        loader(directory, cache=False) if loader is jaxsr.load_model else loader(directory)
    return str(info.value)


def write_config(directory: Path, config) -> None:
    (directory / "config.json").write_text(json.dumps(config))


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


def test_a_shard_that_is_a_directory_is_named(tmp_path_factory, tmp_path):
    sharded, _ = H.checkpoint("llama2", tmp_path_factory, max_shard_size="10KB")
    directory = shutil.copytree(sharded, tmp_path / "ckpt")
    index_file = directory / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    index["weight_map"][next(iter(index["weight_map"]))] = "."
    index_file.write_text(json.dumps(index))
    assert "is missing" in refused(directory)


def test_tensor_errors_name_the_checkpoint(llama, tmp_path):
    directory = shutil.copytree(llama, tmp_path / "ckpt")
    config = json.loads((directory / "config.json").read_text())
    write_config(directory, config | {"num_hidden_layers": config["num_hidden_layers"] + 1})
    message = refused(directory)
    assert message.startswith(str(directory)) and "missing tensor" in message


def test_a_file_that_is_not_utf8_is_named(llama, tmp_path):
    directory = shutil.copytree(llama, tmp_path / "ckpt")
    (directory / "config.json").write_bytes(b"\xff\xfe{}")
    assert "config.json: not UTF-8" in refused(directory)


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


def test_an_index_without_a_weight_map_is_named(tmp_path_factory, tmp_path):
    sharded, _ = H.checkpoint("llama2", tmp_path_factory, max_shard_size="10KB")
    directory = shutil.copytree(sharded, tmp_path / "ckpt")
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}}))
    assert "weight_map" in refused(directory)


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


# -- chat templates ------------------------------------------------------------------------------


ENDLESS = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"


@pytest.fixture
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_draft_path()))


@pytest.mark.parametrize(
    ("template", "named"),
    [
        ("{{ raise_exception('only user turns') }}", "only user turns"),
        ("{% for m in messages %}{{ m.content.nope() }}{% endfor %}", "UndefinedError"),
        ("{% for m in messages %}{{ m.__class__.__mro__ }}{% endfor %}", "SecurityError"),
    ],
    ids=["raises", "undefined", "sandbox"],
)
def test_a_failing_chat_template_is_a_value_error_naming_the_tokenizer(tokenizer, template, named):
    tokenizer.chat_template = template
    with pytest.raises(ValueError, match="chat template of") as info:
        text.render_chat(tokenizer, [{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert named in str(info.value)


def test_a_chat_template_that_never_ends_is_stopped(tokenizer, monkeypatch):
    monkeypatch.setattr(chat_template, "LINE_BUDGET", 20_000)
    tokenizer.chat_template = ENDLESS
    with pytest.raises(ValueError, match="still rendering after 20000 template lines"):
        text.render_chat(tokenizer, [{"role": "user", "content": "hi"}], add_generation_prompt=True)


def test_the_shipped_template_renders_within_the_budget_and_tracing_is_restored(tokenizer):
    import sys

    before = sys.gettrace()
    rendered = text.render_chat(tokenizer, [{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert rendered == tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert sys.gettrace() is before


def test_generate_refuses_a_runaway_template_before_decoding(monkeypatch):
    model = jaxsr.load_model(smollm2_draft_path())
    monkeypatch.setattr(chat_template, "LINE_BUDGET", 20_000)
    model.tokenizer.chat_template = ENDLESS
    with pytest.raises(ValueError, match="chat template"):
        jaxsr.generate(model, ["hi"], max_new_tokens=2)


# -- prompt data files -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "content", "named"),
    [
        ("empty.jsonl", "", "holds no prompts"),
        ("empty.json", "[]", "holds no prompts"),
        ("bad.jsonl", '{"prompt": "a"}\n{"prompt": "b"}\n{"prompt": \n', "at line 3"),
        ("bad.json", '[\n{"prompt": "a"},\n}', "at line 3"),
        ("blank.json", '[{"prompt": "  "}]', "record 0"),
    ],
    ids=["empty-jsonl", "empty-json", "jsonl-line", "json-line", "blank-prompt"],
)
def test_a_bad_data_file_is_named_with_its_line(tmp_path, name, content, named):
    file = tmp_path / name
    file.write_text(content)
    with pytest.raises(ValueError, match=named) as info:
        read_prompts(str(file))
    assert str(file) in str(info.value)


def test_a_data_file_that_is_not_utf8_is_named(tmp_path):
    file = tmp_path / "latin1.jsonl"
    file.write_bytes('{"prompt": "caf\xe9"}\n'.encode("latin-1"))
    with pytest.raises(ValueError, match="not UTF-8"):
        read_prompts(str(file))


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


@pytest.mark.parametrize("shape", [[2**62, 0], [0] * 100])
def test_an_impossible_tensor_shape_names_the_file_and_tensor(tmp_path, shape):
    header = json.dumps({"w": {"dtype": "F32", "shape": shape, "data_offsets": [0, 0]}}).encode()
    file = tmp_path / "model.safetensors"
    file.write_bytes(len(header).to_bytes(8, "little") + header)
    with pytest.raises(CheckpointError, match=r"model.safetensors: tensor 'w' has an impossible shape"):
        read_safetensors(file)


def test_a_template_that_renders_gigabytes_is_refused_before_tokenizing(monkeypatch):
    """A one-line template can turn "hi" into more text than any context holds: refused by its length
    before the tokenizer (whose allocation failure would abort the process) sees it."""
    model = jaxsr.load_model(smollm2_draft_path())
    model.tokenizer.chat_template = "{{ 'x' * 10**7 }}"
    encode = text.encode

    def short_only(tokenizer, rendered, **kwargs):
        assert len(rendered) < 10**6, "the rendering was tokenized"
        return encode(tokenizer, rendered, **kwargs)

    monkeypatch.setattr(text, "encode", short_only)
    with pytest.raises(ValueError, match=r"^prompts\[0\]: chat template of .*10{7}"):
        jaxsr.generate(model, ["hi"], max_new_tokens=2)
