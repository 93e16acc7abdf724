"""Speculative Rejection (Sun, Haider, Zhang et al., NeurIPS 2024).

Best-of-N that starts as wide as the KV memory budget allows and, whenever the cache segment is full
(or every `decision_interval` tokens), scores the partial responses and stops the worst. Each prompt
is searched within its own budget, its KV prefilled once and shared by every row (several prompts'
searches can run at once, their rows decoded together: `jaxsr.search.scheduler`). Rows live in a
fixed-shape decode state; finished and rejected rows are masked, and at each decision point the
survivors are gathered into a rung of a static batch ladder B0 > round((1-α)·B0) > … (the rows the
keep rule leaves when no response has finished; one row less where it would not shrink). A rung's
row cache takes every slot the budget allows (the first rung's segment rounded down to a multiple
of `memory.SLOT_ALIGN`; on a TPU that stores keys as values every rung's cache, look-ahead included,
to whole tiles: `Sampler.slot_tile`; the plan is `memory.MemoryPlan`), so the rows the rule keeps
fit the next rung and grow there whenever the memory can hold them; each rung is one compiled shape.
Survivors are never re-prefilled.

Bookkeeping (the reference implementation's, `decide`; `Rejection` is the search's policy): the
pool of a decision point is the finished responses kept at the previous one plus every row of this
round, ranked by reward; the
round((1-α)·|pool|) best are kept (Python's round, half to even). Kept finished responses join a
permanent list that is never pruned, kept unfinished rows continue. The answer is the best of the
permanent list and the last round's rows, which are also `Result.samples`.
`Result.stats["decisions"]` gives each decision's pool size, keep count, forced rejections and
effective rejection rate.

Deviations from the reference implementation (deliberate): survivors keep their exact tokens and
cache (no re-tokenisation, no truncation to the shortest row) and padding is never attended to.
At least one pool member is kept (`min_keep=1`) where the reference's int(round(...)) can keep none
and end the search on partial responses; `min_keep=0` restores that. When the memory cannot hold the
kept unfinished rows at the tokens they already have (kept finished responses in the pool can leave
more of them than the rule would of the live rows alone; a short first segment or a sampler's
look-ahead overshoot can leave too little room to grow), the lowest-ranked are also stopped, down to
the widest rung that can grow (where none can, the search ends on this round's rows):
`Result.stats["forced_rejections"]` and each decision's `forced` count them. With no finished
response and a first segment of at least 16 tokens at a Best-of-N budget this does not happen. On a
TPU with keys stored as values a rung's cache is whole 8-slot tiles where the rows arriving fit
(`Sampler.slot_tile`), so a decision that keeps every row of such a rung can force one up to a tile
sooner than the memory would.

The rows may be decoded by a two-model sampler (`jaxsr.speculative_decoder` etc.): the budget then
counts positions in both models' caches, each row keeps the sampler's look-ahead headroom (γ+1 slots)
past its segment, and a speculative step may carry a row up to γ tokens past a decision point (its
partial response is scored as it stands).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Literal, NamedTuple

import numpy as np

from jaxsr.checks import check_callback, check_positive_int, is_int, is_real
from jaxsr.decoding.driver import Sampler, as_sampler
from jaxsr.decoding.inputs import Options, prepare
from jaxsr.decoding.memory import derived
from jaxsr.decoding.sampling import SamplingConfig
from jaxsr.ladder import bucket
from jaxsr.models.model import Model
from jaxsr.results import Rejected, Result, Sample
from jaxsr.rewards import as_reward
from jaxsr.search.candidates import check_reward
from jaxsr.search.memory import MemoryPlan, prompt_budget, row_layout
from jaxsr.search.scheduler import Batch, Decision, PromptSearch, run_searches

Rule = Literal["keep_fraction", "quantile"]


def keep_mask(
    scores: np.ndarray, rejection_rate: float, rule: Rule = "keep_fraction", min_keep: int = 1
) -> np.ndarray:
    """Which pool members survive a decision point.

    keep_fraction (the reference's rule): the round((1-α)·|pool|) best (Python's round, half to even;
    ties broken by pool order), floored at `min_keep` (1 by default; the reference's is 0). quantile
    (the paper's rule): scores ≥ the α-quantile (the best always)."""
    kept = np.zeros(len(scores), bool)
    if len(scores) == 0:
        return kept
    if rule == "keep_fraction":
        k = min(len(scores), max(min_keep, round((1 - rejection_rate) * len(scores))))
        kept[np.argsort(-scores, kind="stable")[:k]] = True
    elif rule == "quantile":
        kept = scores >= np.quantile(scores, rejection_rate)
        kept[int(np.argmax(scores))] = True
    else:
        raise ValueError(f"rule: expected 'keep_fraction' or 'quantile', got {rule!r}")
    return kept


class Book(NamedTuple):
    """The reference's bookkeeping of finished responses between decision points."""

    permanent: tuple[Sample, ...] = ()
    """Every finished response kept at some decision point: never pruned, always a candidate."""
    carried: tuple[Sample, ...] = ()
    """The finished responses kept at the last decision point: ranked again at the next one."""


def decide(
    book: Book, round_samples: Sequence[Sample], rate: float, rule: Rule = "keep_fraction", min_keep: int = 1
) -> tuple[Book, list[int], dict[str, Any]]:
    """One decision point, as the reference makes it: the pool is `book.carried` plus every row of this
    round, ranked by score; finished members it keeps join `book.permanent` and are carried to the next
    pool, unfinished ones continue. Returns the new book, the continuing rows (indices into
    `round_samples`, best first) and the decision's pool size and keep count."""
    pool = [*book.carried, *round_samples]
    kept = keep_mask(np.array([s.score for s in pool], np.float64), rate, rule, min_keep)
    in_round = kept[len(book.carried) :]
    carried = tuple(s for s, k in zip(pool, kept, strict=True) if k and s.finished)
    new = tuple(s for s, k in zip(round_samples, in_round, strict=True) if k and s.finished)
    order = np.argsort(-np.array([s.score for s in round_samples], np.float64), kind="stable")
    continuing = [int(j) for j in order if in_round[j] and not round_samples[j].finished]
    return Book(book.permanent + new, carried), continuing, {"pool": len(pool), "kept": int(kept.sum())}


def check_rejection_rate(rejection_rate: Any) -> float:
    if not is_real(rejection_rate):
        raise TypeError(f"rejection_rate: expected a float in [0, 1), got {type(rejection_rate).__name__}")
    if not 0 <= rejection_rate < 1:
        raise ValueError(f"rejection_rate: expected a value in [0, 1), got {rejection_rate}")
    return float(rejection_rate)


MAX_PROMPT_BUCKET = 2**20


def _check_bucket(min_prompt_bucket: Any) -> int:
    bucket = check_positive_int("min_prompt_bucket", min_prompt_bucket)
    if bucket > MAX_PROMPT_BUCKET:
        raise ValueError(f"min_prompt_bucket: expected at most {MAX_PROMPT_BUCKET} slots, got {bucket}")
    return bucket


@dataclasses.dataclass(frozen=True)
class SearchConfig:
    """The options of one `speculative_rejection` call that every prompt's search shares, validated."""

    rate: float
    rule: Rule
    min_keep: int
    decision_interval: int | None
    min_first_segment: int
    min_prompt_bucket: int
    keep_rejected: bool = False

    @classmethod
    def checked(
        cls,
        rejection_rate: Any,
        rule: Any,
        min_keep: Any,
        decision_interval: Any,
        min_first_segment: Any,
        min_prompt_bucket: Any,
        keep_rejected: Any = False,
    ) -> SearchConfig:
        if not isinstance(rule, str) or rule not in ("keep_fraction", "quantile"):
            raise ValueError(f"rule: expected 'keep_fraction' or 'quantile', got {rule!r}")
        if not is_int(min_keep) or min_keep not in (0, 1):
            raise ValueError(f"min_keep: expected 0 (the reference's count) or 1, got {min_keep!r}")
        if decision_interval is not None:
            decision_interval = check_positive_int("decision_interval", decision_interval)
        if not isinstance(keep_rejected, bool):
            raise TypeError(f"keep_rejected: expected True or False, got {keep_rejected!r}")
        return cls(
            rate=check_rejection_rate(rejection_rate),
            rule=rule,
            min_keep=int(min_keep),
            decision_interval=decision_interval,
            min_first_segment=check_positive_int("min_first_segment", min_first_segment),
            min_prompt_bucket=_check_bucket(min_prompt_bucket),
            keep_rejected=keep_rejected,
        )


def speculative_rejection(
    model: Model | Sampler,
    reward: Any,
    prompts: Sequence[str] | Sequence[Sequence[int]],
    *,
    n: int | None = None,
    rejection_rate: float = 0.5,
    memory_budget: int | str | None = None,
    max_new_tokens: int,
    sampling: SamplingConfig | None = None,
    seed: int = 0,
    decision_interval: int | None = None,
    rule: Rule = "keep_fraction",
    min_keep: int = 1,
    min_first_segment: int = 16,
    min_prompt_bucket: int = 16,
    concurrent_prompts: int = 1,
    chat: bool | None = None,
    stop_token_ids: Sequence[int] = (),
    stop: Sequence[str] = (),
    prompt_offset: int | Sequence[int] = 0,
    on_result: Callable[[int, Result], None] | None = None,
    keep_rejected: bool = False,
) -> list[Result]:
    """Speculative Rejection per prompt; `rejection_rate=0` with a budget that holds all n rows is
    exactly `best_of_n` with the same seed. `model` is a language model or a two-model sampler. See
    the module docstring for the algorithm. `min_keep` floors each decision's keep count (1; 0 is the
    reference's count, which can stop every row).

    `memory_budget` is each prompt's KV budget. `concurrent_prompts` prompts search at once, each within
    its own budget (memory in use: up to `concurrent_prompts` budgets; with `memory_budget=None` the
    devices' free memory is split among them, every `data` shard counted: `memory.mesh_budget`): the
    rows of prompts whose rounds have the same shapes decode together in one batch, and a finished
    prompt's memory goes to the next prompt. Each prompt's result is the one it gets searched alone
    with the same budget (`jaxsr.search.scheduler`).

    `min_prompt_bucket` pads every prompt to at least that many slots (a power of two), so prompts of
    different lengths share compiled programs (on accelerators, where compiles are costly); the padding
    counts against the memory budget.

    `on_result(i, result)` is called with prompt `i`'s result as soon as its search ends (searches end
    out of prompt order), before the call returns the list. `keep_rejected`: each result also lists the
    partial responses its decisions stopped (`Result.rejected`), preference data too.

    Decisions rank partial responses by the reward's scores of them as they stand; a classifier that
    reads the generator's ids scores them there, on device, from their ids. The scores a result stores
    (its samples and rejected responses) are the reward of their stored text: any the reward reads
    otherwise through its text are rescored through it when the search ends."""
    sampler = as_sampler(model, sampling)
    reward = as_reward(reward)
    config = SearchConfig.checked(
        rejection_rate, rule, min_keep, decision_interval, min_first_segment, min_prompt_bucket, keep_rejected
    )
    if n is not None:
        n = check_positive_int("n", n)
    concurrent_prompts = check_positive_int("concurrent_prompts", concurrent_prompts)
    check_callback("on_result", on_result)
    options = Options(max_new_tokens, sampler.sampling, seed, chat, stop_token_ids, prompt_offset, stop)
    request = prepare(sampler.models, prompts, options)
    check_reward(reward, sampler.target, prompts, request.encoded)
    concurrent_prompts = min(concurrent_prompts, len(request.encoded))  # no more in flight than there are
    # every prompt's plan before any decoding: a prompt that cannot fit its budget is refused up front
    searches, rows = [], row_layout(sampler, derived(sampler, memory_budget))
    for i, ids in enumerate(request.encoded):
        prompt_slots = bucket(len(ids), config.min_prompt_bucket)
        budget = prompt_budget(
            sampler, memory_budget, prompt_slots, request.max_new_tokens, n, concurrent_prompts
        )
        plan = MemoryPlan(
            budget, prompt_slots, request.max_new_tokens, n, config.rate, config.min_first_segment, rows
        )
        searches.append(PromptSearch(sampler, reward, request, i, Rejection(config, plan)))
    with sampler.on_mesh():
        ended = None if on_result is None else lambda search: on_result(search.index, search.result())
        run_searches(sampler, searches, concurrent_prompts, ended)
    return [s.result() for s in searches]


class Rejection:
    """Speculative Rejection's `Policy` for one prompt: its memory plan, the reference's bookkeeping
    (`decide`) and the log of its decisions. A round ends where the rung's cache segment is full (or
    the decision interval is reached, or the budget)."""

    def __init__(self, config: SearchConfig, plan: MemoryPlan):
        self.config, self.plan = config, plan
        self.prompt_slots = plan.prompt_slots
        self.book = Book()
        self.decisions: list[dict[str, Any]] = []
        self.stopped: list[Rejected] | None = [] if config.keep_rejected else None

    def first_batch(self) -> Batch:
        rows = self.plan.ladder[0]
        return Batch(rows, self.plan.capacity(rows))

    def round_end(self, generated: int, segment: int) -> int:
        pause = min(self.plan.max_new_tokens, segment + 1)
        if self.config.decision_interval is not None:
            pause = min(pause, generated + self.config.decision_interval)
        return pause

    def decide(self, samples: list[Sample], generated: int) -> Decision | None:
        """The reference's bookkeeping, and the rung the continuing rows go to: where the memory cannot
        hold them all, the lowest-ranked are stopped too (forced rejections); where it cannot hold a
        row further, the search ends. Logs the decision with its forced rejections and effective rate."""
        config, plan = self.config, self.plan
        book, continuing, decision = decide(self.book, samples, config.rate, config.rule, config.min_keep)
        rung = plan.next_rung(len(continuing), generated) if continuing else None
        decision["forced"] = len(continuing) - (0 if rung is None else min(rung, len(continuing)))
        decision["rate"] = 1 - (decision["kept"] - decision["forced"]) / decision["pool"]
        self.decisions.append({"token": generated, **decision})
        if rung is None:
            return None
        if self.stopped is not None:
            self._log_stopped(samples, continuing, rung, book.permanent[len(self.book.permanent) :])
        self.book = book
        return Decision(continuing[:rung], Batch(rung, plan.capacity(rung)))

    def _log_stopped(self, samples: list[Sample], continuing: list[int], rung: int, done: tuple) -> None:
        """Keep the rows of this round the decision stops: neither continuing nor kept as finished;
        `forced` where the rule kept them but the memory could not."""
        going = set(continuing[:rung])
        forced = set(continuing[rung:])
        at, decision = self.decisions[-1]["token"], len(self.decisions) - 1
        for j, sample in enumerate(samples):
            if j not in going and not any(sample is kept for kept in done):
                self.stopped.append(Rejected(sample, decision, at, j in forced))

    def rejected(self) -> list[Rejected] | None:
        return self.stopped

    def final(self, samples: list[Sample]) -> list[Sample]:
        """The permanent list and the last round's rows, by sample index."""
        return sorted([*self.book.permanent, *samples], key=lambda s: s.index)

    def stats(self) -> dict[str, Any]:
        return {
            "initial_batch": self.plan.ladder[0],
            "memory_budget_slots": self.plan.budget,
            "decisions": self.decisions,
            "forced_rejections": sum(d["forced"] for d in self.decisions),
        }
