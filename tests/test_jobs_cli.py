"""Dataset-generation jobs and the `jaxsr` command: config parsing, JSONL output, resume after a kill,
refusal of foreign outputs and bad values, and Best-of-N / SR jobs, on a tiny checkpoint with a
byte-level tokenizer and a chat template."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import hf_fixtures as H
import pytest
import yaml
from repository import copy_repository

from jaxsr.cli import main
from jaxsr.data import read_prompts
from jaxsr.jobs.config import LATER_KEYS, JobConfig, load_job_config
from jaxsr.jobs.runner import JsonlOutput, job_file
from jaxsr.locks import lock_path
from jaxsr.search.scheduler import PromptSearch
from jaxsr.search.speculative_rejection import speculative_rejection

PROMPTS = ["Name a color.", "Say hi.", "Count to three.", "Pick a fruit."]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A tiny random Llama checkpoint (safetensors) with the byte tokenizer: what `model=` points at."""
    directory = tmp_path_factory.mktemp("byte-llama")
    return H.build_llama_with_tokenizer(
        "LlamaForCausalLM", H.byte_tokenizer(), directory, 21, rms_norm_eps=1e-6
    )


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("data")
    as_json, as_jsonl = root / "prompts.json", root / "prompts.jsonl"
    as_json.write_text(json.dumps([{"prompt": p, "id": i} for i, p in enumerate(PROMPTS)]))
    as_jsonl.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS) + "\n")
    return {"json": as_json, "jsonl": as_jsonl}


@pytest.fixture
def job(model_dir, data, tmp_path):
    """A generate job's YAML file; returns (config path, output path)."""
    output = tmp_path / "out" / "job.jsonl"
    config = {
        "method": "generate",
        "model": str(model_dir),
        "data": str(data["json"]),
        "output": str(output),
        "max_new_tokens": 8,
        "num_samples": 2,
        "seed": 0,
    }
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(config))
    return path, output


def cli(*argv: str) -> int:
    return main([argv[0], *argv[1:], "--no-progress"] if argv[0] == "run" else list(argv))


def read_jsonl(path: Path) -> tuple[dict, list[dict]]:
    """(the job file beside the output, the output's records)."""
    return json.loads(job_file(path).read_text()), parse_records(path.read_text())


def parse_records(text: str) -> list[dict]:
    """The records in prompt order (a job writes them as its prompts finish, shortest prompts first)."""
    return sorted((json.loads(line) for line in text.splitlines()), key=lambda r: r["index"])


def without_stats(record: dict) -> dict:
    return {k: v for k, v in record.items() if k != "stats"}


def assert_same_up_to_rounding(records: list[dict], expected: list[dict]) -> None:
    """Same tokens, texts and flags; log-probabilities and certainties equal up to float32 summation
    order (a mesh that splits the model sums its matmuls in another order)."""
    sums = ("logprob", "certainty")

    def parts(record: dict) -> tuple[dict, list[float]]:
        samples = [{k: v for k, v in s.items() if k not in sums} for s in record["samples"]]
        floats = [s[k] for s in record["samples"] for k in sums]
        return {**without_stats(record), "samples": samples}, floats

    for record, reference in zip(records, expected, strict=True):
        (exact, logprobs), (exact_ref, logprobs_ref) = parts(record), parts(reference)
        assert exact == exact_ref
        assert logprobs == pytest.approx(logprobs_ref, rel=1e-5)


# -- configuration ---------------------------------------------------------------------------------


def test_yaml_and_typed_overrides(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("method: best_of_n\nreward: self_likelihood\nn: 4\ntemperature: 0.7\nlimit: 10\n")
    config = load_job_config(path, ["limit=3", "top_p=0.9", "chat=false", "memory_budget=2GiB", "seed=5"])
    assert (config.method, config.reward, config.n, config.temperature) == (
        "best_of_n",
        "self_likelihood",
        4,
        0.7,
    )
    assert config.limit == 3 and type(config.limit) is int  # the override wins over the file
    assert config.top_p == 0.9 and type(config.top_p) is float
    assert config.chat is False and config.seed == 5
    assert config.memory_budget == "2GiB"
    assert load_job_config(path, ["memory_budget=512"]).memory_budget == 512
    with pytest.raises(ValueError, match="reward: best_of_n needs a reward"):  # null is a value: no reward
        load_job_config(path, ["reward=null"])
    assert load_job_config(None, []) == JobConfig()  # no file: the defaults
    with pytest.raises(FileNotFoundError, match=r"nope\.yaml: the config does not exist") as missing:
        load_job_config(tmp_path / "nope.yaml", [])
    assert isinstance(missing.value, ValueError)


def test_fingerprint_names_the_content_not_the_output(tmp_path):
    base = load_job_config(None, ["seed=1", "output=a.jsonl"])
    assert base.fingerprint() == load_job_config(None, ["seed=1", "output=b.jsonl"]).fingerprint()
    assert base.fingerprint() != load_job_config(None, ["seed=2", "output=a.jsonl"]).fingerprint()
    assert base.fingerprint() != load_job_config(None, ["seed=1", "max_new_tokens=9"]).fingerprint()
    # the devices a job runs on do not change its results, so they are not part of its identity
    elsewhere = load_job_config(None, ["seed=1", "mesh_data=4", "mesh_model=2"])
    assert base.fingerprint() == elsewhere.fingerprint()


SR = ["method=speculative_rejection", "reward=minilm"]


def test_search_keys_added_later_change_the_fingerprint_only_when_set():
    """Outputs of jobs started before `min_first_segment`, `decision_interval`, `rule` and `min_keep`
    existed still resume: at their defaults the fingerprint is the one those jobs got."""
    config = load_job_config(None, SR)
    before = {k: v for k, v in dataclasses.asdict(config).items() if k not in LATER_KEYS}
    for placement in ("output", "mesh_data", "mesh_model", "concurrent_prompts"):
        del before[placement]
    del before["max_rows"]  # added later still, as a placement key: it never entered a fingerprint
    earlier = hashlib.sha256(json.dumps(before, sort_keys=True).encode()).hexdigest()[:16]
    assert config.fingerprint() == earlier
    for key in ("min_first_segment=8", "decision_interval=4", "rule=quantile", "min_keep=0"):
        assert load_job_config(None, [*SR, key]).fingerprint() != earlier, key


@pytest.mark.parametrize(
    "bad, message, good",
    [
        ("min_first_segment=0", "min_first_segment: expected an int >= 1", "min_first_segment=8"),
        ("decision_interval=0", "decision_interval: expected an int >= 1", "decision_interval=4"),
        ("rule=median", "rule: expected one of", "rule=quantile"),
        ("min_keep=2", "min_keep: expected 0", "min_keep=0"),
    ],
)
def test_bad_search_keys_are_named(bad, message, good):
    with pytest.raises(ValueError, match=message):
        load_job_config(None, [*SR, bad])
    with pytest.raises(ValueError, match="does not use it"):  # only speculative_rejection reads them
        load_job_config(None, ["method=best_of_n", "reward=minilm", "n=4", good])


@pytest.mark.parametrize(
    "override, suggestion", [("max_new_token=5", "max_new_tokens"), ("temprature=0.5", "temperature")]
)
def test_unknown_key_gets_a_suggestion(tmp_path, override, suggestion):
    with pytest.raises(ValueError, match=f"did you mean '{suggestion}'"):
        load_job_config(None, [override])
    path = tmp_path / "job.yaml"
    path.write_text(override.replace("=", ": "))
    with pytest.raises(ValueError, match=f"did you mean '{suggestion}'"):
        load_job_config(path)


def test_malformed_configs_are_refused(tmp_path):
    with pytest.raises(ValueError, match="method"):
        load_job_config(None, ["method=beam_search"])
    with pytest.raises(ValueError, match="key=value"):
        load_job_config(None, ["seed"])
    path = tmp_path / "list.yaml"
    path.write_text("- method: generate\n")
    with pytest.raises(ValueError, match="mapping"):
        load_job_config(path)
    path.write_text("method: [generate\n")
    with pytest.raises(ValueError, match="not valid YAML"):
        load_job_config(path)
    path.write_text("limit: 1\nn: 2\nlimit: 2\n")
    with pytest.raises(ValueError, match=r":3:1: not valid YAML \(the key 'limit' is given twice\)"):
        load_job_config(path)
    with pytest.raises(ValueError, match=r"not a regular file \(a directory\)"):
        load_job_config(tmp_path)
    assert load_job_config(None, ["output=[a.jsonl"]).output == "[a.jsonl"  # not YAML: the text itself


def test_a_data_file_must_hold_a_list_of_records(tmp_path):
    path = tmp_path / "one.json"
    path.write_text(json.dumps({"prompt": "Write a poem"}))
    with pytest.raises(ValueError, match=r"data: .* expected a list"):
        read_prompts(str(path))


@pytest.mark.parametrize("override", ["max_new_tokens=abc", "limit=abc", "top_k=0.5", "seed=[1]"])
def test_override_values_are_checked_against_field_types(override):
    key = override.partition("=")[0]
    with pytest.raises((ValueError, TypeError), match=key):
        load_job_config(None, [override])


def test_numeric_spelling_does_not_change_the_job():
    one = load_job_config(None, ["temperature=1", "top_p=1"])
    assert type(one.temperature) is float and type(one.top_p) is float
    assert one.fingerprint() == load_job_config(None, ["temperature=1.0", "top_p=1.0"]).fingerprint()


def test_keys_the_method_does_not_use_are_refused():
    with pytest.raises(ValueError, match="n: method=generate does not use it"):
        load_job_config(None, ["method=generate", "n=8"])  # would give 1 sample, not 8
    with pytest.raises(ValueError, match="draft: method=best_of_n does not use it"):
        load_job_config(None, ["method=best_of_n", "reward=minilm", "n=4", "draft=smollm2-draft"])
    with pytest.raises(ValueError, match="rejection_rate: method=contrastive_decode"):
        load_job_config(None, ["method=contrastive_decode", "draft=x", "rejection_rate=0.3"])
    keys = ["method=best_of_n", "n=4", "reward=minilm", "decoder=contrastive", "draft=x", "beta=1"]
    config = load_job_config(None, keys)
    assert config.beta == 1.0  # a decoder's options are used
    assert load_job_config(None, ["method=generate", "gamma=4"]).gamma == 4  # a default is not a setting


@pytest.mark.parametrize(
    "keys, named",
    [
        (["method=best_of_n", "reward=self_likelihood"], "n: best_of_n needs n"),
        (["method=best_of_n", "n=4"], "reward: best_of_n needs a reward"),
        (["method=speculative_rejection"], "reward: speculative_rejection needs a reward"),
        (["method=speculative_decode"], "draft: speculative_decode needs a second model"),
        (["method=best_of_n", "n=2", "reward=minilm", "decoder=contrastive"], "draft: decoder=contrastive"),
        (["method=best_of_n", "n=2", "reward=self-certainty"], "did you mean self_certainty?"),
        (["method=best_of_n", "n=2", "reward=MiniLM"], "reward: 'MiniLM' is no built-in reward"),
        (["method=tree_best_of_n", "n=6", "branch=4", "reward=minilm"], "branch: expected a divisor of n=6"),
        (["stop_token_ids=[2, -3]"], "stop_token_ids: token ids are >= 0, got -3"),
        (
            ["chat=false", "system_prompt=Be brief."],
            "system_prompt: a system message needs the chat template",
        ),
    ],
)
def test_a_job_missing_what_its_method_needs_is_refused_before_any_model_loads(
    keys, named, tmp_path, monkeypatch, capsys
):
    monkeypatch.setenv("JAXSR_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr("jaxsr.jobs.methods.resolve_model", lambda *a, **k: pytest.fail("a model loaded"))
    output, config = tmp_path / "out" / "job.jsonl", tmp_path / "job.yaml"
    config.write_text(f"output: {output}\n")
    assert main(["run", str(config), *keys, "--no-progress"]) == 2
    assert named in capsys.readouterr().err
    assert not output.parent.exists() and not (tmp_path / "cache").exists()  # nothing written


def test_a_config_file_names_its_key_when_a_method_lacks_one(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text(json.dumps({"method": "best_of_n", "reward": "minilm"}))
    with pytest.raises(ValueError, match=r"^n: best_of_n needs n"):
        load_job_config(Path(path))


# -- running jobs from the command line ------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        (["model=/no/such/model"], "model: source: /no/such/model does not exist"),
        (["max_new_tokens=0"], "max_new_tokens: expected an int >= 1, got 0"),  # not blamed on the data
        (
            ["method=speculative_decode", "draft=/no/such/draft"],
            "draft: source: /no/such/draft does not exist",
        ),
        (
            ["method=best_of_n", "num_samples=1", "n=2", "reward=/no/such/reward"],
            "reward: source: /no/such/reward does not exist",
        ),
    ],
    ids=["model", "max_new_tokens", "draft", "reward"],
)
def test_a_bad_value_is_named_by_its_config_key(job, capsys, overrides, named):
    path, output = job
    assert cli("run", str(path), *overrides) == 2
    assert capsys.readouterr().err.strip() == f"jaxsr: error: {named}"
    assert not output.exists()


@pytest.mark.slow
def test_run_writes_a_job_file_and_one_record_per_prompt(job, capsys):
    path, output = job
    assert cli("run", str(path), "limit=3") == 0
    assert capsys.readouterr().out.strip() == str(output)
    spec, records = read_jsonl(output)
    assert job_file(output) == output.with_name("job.job.json")
    assert spec["jaxsr_job"] == load_job_config(path, ["limit=3"]).fingerprint()
    assert spec["config"]["limit"] == 3 and spec["config"]["method"] == "generate"
    assert [r["index"] for r in records] == [0, 1, 2]
    assert [r["prompt"] for r in records] == PROMPTS[:3]
    for record in records:
        assert len(record["samples"]) == 2 and [s["index"] for s in record["samples"]] == [0, 1]
        for sample in record["samples"]:
            assert 1 <= len(sample["token_ids"]) + sample["finished"] <= 8
            assert isinstance(sample["text"], str)
        assert record["stats"]["token_forwards"]["generator"] > 0
    assert records[0]["samples"][0]["token_ids"] != records[0]["samples"][1]["token_ids"]


def test_jsonl_data_gives_the_same_records(job, data, tmp_path):
    path, output = job
    assert cli("run", str(path), "limit=3") == 0
    other = tmp_path / "from_jsonl.jsonl"
    assert cli("run", str(path), "limit=3", f"data={data['jsonl']}", f"output={other}") == 0
    (_, a), (_, b) = read_jsonl(output), read_jsonl(other)
    assert [r["samples"] for r in a] == [r["samples"] for r in b]  # the same computation: bitwise


def test_output_loads_with_datasets_as_one_row_per_prompt(job):
    datasets = pytest.importorskip("datasets")
    path, output = job
    assert cli("run", str(path), "limit=3") == 0
    table = datasets.load_dataset("json", data_files=str(output), split="train")
    assert table.num_rows == 3 and sorted(table["index"]) == [0, 1, 2]
    assert table["prompt"] == [PROMPTS[i] for i in table["index"]] and "jaxsr_job" not in table.column_names
    assert [len(samples) for samples in table["samples"]] == [2, 2, 2]


@pytest.mark.slow
def test_resume_after_a_kill_matches_an_uninterrupted_run(job):
    path, output = job
    assert cli("run", str(path), "limit=3") == 0  # one call: 3 prompts in a batch of 4 rows
    uninterrupted = output.read_text()
    lines = uninterrupted.splitlines(keepends=True)
    assert len(lines) == 3
    torn = lines[0] + lines[1][: len(lines[1]) // 2]  # killed while writing record 1
    output.write_text(torn)
    assert cli("run", str(path), "limit=3") == 0  # prompts 1 and 2 redone in one call at offset 1
    resumed = output.read_text()
    assert resumed.startswith(lines[0])
    _, records = read_jsonl(output)
    assert [r["index"] for r in records] == [0, 1, 2]
    # same tokens and texts; log-probabilities to rounding (2 prompts a batch instead of 3)
    assert_same_up_to_rounding(records, parse_records(uninterrupted))
    assert cli("run", str(path), "limit=3") == 0  # a complete job: nothing to do, nothing written
    assert output.read_text() == resumed


def test_a_job_resumes_on_another_mesh_with_the_same_records(job):
    path, output = job
    assert cli("run", str(path), "limit=3") == 0
    uninterrupted = output.read_text()
    lines = uninterrupted.splitlines(keepends=True)
    output.write_text(lines[0])  # killed after prompt 0, resumed on 8 devices
    assert cli("run", str(path), "limit=3", "mesh_data=4", "mesh_model=2") == 0
    _, records = read_jsonl(output)
    assert_same_up_to_rounding(records, parse_records(uninterrupted))


@pytest.mark.slow
def test_a_copy_of_the_repository_with_nothing_beside_it_runs_a_bundled_set(job, tmp_path):
    """A user's clone has no workspace folders around it: the prompt sets come with the package."""
    path, _ = job
    alone = tmp_path / "alone"
    copy = copy_repository(alone / "jaxsr")
    assert [p.name for p in alone.iterdir()] == ["jaxsr"]
    env = {**os.environ, "PYTHONPATH": str(copy), "JAXSR_DATA_DIR": ""}
    where = subprocess.run(
        [sys.executable, "-c", "import jaxsr; print(jaxsr.__file__)"],
        cwd=copy,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert Path(where.stdout.strip()).is_relative_to(copy)  # the copy's package, not this checkout's
    output = alone / "out.jsonl"
    command = ["-m", "jaxsr.cli", "run", str(path), "data=hh_rlhf_100", "limit=2", f"output={output}"]
    done = subprocess.run(
        [sys.executable, *command, "--no-progress"], cwd=copy, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
    _, records = read_jsonl(output)
    assert [r["prompt"] for r in records] == read_prompts("hh_rlhf_100", limit=2)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


LONG = [f"Write a short poem about the number {i} and explain each line of it." for i in range(4)]
"""Prompts about three times the others' length."""


@pytest.mark.slow
def test_two_processes_split_a_job_by_tokens_and_process_0_merges_it(job, tmp_path):
    """The first half of the prompts is long: the processes' shares hold nearly the same token count
    (contiguous blocks would give one of them 2/3 of the tokens), and the merged output is the
    single-process one."""
    path, output = job
    data = tmp_path / "mixed.jsonl"
    data.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in [*LONG, *PROMPTS]))
    single = tmp_path / "single.jsonl"
    assert cli("run", str(path), f"output={single}", f"data={data}") == 0
    _, expected = read_jsonl(single)
    # a part left by an earlier 2-process run that was killed: neither process may redo prompt 2
    line_2 = next(
        line for line in single.read_text().splitlines(keepends=True) if json.loads(line)["index"] == 2
    )
    part_1 = output.with_name("job.part-00001-of-00002.jsonl")
    part_1.parent.mkdir(parents=True, exist_ok=True)
    part_1.write_text(line_2)
    shutil.copy(job_file(single), job_file(part_1))
    port = free_port()
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}  # 4 devices a host
    command = [sys.executable, "-m", "jaxsr.cli", "run", str(path), "mesh_data=-1", f"data={data}"]
    hosts = ["--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id"]
    processes = [
        subprocess.Popen([*command, *hosts, str(i)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for i in range(2)
    ]
    outcomes = [p.communicate(timeout=600) for p in processes]
    tokens = []
    for i, (p, (out, err)) in enumerate(zip(processes, outcomes, strict=True)):
        assert p.returncode == 0, err.decode()[-3000:]
        assert out.decode().strip().splitlines()[-1] == str(output)  # after gloo's connection log
        share = re.search(rf"process {i} of 2: (\d) of 7 pending prompts \((\d+) tokens\)", err.decode())
        assert share, err.decode()[-3000:]
        tokens.append(int(share[2]))
    lengths = {r["index"]: r["stats"]["prompt_tokens"] for r in expected}
    long_half = sum(lengths[i] for i in range(4) if i != 2)
    assert sum(tokens) == sum(lengths.values()) - lengths[2] and long_half > 0.65 * sum(tokens)
    assert max(tokens) < 0.55 * sum(tokens)
    _, records = read_jsonl(output)
    assert [r["index"] for r in records] == list(range(8))
    assert_same_up_to_rounding(records, expected)
    assert [
        line for line in output.read_text().splitlines(keepends=True) if json.loads(line)["index"] == 2
    ] == [line_2]  # the old part's record, stats too
    assert not list(output.parent.glob("*.part-*"))  # merged and removed, job files too


def test_parts_of_a_killed_multi_process_run_are_kept_by_a_single_process_resume(job):
    path, output = job
    assert cli("run", str(path), "limit=3") == 0
    lines = sorted(output.read_text().splitlines(keepends=True), key=lambda line: json.loads(line)["index"])
    output.unlink()
    for name, text in [
        ("job.part-00000-of-00002", lines[0]),
        ("job.part-00001-of-00002", lines[1] + lines[2][:20]),
    ]:
        output.with_name(f"{name}.jsonl").write_text(text)
        shutil.copy(job_file(output), output.with_name(f"{name}.job.json"))
    assert cli("run", str(path), "limit=3") == 0
    assert output.read_text().startswith(lines[0] + lines[1])  # records 0, 1 from the parts
    _, records = read_jsonl(output)
    # prompt 2 was redone alone (a batch of 1 prompt instead of 3): log-probabilities to rounding
    assert_same_up_to_rounding(records, parse_records("".join(lines)))
    assert not list(output.parent.glob("*.part-*"))


def test_a_job_killed_while_writing_its_first_record_starts_afresh(job):
    path, output = job
    assert cli("run", str(path), "limit=2") == 0
    complete = output.read_text()
    output.write_text(complete[:20])  # the job file was written, only part of record 0 reached the disk
    assert cli("run", str(path), "limit=2") == 0
    # the same call (2 prompts in one batch) redone: bitwise the same records
    assert [without_stats(r) for r in parse_records(output.read_text())] == [
        without_stats(r) for r in parse_records(complete)
    ]
    job_file(output).unlink()
    output.write_text('{"not": "ours"')  # a partial line with no job file is not ours: not touched
    assert cli("run", str(path), "limit=2") == 2
    assert output.read_text() == '{"not": "ours"'


def test_an_output_written_with_a_header_line_resumes_in_the_new_form(job, capsys):
    """Outputs of earlier jaxsr versions named the job on their first line."""
    path, output = job
    assert cli("run", str(path), "limit=3") == 0
    job_text, records_text = job_file(output).read_text(), output.read_text()
    header = json.dumps(json.loads(job_text)) + "\n"
    job_file(output).unlink()
    output.write_text(header + records_text.splitlines(keepends=True)[0])  # killed after record 0
    assert cli("run", str(path), "limit=3") == 0
    _, records = read_jsonl(output)
    assert [r["index"] for r in records] == [0, 1, 2]
    assert output.read_text().startswith(records_text.splitlines(keepends=True)[0])
    assert_same_up_to_rounding(records, parse_records(records_text))
    job_file(output).unlink()
    other = json.loads(job_text)
    other = other | {"jaxsr_job": "0" * 16, "config": other["config"] | {"seed": 7}}
    output.write_text(json.dumps(other) + "\n" + records_text)  # an old output of another job
    capsys.readouterr()
    assert cli("run", str(path), "limit=3") == 2
    err = capsys.readouterr().err
    assert "different job (seed: 7 -> " in err and "set those keys back" in err
    assert not job_file(output).exists()


HOLD_LOCK = """
import sys, time
from pathlib import Path
from jaxsr.locks import holding
with holding(Path(sys.argv[1])):
    print("held", flush=True)
    time.sleep(600)
"""


def test_a_second_job_on_a_held_output_is_refused_at_once_and_a_killed_holder_frees_it(job, capsys):
    path, output = job
    command = [sys.executable, "-c", HOLD_LOCK, str(output)]
    holder = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        capsys.readouterr()
        assert cli("run", str(path), "limit=3") == 2
        err = capsys.readouterr().err
        assert "output" in err and "another job" in err and f"pid {holder.pid}" in err
        assert not output.exists() and not job_file(output).exists()  # refused before any work
    finally:
        holder.kill()  # SIGKILL: the operating system releases the lock
        holder.wait()
    assert cli("run", str(path), "limit=3") == 0
    _, records = read_jsonl(output)
    assert [r["index"] for r in records] == [0, 1, 2]
    assert not lock_path(output).exists()  # a finished job leaves only its records and job file


@pytest.mark.slow  # two CLI processes at once, each importing JAX and compiling a generate job
def test_two_concurrent_jobs_on_one_output_never_duplicate_a_record(job):
    path, output = job
    command = [sys.executable, "-m", "jaxsr.cli", "run", str(path), "limit=4", "--no-progress"]
    runs = [subprocess.Popen(command, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    codes = sorted(run.wait(timeout=600) for run in runs)
    errors = "".join(run.stderr.read() for run in runs)
    assert codes in ([0, 0], [0, 2]), errors  # the second waits for nothing: it ran after, or refused
    _, records = read_jsonl(output)
    assert [r["index"] for r in records] == [0, 1, 2, 3]


def test_an_output_that_cannot_be_written_is_refused_before_any_work(job, tmp_path, capsys):
    path, _ = job
    (tmp_path / "a_directory.jsonl").mkdir()
    assert cli("run", str(path), f"output={tmp_path / 'a_directory.jsonl'}") == 2
    assert "is a directory" in capsys.readouterr().err
    locked = tmp_path / "read_only"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        if os.access(locked, os.W_OK):  # root ignores permissions: nothing to check here
            return
        assert cli("run", str(path), f"output={locked / 'x.jsonl'}") == 2
        assert "cannot write" in capsys.readouterr().err
    finally:
        locked.chmod(0o700)


def test_output_of_another_job_is_refused(job, capsys):
    path, output = job
    assert cli("run", str(path), "limit=3", "seed=1") == 0
    before = output.read_bytes()
    capsys.readouterr()
    assert cli("run", str(path), "limit=3", "seed=0") == 2
    err = capsys.readouterr().err
    assert "output" in err and "different job (seed: 1 -> 0)" in err  # the key that differs, named
    assert output.read_bytes() == before
    output.write_text("not a jaxsr file\n")
    assert cli("run", str(path), "limit=3") == 2
    assert "output" in capsys.readouterr().err
    assert output.read_text() == "not a jaxsr file\n"
    job_file(output).unlink()  # records without a job file beside them are no job's: refused too
    output.write_bytes(before)
    assert cli("run", str(path), "limit=3") == 2
    assert "not a jaxsr output" in capsys.readouterr().err
    assert output.read_bytes() == before


@pytest.mark.parametrize(
    "overrides, name",
    [
        (["top_p=2"], "top_p"),
        (["temperature=-1"], "temperature"),
        (["top_k=-3"], "top_k"),
        (["method=beam"], "method"),
        (["max_new_token=4"], "max_new_tokens"),
        pytest.param(["max_new_tokens=0"], "max_new_tokens"),
        pytest.param(["num_samples=0"], "num_samples"),
        pytest.param(["method=best_of_n", "num_samples=1", "reward=self_likelihood", "n=0"], "n"),
        (["method=best_of_n", "num_samples=1", "n=4"], "reward"),
        pytest.param(
            ["method=speculative_rejection", "num_samples=1", "reward=self_likelihood", "rejection_rate=1.5"],
            "rejection_rate",
        ),
        pytest.param(
            ["method=speculative_rejection", "num_samples=1", "reward=self_likelihood", "memory_budget=lots"],
            "memory_budget",
        ),
        (["data=/nonexistent/prompts.json"], "data"),
        (["mesh_data=0"], "mesh_data"),
        (["mesh_model=0"], "mesh_model"),
        (["mesh_data=-1", "mesh_model=3"], "mesh_model"),  # 3 does not divide the 8 test devices
    ],
    ids=lambda v: v if isinstance(v, str) else " ".join(v),
)
def test_bad_values_exit_2_and_write_nothing(job, capsys, overrides, name):
    path, output = job
    assert cli("run", str(path), "limit=1", *overrides) == 2
    err = capsys.readouterr().err
    assert err.startswith("jaxsr: error:") and (f"{name}:" in err or f"'{name}'" in err)
    assert not output.exists()


def test_a_bad_limit_is_named(job, capsys):
    path, output = job
    assert cli("run", str(path), "limit=abc") == 2
    assert "limit" in capsys.readouterr().err
    assert not output.exists()


def test_a_fixed_config_runs_after_a_refused_one(job):
    path, output = job
    assert cli("run", str(path), "limit=3", "max_new_tokens=0") == 2
    assert cli("run", str(path), "limit=3", "max_new_tokens=4") == 0
    _, records = read_jsonl(output)
    assert [r["index"] for r in records] == [0, 1, 2]


# -- search methods as jobs -------------------------------------------------------------------------


def check_best(record: dict) -> None:
    scores = [s["score"] for s in record["samples"]]
    assert all(isinstance(s, float) for s in scores)
    assert record["best"] is not None and record["best"]["score"] == max(scores)
    assert record["best"] == record["samples"][scores.index(max(scores))]


@pytest.mark.slow
def test_best_of_n_job(job):
    path, output = job
    overrides = [
        "method=best_of_n",
        "num_samples=1",
        "reward=self_likelihood",
        "n=4",
        "limit=2",
        "max_new_tokens=12",
    ]
    assert cli("run", str(path), *overrides) == 0
    spec, records = read_jsonl(output)
    assert spec["config"]["method"] == "best_of_n" and spec["config"]["n"] == 4
    assert [r["index"] for r in records] == [0, 1]
    # one call decodes both prompts' rows in one batch (each prompt's samples are the ones it gets alone:
    # test_best_of_n_counts_every_prompt_cache_of_a_batch_in_the_budget)
    assert [r["stats"]["batch_rows"] for r in records] == [8, 8]
    for record in records:
        assert len(record["samples"]) == 4
        check_best(record)
        for sample in record["samples"]:  # self-likelihood: mean log-probability per scored token
            count = len(sample["token_ids"]) + sample["finished"]
            assert sample["score"] == pytest.approx(sample["logprob"] / count, rel=1e-6)
        assert record["stats"]["token_forwards"]["reward"] == 0


@pytest.mark.slow
def test_speculative_rejection_job(job):
    path, output = job
    overrides = [
        "method=speculative_rejection",
        "num_samples=1",
        "reward=self_likelihood",
        "n=8",
        "rejection_rate=0.5",
        "memory_budget=192",  # ≤ 64 prompt slots + 8 rows × 16: the first decision comes at 17 tokens
        "max_new_tokens=32",
        "limit=2",
    ]
    assert cli("run", str(path), *overrides) == 0
    spec, records = read_jsonl(output)
    assert spec["config"]["memory_budget"] == 192
    assert [r["index"] for r in records] == [0, 1]
    for record in records:
        stats = record["stats"]
        assert stats["initial_batch"] == 8 and stats["batch_sizes"][0] == 8
        assert stats["rounds"] >= 2 and stats["batch_sizes"][-1] <= 4
        assert stats["memory_budget_slots"] == 192
        assert 1 <= len(record["samples"]) <= 8
        check_best(record)


@pytest.mark.slow
def test_a_speculative_rejection_job_passes_its_search_keys(job, tmp_path):
    """min_first_segment, decision_interval, rule and min_keep reach the search: half the first segment
    starts about twice the rows in the same memory, and a decision interval of 4 decides every 4 tokens."""
    path, _ = job
    common = [
        "method=speculative_rejection", "num_samples=1", "reward=self_likelihood",
        "memory_budget=192", "max_new_tokens=32", "limit=1",
    ]  # fmt: skip
    runs = {}
    for name, keys in {
        "default": [],
        "set": ["min_first_segment=8", "decision_interval=4", "rule=quantile", "min_keep=0"],
    }.items():
        output = tmp_path / f"{name}.jsonl"
        assert cli("run", str(path), *common, *keys, f"output={output}") == 0
        runs[name] = read_jsonl(output)[1][0]["stats"]
    first, wider = runs["default"]["initial_batch"], runs["set"]["initial_batch"]
    assert wider in (2 * first, 2 * first + 1)
    tokens = [d["token"] for d in runs["set"]["decisions"]]
    assert tokens[:2] == [5, 9]  # every 4 tokens from the first (9: the first segment of 8 is full too)


@pytest.mark.slow  # runs an SR job twice from the CLI, 1 and 3 prompts in flight
def test_a_speculative_rejection_job_packs_prompts_and_resumes_with_another_packing(job):
    """concurrent_prompts changes how the job runs, not what it computes: the records of 1 and 3
    prompts in flight are the same, and a job started with one resumes with the other."""
    path, output = job
    overrides = [
        "method=speculative_rejection", "num_samples=1", "reward=self_likelihood", "n=8",
        "rejection_rate=0.5", "memory_budget=192", "max_new_tokens=32", "limit=4",
    ]  # fmt: skip
    assert cli("run", str(path), *overrides, "concurrent_prompts=1") == 0
    alone = output.read_text()
    lines = alone.splitlines(keepends=True)
    output.write_text("".join(lines[:1]))  # killed after the first record
    assert cli("run", str(path), *overrides, "concurrent_prompts=3") == 0
    _, records = read_jsonl(output)
    assert [r["index"] for r in records] == [0, 1, 2, 3]
    exact = ("token_ids", "text", "finished", "index")
    for record, reference in zip(records, parse_records(alone), strict=True):
        ours, theirs = [*record["samples"], record["best"]], [*reference["samples"], reference["best"]]
        for got, want in zip(ours, theirs, strict=True):
            assert {k: got[k] for k in exact} == {k: want[k] for k in exact}
            # the rows of a stack decode in another batch shape: float32 rounding of the scores
            assert got["score"] == pytest.approx(want["score"], rel=1e-5, abs=1e-6)


def test_config_file_is_not_modified(job):
    path, _ = job
    before = path.read_text()
    assert cli("run", str(path), "limit=3", "max_new_tokens=4") == 0
    assert path.read_text() == before
    assert dataclasses.asdict(load_job_config(path))["max_new_tokens"] == 8


def test_options_may_precede_overrides(job):
    path, output = job
    try:
        code = main(["run", str(path), "--no-progress", "limit=3"])
    except SystemExit as e:  # argparse's own error exit
        code = e.code
    assert code == 0
    _, records = read_jsonl(output)
    assert len(records) == 3


@pytest.mark.parametrize("path", sorted(Path(__file__).resolve().parents[1].glob("configs/*.yaml")), ids=str)
def test_shipped_configs_are_valid_jobs(path):
    config = load_job_config(path)
    assert config.method in ("generate", "best_of_n", "speculative_rejection")
    assert config.output.startswith("out/")


@pytest.mark.slow
def test_speculative_contrastive_job_matches_the_contrastive_job_when_greedy(job, tmp_path):
    path, _ = job
    model = yaml.safe_load(path.read_text())["model"]  # the amateur is the same tiny model here
    common = ["temperature=0", "num_samples=1", "limit=2", "max_new_tokens=8", f"draft={model}"]
    scd_out, cd_out = tmp_path / "scd.jsonl", tmp_path / "cd.jsonl"
    assert (
        cli(
            "run", str(path), "method=speculative_contrastive_decode", "gamma=3", f"output={scd_out}", *common
        )
        == 0
    )
    assert cli("run", str(path), "method=contrastive_decode", f"output={cd_out}", *common) == 0
    (_, scd), (_, cd) = read_jsonl(scd_out), read_jsonl(cd_out)
    assert [r["samples"][0]["token_ids"] for r in scd] == [r["samples"][0]["token_ids"] for r in cd]
    assert all(r["stats"]["acceptance_rate"] is not None for r in scd)


def test_two_model_jobs_need_a_draft(job, capsys):
    path, output = job
    assert cli("run", str(path), "method=speculative_decode", "limit=1") == 2
    assert "draft" in capsys.readouterr().err and not output.exists()


@pytest.mark.slow
def test_speculative_rejection_over_a_decoder_job(job):
    path, output = job
    model = yaml.safe_load(path.read_text())["model"]  # the amateur is the same tiny model here
    overrides = [
        "method=speculative_rejection",
        "num_samples=1",
        "reward=self_likelihood",
        "decoder=speculative_contrastive",
        f"draft={model}",
        "gamma=2",
        "n=4",
        "memory_budget=160",
        "max_new_tokens=24",
        "limit=1",
    ]
    assert cli("run", str(path), *overrides) == 0
    spec, (record,) = read_jsonl(output)
    assert spec["config"]["decoder"] == "speculative_contrastive"
    assert set(record["stats"]["token_forwards"]) == {"expert", "amateur", "reward"}
    check_best(record)


@pytest.mark.parametrize(
    "overrides, name",
    [
        (["decoder=beam"], "decoder"),
        (
            ["method=best_of_n", "num_samples=1", "reward=self_likelihood", "n=2", "decoder=speculative"],
            "draft",
        ),
    ],
)
def test_search_decoder_settings_are_checked(job, capsys, overrides, name):
    path, output = job
    assert cli("run", str(path), "limit=1", *overrides) == 2
    assert f"{name}:" in capsys.readouterr().err and not output.exists()


def test_a_bad_prompt_far_down_the_data_fails_the_job_before_any_record(job, tmp_path, capsys):
    config_path, output = job
    data = tmp_path / "long.jsonl"
    data.write_text(json.dumps({"prompt": "hi"}) + "\n" + json.dumps({"prompt": "x " * 5000}) + "\n")
    assert cli("run", str(config_path), f"data={data}") == 2
    error = capsys.readouterr().err
    assert f"data: {data}: prompts[1]" in error and "context" in error
    assert not output.exists() and not job_file(output).exists()


@pytest.mark.parametrize("where", ["job file is a directory", "output is not .jsonl"])
def test_an_output_that_cannot_be_written_is_refused_before_loading(job, where, capsys, monkeypatch):
    config_path, output = job
    monkeypatch.setattr("jaxsr.jobs.methods.resolve_model", _refuse_to_load)
    overrides = []
    if where == "job file is a directory":
        job_file(output).mkdir(parents=True)
    else:
        overrides = [f"output={output.with_suffix('.json')}"]
    assert cli("run", str(config_path), *overrides) == 2
    assert "output:" in capsys.readouterr().err
    assert not output.exists()


def _refuse_to_load(*args, **kwargs):
    raise AssertionError("a model was loaded for a job whose output cannot be written")


def test_a_failed_record_write_leaves_nothing_half_written(job, capsys, monkeypatch):
    config_path, output = job
    real_open = Path.open

    def full_disk(self, mode="r", *args, **kwargs):
        if self == output and "a" in mode:
            raise OSError(28, "No space left on device")
        return real_open(self, mode, *args, **kwargs)

    monkeypatch.setattr(Path, "open", full_disk)
    assert cli("run", str(config_path)) == 2
    error = capsys.readouterr().err
    assert "output: cannot write" in error and "No space left" in error
    assert not output.exists() and not job_file(output).exists()
    assert not list(output.parent.glob("*.partial"))


def test_a_job_that_writes_nothing_leaves_no_new_folder(job, tmp_path, capsys):
    config_path, _ = job
    output = tmp_path / "new" / "deeper" / "x.jsonl"
    assert cli("run", str(config_path), f"output={output}", "model=/nonexistent/model") == 2
    assert not (tmp_path / "new").exists()


@pytest.mark.parametrize(
    ("text", "named"),
    [("1: 2\n", "config key 1"), ("[" * 100000 + "\n", "nested too deeply"), (b"\xff\xfe", "not UTF-8")],
    ids=["int-key", "deep", "binary"],
)
def test_a_malformed_config_file_is_named(tmp_path, text, named, capsys):
    path = tmp_path / "job.yaml"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    assert cli("run", str(path)) == 2
    error = capsys.readouterr().err
    assert named in error and "Traceback" not in error


def test_an_output_that_is_not_a_regular_file_is_refused_before_loading(job, tmp_path, capsys, monkeypatch):
    config_path, _ = job
    fifo = tmp_path / "pipe.jsonl"
    os.mkfifo(fifo)
    monkeypatch.setattr("jaxsr.jobs.methods.resolve_model", _refuse_to_load)
    assert cli("run", str(config_path), f"output={fifo}") == 2
    assert "is not a regular file" in capsys.readouterr().err
    assert fifo.exists()


def test_records_of_prompts_the_data_does_not_have_are_refused(job, capsys):
    config_path, output = job
    assert cli("run", str(config_path)) == 0
    _, records = read_jsonl(output)
    bogus = json.loads(json.dumps(records[0])) | {"index": len(PROMPTS) + 5}
    with output.open("a") as f:
        f.write(json.dumps(bogus) + "\n")
    assert cli("run", str(config_path)) == 2
    assert "holds a record of prompt" in capsys.readouterr().err


@pytest.mark.parametrize("index", ['"0"', "-1", "true"])
def test_a_record_whose_index_is_not_a_prompt_index_is_refused(job, index, capsys):
    config_path, output = job
    assert cli("run", str(config_path)) == 0
    with output.open("a") as f:
        f.write('{"index": ' + index + "}\n")
    assert cli("run", str(config_path)) == 2
    assert "is not a jaxsr record" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ("a: &x [1, 2]\nb: *x\n", "aliases (*name) are not allowed"),
        ("method: [unclosed\n", "job.yaml:2:1: not valid YAML"),
        ("seed: -1\n", "seed: expected an int in [0, 2**32)"),
    ],
    ids=["alias", "position", "seed"],
)
def test_config_files_are_refused_in_one_line(tmp_path, text, named, capsys):
    path = tmp_path / "job.yaml"
    path.write_text(text)
    assert cli("run", str(path)) == 2
    error = capsys.readouterr().err
    assert named in error and error.count("\n") == 1, error


@pytest.mark.parametrize(
    ("jaxsr_cache", "expected"), [(None, ".cache/jaxsr/xla"), ("off", None)], ids=["default", "off"]
)
def test_the_cli_keeps_compiled_programs_unless_told_otherwise(monkeypatch, tmp_path, jaxsr_cache, expected):
    import jax

    from jaxsr.cli import use_compilation_cache

    before = jax.config.jax_compilation_cache_dir
    monkeypatch.setenv("HOME", str(tmp_path))
    if jaxsr_cache is None:
        monkeypatch.delenv("JAXSR_CACHE_DIR", raising=False)
    else:
        monkeypatch.setenv("JAXSR_CACHE_DIR", jaxsr_cache)
    try:
        jax.config.update("jax_compilation_cache_dir", None)
        use_compilation_cache()
        chosen = jax.config.jax_compilation_cache_dir
        assert chosen == (None if expected is None else str(tmp_path / expected))
        jax.config.update("jax_compilation_cache_dir", "/elsewhere")  # the user's own choice wins
        use_compilation_cache()
        assert jax.config.jax_compilation_cache_dir == "/elsewhere"
    finally:
        jax.config.update("jax_compilation_cache_dir", before)


def test_a_job_grows_with_its_limit_and_a_finished_job_loads_nothing(job, capsys, monkeypatch):
    """`limit` is not part of a job's identity: raising it adds the new prompts' records to the same
    output. A finished job exits before loading any model."""
    path, output = job
    assert cli("run", str(path), "limit=2") == 0
    first = output.read_text()
    assert cli("run", str(path), "limit=3") == 0
    config, records = read_jsonl(output)
    assert [r["index"] for r in records] == [0, 1, 2] and output.read_text().startswith(first)
    assert config["config"]["limit"] == 3
    monkeypatch.setattr("jaxsr.jobs.methods.resolve_model", _refuse_to_load)
    assert cli("run", str(path), "limit=3") == 0  # finished
    assert cli("run", str(path), "limit=2") == 0  # finished, a smaller part of the same job
    assert [r["index"] for r in read_jsonl(output)[1]] == [0, 1, 2]


def test_records_of_prompts_the_data_no_longer_has_are_refused(job, tmp_path, capsys):
    """Data edited or reordered between runs: the resume names the first record whose prompt is not
    the data's at its index, and writes nothing."""
    path, output = job
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    assert cli("run", str(path), f"data={data}", "limit=2") == 0
    before = output.read_bytes()
    data.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in [PROMPTS[1], PROMPTS[0], *PROMPTS[2:]]))
    capsys.readouterr()
    assert cli("run", str(path), f"data={data}", "limit=3") == 2
    err = capsys.readouterr().err
    assert re.search(r"record of prompt [01] for '(Name a color|Say hi)", err) and "the data changed" in err
    assert output.read_bytes() == before


def test_a_search_job_writes_each_record_as_its_search_ends(job, monkeypatch):
    """Calls of several prompts searched one at a time: each record is on disk before the next search
    starts, not when its call returns."""
    path, output = job
    events: list[str] = []

    def logged(name: str, function):
        def run(*args, **kwargs):
            events.append(name)
            return function(*args, **kwargs)

        return run

    monkeypatch.setattr(PromptSearch, "start", logged("start", PromptSearch.start))
    monkeypatch.setattr(JsonlOutput, "write", logged("write", JsonlOutput.write))
    monkeypatch.setattr("jaxsr.jobs.methods.speculative_rejection", logged("call", speculative_rejection))
    overrides = [
        "method=speculative_rejection", "num_samples=1", "reward=self_likelihood", "n=4",
        "memory_budget=192", "max_new_tokens=8", "limit=4", "concurrent_prompts=1",
    ]  # fmt: skip
    assert cli("run", str(path), *overrides) == 0
    calls = ",".join(events).split("call,")[1:]
    assert len(calls) < 4 and all(
        c.rstrip(",") == ",".join(["start,write"] * c.count("start")) for c in calls
    )
    assert sorted(r["index"] for r in read_jsonl(output)[1]) == [0, 1, 2, 3]


def test_a_job_says_what_it_does_and_sums_up_at_the_end(job, capsys):
    """Status lines before decoding, a bar over the prompts with an ETA, and a summary: prompts, new
    tokens, mean best reward, padding, and where the time went."""
    path, output = job
    overrides = ["method=best_of_n", "num_samples=1", "reward=self_likelihood", "n=2", "limit=3"]
    capsys.readouterr()
    assert main(["run", str(path), *overrides]) == 0
    err = capsys.readouterr().err
    for line in ("jaxsr: reading", "jaxsr: loading model", "jaxsr: checking 3 prompts", "3/3 prompts", "ETA"):
        assert line in err, line
    records = read_jsonl(output)[1]
    tokens = sum(len(s["token_ids"]) for r in records for s in r["samples"])
    mean_best = sum(r["best"]["score"] for r in records) / 3
    assert "3 records written by this run" in err and f"{tokens} new tokens" in err
    assert f"mean best reward {mean_best:.4f}" in err
    split = re.search(
        r"time +read .* load .* check .*\n +compile .* prefill .* decode .* reward .* write .* other", err
    )
    assert split, err
    assert main(["run", str(path), *overrides]) == 0  # done: nothing loaded, and it says so
    assert "all 3 prompts are done; nothing to load" in capsys.readouterr().err
