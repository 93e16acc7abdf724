"""Outputs that cannot be written: a durable write or a lock file that fails names its file and leaves
no partial one, a full disk is refused before any model loads (naming the directory), and SFT
checkpoints past a file-size limit end the run in one line, with no temporary left behind."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from hf_fixtures import build_llama_with_tokenizer, byte_tokenizer

from jaxsr import cli
from jaxsr.jobs.runner import write_durably
from jaxsr.locks import holding

ROOT = Path(__file__).resolve().parents[1]


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


@pytest.mark.slow  # a subprocess imports JAX and trains SFT steps until a checkpoint fails
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
