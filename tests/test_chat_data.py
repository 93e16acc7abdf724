"""Chat datasets as users bring them: conversations (system prompts, multi-turn) with ids, in JSONL and
Parquet, run as Best-of-N and Speculative Rejection jobs. Each record carries its input's fields, and
every stored score is the reward model's score of the stored text in the reward model's own template
(checked against the PyTorch model), though the generator's sampled ids are often not their text's
tokenization."""

from __future__ import annotations

import json

import hf_fixtures as H
import numpy as np
import pytest
import torch
import transformers
import yaml

from jaxsr.cli import main
from jaxsr.data import Columns, read_records
from jaxsr.loading.embedded import smollm2_draft_path

CONVERSATIONS = [
    [
        {"role": "system", "content": "You answer with a numbered list."},
        {"role": "user", "content": "Give me three tips to sleep well."},
    ],
    [
        {"role": "user", "content": "Name a fruit."},
        {"role": "assistant", "content": "An apple."},
        {"role": "user", "content": "List 2 more, numbered."},
    ],
    [{"role": "user", "content": "How do I boil an egg? Steps, please."}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What are the steps to plant a tree?"},
    ],
]
TOLERANCE = 1e-4  # float32 scores of the same ids, in other batch shapes than the PyTorch model's


@pytest.fixture(scope="module")
def reward_dir(tmp_path_factory):
    """A small random reward head over SmolLM2's tokenizer and chat template: it reads the generator's
    ids, so Best-of-N and SR may score on device."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(smollm2_draft_path()))
    return H.build_llama_with_tokenizer(
        "LlamaForSequenceClassification",
        tokenizer,
        tmp_path_factory.mktemp("smol-rm"),
        5,
        num_labels=1,
        max_position_embeddings=512,
    )


def write_data(directory):
    rows = [{"id": f"chat-{k}", "messages": m, "source": "test"} for k, m in enumerate(CONVERSATIONS)]
    jsonl = directory / "chats.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    import pyarrow as pa
    import pyarrow.parquet as pq

    parquet = directory / "chats.parquet"
    pq.write_table(pa.Table.from_pylist(rows), parquet)
    return jsonl, parquet


def run_job(directory, name, data, **keys):
    config = {
        "model": "smollm2-draft",
        "data": str(data),
        "max_new_tokens": 32,
        "seed": 3,
        "output": str(directory / f"{name}.jsonl"),
        **keys,
    }
    path = directory / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    assert main(["run", str(path), "--no-progress"]) == 0
    return [json.loads(line) for line in (directory / f"{name}.jsonl").read_text().splitlines()]


def torch_scores(reward_dir, conversation, texts):
    """The PyTorch reward model's scores of `texts` as the assistant's answers to `conversation`,
    rendered by transformers' own chat template code."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(reward_dir))
    model = transformers.AutoModelForSequenceClassification.from_pretrained(str(reward_dir)).eval()
    scores = []
    for text in texts:
        rendered = tokenizer.apply_chat_template(
            [*conversation, {"role": "assistant", "content": text}], tokenize=False
        )
        # one template, never a template in a template: a header per message and the answer's
        assert rendered.count("<|im_start|>") == len(conversation) + 1 + (conversation[0]["role"] != "system")
        ids = tokenizer(rendered, add_special_tokens=False, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            scores.append(float(model(input_ids=ids).logits[0, 0]))
    return np.array(scores)


@pytest.mark.slow
def test_chat_dataset_jobs_store_scores_of_their_text(tmp_path, reward_dir):
    jsonl, parquet = write_data(tmp_path)
    common = {"reward": str(reward_dir), "n": 6}
    bon = run_job(tmp_path, "bon", jsonl, method="best_of_n", **common)
    sr = run_job(
        tmp_path,
        "sr",
        parquet,
        method="speculative_rejection",
        memory_budget=160,
        keep_rejected=True,
        **common,
    )
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(reward_dir))
    rescored = 0
    for records in (bon, sr):
        assert sorted(r["id"] for r in records) == [f"chat-{k}" for k in range(len(CONVERSATIONS))]
        for record in records:
            conversation = CONVERSATIONS[record["index"]]
            assert record["prompt"] == conversation and record["source"] == "test"
            assert record["provenance"]["reward"] == str(reward_dir)
            stored = [*record["samples"], *record.get("rejected", [])]
            expected = torch_scores(reward_dir, conversation, [s["text"] for s in stored])
            np.testing.assert_allclose([s["score"] for s in stored], expected, atol=TOLERANCE, rtol=0)
            assert record["best"]["score"] == max(s["score"] for s in record["samples"])
            # samples whose sampled ids are not what their text tokenizes to: scored through the text
            rescored += sum(
                tokenizer(s["text"], add_special_tokens=False)["input_ids"] != s["token_ids"] for s in stored
            )
    assert rescored > 0  # the case that made stored scores differ from their text's is in the data
    assert any(r["rejected"] for r in sr) and all("decision" in x for r in sr for x in r["rejected"])
    # `jaxsr run` ended with a report beside each output; `jaxsr report` prints the table and rewrites it
    assert (tmp_path / "bon.report" / "report.html").stat().st_size > 0
    assert main(["report", str(tmp_path / "sr.jsonl"), "--dir", str(tmp_path / "again")]) == 0
    assert "rejected" in (tmp_path / "again" / "report.html").read_text()
    # `jaxsr export`: TRL's conversational layouts, the conversation kept as it was, the ids carried (32
    # tokens cut most of the draft's answers: --keep-truncated gives every conversation a row)
    sft, pairs = tmp_path / "sft.jsonl", tmp_path / "pairs.jsonl"
    sets = ["--sft", str(sft), "--preference", str(pairs)]
    assert main(["export", str(tmp_path / "bon.jsonl"), *sets, "--keep-truncated"]) == 0
    assert len(sft.read_text().splitlines()) == len(pairs.read_text().splitlines()) == len(CONVERSATIONS)
    for row in map(json.loads, pairs.read_text().splitlines()):
        k = int(row["id"].split("-")[1])
        assert row["prompt"] == CONVERSATIONS[k] and row["score_chosen"] > row["score_rejected"]
    for row in map(json.loads, sft.read_text().splitlines()):
        k = int(row["id"].split("-")[1])
        assert row["messages"][:-1] == CONVERSATIONS[k] and row["messages"][-1]["role"] == "assistant"


def test_columns_system_prompt_and_carried_fields(tmp_path):
    path = tmp_path / "set.jsonl"
    rows = [
        {"qid": 1, "question": "Why is the sky blue?"},
        {"qid": 2, "question": [{"role": "user", "content": "Hi"}]},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    records = read_records(str(path), columns=Columns(prompt_field="question", system_prompt="Be kind."))
    assert [r.fields for r in records] == [{"qid": 1}, {"qid": 2}]
    assert records[0].prompt == [
        {"role": "system", "content": "Be kind."},
        {"role": "user", "content": "Why is the sky blue?"},
    ]
    assert records[1].prompt[0] == {"role": "system", "content": "Be kind."}
    plain = read_records(str(path), columns=Columns(prompt_field="question"))
    assert plain[0].prompt == "Why is the sky blue?"


@pytest.mark.parametrize(
    "row, columns, message",
    [
        ({"text": "hi"}, Columns(), "record 0 of .* has no `prompt` field"),
        ({"q": "hi"}, Columns(messages_field="q"), "record 0 .*`q`: expected a list of .* messages, got str"),
        ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}, Columns(),
         "must end in a non-empty user turn"),
        ({"messages": [{"role": "user", "text": "hi"}]}, Columns(), r"`messages`\[0\]: expected the keys"),
        ({"prompt": 3}, Columns(), "`prompt` is a int, expected a string or a list of messages"),
        ({"prompt": "  "}, Columns(), "empty prompt"),
    ],
)  # fmt: skip
def test_records_that_fit_no_format_are_refused_naming_file_and_record(tmp_path, row, columns, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(row) + "\n")
    with pytest.raises(ValueError, match=message):
        read_records(str(path), columns=columns)


def test_a_parquet_file_that_is_not_parquet_is_refused(tmp_path):
    path = tmp_path / "x.parquet"
    path.write_text("not parquet")
    with pytest.raises(ValueError, match="is not a readable Parquet file"):
        read_records(str(path))


def test_distillation_splits_conversation_prompts_from_its_held_out_set(tmp_path, monkeypatch):
    from jaxsr.training import load_distill_config
    from jaxsr.training.distill import split_prompts

    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    (tmp_path / "train.jsonl").write_text(
        "".join(
            json.dumps(r) + "\n"
            for r in [{"messages": chat}, {"prompt": "a"}, {"messages": chat}, {"prompt": "b"}]
        )
    )
    (tmp_path / "held.jsonl").write_text(json.dumps({"prompt": "b"}) + "\n")
    monkeypatch.setenv("JAXSR_DATA_DIR", str(tmp_path))
    train, held = split_prompts(load_distill_config(None, ["prompts=train", "heldout=held"]))
    assert train == [chat, "a"] and held == ["b"]  # each once, in order, the held-out one left out
