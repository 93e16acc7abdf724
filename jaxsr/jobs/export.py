"""Training sets from a job's output (`jaxsr export`), in the conversational layout TRL's SFTTrainer and
DPOTrainer read: SFT rows as `messages`, preference rows as `prompt` (messages) with `chosen` and
`rejected` (assistant message lists) and their scores.

A record's prompt is a conversation (a text prompt is one user turn). The SFT set has a row per record
with a `best`: the conversation followed by the best response. The preference set pairs the
highest-scored sample with the lowest-scored other one (`best_vs_worst`) or with another drawn at random
from (seed, prompt index) (`best_vs_random`); a pair is kept when its margin is positive and at least
`min_margin` (a tie states no preference). Unscored samples and those with a non-finite score are never
paired; the partial responses Speculative Rejection stopped (`rejected`) neither: their scores judge a
prefix (and a job run with `keep_samples: false` kept the best alone: it gives no pair). With
`finished_only`, only responses that ended on their own count: an SFT row's best, and the samples a pair
is drawn from. A response is a complete assistant turn to a trainer (TRL and `jaxsr train sft` learn its
end of turn too), hence `finished_only` for jobs whose `max_new_tokens` cut many. The fields a record
carries from its input record (an `id`, …) are carried into its rows.

The output is read a line at a time (outputs can be gigabytes) and only its complete records (a running
or killed job's torn last line is left out); rows keep the output's order. Each set is written
atomically (a refusal or a kill leaves no partial file), the preference set first: it is the one that
refuses an output without scores, before anything is written.
"""

from __future__ import annotations

import collections
import dataclasses
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from jaxsr.checks import check_bool, check_number, check_seed, finite
from jaxsr.jobs.records import OWN_FIELDS, read_output
from jaxsr.jobs.runner import complete_end, write_durably
from jaxsr.text import as_messages, check_conversation

PAIRS = ("best_vs_worst", "best_vs_random")
EXPORT_FIELDS = ("messages", "prompt", "chosen", "rejected", "score_chosen", "score_rejected")
"""The columns the sets are made of: a carried field of the same name is kept as `input_<name>`, as a
job keeps an input field named like one of its own."""

NEEDED = {
    "sft": "records with a best",
    "preference": "records with two scored samples",
}
"""What each set is made of."""
JOBS = "the output of a job with a reward: best_of_n or speculative_rejection"

Row = dict[str, Any]
Scored = tuple[float, Row]
Skip = str
"""Why a record gives no row (counted by reason)."""


@dataclasses.dataclass(frozen=True)
class Source:
    """A job output and the size of its complete records when the export began: every set is made of
    the same records, even of a job still appending (its torn last line is left out)."""

    path: Path
    end: int

    def records(self) -> Iterator[Row]:
        """The records, a line at a time, each checked (`records.read_output`, and a prompt that is a
        text or a conversation)."""
        for number, record in read_output(self.path, self.end):
            _check_prompt(record["prompt"], f"output: line {number} of {self.path}")
            yield record


@dataclasses.dataclass(frozen=True)
class PairRule:
    """How a record's samples make a preference pair: checked by `export`."""

    pairs: str = "best_vs_worst"
    min_margin: float = 0.0
    finished_only: bool = False
    seed: int = 0


@dataclasses.dataclass(frozen=True)
class Exported:
    """One set written: where, how many records were read, how many rows written, and how many records
    gave none, by reason."""

    kind: str
    path: Path
    records: int
    rows: int
    skipped: dict[Skip, int]

    def summary(self) -> str:
        """One line for the command to print."""
        skipped = f"; skipped {describe(self.skipped)}" if self.skipped else ""
        return f"{self.kind}: wrote {self.rows} rows of {self.records} records to {self.path}{skipped}"


def describe(skipped: dict[Skip, int]) -> str:
    """Skipped records by reason, as messages show them: `3 records without a best; 1 record …`."""
    return "; ".join(f"{n} record{'s' * (n != 1)} {why}" for why, n in sorted(skipped.items()))


def export(
    output: str | Path,
    *,
    sft: str | Path | None = None,
    preference: str | Path | None = None,
    pairs: str = "best_vs_worst",
    min_margin: float = 0.0,
    finished_only: bool = False,
    seed: int = 0,
) -> list[Exported]:
    """Write the SFT set of the job output `output` to `sft` and/or its preference set to `preference`
    (JSONL files); `finished_only` keeps only responses that ended on their own. Every argument is
    checked before anything is read; an input line that is no jaxsr record, or a set that would have no
    row (a preference set of a job without a reward), refuses with nothing written."""
    source = _check_source(output)
    rule = _check_rule(pairs, min_margin, finished_only, seed)
    targets = {
        kind: _check_target(kind, path, source)
        for kind, path in (("preference", preference), ("sft", sft))
        if path is not None
    }
    if not targets:
        raise ValueError("sft, preference: expected the path of at least one set to write")
    if len(set(targets.values())) < len(targets):
        raise ValueError(f"sft, preference: both name {targets['sft']}; expected two files")
    makers = {
        "preference": lambda r: preference_row(r, rule),
        "sft": lambda r: sft_row(r, rule.finished_only),
    }
    return [_write_set(kind, source, target, makers[kind]) for kind, target in targets.items()]


# -- arguments -------------------------------------------------------------------------------------
def _check_source(output: str | Path) -> Source:
    path = Path(output)
    if not path.is_file():
        raise ValueError(f"output: {path} is not a file (expected a job's JSONL output)")
    return Source(path.resolve(), complete_end(path))


def _check_target(name: str, path: str | Path, source: Source) -> Path:
    """An export path: a .jsonl file in an existing directory, not the job output itself."""
    target = Path(path)
    if target.suffix != ".jsonl":
        raise ValueError(f"{name}: expected a path ending in .jsonl, got {target}")
    if not target.parent.is_dir():
        raise ValueError(f"{name}: the directory of {target} does not exist")
    if target.is_dir():
        raise ValueError(f"{name}: {target} is a directory")
    if target.resolve() == source.path:
        raise ValueError(f"{name}: {target} is the job output being exported; expected another file")
    return target.resolve()


def _check_rule(pairs: str, min_margin: float, finished_only: bool, seed: int) -> PairRule:
    if pairs not in PAIRS:
        raise ValueError(f"pairs: expected one of {PAIRS}, got {pairs!r}")
    margin = check_number("min_margin", min_margin)
    if margin < 0:
        raise ValueError(f"min_margin: expected a number >= 0, got {min_margin}")
    return PairRule(pairs, margin, check_bool("finished_only", finished_only), check_seed(seed))


# -- reading ---------------------------------------------------------------------------------------
def _check_prompt(prompt: Any, where: str) -> None:
    """A record's prompt must be a text or a conversation (it is exported as messages)."""
    if isinstance(prompt, str) and prompt.strip():
        return
    try:
        check_conversation(f"{where}: prompt", prompt)
    except TypeError:
        raise ValueError(f"{where}: prompt: expected a text or a conversation") from None


def score_of(sample: Row) -> float | None:
    """A sample's score, None when it has none that orders (absent, null or not finite)."""
    return finite(sample.get("score"))


# -- rows ------------------------------------------------------------------------------------------
def sft_row(record: Row, finished_only: bool) -> Row | Skip:
    """The record's conversation answered by its best response."""
    best = record.get("best")
    if best is None:
        return "without a best"
    if finished_only and best.get("finished") is not True:
        return "whose best did not finish"
    return {"messages": [*as_messages(record["prompt"]), _assistant(best)], **_carried(record)}


def preference_row(record: Row, rule: PairRule) -> Row | Skip:
    """The record's conversation with a chosen and a rejected response, picked by score (`PairRule`)."""
    scored = [
        (score, sample)
        for sample in record["samples"]
        if (score := score_of(sample)) is not None
        and (sample.get("finished") is True or not rule.finished_only)
    ]
    if len(scored) < 2:
        return ("without a scored sample", "with one scored sample")[len(scored)]
    (score_chosen, chosen), (score_rejected, rejected) = pick_pair(scored, rule, record["index"])
    margin = score_chosen - score_rejected
    if margin <= 0 or margin < rule.min_margin:
        return "whose pair is a tie or under min_margin"
    return {
        "prompt": as_messages(record["prompt"]),
        "chosen": [_assistant(chosen)],
        "rejected": [_assistant(rejected)],
        "score_chosen": score_chosen,
        "score_rejected": score_rejected,
        **_carried(record),
    }


def pick_pair(scored: list[Scored], rule: PairRule, index: int) -> tuple[Scored, Scored]:
    """(chosen, rejected) of two or more (score, sample): the highest-scored (the first of a tie) and,
    among the others, the lowest-scored (the first of a tie) or one drawn from (seed, prompt index)."""
    best = max(range(len(scored)), key=lambda i: scored[i][0])
    others = scored[:best] + scored[best + 1 :]
    if rule.pairs == "best_vs_worst":
        return scored[best], min(others, key=lambda pair: pair[0])
    return scored[best], others[np.random.default_rng([rule.seed, index]).integers(len(others))]


def _assistant(sample: Row) -> dict[str, str]:
    return {"role": "assistant", "content": sample["text"]}


def _carried(record: Row) -> Row:
    """The record's fields that came with its input record."""
    return {f"input_{k}" if k in EXPORT_FIELDS else k: v for k, v in record.items() if k not in OWN_FIELDS}


# -- writing ---------------------------------------------------------------------------------------
@dataclasses.dataclass
class _Tally:
    rows: int = 0
    skipped: collections.Counter[Skip] = dataclasses.field(default_factory=collections.Counter)


def _write_set(kind: str, source: Source, target: Path, make_row: Callable[[Row], Row | Skip]) -> Exported:
    """Stream `source`'s records through `make_row` into `target`, atomically; a set without a row is
    refused (and not written)."""
    tally = _Tally()
    write_durably(target, _lines(kind, source, make_row, tally))
    return Exported(kind, target, tally.rows + tally.skipped.total(), tally.rows, dict(tally.skipped))


def _lines(
    kind: str, source: Source, make_row: Callable[[Row], Row | Skip], tally: _Tally
) -> Iterator[bytes]:
    """The set's JSONL lines, counted into `tally`; raises at the end when there was none."""
    for record in source.records():
        made = make_row(record)
        if isinstance(made, str):
            tally.skipped[made] += 1
        else:
            tally.rows += 1
            yield (json.dumps(made) + "\n").encode()
    if not tally.rows:
        found = describe(tally.skipped) or "no record"
        raise ValueError(f"{kind}: no row from {source.path} ({found}); expected {NEEDED[kind]} ({JOBS})")
