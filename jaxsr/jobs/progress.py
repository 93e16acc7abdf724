"""What a running job shows on stderr: a status line for each phase before decoding (reading the data,
loading the models, checking the prompts), a bar over the prompts whose ETA comes from the measured
rate, and at the end a one-screen summary of what the job produced and where its time went."""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any

from tqdm.auto import tqdm

from jaxsr.jobs.records import response_tokens
from jaxsr.timing import compiling

STAGES = {"compile_s": "compile", "prefill_s": "prefill", "decode_s": "decode", "scoring_s": "reward"}
"""Records' stats summed into the summary's time split, and their names there."""


@dataclasses.dataclass
class Totals:
    """Sums over the records this run wrote."""

    records: int = 0
    new_tokens: int = 0
    best_scores: list[float] = dataclasses.field(default_factory=list)
    stages: dict[str, float] = dataclasses.field(default_factory=lambda: dict.fromkeys(STAGES, 0.0))
    prefill_positions: float = 0.0
    prompt_tokens: int = 0

    def add(self, record: dict[str, Any]) -> None:
        self.records += 1
        self.new_tokens += sum(response_tokens(s) or 0 for s in record["samples"])
        best = record.get("best")
        if best is not None and best.get("score") is not None:
            self.best_scores.append(best["score"])
        stats = record.get("stats", {})
        for key in STAGES:
            self.stages[key] += stats.get(key, 0.0)
        if "prefill_positions" in stats:
            self.prefill_positions += stats["prefill_positions"]
            self.prompt_tokens += stats["prompt_tokens"]


class Progress:
    """A job's progress and summary (status lines and bar only when `enabled`; the summary always)."""

    def __init__(self, enabled: bool, file: Any = None):
        self.enabled, self.file = enabled, file if file is not None else sys.stderr
        self.began = time.time()
        self.phases: dict[str, float] = {}
        """Seconds of each phase before decoding (load, check)."""
        self.totals = Totals()
        self.write_s = 0.0
        self._bar: tqdm | None = None
        self._calls_began = 0.0
        self._weights: dict[int, int] = {}
        self._done_weight = self._left_weight = self._before = self._prompt_tokens = 0

    def status(self, message: str) -> None:
        if self.enabled:
            tqdm.write(f"jaxsr: {message}", file=self.file)

    @contextlib.contextmanager
    def phase(self, name: str, message: str) -> Iterator[None]:
        """A phase before decoding: its status line, then its seconds in the summary."""
        self.status(message)
        start = time.time()
        yield
        self.phases[name] = self.phases.get(name, 0.0) + time.time() - start

    def start(self, pending: dict[int, int], max_new_tokens: int, done: int = 0) -> None:
        """The bar over `done` prompts already answered and the `pending` ones (index → token count);
        a prompt's weight in the ETA is its tokens and the new-token budget."""
        self._weights = {i: length + max_new_tokens for i, length in pending.items()}
        self._left_weight, self._before = sum(self._weights.values()), done
        self._prompt_tokens = sum(pending.values())
        self._calls_began = time.time()
        self._bar = tqdm(
            total=done + len(pending),
            initial=done,
            disable=not self.enabled,
            unit="prompt",
            file=self.file,
            dynamic_ncols=True,
            bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} prompts [{elapsed}{postfix}]",
        )
        self._bar.set_postfix_str("ETA after the first records (the first call compiles)", refresh=True)

    def wrote(self, index: int, record: dict[str, Any], seconds: float) -> None:
        """Record `index` was written in `seconds`: count it and update the ETA."""
        self.write_s += seconds
        self.totals.add(record)
        weight = self._weights.get(index, 0)
        self._done_weight += weight
        self._left_weight -= weight
        if self._bar is not None:
            self._bar.set_postfix_str(self._eta(), refresh=False)
            self._bar.update(1)

    def _eta(self) -> str:
        """Remaining time at the rate measured so far (seconds per prompt token and new-token budget),
        compiling left out (shapes compile once)."""
        now = time.time()
        compiled = compiling(self._calls_began, now)
        running = max(0.0, now - self._calls_began - compiled)
        left = running / max(self._done_weight, 1) * self._left_weight
        return f"ETA {tqdm.format_interval(left)}, compiled {compiled:.0f} s"

    def finish(self, output: str) -> None:
        """Close the bar and print the summary."""
        if self._bar is not None:
            self._bar.close()
        tqdm.write(self.summary(output), file=self.file)

    def summary(self, output: str) -> str:
        """One screen: prompts, tokens/s, mean best reward, padding, and the time split."""
        t, now = self.totals, time.time()
        calls = now - self._calls_began if self._bar is not None else 0.0
        lines = [
            f"jaxsr: {output}: {t.records} records written by this run ({self._prompt_tokens} prompt "
            f"tokens) in {tqdm.format_interval(now - self.began)}; {self._before} were there before"
        ]
        if t.records:
            running = calls - compiling(self._calls_began, now) - self.write_s
            speed = t.new_tokens / max(running, 1e-3)
            line = f"  {t.new_tokens} new tokens, {speed:.1f}/s (compiling left out)"
            if t.best_scores:
                line += f"; mean best reward {sum(t.best_scores) / len(t.best_scores):.4f}"
            if t.prompt_tokens:
                line += f"; prefill positions {t.prefill_positions / t.prompt_tokens:.2f}x the prompt tokens"
            lines.append(line)
        stages = [(STAGES[key], seconds) for key, seconds in self.totals.stages.items()]
        decoding = [*stages, ("write", self.write_s)]
        before = list(self.phases.items())
        other = now - self.began - sum(seconds for _, seconds in [*before, *decoding])
        lines.append(f"  time   {_split(before, now - self.began)}")
        lines.append(f"         {_split([*decoding, ('other', max(0.0, other))], now - self.began)}")
        return "\n".join(lines)


def _split(parts: Sequence[tuple[str, float]], total: float) -> str:
    """`name 1.2 s (3%)` for each part, as a share of `total` seconds."""
    total = max(total, 1e-9)
    return " · ".join(f"{name} {seconds:.1f} s ({100 * seconds / total:.0f}%)" for name, seconds in parts)
