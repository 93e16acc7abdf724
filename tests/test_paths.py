"""Paths and the file system: `~` and `~user` expand as a shell user means them (an unknown user is
refused naming the key), and files that are no small regular file (FIFOs, devices, directories, huge
files) are refused before they are read."""

from __future__ import annotations

import json

import pytest

from jaxsr.data import find_dataset
from jaxsr.jobs.config import JobConfig, load_job_config
from jaxsr.jobs.export import export
from jaxsr.jobs.report import summarize, write_report
from jaxsr.training import load_sft_config

UNKNOWN_USER = "~no-such-user-jaxsr"


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
    for call, name in [
        (lambda: summarize(f"{UNKNOWN_USER}/out.jsonl"), "output"),
        (lambda: write_report("out.jsonl", f"{UNKNOWN_USER}/report"), "directory"),
        (lambda: export(f"{UNKNOWN_USER}/out.jsonl", sft="sft.jsonl"), "output"),
    ]:
        with pytest.raises(ValueError, match=f"^{name}: cannot expand '{UNKNOWN_USER}'"):
            call()
    with pytest.raises(ValueError, match=r"^JAXSR_DATA_DIR: cannot expand"):
        find_dataset("some_set")


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
