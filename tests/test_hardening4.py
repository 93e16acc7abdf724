"""Issue 15, fourth round: NumPy scalars as numbers, chat templates bounded in work, hub ids offline,
one-line CLI usage errors, and a parameter cache that never serves a different config."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import numpy as np
import pytest
from tiny import tiny_model

import jaxsr
from jaxsr.rewards import SelfLikelihood


@pytest.fixture(scope="module")
def lm():
    return tiny_model(seed=1, eos_token_ids=(63,))


NUMPY_NUMBERS = [np.float32(0.7), np.float16(0.5), np.int64(3), np.int32(2), np.uint8(1)]


def test_sampling_config_takes_numpy_scalars_as_their_python_twins():
    config = jaxsr.SamplingConfig(temperature=np.float32(0.5), top_k=np.int64(50), top_p=np.float64(0.9))
    assert config == jaxsr.SamplingConfig(temperature=0.5, top_k=50, top_p=0.9)
    assert hash(config) == hash(jaxsr.SamplingConfig(temperature=0.5, top_k=50, top_p=0.9))
    assert type(config.temperature) is float and type(config.top_k) is int and type(config.top_p) is float


@pytest.mark.parametrize(
    "kwargs, error, name",
    [
        ({"temperature": np.bool_(True)}, TypeError, "temperature"),
        ({"temperature": True}, TypeError, "temperature"),
        ({"top_k": np.bool_(False)}, TypeError, "top_k"),
        ({"top_k": np.float32(5.0)}, TypeError, "top_k"),
        ({"top_p": np.float32("nan")}, ValueError, "top_p"),
        ({"temperature": np.float64("inf")}, ValueError, "temperature"),
        ({"top_k": np.int64(-1)}, ValueError, "top_k"),
    ],
)
def test_sampling_config_still_refuses_numpy_bools_and_bad_values(kwargs, error, name):
    with pytest.raises(error, match=name):
        jaxsr.SamplingConfig(**kwargs)


def test_entry_points_take_numpy_numbers_alike(lm):
    """The numbers of every entry point go through jaxsr.checks: NumPy ints/floats behave as Python's."""
    sampling = jaxsr.SamplingConfig(temperature=np.float32(1.0), top_k=np.int64(0))
    plain = jaxsr.generate(
        lm, [[1, 2, 3]], max_new_tokens=4, num_samples=2, seed=5, sampling=jaxsr.SamplingConfig(top_k=0)
    )
    numpy = jaxsr.generate(
        lm, [[np.int64(1), 2, 3]], max_new_tokens=np.int32(4), num_samples=np.int64(2), seed=np.uint32(5),
        sampling=sampling, max_rows=np.int64(8), prompt_offset=np.int64(0), stop_token_ids=[np.int64(63)],
    )  # fmt: skip
    assert [s.token_ids for s in numpy[0].samples] == [s.token_ids for s in plain[0].samples]
    reward = SelfLikelihood()
    bon = jaxsr.best_of_n(
        lm, reward, [[1, 2]], n=np.int64(2), max_new_tokens=np.int64(4), memory_budget=np.int64(64)
    )
    sr = jaxsr.speculative_rejection(
        lm, reward, [[1, 2]], n=np.int64(2), rejection_rate=np.float32(0.0), max_new_tokens=4,
        memory_budget=np.int64(64), min_keep=np.int64(1), min_first_segment=np.int64(4),
        min_prompt_bucket=np.int64(16), concurrent_prompts=np.int64(1),
    )  # fmt: skip
    assert [s.token_ids for s in sr[0].samples] == [s.token_ids for s in bon[0].samples]
    draft = tiny_model(seed=2, eos_token_ids=(63,))
    jaxsr.speculative_decoder(lm, draft, gamma=np.int64(2))
    jaxsr.contrastive_decoder(lm, draft, alpha=np.float32(0.1), beta=np.float16(0.5), tau=np.int64(1))


@pytest.mark.parametrize("value", [np.bool_(True), True])
def test_entry_points_refuse_bools_for_numbers(lm, value):
    with pytest.raises(TypeError, match="num_samples"):
        jaxsr.generate(lm, [[1, 2]], max_new_tokens=4, num_samples=value)
    with pytest.raises(TypeError, match="rejection_rate"):
        jaxsr.speculative_rejection(lm, SelfLikelihood(), [[1]], rejection_rate=value, max_new_tokens=4)
    with pytest.raises(TypeError, match="memory_budget"):
        jaxsr.best_of_n(lm, SelfLikelihood(), [[1]], n=2, max_new_tokens=4, memory_budget=value)


def test_config_files_take_numpy_numbers_as_python_ones(tmp_path):
    from jaxsr.training import SFTConfig

    config = SFTConfig(
        model="smollm2", data=str(tmp_path / "d.jsonl"), output_dir=str(tmp_path / "o"),
        learning_rate=np.float32(1e-4), seed=np.int64(3),
    )  # fmt: skip
    assert type(config.learning_rate) is float and type(config.seed) is int
    with pytest.raises(ValueError, match="seed"):
        SFTConfig(model="smollm2", data="d", output_dir="o", seed=np.bool_(True))


@pytest.fixture
def cached_checkpoint(tmp_path, tmp_path_factory, monkeypatch):
    """A private tiny llama checkpoint, with the parameter cache on for it (under tmp_path)."""
    import hf_fixtures as H

    from jaxsr.loading import param_cache

    monkeypatch.setenv("JAXSR_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(param_cache, "MIN_DIRECTORY_BYTES", 0)
    return H.copy_checkpoint(H.checkpoint("llama2", tmp_path_factory)[0], tmp_path / "llama2")


def _rewrite_keeping_size_and_mtime(path, old: str, new: str) -> None:
    """Edit `path` so that only its content differs: same size, same mtime (as `cp -p` or a fast edit)."""
    stat, text = path.stat(), path.read_text()
    assert old in text and len(old) == len(new)
    path.write_text(text.replace(old, new))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))


def test_param_cache_misses_when_config_json_changes_in_content_only(cached_checkpoint):
    config = cached_checkpoint / "config.json"
    json_text = config.read_text()
    old = json.dumps({"rms_norm_eps": json.loads(json_text)["rms_norm_eps"]})[1:-1]
    assert old in json_text, old
    first = jaxsr.load_model(cached_checkpoint)
    _rewrite_keeping_size_and_mtime(config, old, old.replace("1e-05", "3e-05"))
    second = jaxsr.load_model(cached_checkpoint)
    assert (first.config.norm_eps, second.config.norm_eps) == (1e-5, 3e-5)


def test_param_cache_never_serves_an_edited_entry_config(cached_checkpoint, tmp_path):
    reference = jaxsr.load_model(cached_checkpoint, cache=False)
    jaxsr.load_model(cached_checkpoint)
    (meta,) = (tmp_path / "cache").glob("*/meta.json")
    record = json.loads(meta.read_text())
    record["hf_config"]["rope_theta"] = 123.0  # a valid config, just not the source's
    meta.write_text(json.dumps(record))
    with pytest.warns(UserWarning, match="rebuilding the parameter cache.*edited"):
        rebuilt = jaxsr.load_model(cached_checkpoint)
    assert rebuilt.config == reference.config


def _hub_response(status: int):
    import httpx2

    return httpx2.Response(status, request=httpx2.Request("GET", "https://huggingface.co/api/models/x"))


def _hub_failures():
    """What snapshot_download raises for a source the hub cannot provide (built here: no network)."""
    import httpx2
    from huggingface_hub import errors

    unreachable = errors.LocalEntryNotFoundError("cannot find the files")
    unreachable.__cause__ = httpx2.ConnectError("no route to host")
    return [
        (errors.RepositoryNotFoundError("404", response=_hub_response(404)), "no such repository"),
        (errors.GatedRepoError("403", response=_hub_response(403)), "gated"),
        (errors.RevisionNotFoundError("404", response=_hub_response(404)), r"revision: .* no revision 'v9'"),
        (unreachable, r"unreachable \(ConnectError\) and its local cache holds no complete copy"),
    ]


def test_an_offline_hub_id_is_a_bad_source_naming_the_argument_the_id_and_what_was_tried(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError, match="source: 'no-such-org/no-such-model' names no local file") as error:
        jaxsr.load_model("no-such-org/no-such-model", cache=False)
    assert "HF_HUB_OFFLINE" in str(error.value) and isinstance(error.value, FileNotFoundError)


@pytest.mark.parametrize("index", range(4))
def test_hub_failures_that_name_nothing_are_value_errors(monkeypatch, index):
    failure, message = _hub_failures()[index]

    def snapshot_download(*args, **kwargs):
        raise failure

    monkeypatch.setattr("huggingface_hub.snapshot_download", snapshot_download)
    with pytest.raises(ValueError, match=message):
        jaxsr.load_model("someorg/some-model", revision="v9", cache=False)


def test_other_hub_failures_stay_os_errors(monkeypatch):
    def snapshot_download(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("huggingface_hub.snapshot_download", snapshot_download)
    with pytest.raises(OSError, match=r"someorg/some-model.*No space left") as error:
        jaxsr.load_model("someorg/some-model", cache=False)
    assert not isinstance(error.value, ValueError)


@pytest.mark.parametrize("source", ["./no/such/dir", "/no/such/model.gguf", "~/no-such-dir", "missing.gguf"])
def test_missing_local_looking_paths_never_reach_the_hub(monkeypatch, source):
    monkeypatch.setattr("huggingface_hub.snapshot_download", lambda *a, **k: pytest.fail("asked the hub"))
    with pytest.raises(ValueError, match=r"source: .* does not exist"):
        jaxsr.load_model(source, cache=False)


@pytest.mark.parametrize(
    "argv, named",
    [
        ([], "arguments are required: command"),
        (["rn", "x.yaml"], "invalid choice: 'rn'"),
        (["run"], "arguments are required: config"),
        (["demo", "--prompts", "x"], "argument --prompts: invalid int value: 'x'"),
        (["demo", "--seed"], "argument --seed: expected one argument"),
        (["demo", "--bogus"], "unrecognized arguments: --bogus"),
        (["run", "c.yaml", "--nope"], "unrecognized arguments: --nope"),
        (["train"], "arguments are required: stage"),
        (["train", "sft"], "arguments are required: config"),
    ],
)
def test_cli_usage_errors_are_one_line_naming_the_argument(capsys, argv, named):
    from jaxsr.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2
    assert err.count("\n") == 1 and named in err and err.startswith("jaxsr"), err
    assert "usage:" not in err and "Traceback" not in err


def test_cli_usage_error_from_the_command_line_and_help_unchanged():
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    bad = subprocess.run([sys.executable, "-m", "jaxsr", "demo", "--n", "two"], capture_output=True, env=env)
    assert bad.returncode == 2 and bad.stdout == b""
    assert bad.stderr.decode() == (
        "jaxsr demo: error: argument --n: invalid int value: 'two' (see jaxsr demo --help)\n"
    )
    good = subprocess.run([sys.executable, "-m", "jaxsr", "run", "--help"], capture_output=True, env=env)
    assert (
        good.returncode == 0 and good.stdout.startswith(b"usage: jaxsr run") and b"key=value" in good.stdout
    )


# -- chat templates: rendered exactly as transformers renders them, within a bound on work ----------

LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
    "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + "
    "'<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{% endif %}"
)
GEMMA = (
    "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'assistant') %}{% set role = "
    "'model' %}{% else %}{% set role = message['role'] %}{% endif %}{{ '<start_of_turn>' + role + '\\n' + "
    "message['content'] | trim + '<end_of_turn>\\n' }}{% endfor %}{% if add_generation_prompt %}"
    "{{'<start_of_turn>model\\n'}}{% endif %}"
)
MISTRAL = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}{{ '[INST] ' + "
    "message['content'] + ' [/INST]' }}{% elif message['role'] == 'assistant' %}{{ message['content'] + "
    "eos_token}}{% else %}{{ '<<SYS>>' ~ message['content'] ~ '<</SYS>>' }}{% endif %}{% endfor %}"
)
QWEN = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}{%- for tool in tools %}{{- tool | tojson }}{%- endfor %}"
    "{%- elif messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + "
    "'<|im_end|>\\n' }}{%- else %}{{- '<|im_start|>system\\nYou are Qwen.<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}{%- if message.role == 'system' and loop.first %}{% continue %}{% endif %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
FILTERS = (  # the filters, globals and operators templates use, each within the budget
    "{% set ns = namespace(n=0, parts=[]) %}{% for m in messages %}{% set ns.n = ns.n + m.content|length %}"
    "{% set ns.parts = ns.parts + [m.role|upper] %}{% endfor %}{{ ns.n }} {{ ns.parts|join(', ') }}\n"
    "{{ messages|tojson(indent=2) }}{{ messages[0]|tojson }}{{ dict(a=1, b=[2])|tojson(sort_keys=True) }}\n"
    "{{ '{:>6}|{}'.format('ab', 7) }} {{ '%5s|%-4d' % ('x', 3) }} {{ 'hi'|center(9) }}{{ 'a\\nb'|indent(3) }}"
    "{{ 'x' * 3 ~ '-' * 2 }} {{ 2 ** 10 }} {{ 'a b c d'|wordwrap(3) }} {{ 'abcabc'|replace('b', 'BB') }}"
    "{{ [1, 2, 3]|map('string')|join }} {{ [[1], [2]]|sum(start=[]) }} {{ range(5)|batch(2)|list }}"
    "{{ bos_token ~ eos_token }}{{ strftime_now('%Y') }}{{ messages|selectattr('role', 'eq', 'user')|list }}"
    "{% macro turn(m) %}[{{ m.role }}]{{ caller() }}{% endmacro %}{% for m in messages %}{% call turn(m) %}"
    "{{ m.content|truncate(9) }}{% endcall %}{% if loop.index > 2 %}{% break %}{% endif %}{% endfor %}"
    "{% set block %}{{ messages|length }} turns{% endset %}{{ block|title }}{{ 'ab'.zfill(5) }}"
)
CONVERSATIONS = [
    [{"role": "user", "content": "hi"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2+2?  "},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3 × 3 — ünïcode?"},
    ],
]


@pytest.fixture(scope="module")
def tokenizers():
    """Every tokenizer with a chat template available offline: SmolLM2's (the shipped draft, the GGUF's
    tokenizer is the same template) and the byte-level test tokenizer's ChatML."""
    import hf_fixtures as H
    from transformers import AutoTokenizer

    from jaxsr.loading.embedded import smollm2_draft_path

    return {"smollm2": AutoTokenizer.from_pretrained(str(smollm2_draft_path())), "bytes": H.byte_tokenizer()}


@pytest.mark.parametrize("template", [None, LLAMA3, GEMMA, MISTRAL, QWEN, FILTERS])
@pytest.mark.parametrize("prompt", [True, False])
def test_chat_templates_render_exactly_as_transformers_renders_them(tokenizers, template, prompt):
    """Or fail where transformers fails (the byte tokenizer has no bos_token), as a ValueError."""
    from jaxsr import text

    for tokenizer in tokenizers.values():
        original = tokenizer.chat_template
        tokenizer.chat_template = template or original
        try:
            for messages in CONVERSATIONS:
                try:
                    expected = tokenizer.apply_chat_template(
                        messages, tokenize=False, add_generation_prompt=prompt
                    )
                except Exception as e:
                    with pytest.raises(ValueError, match=f"chat template of .*{type(e).__name__}: {e}"):
                        text.render_chat(tokenizer, messages, add_generation_prompt=prompt)
                    continue
                assert text.render_chat(tokenizer, messages, add_generation_prompt=prompt) == expected
        finally:
            tokenizer.chat_template = original


RUNAWAYS = [
    "{{ 'x' * 10**10 }}",
    "{{ ['x'] * 10**10 }}",
    "{{ 2 ** 10000000000 }}",
    "{% set ns = namespace(x=3) %}{% for i in range(64) %}{% set ns.x = ns.x * ns.x %}{% endfor %}",
    "{% set ns = namespace(s='ab') %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
    "{% set ns = namespace(s=['a']) %}{% for i in range(60) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
    "{{ range(100000)|join('x' * 100000) }}",
    "{{ 'x'.join(['y' * 100000] * 100000) }}",
    "{{ 'a'|center(10**10) }}",
    "{{ 'a'.ljust(10**10) }}",
    "{{ 'a'.zfill(10**10) }}",
    "{{ '%0999999999999d' % 1 }}",
    "{{ '%*d' % (10**10, 1) }}",
    "{{ '%09999999999d'|format(1) }}",
    "{{ '{:>9999999999}'.format(1) }}",
    "{{ '{:>{}}'.format(1, 10**10) }}",
    "{{ '{a:>9999999999}'.format_map({'a': 1}) }}",
    "{{ ('a' * 100000)|replace('a', 'b' * 100000) }}",
    "{{ ('a' * 100000).replace('a', 'b' * 100000) }}",
    "{{ ('\\t' * 100000).expandtabs(100000) }}",
    "{{ 'x\\ny'|indent(10**10) }}",
    "{{ 'a b'|wordwrap(1, wrapstring='x' * 1000000) }}",
    "{{ [1]|batch(10**10, 0)|list }}",
    "{{ [1]|slice(10**10)|list }}",
    "{{ messages|tojson(indent=10**9) }}",
    "{{ dict.fromkeys(range(100000), 'x' * 100000)|tojson }}",
    "{{ ([['a'] * 100000] * 100000)|sum(start=[]) }}",
    "{{ ['a' * 100000] * 100000 }}",
    "{{ (['a' * 100000] * 100000)|string }}",
    "{{ ['a' * 100000] * 100000 ~ '' }}",
    "{{ range(100000)|map('center', 100000)|join }}",
    "{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}",
    "{% set x %}{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}{% endset %}{{ x }}",
    "{% for i in range(10**5) %}{% for j in range(10**5) %}{% endfor %}{% endfor %}",
]


@pytest.mark.parametrize("template", RUNAWAYS)
def test_a_runaway_template_is_refused_quickly_naming_the_tokenizer(tokenizers, template):
    import resource
    import time

    from jaxsr import chat_template, text

    tokenizer = tokenizers["smollm2"]
    original = tokenizer.chat_template
    tokenizer.chat_template = template
    started, peak = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    try:
        with pytest.raises(
            ValueError, match=f"^chat template of {re.escape(tokenizer.name_or_path)}: "
        ) as error:
            text.render_chat(tokenizer, [{"role": "user", "content": "hi"}], add_generation_prompt=True)
    finally:
        tokenizer.chat_template = original
    assert isinstance(error.value.__context__, chat_template.TemplateOverBudget | OverflowError | None)
    assert time.perf_counter() - started < 6  # (~2 s at most on a loaded CPU: loops of 100 000 turns)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak < 2**20  # KiB: under 1 GiB more


def test_load_model_refuses_an_empty_source_and_a_revision_that_is_not_text(monkeypatch):
    monkeypatch.setattr("huggingface_hub.snapshot_download", lambda *a, **k: pytest.fail("asked the hub"))
    with pytest.raises(ValueError, match="source: expected a path or a hub id, got ''"):
        jaxsr.load_model("")  # (Path("") is the working directory)
    with pytest.raises(TypeError, match="revision: expected a branch, tag or commit"):
        jaxsr.load_model("someorg/some-model", revision=3)


@pytest.mark.parametrize("field", ["learning_rate", "weight_decay", "max_grad_norm", "threshold"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), np.float32("-inf")])
def test_config_float_fields_must_be_finite(field, value):
    from jaxsr.jobs.config import load_job_config
    from jaxsr.training import SFTConfig

    with pytest.raises(ValueError, match=f"{field}: expected a finite number"):
        SFTConfig(data="d.jsonl", **{field: value})
    with pytest.raises(ValueError, match="temperature: expected a finite number"):
        load_job_config(None, ["temperature=.inf"])
