"""Fine-tuning examples from a results JSONL (`jaxsr run`'s output) or an SFT export (`jaxsr export
--sft`), and their batches.

Each results record holds a prompt and its scored samples; a selection rule picks the responses to learn
from. Each SFT-export row is a conversation ending in the response to learn (`select=best` takes it; the
rules that choose by score refuse it: it has no score). An example is the prompt as the generator saw it
(through the chat template when the model has one, the same encoding inference uses) followed by the
response's tokens and, when the response ended on its own, the end-of-sequence token. Only response
tokens are targets.

Batches are drawn from an endless stream of epochs, each a permutation fixed by (seed, epoch), so the
batch of any step is a pure function of the seed and the step's position in the stream: a resumed run
reads exactly the batches an uninterrupted one does. Each batch is left-padded to a rung of the length
ladder (`fine_bucket`: two rungs per octave), so the train step compiles once per rung.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from jaxsr.checks import finite
from jaxsr.decoding.inputs import encode_prompts
from jaxsr.ladder import fine_bucket
from jaxsr.loading.api import Header
from jaxsr.models.model import Model
from jaxsr.text import check_conversation, encode, left_pad

SELECTIONS = ("best", "top_k", "threshold")
MIN_LENGTH = 16
"""The shortest rung of the batch length ladder."""


@dataclasses.dataclass(frozen=True)
class Example:
    """One prompt + response sequence; positions from `prompt_length` on are the response."""

    tokens: np.ndarray
    prompt_length: int


def read_results(path: str | Path) -> list[dict[str, Any]]:
    """The records of a results JSONL (objects with a `prompt` and a list of `samples`) or the rows of an
    SFT export (objects with `messages`, a conversation ending in an assistant turn)."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise ValueError(f"data: {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"data: cannot read {path} ({getattr(e, 'strerror', None) or e})") from None
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"data: line {number} of {path}"
        try:
            record = json.loads(line)
        except (json.JSONDecodeError, RecursionError):
            raise ValueError(f"{where} is not JSON") from None
        if isinstance(record, dict) and "messages" in record:
            _check_sft_row(record["messages"], where)
        elif not (
            isinstance(record, dict) and "prompt" in record and isinstance(record.get("samples"), list)
        ):
            raise ValueError(f"{where} is not a results record (prompt, samples) nor an SFT row (messages)")
        records.append(record)
    return records


def _check_sft_row(messages: Any, where: str) -> None:
    """An SFT row's `messages`: a conversation to answer, then the assistant's answer."""
    last = messages[-1] if isinstance(messages, list) and messages else None
    if not (
        isinstance(last, dict) and last.get("role") == "assistant" and isinstance(last.get("content"), str)
    ):
        raise ValueError(f"{where}: messages: expected a conversation ending in an assistant turn")
    try:
        check_conversation(f"{where}: messages", messages[:-1])
    except TypeError as e:
        raise ValueError(str(e)) from None


def exported_response(messages: list[dict[str, str]], select: str) -> tuple[Any, dict[str, Any]]:
    """(prompt, response) of an SFT-export row: the conversation before the last turn (a lone user turn
    as the text prompt it was exported from, so it is encoded as the generator encoded it, chat template
    or not) and that turn's text, a finished response (a chat turn is complete: it ends on EOS)."""
    if select != "best":
        raise ValueError(
            f"select: select={select} chooses among scored samples, but the data holds SFT-export rows "
            "(messages), one unscored response each; use select=best"
        )
    prompt: Any = messages[:-1]
    if len(prompt) == 1 and prompt[0]["role"] == "user":
        prompt = prompt[0]["content"]
    return prompt, {"text": messages[-1]["content"], "finished": True}


def _score(sample: dict[str, Any]) -> float | None:
    """A sample's score, None when it has none that ranks (absent, not a number, NaN or infinite)."""
    return finite(sample.get("score"))


def select_responses(
    records: list[dict[str, Any]], select: str, *, k: int = 1, threshold: float | None = None
) -> list[tuple[Any, dict[str, Any]]]:
    """(prompt, sample) pairs to learn from: each record's `best` (or its highest-scored sample), its
    `k` highest-scored samples, or every sample scored at least `threshold`. Unscored samples are
    never chosen by score. An SFT-export row gives its response (`exported_response`)."""
    if select not in SELECTIONS:
        raise ValueError(f"select: expected one of {SELECTIONS}, got {select!r}")
    pairs = []
    for record in records:
        if "messages" in record:
            pairs.append(exported_response(record["messages"], select))
            continue
        scored = sorted(
            (s for s in record["samples"] if isinstance(s, dict) and _score(s) is not None),
            key=lambda s: -_score(s),
        )  # a stable sort: ties keep the record's order
        if select == "best":
            best = record.get("best")
            chosen = [best] if isinstance(best, dict) else scored[:1]
        elif select == "top_k":
            chosen = scored[:k]
        else:
            chosen = [s for s in scored if _score(s) >= threshold]
        pairs += [(record["prompt"], sample) for sample in chosen]
    return pairs


def tokenize_examples(
    model: Model | Header, pairs: list[tuple[Any, dict[str, Any]]], *, chat: bool | None, max_length: int
) -> list[Example]:
    """Prompt ids (as inference encodes them) + response text ids + EOS when the response finished,
    cut to `max_length`; an example left without a response token is dropped. `model` may be a
    checkpoint's `Header` (its tokenizer, config and EOS ids are all this reads)."""
    if model.tokenizer is None:
        raise ValueError(f"model: {model.name or 'the model'} has no tokenizer to encode the responses")
    distinct = {json.dumps(p): p for p, _ in pairs}  # each prompt encoded once
    try:
        prompts = dict(zip(distinct, encode_prompts(model, list(distinct.values()), chat=chat), strict=True))
    except (ValueError, TypeError) as e:
        raise ValueError(f"data: {e}") from None
    eos = list(model.eos_token_ids[:1])
    examples = []
    for prompt, sample in pairs:
        if not isinstance(sample.get("text"), str):
            raise ValueError(f"data: a sample of prompt {str(prompt)[:40]!r} has no text")
        prompt_ids = prompts[json.dumps(prompt)]
        response = encode(model.tokenizer, sample["text"], special_tokens=False)
        tokens = (prompt_ids + response + (eos if sample.get("finished") else []))[:max_length]
        if len(tokens) > len(prompt_ids):
            examples.append(Example(np.asarray(tokens, np.int32), len(prompt_ids)))
    return examples


def stream_indices(count: int, seed: int, start: int, size: int) -> np.ndarray:
    """Positions [start, start + size) of the endless example stream: epoch e is the permutation of
    `count` examples drawn from (seed, e)."""
    epochs = range(start // count, math.ceil((start + size) / count))
    stream = np.concatenate([np.random.default_rng([seed, e]).permutation(count) for e in epochs])
    offset = start - epochs[0] * count
    return stream[offset : offset + size]


def make_batch(examples: list[Example], indices: np.ndarray, micro_batches: int, max_length: int) -> dict:
    """[micro_batches, rows, T] left-padded `tokens` and `mask`, T the ladder rung of the longest example,
    and `targets` [micro_batches, rows, W]: 1 at the response tokens among the last W positions. Left
    padding puts every response at the end, so a window of the longest response's rung (plus the
    position that predicts its first token) holds them all: a loss needs the output layer there only."""
    chosen = [examples[i] for i in indices]
    length = fine_bucket(max(len(e.tokens) for e in chosen), MIN_LENGTH, cap=max_length)
    longest = max(len(e.tokens) - e.prompt_length for e in chosen)
    window = min(fine_bucket(longest + 1, MIN_LENGTH), length)
    rows = len(chosen) // micro_batches
    tokens, mask = left_pad([e.tokens.tolist() for e in chosen], len(chosen), length)
    targets = np.zeros((len(chosen), window), mask.dtype)
    for r, e in enumerate(chosen):
        targets[r, window - (len(e.tokens) - e.prompt_length) :] = 1
    return {
        "tokens": tokens.reshape(micro_batches, rows, length),
        "mask": mask.reshape(micro_batches, rows, length),
        "targets": targets.reshape(micro_batches, rows, window),
    }
