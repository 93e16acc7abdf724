"""Issue 30, first classes: a job config missing what its method needs is refused before any model
loads; paths as a shell user means them (`~`, `~user`); Ctrl-C ends with one line and 130; a failed
durable write names its file; a reward cannot alter the results it is given; NaN scores are never
chosen for fine-tuning."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hf_fixtures import build_llama_with_tokenizer, byte_tokenizer
from tiny import tiny_model

import jaxsr
from jaxsr import cli
from jaxsr.data import find_dataset
from jaxsr.jobs.config import JobConfig, load_job_config
from jaxsr.jobs.runner import write_durably
from jaxsr.locks import holding
from jaxsr.rewards import SelfLikelihood
from jaxsr.training import load_sft_config
from jaxsr.training.data import select_responses

ROOT = Path(__file__).resolve().parents[1]
UNKNOWN_USER = "~no-such-user-jaxsr"


@pytest.mark.parametrize(
    "keys, named",
    [
        (["method=best_of_n", "reward=self_likelihood"], "n: best_of_n needs n"),
        (["method=best_of_n", "n=4"], "reward: best_of_n needs a reward"),
        (["method=speculative_rejection"], "reward: speculative_rejection needs a reward"),
        (["method=speculative_decode"], "draft: speculative_decode needs a second model"),
        (["method=best_of_n", "n=2", "reward=minilm", "decoder=contrastive"], "draft: decoder=contrastive"),
    ],
)
def test_a_job_missing_what_its_method_needs_is_refused_before_any_model_loads(
    keys, named, tmp_path, monkeypatch, capsys
):
    monkeypatch.setenv("JAXSR_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr("jaxsr.jobs.methods.resolve_model", lambda *a, **k: pytest.fail("a model loaded"))
    output, config = tmp_path / "out" / "job.jsonl", tmp_path / "job.yaml"
    config.write_text(f"output: {output}\n")
    assert cli.main(["run", str(config), *keys, "--no-progress"]) == 2
    assert named in capsys.readouterr().err
    assert not output.parent.exists() and not (tmp_path / "cache").exists()  # nothing written


def test_paths_expand_home_and_refuse_unknown_users_by_name(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    assert JobConfig(output="~/runs/job.jsonl").output == str(tmp_path / "runs" / "job.jsonl")
    assert load_sft_config(None, ["data=~/r.jsonl", "output_dir=~/sft"]).output_dir == str(tmp_path / "sft")
    (tmp_path / "set.jsonl").write_text('{"prompt": "hi"}\n')
    assert find_dataset("~/set.jsonl") == tmp_path / "set.jsonl"
    for make, name in [
        (lambda: JobConfig(output=f"{UNKNOWN_USER}/job.jsonl"), "output"),
        (lambda: load_sft_config(None, [f"data={UNKNOWN_USER}/r.jsonl"]), "data"),
        (lambda: load_sft_config(None, ["data=r.jsonl", f"output_dir={UNKNOWN_USER}/x"]), "output_dir"),
        (lambda: find_dataset(f"{UNKNOWN_USER}/set.jsonl"), "data"),
    ]:
        with pytest.raises(ValueError, match=f"^{name}: cannot expand '{UNKNOWN_USER}'"):
            make()
    monkeypatch.setenv("JAXSR_DATA_DIR", f"{UNKNOWN_USER}/sets")
    with pytest.raises(ValueError, match=r"^JAXSR_DATA_DIR: cannot expand"):
        find_dataset("some_set")


def test_ctrl_c_ends_with_one_line_and_exit_code_130(monkeypatch, capsys):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "run_job", interrupted)
    assert cli.main(["run", "configs/generate_alpaca.yaml", "--no-progress"]) == 130
    assert capsys.readouterr().err == "jaxsr: interrupted\n"


def test_a_write_that_fails_names_its_file_and_leaves_no_partial(tmp_path, monkeypatch):
    target = tmp_path / "job.job.json"

    def full(_):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("os.fsync", full)
    with pytest.raises(ValueError, match=f"cannot write {target} \\(No space left on device\\)"):
        write_durably(target, [b"{}"])
    assert list(tmp_path.iterdir()) == []


def test_a_full_disk_is_refused_before_any_model_loads_naming_the_directory(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("jaxsr.jobs.methods.resolve_model", lambda *a, **k: pytest.fail("a model loaded"))
    full = os.statvfs_result((4096, 4096, 1000, 0, 0, 100, 0, 0, 0, 255))  # no block free
    monkeypatch.setattr("jaxsr.locks.os.statvfs", lambda path: full)
    config = tmp_path / "job.yaml"
    config.write_text(f"output: {tmp_path / 'out' / 'job.jsonl'}\n")
    assert cli.main(["run", str(config), "--no-progress"]) == 2
    assert capsys.readouterr().err == (
        f"jaxsr: error: output: {tmp_path} has 0 KiB free (its disk is full); free some space or "
        "choose another output\n"
    )
    assert list(tmp_path.iterdir()) == [config]


def test_a_lock_file_that_cannot_be_written_is_named(tmp_path, monkeypatch):
    def full(fd, data):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("jaxsr.locks.os.write", full)
    output = tmp_path / "job.jsonl"
    refused = pytest.raises(ValueError, match=f"cannot write the lock file {output}.lock \\(No space left")
    with refused, holding(output):
        pytest.fail("the block ran")
    assert list(tmp_path.iterdir()) == []


SFT_ON_A_SMALL_DISK = """
import resource, signal, sys
sys.path.insert(0, "tests")
from test_train import records, write_results
from jaxsr.cli import main
directory, checkpoint = sys.argv[1], sys.argv[2]
data = write_results(__import__("pathlib").Path(directory) / "results.jsonl", records())
open(directory + "/sft.yaml", "w").write(
    f"model: {checkpoint}\\ndata: {data}\\noutput_dir: {directory}/run\\nbatch_size: 4\\nsteps: 4\\n"
    "save_every: 2\\nmax_length: 64\\nwarmup_steps: 1\\n"
)
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG) as on a full disk
resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, resource.RLIM_INFINITY))
sys.exit(main(["train", "sft", directory + "/sft.yaml", "--no-progress"]))
"""


def test_checkpoints_that_cannot_be_written_end_in_one_line_and_leave_no_temporary(tmp_path):
    """orbax's writer threads fail on a file they cannot write: one message, not their tracebacks."""
    checkpoint = build_llama_with_tokenizer(
        "LlamaForCausalLM", byte_tokenizer(), tmp_path / "model", seed=5, num_hidden_layers=1,
        hidden_size=128, intermediate_size=256,
    )  # fmt: skip
    script = [sys.executable, "-c", SFT_ON_A_SMALL_DISK, str(tmp_path), str(checkpoint)]
    env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "xla")}  # its cut entries stay here
    done = subprocess.run(script, capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr == (  # one line: no tracebacks, no warnings
        f"jaxsr: error: checkpoints: cannot write a checkpoint in {tmp_path / 'run' / 'checkpoints'} "
        "(File too large)\n"
    )
    assert not list((tmp_path / "run").rglob("*orbax-checkpoint-tmp*"))


class Meddling:
    """A reward that edits what it is given: its token-id lists, texts and the prompt's messages."""

    name, token_forwards = "meddling", 0

    def score(self, candidates):
        for ids in candidates.token_ids:
            ids.extend([1, 2, 3])
        candidates.texts[:] = ["changed"] * len(candidates.texts)
        candidates.messages[0]["content"] = "changed"
        return np.arange(len(candidates), dtype=np.float64)


@pytest.mark.parametrize("search", [jaxsr.best_of_n, jaxsr.speculative_rejection])
def test_a_reward_cannot_alter_the_results_it_scores(search):
    lm = tiny_model(seed=2, eos_token_ids=(63,))
    kwargs = dict(n=4, max_new_tokens=8, seed=1)
    if search is jaxsr.speculative_rejection:
        kwargs["memory_budget"] = 256
    meddled = search(lm, Meddling(), [[3, 4, 5]], **kwargs)[0]
    plain = search(lm, SelfLikelihood(), [[3, 4, 5]], **kwargs)[0]
    assert [s.token_ids for s in meddled.samples] == [s.token_ids for s in plain.samples]
    assert all(len(s.token_ids) <= 8 for s in meddled.samples)


def test_sft_never_chooses_a_nan_or_infinite_score():
    samples = [
        {"text": "nan", "score": float("nan")},
        {"text": "inf", "score": float("inf")},
        {"text": "good", "score": 1.0},
        {"text": "worse", "score": 0.5},
    ]
    record = {"prompt": "p", "samples": samples, "best": None}
    assert [s["text"] for _, s in select_responses([record], "best")] == ["good"]
    assert [s["text"] for _, s in select_responses([record], "top_k", k=2)] == ["good", "worse"]
    assert [s["text"] for _, s in select_responses([record], "threshold", threshold=0.0)] == ["good", "worse"]


def test_a_config_file_names_its_key_when_a_method_lacks_one(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text(json.dumps({"method": "best_of_n", "reward": "minilm"}))
    with pytest.raises(ValueError, match=r"^n: best_of_n needs n"):
        load_job_config(Path(path))


def test_a_tokenizer_that_panics_is_a_value_error_naming_it():
    import transformers
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers

    from jaxsr import text

    backend = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("((a+)+)+b"), behavior="isolated")  # backtracks
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")
    with pytest.raises(ValueError, match=r"tokenizer of .* failed on a text: .*retry-limit"):
        text.encode(tokenizer, "a" * 30)
    assert text.encode(tokenizer, "a") == [1]  # the same tokenizer on a text it can take


@pytest.mark.parametrize("kind", ["fifo", "device", "directory", "huge"])
def test_metadata_files_that_are_no_small_regular_file_are_refused_before_reading(
    tmp_path, kind, monkeypatch
):
    import os

    from jaxsr.loading import files

    path = tmp_path / "config.json"
    if kind == "fifo":
        os.mkfifo(path)  # reading it would block forever
    elif kind == "device":
        path.symlink_to("/dev/zero")  # reading it would never end
    elif kind == "directory":
        path.mkdir()
    else:
        monkeypatch.setattr(files, "METADATA_BYTES", 1024)
        path.write_text(json.dumps({"x": "y" * 2048}))
    message = "larger than 1024 bytes" if kind == "huge" else "not a regular file"
    with pytest.raises(ValueError, match=f"config.json: {message}"):
        files.read_json(path)
    yaml_path = tmp_path / "job.yaml"
    if kind != "huge":
        yaml_path.symlink_to(path)
        with pytest.raises(ValueError, match="not a regular file"):
            load_job_config(yaml_path)


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
