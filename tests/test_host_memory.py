"""Work the host cannot hold is refused before any decoding, naming the argument to change: a memory
budget past the host's free memory (the prompts in flight counted), every row of a CPU search at once,
more responses or KV-cache rows than host memory holds."""

from __future__ import annotations

import pytest
import refusals

import jaxsr
from jaxsr import checks
from jaxsr.decoding.driver import as_sampler
from jaxsr.rewards import SelfLikelihood

lm, no_decoding = refusals.lm, refusals.no_decoding  # the fixtures: a tiny model, no prefill allowed


def test_a_budget_the_host_cannot_hold_is_refused_before_decoding(lm, no_decoding, monkeypatch):
    monkeypatch.setattr(checks, "host_available_bytes", lambda: 2**20)
    for call in (jaxsr.speculative_rejection, jaxsr.best_of_n):
        with pytest.raises(ValueError, match=r"memory_budget: '1GiB' needs 1\.00 GiB .* 1\.0 MiB available"):
            call(lm, SelfLikelihood(), [[1, 2, 3]], n=4, memory_budget="1GiB", max_new_tokens=8)


def test_prompts_in_flight_count_against_the_host(lm, no_decoding, monkeypatch):
    slot = as_sampler(lm, jaxsr.SamplingConfig()).slot_bytes
    monkeypatch.setattr(checks, "host_available_bytes", lambda: 3 * 1024 * slot)
    options = dict(n=4, memory_budget=1024, max_new_tokens=8)
    with pytest.raises(ValueError, match=r"x 4 prompts in flight"):
        jaxsr.speculative_rejection(lm, SelfLikelihood(), [[1, 2]] * 4, concurrent_prompts=4, **options)


def test_every_row_at_once_on_cpu_is_refused_when_it_cannot_fit(lm, no_decoding):
    """Without a budget, SR on CPU plans all n rows at once: n=10**9 would allocate until killed."""
    with pytest.raises(ValueError, match=r"memory_budget: every row at once .* give a smaller"):
        jaxsr.speculative_rejection(lm, SelfLikelihood(), [[1, 2, 3]], n=10**9, max_new_tokens=8)


@pytest.mark.parametrize(
    ("call", "count"),
    [
        (lambda lm: jaxsr.generate(lm, [[1, 2]], num_samples=10**12, max_new_tokens=8), "num_samples"),
        (lambda lm: jaxsr.best_of_n(lm, SelfLikelihood(), [[1, 2]], n=10**12, max_new_tokens=8), "n"),
    ],
    ids=["generate", "best_of_n"],
)
def test_more_responses_than_the_host_can_hold_are_refused(lm, no_decoding, call, count):
    with pytest.raises(ValueError, match=rf"^{count}: 1000000000000 responses .* host memory"):
        call(lm)


def test_ten_million_responses_do_not_fit_sixteen_gib(lm, no_decoding, monkeypatch):
    """The per-response cost is what a `Sample` takes (measured): Best-of-10**7 at 64 tokens needs
    about 29 GiB of host memory for its results."""
    monkeypatch.setattr(checks, "host_available_bytes", lambda: 16 * 2**30)
    with pytest.raises(
        ValueError, match=r"^n: 10000000 responses of up to 64 tokens need at least 29.17 GiB"
    ):
        jaxsr.best_of_n(lm, SelfLikelihood(), [[1, 2]], n=10**7, max_new_tokens=64)


def test_a_batch_of_rows_the_host_cannot_hold_is_refused_before_decoding(lm, no_decoding, monkeypatch):
    monkeypatch.setattr(checks, "host_available_bytes", lambda: 4 * 2**20)  # holds the responses alone
    with pytest.raises(ValueError, match=r"^max_rows: the KV caches need .* give a smaller max_rows"):
        jaxsr.generate(lm, [[1, 2]], num_samples=4096, max_rows=4096, max_new_tokens=8)
    # caches are sized by the bucket of max_new_tokens (16 slots here), not by max_new_tokens itself
    monkeypatch.setattr(checks, "host_available_bytes", lambda: 4 * 2**20)
    with pytest.raises(ValueError, match=r"^max_rows: the KV caches need"):
        jaxsr.generate(lm, [[1, 2]], num_samples=2048, max_rows=2048, max_new_tokens=1)
