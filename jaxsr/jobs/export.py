"""Training sets from a job's output (`jaxsr export`), in the conversational layout TRL's SFTTrainer and
DPOTrainer read: SFT rows as `messages`, preference rows as `prompt` (messages) with `chosen` and
`rejected` (assistant message lists) and their scores.

A record's prompt is a conversation (a text prompt is one user turn). The SFT set has a row per record
with a `best`: the conversation followed by the best response. The preference set pairs the
highest-scored sample with the lowest-scored other one (`best_vs_worst`) or with another drawn at random
from (seed, prompt index) (`best_vs_random`); a pair is kept when its margin is positive and at least
`min_margin` (a tie states no preference). Unscored samples and those with a non-finite score are never
paired; the partial responses Speculative Rejection stopped (`rejected`) neither: their scores judge a
prefix (and a job run with `keep_samples: false` kept the best alone: it gives no pair).

A response is a complete assistant turn to a trainer (TRL and `jaxsr train sft` close it with an end of
turn and learn it), so one cut at `max_new_tokens` (not `finished`) would teach a model to stop
mid-sentence: it is never an SFT answer nor a pair's chosen. The best response that finished stands in
for a cut best (the highest-scored finished sample, the first of a tie); a record with none is left out
(counted), as is a `keep_samples: false` record whose best was cut. A cut response may be a pair's
rejected one, when scored no higher than the chosen: training pushes it down, which teaches nothing
wrong. `keep_truncated` exports cut responses as any other (the best as it is). The fields a record
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

from jaxsr.checks import check_bool, check_number, check_seed, finite, user_path
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
Made = tuple[Row, bool] | Skip
"""A record's row and whether its response stands in for a best cut at max_new_tokens, or why it gives
none."""

CUT: Skip = "with no finished response, all cut at max_new_tokens"
OUTSCORED: Skip = "with one finished response, outscored by every cut one"
REPLACED = "with the best finished response in place of a best cut at max_new_tokens"


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
    keep_truncated: bool = False
    seed: int = 0


@dataclasses.dataclass(frozen=True)
class Exported:
    """One set written: where, how many records were read, how many rows written (how many of them with
    the best finished response in place of a best cut at max_new_tokens), and how many records gave
    none, by reason."""

    kind: str
    path: Path
    records: int
    rows: int
    skipped: dict[Skip, int]
    replaced: int = 0

    def summary(self) -> str:
        """One line for the command to print."""
        replaced = f" ({self.replaced} {REPLACED})" if self.replaced else ""
        skipped = f"; skipped {describe(self.skipped)}" if self.skipped else ""
        return (
            f"{self.kind}: wrote {self.rows} rows of {self.records} records to {self.path}{replaced}{skipped}"
        )


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
    keep_truncated: bool = False,
    seed: int = 0,
) -> list[Exported]:
    """Write the SFT set of the job output `output` to `sft` and/or its preference set to `preference`
    (JSONL files); `keep_truncated` also answers and chooses with responses cut at max_new_tokens. Every
    argument is checked before anything is read; an input line that is no jaxsr record, or a set that
    would have no row (a preference set of a job without a reward), refuses with nothing written."""
    source = _check_source(output)
    rule = _check_rule(pairs, min_margin, keep_truncated, seed)
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
        "sft": lambda r: sft_row(r, rule.keep_truncated),
    }
    return [_write_set(kind, source, target, makers[kind]) for kind, target in targets.items()]


# -- arguments -------------------------------------------------------------------------------------
def _check_source(output: str | Path) -> Source:
    path = user_path("output", output)
    if not path.is_file():
        raise ValueError(f"output: {path} is not a file (expected a job's JSONL output)")
    return Source(path.resolve(), complete_end(path))


def _check_target(name: str, path: str | Path, source: Source) -> Path:
    """An export path: a .jsonl file in an existing directory, not the job output itself."""
    target = user_path(name, path)
    if target.suffix != ".jsonl":
        raise ValueError(f"{name}: expected a path ending in .jsonl, got {target}")
    if not target.parent.is_dir():
        raise ValueError(f"{name}: the directory of {target} does not exist")
    if target.is_dir():
        raise ValueError(f"{name}: {target} is a directory")
    if target.resolve() == source.path:
        raise ValueError(f"{name}: {target} is the job output being exported; expected another file")
    return target.resolve()


def _check_rule(pairs: str, min_margin: float, keep_truncated: bool, seed: int) -> PairRule:
    if pairs not in PAIRS:
        raise ValueError(f"pairs: expected one of {PAIRS}, got {pairs!r}")
    margin = check_number("min_margin", min_margin)
    if margin < 0:
        raise ValueError(f"min_margin: expected a number >= 0, got {min_margin}")
    return PairRule(pairs, margin, check_bool("keep_truncated", keep_truncated), check_seed(seed))


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


def finished(sample: Row) -> bool:
    """Whether the response ended on its own (EOS or a stop string), not at max_new_tokens."""
    return sample.get("finished") is True


def scored_samples(record: Row) -> list[Scored]:
    """(score, sample) of the record's samples that have a score that orders, in the record's order."""
    return [(score, sample) for sample in record["samples"] if (score := score_of(sample)) is not None]


def top(scored: list[Scored], keep_truncated: bool) -> int | None:
    """Index of the highest-scored (the first of a tie) of `scored` that finished (of any, with
    `keep_truncated`), as a job picks its best; None when there is none."""
    eligible = [i for i, (_, sample) in enumerate(scored) if keep_truncated or finished(sample)]
    return max(eligible, key=lambda i: scored[i][0], default=None)


# -- rows ------------------------------------------------------------------------------------------
def sft_row(record: Row, keep_truncated: bool) -> Made:
    """The record's conversation answered by its best response, or by its best finished one where the
    best was cut at max_new_tokens (unless `keep_truncated`)."""
    best = record.get("best")
    if best is None:
        return "without a best"
    replaced = not (keep_truncated or finished(best))
    if replaced:
        scored = scored_samples(record)
        chosen = top(scored, keep_truncated=False)
        if chosen is None:
            return CUT
        best = scored[chosen][1]
    return {"messages": [*as_messages(record["prompt"]), _assistant(best)], **_carried(record)}, replaced


def preference_row(record: Row, rule: PairRule) -> Made:
    """The record's conversation with a chosen and a rejected response, picked by score (`pick_pair`)."""
    scored = scored_samples(record)
    if len(scored) < 2:
        return ("without a scored sample", "with one scored sample")[len(scored)]
    pair = pick_pair(scored, rule, record["index"])
    if isinstance(pair, str):
        return pair
    (score_chosen, chosen), (score_rejected, rejected) = pair
    margin = score_chosen - score_rejected
    if margin <= 0 or margin < rule.min_margin:
        return "whose pair is a tie or under min_margin"
    row = {
        "prompt": as_messages(record["prompt"]),
        "chosen": [_assistant(chosen)],
        "rejected": [_assistant(rejected)],
        "score_chosen": score_chosen,
        "score_rejected": score_rejected,
        **_carried(record),
    }
    return row, chosen is not scored[top(scored, keep_truncated=True)][1]


def pick_pair(scored: list[Scored], rule: PairRule, index: int) -> tuple[Scored, Scored] | Skip:
    """(chosen, rejected) of two or more (score, sample): the chosen the highest-scored that finished
    (of any, with `keep_truncated`; the first of a tie); the rejected, among the others scored no higher
    (cut ones too), the lowest-scored (the first of a tie) or one drawn from (seed, prompt index)."""
    best = top(scored, rule.keep_truncated)
    if best is None:
        return CUT
    others = [pair for i, pair in enumerate(scored) if i != best and pair[0] <= scored[best][0]]
    if not others:
        return OUTSCORED
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
    replaced: int = 0
    skipped: collections.Counter[Skip] = dataclasses.field(default_factory=collections.Counter)


def _write_set(kind: str, source: Source, target: Path, make_row: Callable[[Row], Made]) -> Exported:
    """Stream `source`'s records through `make_row` into `target`, atomically; a set without a row is
    refused (and not written)."""
    tally = _Tally()
    write_durably(target, _lines(kind, source, make_row, tally))
    records = tally.rows + tally.skipped.total()
    return Exported(kind, target, records, tally.rows, dict(tally.skipped), tally.replaced)


def _lines(kind: str, source: Source, make_row: Callable[[Row], Made], tally: _Tally) -> Iterator[bytes]:
    """The set's JSONL lines, counted into `tally`; raises at the end when there was none."""
    for record in source.records():
        made = make_row(record)
        if isinstance(made, str):
            tally.skipped[made] += 1
            continue
        row, replaced = made
        tally.rows += 1
        tally.replaced += replaced
        yield (json.dumps(row) + "\n").encode()
    if not tally.rows:
        raise ValueError(_no_row(kind, source.path, tally.skipped))


def _no_row(kind: str, path: Path, skipped: dict[Skip, int]) -> str:
    """Why a set got no row, and what gives one: where responses cut at max_new_tokens were left out, a
    larger max_new_tokens or `keep_truncated`."""
    found = describe(skipped) or "no record"
    if CUT in skipped or OUTSCORED in skipped:
        advice = (
            "a response cut at max_new_tokens would teach a model to stop mid-sentence: run the job with "
            "a larger max_new_tokens, or export cut responses as they are with keep_truncated "
            "(--keep-truncated)"
        )
    else:
        advice = f"expected {NEEDED[kind]} ({JOBS})"
    return f"{kind}: no row from {path} ({found}); {advice}"
