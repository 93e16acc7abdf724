"""`jaxsr.jobs.export`: a job's output as TRL's conversational SFT and preference sets. A real Best-of-N
job's export loads with `datasets` in TRL's columns and TRL reads it as conversations; the pair rules,
responses cut at max_new_tokens, the carried fields and the refusals on hand-made records."""

from __future__ import annotations

import json
import math
from pathlib import Path

import hf_fixtures as H
import pytest

from jaxsr.cli import main
from jaxsr.jobs.config import JobConfig
from jaxsr.jobs.export import CUT, OUTSCORED, PairRule, export, pick_pair, preference_row, sft_row
from jaxsr.jobs.methods import build_solver
from jaxsr.jobs.runner import run_job
from jaxsr.text import as_messages

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
PROMPTS = ["Name a color.", "Say hi.", "Count to three.", CHAT]
SFT_COLUMNS = ["messages", "id"]
PREFERENCE_COLUMNS = ["prompt", "chosen", "rejected", "score_chosen", "score_rejected", "id"]


def sample(text: str, score: float | None, finished: bool = True) -> dict:
    return {"token_ids": [1], "text": text, "score": score, "finished": finished, "logprob": -1.0, "index": 0}


def record(index: int, scores: list[float | None], prompt="Question?", **fields) -> dict:
    """A record as a job writes it: a sample per score (text `s<i>`), `best` the highest scored."""
    samples = [sample(f"s{i}", score) for i, score in enumerate(scores)]
    scored = [s for s in samples if s["score"] is not None]
    best = max(scored, key=lambda s: s["score"]) if scored else None
    return {"index": index, "prompt": prompt, "samples": samples, "best": best, "stats": {}, **fields}


def cut(record: dict, *indices: int) -> dict:
    """`record` with its samples `indices` cut at max_new_tokens (its best too, when one of them)."""
    for i in indices:
        record["samples"][i]["finished"] = False  # `best` is the same object as its sample
    return record


def write_output(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def read_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def pair_of(scores: list[float | None], cuts: tuple[int, ...] = (), **rule) -> tuple[str, str] | str:
    """(chosen text, rejected text) of a record with these scores and these samples cut at
    max_new_tokens, or why it gave no pair."""
    made = preference_row(cut(record(0, scores), *cuts), PairRule(**rule))
    if isinstance(made, str):
        return made
    row, _ = made
    return row["chosen"][0]["content"], row["rejected"][0]["content"]


def answer_of(record: dict, keep_truncated: bool = False) -> str:
    """The SFT answer of `record`, or why it gave none."""
    made = sft_row(record, keep_truncated)
    return made if isinstance(made, str) else made[0]["messages"][-1]["content"]


@pytest.fixture(scope="module")
def job_output(tmp_path_factory) -> Path:
    """A Best-of-4 job's output (self-likelihood scores) over three text prompts and a conversation, each
    with an `id`, on a tiny random Llama with a byte tokenizer and a ChatML template."""
    root = tmp_path_factory.mktemp("export-job")
    model = H.build_llama_with_tokenizer("LlamaForCausalLM", H.byte_tokenizer(), root / "model", 21)
    data = root / "prompts.json"
    data.write_text(json.dumps([{"prompt": p, "id": f"q{i}"} for i, p in enumerate(PROMPTS)]))
    config = JobConfig(
        method="best_of_n",
        reward="self_likelihood",
        n=4,
        model=str(model),
        data=str(data),
        output=str(root / "out" / "job.jsonl"),
        max_new_tokens=12,
    )
    return run_job(config, build_solver, progress=False)


@pytest.fixture(scope="module")
def exported(job_output, tmp_path_factory) -> tuple[Path, Path]:
    """The job output's SFT and preference sets (best_vs_worst), cut responses kept: a random model's
    answers mostly run to max_new_tokens, and the layouts are what is tested."""
    root = tmp_path_factory.mktemp("exported")
    sets = export(job_output, sft=root / "sft.jsonl", preference=root / "pref.jsonl", keep_truncated=True)
    assert [(s.kind, s.records) for s in sets] == [("preference", 4), ("sft", 4)]
    assert sets[1].rows == 4 and sets[1].skipped == {}
    assert sets[1].summary() == f"sft: wrote 4 rows of 4 records to {root / 'sft.jsonl'}"
    return root / "sft.jsonl", root / "pref.jsonl"


# -- a real job's export ---------------------------------------------------------------------------
@pytest.mark.slow
def test_a_best_of_n_export_loads_with_datasets_in_trls_columns(job_output, exported):
    import datasets

    sft_path, preference_path = exported
    sft = datasets.load_dataset("json", data_files=str(sft_path), split="train")
    preference = datasets.load_dataset("json", data_files=str(preference_path), split="train")
    assert sft.column_names == SFT_COLUMNS and preference.column_names == PREFERENCE_COLUMNS
    records = {r["id"]: r for r in read_rows(job_output)}
    assert sorted(sft["id"]) == sorted(preference["id"]) == ["q0", "q1", "q2", "q3"]
    for row in sft:
        conversation = as_messages(PROMPTS[int(row["id"][1:])])
        best = records[row["id"]]["best"]
        assert row["messages"] == [*conversation, {"role": "assistant", "content": best["text"]}]
    for row in preference:  # four samples of random text: no tie
        samples = records[row["id"]]["samples"]
        scores = [s["score"] for s in samples]
        assert row["prompt"] == as_messages(PROMPTS[int(row["id"][1:])])
        assert (row["score_chosen"], row["score_rejected"]) == (max(scores), min(scores))
        assert row["chosen"] == [{"role": "assistant", "content": samples[scores.index(max(scores))]["text"]}]
        assert row["rejected"] == [
            {"role": "assistant", "content": samples[scores.index(min(scores))]["text"]}
        ]


@pytest.mark.slow
def test_trl_reads_both_sets_as_conversations_with_the_generators_prompt(exported):
    """TRL takes the rows as conversational and renders them through SmolLM2's chat template; the prompt
    it trains on is the text jaxsr's generator renders for that conversation."""
    import transformers
    from trl.data_utils import is_conversational, maybe_apply_chat_template

    from jaxsr.loading.embedded import smollm2_draft_path
    from jaxsr.text import render_chat

    tokenizer = transformers.AutoTokenizer.from_pretrained(smollm2_draft_path())
    sft_path, preference_path = exported
    for row in read_rows(sft_path):
        assert is_conversational(row)
        text = maybe_apply_chat_template(row, tokenizer)["text"]
        assert text == render_chat(tokenizer, row["messages"], add_generation_prompt=False)
        assert text.endswith(f"<|im_start|>assistant\n{row['messages'][-1]['content']}<|im_end|>\n")
    for row in read_rows(preference_path):
        assert is_conversational(row)
        rendered = maybe_apply_chat_template(row, tokenizer)
        assert rendered["prompt"] == render_chat(tokenizer, row["prompt"], add_generation_prompt=True)
        assert rendered["chosen"] == row["chosen"][0]["content"] + "<|im_end|>\n"
        assert rendered["rejected"] == row["rejected"][0]["content"] + "<|im_end|>\n"


@pytest.mark.slow
def test_best_vs_random_sets_are_a_function_of_the_seed(job_output, tmp_path):
    def pairs(seed: int) -> list[tuple[str, str]]:
        path = tmp_path / f"seed{seed}.jsonl"
        export(job_output, preference=path, pairs="best_vs_random", seed=seed, keep_truncated=True)
        return [(row["chosen"][0]["content"], row["rejected"][0]["content"]) for row in read_rows(path)]

    assert pairs(3) == pairs(3)
    assert len({tuple(pairs(seed)) for seed in range(6)}) > 1


# -- pair rules ------------------------------------------------------------------------------------
def test_best_vs_worst_pairs_the_highest_and_lowest_scored_samples():
    assert pair_of([0.5, 2.0, -1.0, 1.0]) == ("s1", "s2")
    # unscored and non-finite scores are never paired
    assert pair_of([None, 2.0, math.nan, 1.0, -math.inf]) == ("s1", "s3")
    assert pair_of([1.0, 1.0, 0.0]) == ("s0", "s2")  # a tie for best: the first


def test_best_vs_random_draws_every_other_sample_and_never_the_best():
    scores = [0.0, 3.0, 1.0, 2.0]
    rule = PairRule(pairs="best_vs_random", seed=7)
    drawn = [
        pick_pair([(s, sample(f"s{i}", s)) for i, s in enumerate(scores)], rule, index)
        for index in range(200)
    ]
    assert {chosen[1]["text"] for chosen, _ in drawn} == {"s1"}
    counts = {text: sum(r[1]["text"] == text for _, r in drawn) for text in ("s0", "s2", "s3")}
    assert sum(counts.values()) == 200 and min(counts.values()) > 40  # about a third each
    again = [pick_pair([(s, sample(f"s{i}", s)) for i, s in enumerate(scores)], rule, i) for i in range(200)]
    assert [r[1]["text"] for _, r in again] == [r[1]["text"] for _, r in drawn]  # (seed, index) fixes it
    other = PairRule(pairs="best_vs_random", seed=8)
    changed = [
        pick_pair([(s, sample(f"s{i}", s)) for i, s in enumerate(scores)], other, i) for i in range(200)
    ]
    assert [r[1]["text"] for _, r in changed] != [r[1]["text"] for _, r in drawn]


def test_margins_ties_and_scoreless_records_give_no_pair():
    assert pair_of([1.0, 1.0]) == "whose pair is a tie or under min_margin"
    assert pair_of([1.0, 0.5], min_margin=0.5) == ("s0", "s1")  # a margin of min_margin is kept
    assert pair_of([1.0, 0.5], min_margin=0.6) == "whose pair is a tie or under min_margin"
    assert pair_of([1.0, None]) == "with one scored sample"
    assert pair_of([None, None]) == "without a scored sample"


# -- responses cut at max_new_tokens -----------------------------------------------------------------
def test_a_cut_best_gives_way_to_the_best_finished_sample_as_answer_and_chosen():
    assert answer_of(cut(record(0, [3.0, 1.0, 2.0, 0.0]), 0)) == "s2"
    assert answer_of(cut(record(0, [3.0, 2.0, 2.0, 0.0]), 0)) == "s1"  # a tie: the first
    assert answer_of(cut(record(0, [3.0, 1.0, 2.0]), 1)) == "s0"  # a finished best stays
    assert pair_of([3.0, 1.0, 2.0, 0.0], cuts=(0,)) == ("s2", "s3")
    assert pair_of([3.0, 2.0, 2.0, 0.0], cuts=(0,)) == ("s1", "s3")
    # a cut response may be the rejected one, when scored no higher than the chosen
    assert pair_of([3.0, 1.0, 2.0, 0.0], cuts=(0, 3)) == ("s2", "s3")
    # with keep_truncated, the best as it is
    assert answer_of(cut(record(0, [3.0, 1.0, 2.0, 0.0]), 0), keep_truncated=True) == "s0"
    assert pair_of([3.0, 1.0, 2.0, 0.0], cuts=(0,), keep_truncated=True) == ("s0", "s3")


def test_which_rows_stand_in_for_a_cut_best_is_told():
    assert sft_row(cut(record(0, [3.0, 2.0]), 0), keep_truncated=False)[1] is True
    assert sft_row(cut(record(0, [3.0, 2.0]), 1), keep_truncated=False)[1] is False
    assert sft_row(cut(record(0, [3.0, 2.0]), 0), keep_truncated=True)[1] is False
    assert preference_row(cut(record(0, [3.0, 2.0, 1.0]), 0), PairRule())[1] is True
    assert preference_row(cut(record(0, [3.0, 2.0, 1.0]), 1), PairRule())[1] is False
    assert preference_row(cut(record(0, [3.0, 2.0, 1.0]), 0), PairRule(keep_truncated=True))[1] is False


def test_a_record_without_a_finished_response_gives_no_answer_and_no_chosen():
    assert answer_of(cut(record(0, [3.0, 1.0]), 0, 1)) == CUT
    assert pair_of([3.0, 1.0], cuts=(0, 1)) == CUT
    assert answer_of(cut(record(0, [3.0, 1.0]), 0, 1), keep_truncated=True) == "s0"
    assert pair_of([3.0, 1.0], cuts=(0, 1), keep_truncated=True) == ("s0", "s1")
    unknown = record(0, [3.0, 1.0])  # a sample that does not say it finished is taken as cut
    for s in unknown["samples"]:
        del s["finished"]
    assert answer_of(unknown) == CUT
    # the one finished response scored under every cut one: no rejected scored at most the chosen
    assert pair_of([3.0, 2.0, 1.0], cuts=(0, 1)) == OUTSCORED
    assert pair_of([3.0, 2.0, 1.0], cuts=(0, 1), keep_truncated=True) == ("s0", "s2")


def test_best_vs_random_draws_no_rejected_scored_above_a_finished_chosen():
    scored = [(x, sample(f"s{i}", x, finished=i != 0)) for i, x in enumerate([3.0, 0.0, 2.0, 1.0])]
    rule = PairRule(pairs="best_vs_random", seed=7)
    pairs = [pick_pair(scored, rule, index) for index in range(100)]
    drawn = {(chosen[1]["text"], rejected[1]["text"]) for chosen, rejected in pairs}
    assert drawn == {("s2", "s1"), ("s2", "s3")}  # never the cut s0, scored above the chosen


def test_a_record_that_kept_its_best_alone_answers_with_it_only_when_it_finished():
    """A job with `keep_samples: false` stores the best as the only sample."""
    kept_alone = record(0, [2.0])
    assert answer_of(kept_alone) == "s0"
    assert answer_of(cut(kept_alone, 0)) == CUT
    assert answer_of(kept_alone, keep_truncated=True) == "s0"


def test_the_export_tells_rows_that_stand_in_and_records_left_out(tmp_path, capsys):
    rows = [
        record(0, [1.0, 0.0], id="finished"),
        cut(record(1, [3.0, 1.0, 0.0], id="best cut"), 0),
        cut(record(2, [3.0, 1.0], id="all cut"), 0, 1),
    ]
    output = write_output(tmp_path / "job.jsonl", rows)
    sft, pref = tmp_path / "sft.jsonl", tmp_path / "pref.jsonl"
    sets = export(output, sft=sft, preference=pref)
    assert [(s.kind, s.rows, s.replaced, s.skipped) for s in sets] == [
        ("preference", 2, 1, {CUT: 1}),
        ("sft", 2, 1, {CUT: 1}),
    ]
    assert [r["messages"][-1]["content"] for r in read_rows(sft)] == ["s0", "s1"]
    assert [(r["chosen"][0]["content"], r["rejected"][0]["content"]) for r in read_rows(pref)] == [
        ("s0", "s1"),
        ("s1", "s2"),
    ]
    assert sets[1].summary() == (
        f"sft: wrote 2 rows of 3 records to {sft} (1 with the best finished response in place of a best cut "
        "at max_new_tokens); skipped 1 record with no finished response, all cut at max_new_tokens"
    )
    # the command prints each set's summary; --keep-truncated exports the cut best as it is
    assert main(["export", str(output), "--sft", str(sft)]) == 0
    assert capsys.readouterr().out == sets[1].summary() + "\n"
    assert (
        main(["export", str(output), "--sft", str(sft), "--preference", str(pref), "--keep-truncated"]) == 0
    )
    assert capsys.readouterr().out.splitlines() == [
        f"preference: wrote 3 rows of 3 records to {pref}",
        f"sft: wrote 3 rows of 3 records to {sft}",
    ]
    assert [r["messages"][-1]["content"] for r in read_rows(sft)] == ["s0", "s0", "s0"]
    assert [r["chosen"][0]["content"] for r in read_rows(pref)] == ["s0", "s0", "s0"]


def test_a_set_whose_every_response_was_cut_is_refused_saying_so(tmp_path, capsys):
    output = write_output(tmp_path / "job.jsonl", [cut(record(i, [1.0, 0.0]), 0, 1) for i in range(2)])
    for kind in ("sft", "preference"):
        with pytest.raises(ValueError) as refused:
            export(output, **{kind: tmp_path / f"{kind}.jsonl"})
        assert str(refused.value) == (
            f"{kind}: no row from {output} (2 records with no finished response, all cut at "
            "max_new_tokens); a response cut at max_new_tokens would teach a model to stop mid-sentence: "
            "run the job with a larger max_new_tokens, or export cut responses as they are with "
            "keep_truncated (--keep-truncated)"
        )
    assert main(["export", str(output), "--sft", str(tmp_path / "sft.jsonl")]) == 2
    assert "(--keep-truncated)" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["job.jsonl"]
    with pytest.raises(SystemExit):  # the flag it replaced is gone
        main(["export", str(output), "--sft", str(tmp_path / "sft.jsonl"), "--finished-only"])


def test_prompts_become_conversations_and_input_fields_are_carried(tmp_path):
    conversation = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "Name a color."},
    ]
    # the job's own fields stay behind; an input field named like a column is kept as input_<name>
    extra = {"provenance": {"job": "x"}, "rejected": [sample("cut", 0.1)], "chosen": "theirs"}
    rows = [
        record(0, [1.0, 0.0], prompt="Say hi.", id="a", source={"set": "hh"}, **extra),
        record(1, [1.0, 0.0], prompt=conversation, id="b"),
        record(2, [None, None], id="c"),  # a generate job's record: no best, no score
    ]
    output = write_output(tmp_path / "job.jsonl", rows)
    sets = export(output, sft=tmp_path / "sft.jsonl", preference=tmp_path / "pref.jsonl")
    assert [s.skipped for s in sets] == [{"without a scored sample": 1}, {"without a best": 1}]
    sft, preference = read_rows(tmp_path / "sft.jsonl"), read_rows(tmp_path / "pref.jsonl")
    assert sft[0] == {
        "messages": [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "s0"}],
        "id": "a",
        "source": {"set": "hh"},
        "input_chosen": "theirs",
    }
    assert sft[1] == {"messages": [*conversation, {"role": "assistant", "content": "s0"}], "id": "b"}
    assert preference[1] == {
        "prompt": conversation,
        "chosen": [{"role": "assistant", "content": "s0"}],
        "rejected": [{"role": "assistant", "content": "s1"}],
        "score_chosen": 1.0,
        "score_rejected": 0.0,
        "id": "b",
    }
    assert preference[0]["prompt"] == [{"role": "user", "content": "Say hi."}]
    assert preference[0]["chosen"] == [{"role": "assistant", "content": "s0"}]
    assert (preference[0]["id"], preference[0]["input_chosen"]) == ("a", "theirs")
    assert sets[0].summary().endswith("; skipped 1 record without a scored sample")


def test_a_torn_last_line_is_left_out(tmp_path):
    """A job still running (or killed) may end in a partial record: it is not exported."""
    output = write_output(tmp_path / "job.jsonl", [record(0, [1.0, 0.0])])
    with output.open("a") as f:
        f.write(json.dumps(record(1, [1.0, 0.0]))[:30])
    (written,) = export(output, sft=tmp_path / "sft.jsonl")
    assert (written.records, written.rows) == (1, 1)


# -- refusals --------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "keys, message",
    [
        ({}, "sft, preference: expected the path of at least one set"),
        ({"sft": "sft.json"}, r"sft: expected a path ending in \.jsonl"),
        ({"preference": "job.jsonl"}, "preference: .* is the job output being exported"),
        ({"sft": "missing/sft.jsonl"}, "sft: the directory of .* does not exist"),
        ({"sft": "same.jsonl", "preference": "same.jsonl"}, "sft, preference: both name"),
        ({"sft": "sft.jsonl", "pairs": "best_vs_best"}, "pairs: expected one of"),
        ({"sft": "sft.jsonl", "min_margin": -0.1}, "min_margin: expected a number >= 0"),
        ({"sft": "sft.jsonl", "min_margin": math.nan}, "min_margin: expected a finite number"),
        ({"sft": "sft.jsonl", "min_margin": "0.1"}, "min_margin: expected a number"),
        ({"sft": "sft.jsonl", "seed": -1}, "seed: expected an int"),
        ({"sft": "sft.jsonl", "keep_truncated": "yes"}, "keep_truncated: expected True or False"),
    ],
)
def test_bad_arguments_are_refused_naming_them_before_anything_is_written(tmp_path, keys, message):
    output = write_output(tmp_path / "job.jsonl", [record(0, [1.0, 0.0])])
    paths = {k: tmp_path / v if k in ("sft", "preference") else v for k, v in keys.items()}
    with pytest.raises((ValueError, TypeError), match=message):
        export(output, **paths)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["job.jsonl"]


@pytest.mark.parametrize(
    "line, message",
    [
        ("{oops", r"line 2 of .*job.jsonl is not a jaxsr record \(not a JSON object\)"),
        (json.dumps({"prompt": "x", "samples": []}), "line 2 of .*job.jsonl is not a jaxsr record"),
        (json.dumps({**record(1, [1.0]), "samples": [{"score": 1.0}]}), "line 2 .* not a jaxsr record"),
        (
            json.dumps(record(1, [1.0], prompt=[1, 2, 3])),
            "line 2 .*: prompt: expected a text or a conversation",
        ),
        (json.dumps(record(1, [1.0], prompt=[{"role": "assistant", "content": "x"}])), r"line 2 .*: prompt"),
    ],
)
def test_a_line_that_is_no_jaxsr_record_is_refused_naming_file_and_line(tmp_path, line, message):
    output = tmp_path / "job.jsonl"
    output.write_text(json.dumps(record(0, [1.0, 0.0])) + "\n" + line + "\n")
    (tmp_path / "sft.jsonl").write_text("an earlier export\n")
    with pytest.raises(ValueError, match=f"output: {message}"):
        export(output, sft=tmp_path / "sft.jsonl", preference=tmp_path / "pref.jsonl")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["job.jsonl", "sft.jsonl"]  # no partial file
    assert (tmp_path / "sft.jsonl").read_text() == "an earlier export\n"  # kept as it was


def test_a_preference_set_of_an_output_without_scores_is_refused_before_anything_is_written(tmp_path):
    """A `generate` job's records have no score and no best: neither set has a row."""
    output = write_output(tmp_path / "job.jsonl", [record(i, [None, None]) for i in range(3)])
    with pytest.raises(
        ValueError, match=r"preference: no row from .*job\.jsonl \(3 records without a scored"
    ):
        export(output, sft=tmp_path / "sft.jsonl", preference=tmp_path / "pref.jsonl")
    with pytest.raises(
        ValueError, match=r"sft: no row .*\(3 records without a best\); expected records with a best"
    ):
        export(output, sft=tmp_path / "sft.jsonl")
    with pytest.raises(ValueError, match=r"sft: no row .*\(no record\)"):
        export(write_output(tmp_path / "job.jsonl", []), sft=tmp_path / "sft.jsonl")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["job.jsonl"]


def test_a_missing_output_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"output: .*nope\.jsonl is not a file"):
        export(tmp_path / "nope.jsonl", sft=tmp_path / "sft.jsonl")
