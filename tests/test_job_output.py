"""A job's output at the size jobs reach: resuming and merging stream the records, so the memory they
take does not grow with the output; torn lines, legacy headers and foreign outputs as before."""

from __future__ import annotations

import json
import os
import tracemalloc
from pathlib import Path

import pytest
from refusals import within

from jaxsr.jobs.config import JobConfig
from jaxsr.jobs.runner import JsonlOutput, _merge_parts, job_file, part_path, share_of

CONFIG = JobConfig(output="unused.jsonl")
RECORD_BYTES = 6000  # a Best-of-16 record at a few hundred tokens


def record(index: int) -> bytes:
    return (json.dumps({"index": index, "text": "x" * RECORD_BYTES}) + "\n").encode()


def write_output(path: Path, indices, torn: bool = False) -> None:
    """Records of `indices` and the job file naming CONFIG's job (a torn record last with `torn`)."""
    job_file(path).write_text(json.dumps({"jaxsr_job": CONFIG.fingerprint()}))
    with path.open("wb") as f:
        for i in indices:
            f.write(record(i))
        if torn:
            f.write(record(10**6)[:100])


def peak_bytes(call) -> tuple[object, int]:
    """The call's result and the most memory Python allocated at once during it."""
    tracemalloc.start()
    try:
        result = call()
        return result, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("records", [1000, 10000])
def test_a_resume_streams_the_output(tmp_path, records):
    """Resuming 6 MB or 60 MB of records takes the index set and one line at a time (under 200 bytes a
    record of 6 KB; the old reader held about 3 times the file); the torn last record is cut."""
    path = tmp_path / "out.jsonl"
    write_output(path, range(records), torn=True)
    size = path.stat().st_size
    output, peak = peak_bytes(lambda: JsonlOutput(path, CONFIG))
    assert output.done == set(range(records))
    assert path.stat().st_size == sum(len(record(i)) for i in range(records)) < size  # torn line cut
    print(f"{size} bytes resumed in {peak} bytes at most")
    assert peak < 200 * records + 100_000 < size // 20


def test_merging_parts_streams_them_in_prompt_order(tmp_path):
    """Parts of two processes (a record in two places is taken once) merge into the output in prompt
    order, 24 MB of records in a few hundred kB of memory."""
    path, records = tmp_path / "out.jsonl", 4000
    write_output(path, [0, 5])
    for process in (0, 1):
        write_output(part_path(path, process, 2), range(process, records, 2 - process))
    output = JsonlOutput(path, CONFIG)
    missing, peak = peak_bytes(lambda: _merge_parts(output, CONFIG, total=records))
    assert missing == 0 and output.done == set(range(records))
    assert path.read_bytes() == b"".join(record(i) for i in range(records))
    assert not list(tmp_path.glob("*.part-*"))
    assert peak < 500 * records  # where each record lies (and the parts' index sets), not the records
    assert JsonlOutput(path, CONFIG).done == set(range(records))  # and it resumes


def test_a_merge_with_records_missing_keeps_the_parts(tmp_path):
    path = tmp_path / "out.jsonl"
    write_output(part_path(path, 0, 2), [0, 1])
    output = JsonlOutput(path, CONFIG)
    assert _merge_parts(output, CONFIG, total=3) == 1
    assert part_path(path, 0, 2).exists() and not path.exists()


def test_a_legacy_output_is_rewritten_without_its_header(tmp_path):
    """Written before job files existed: the job on the first line, then the records."""
    path = tmp_path / "out.jsonl"
    header = json.dumps({"jaxsr_job": CONFIG.fingerprint(), "config": {}}) + "\n"
    path.write_bytes(header.encode() + record(0) + record(1))
    output = JsonlOutput(path, CONFIG)
    assert output.done == {0, 1}
    assert path.read_bytes() == record(0) + record(1)
    assert json.loads(job_file(path).read_text())["jaxsr_job"] == CONFIG.fingerprint()
    output.write(2, {"text": "x" * RECORD_BYTES})
    assert path.read_bytes() == record(0) + record(1) + record(2)


def test_a_line_that_is_no_record_and_a_foreign_output_are_refused(tmp_path):
    path = tmp_path / "out.jsonl"
    write_output(path, [0])
    with path.open("ab") as f:
        f.write(b'{"no index": 1}\n')
    with pytest.raises(ValueError, match=r"line 2 of .* is not a jaxsr record"):
        JsonlOutput(path, CONFIG)
    other = JobConfig(output="unused.jsonl", seed=CONFIG.seed + 1)
    write_output(path, [0])
    with pytest.raises(ValueError, match="already holds records of a different job"):
        JsonlOutput(path, other)


@pytest.mark.parametrize("processes", [1, 2, 3, 8])
def test_shares_of_a_job_hold_every_prompt_once_and_nearly_the_same_weight(processes):
    """Half the prompts 10x heavier than the rest, in one block: every share's weight is within one
    prompt's of every other's."""
    weights = [400] * 50 + [40] * 50 + [7] * 3
    pending = [i for i in range(len(weights)) if i % 7]  # some are done
    shares = [share_of(pending, weights, p, processes) for p in range(processes)]
    assert sorted(i for share in shares for i in share) == pending
    loads = [sum(weights[i] for i in share) for share in shares]
    assert max(loads) - min(loads) <= max(weights)
    assert shares == [share_of(pending, weights, p, processes) for p in range(processes)]  # every host agrees


def test_a_job_that_keeps_no_token_ids_stores_their_count_and_its_summaries_count_them():
    """`keep_token_ids: false` drops the ids and keeps their count (`num_tokens`), which the run's summary
    and the report count as they count ids (the summary once read the ids of every sample and failed)."""
    from jaxsr.jobs.progress import Totals
    from jaxsr.jobs.records import output_record
    from jaxsr.jobs.report import Summary
    from jaxsr.results import Result, Sample

    samples = [Sample(token_ids=[5] * n, text="x" * n, score=float(n), finished=True) for n in (3, 4)]
    result = {**Result(prompt="p", samples=samples, best=samples[1]).to_dict(), "index": 0}
    kept, dropped = (
        output_record(result, {}, {}, JobConfig(output="o.jsonl", keep_token_ids=keep))
        for keep in (True, False)
    )
    assert [s.get("num_tokens") for s in dropped["samples"]] == [3, 4] and dropped["best"]["num_tokens"] == 4
    assert not any("token_ids" in s for s in [*dropped["samples"], dropped["best"]])
    for record in (kept, dropped):
        totals, summary = Totals(), Summary(Path("o.jsonl"), {})
        totals.add(record)
        summary.add(record)
        assert totals.new_tokens == summary.tokens == 7 and summary.token_samples == 2


def test_a_resume_refuses_a_job_file_that_is_a_fifo_naming_it(tmp_path):
    """A FIFO where the job file belongs would block reading it until a writer came: a resume refuses it
    at once, naming it (it read the file whole)."""
    path = tmp_path / "out.jsonl"
    write_output(path, range(2))
    job_file(path).unlink()
    os.mkfifo(job_file(path))
    with within(5), pytest.raises(ValueError, match=f"{job_file(path)}: not a regular file"):
        JsonlOutput(path, CONFIG)
