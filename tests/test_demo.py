"""`jaxsr demo`: a tiny run of the real demo (embedded SmolLM2, MiniLM reward, shipped draft) prints a table
naming every method, writes a JSONL that loads one row per record and a PNG, and says where they went;
bad options exit 2 before any model loads."""

from __future__ import annotations

import json

import pytest

from jaxsr.cli import main

LABELS = ["SR α=0.5", "Best-of-2", "Best-of-4", "CD", "SCD"]


@pytest.mark.slow
def test_tiny_demo_prints_every_method_and_writes_records_and_plot(tmp_path, capsys):
    out = tmp_path / "demo"
    argv = ["demo", "--prompts", "1", "--max-new-tokens", "8", "--n", "4", "2", "--output-dir", str(out)]
    assert main([*argv, "--no-progress"]) == 0
    printed = capsys.readouterr()
    text = printed.out
    for label in LABELS:
        assert f"\n  {label} " in text, label  # a table row of each method
    assert "all-MiniLM-L6-v2 prompt/response relevance" in text
    assert "KV budget 192 slots" in text  # 64-slot prompt bucket + 8 × 16: Best-of-8's memory
    assert "SR's speedup vs Best-of-" in text and "SCD ÷ CD decoding speed" in text
    assert "[cut at 8 tokens]" in text  # at 8 new tokens some chosen answer is cut
    assert "loading SmolLM2-135M-Instruct" in printed.err and "compiling" in printed.err

    records, plot = out / "records.jsonl", out / "reward_vs_compute.png"
    assert text.rstrip().splitlines()[-2:] == [
        f"records: {records} (5 lines, one per method and prompt)",
        f"plot:    {plot}",
    ]
    rows = [json.loads(line) for line in records.read_text().splitlines()]
    assert [r["label"] for r in rows] == LABELS
    assert {r["method"] for r in rows} == {
        "speculative_rejection",
        "best_of_n",
        "contrastive_decode",
        "speculative_contrastive_decode",
    }
    for r in rows:
        assert r["prompt_index"] == 1 and r["prompt"] and isinstance(r["text"], str)
        assert isinstance(r["finished"], bool) and "token_forwards" in r["stats"]
        assert (r["score"] is None) == (r["label"] in ("CD", "SCD"))  # only the searches score answers
    assert plot.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")

    datasets = pytest.importorskip("datasets")
    loaded = datasets.load_dataset("json", data_files=str(records), split="train")
    assert loaded.num_rows == len(rows) and loaded["label"] == LABELS


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--prompts", "0"], "prompts: expected an int >= 1"),
        (["--n", "0"], "n: expected an int >= 1"),
        (["--gamma", "0"], "gamma: expected an int >= 1"),
        (["--max-new-tokens", "0"], "max_new_tokens: expected an int >= 1"),
    ],
)
def test_bad_demo_options_exit_2_with_an_error(tmp_path, capsys, options, message):
    assert main(["demo", "--output-dir", str(tmp_path), *options]) == 2
    assert f"jaxsr: error: {message}" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


def test_demo_refuses_job_overrides(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "limit=1"])
    assert exit_info.value.code == 2
    assert "unrecognized arguments: limit=1" in capsys.readouterr().err
