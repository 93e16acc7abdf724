"""Sampling controls: repetition, frequency and presence penalties, forbidden ids and min-p, in every
method; their values traced, so a sweep compiles one program; `jaxsr.generate` over any sampler.

Penalties are checked token for token against transformers' `generate` (the repetition penalty) and a
plain-Python greedy loop over the PyTorch model's full forward passes (vLLM's frequency and presence
penalties), on tiny random Llama, Qwen2 and Gemma 2 checkpoints."""

from __future__ import annotations

import dataclasses
import itertools
import json
import re

import hf_fixtures
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from compiles import compilations
from tiny import tiny_model

import jaxsr
from jaxsr.cli import main
from jaxsr.decoding import loop
from jaxsr.decoding.inputs import check_forbidden
from jaxsr.decoding.sampling import SamplingConfig, per_row
from jaxsr.decoding.speculative import SpeculativeDecoding
from jaxsr.decoding.steps import Controls, PlainSampling
from jaxsr.text import left_pad

PROMPTS = [[5, 9, 12, 5, 7, 9, 3], [40, 41, 40, 41, 40, 8, 8, 60], [17]]
STEPS = 16


@pytest.fixture(scope="module", params=["llama2", "qwen2", "gemma2"])
def pair(request, tmp_path_factory):
    """(our model, the PyTorch model) of one tiny random checkpoint."""
    directory, torch_model = hf_fixtures.checkpoint(request.param, tmp_path_factory)
    return jaxsr.load_model(str(directory)), torch_model


def ours(lm, prompt: list[int], sampling: SamplingConfig) -> list[int]:
    """Our greedy tokens, the stop token they ended on included."""
    [result] = jaxsr.generate(lm, [prompt], max_new_tokens=STEPS, sampling=sampling)
    sample = result.samples[0]
    return sample.token_ids + ([sample.stop_token] if sample.finished else [])


def reference_greedy(model, prompt: list[int], eos: tuple[int, ...], config: SamplingConfig) -> list[int]:
    """Greedy decoding in plain Python over full forward passes, the penalties as vLLM defines them:
    repetition over the prompt and the output (divide a positive logit, multiply a negative one), then
    frequency × count and presence × (count > 0) over the output."""
    out: list[int] = []
    for _ in range(STEPS):
        with torch.no_grad():
            z = model(torch.tensor([prompt + out])).logits[0, -1].double().numpy()
        counts = np.bincount(out, minlength=z.shape[0])
        seen = counts > 0
        if config.penalize_prompt:
            seen[prompt] = True
        rate = config.repetition_penalty
        z = np.where(seen, np.where(z > 0, z / rate, z * rate), z)
        z = z - config.frequency_penalty * counts - config.presence_penalty * (counts > 0)
        z[list(config.forbidden_token_ids)] = -np.inf
        out.append(int(np.argmax(z)))
        if out[-1] in eos:
            break
    return out


@pytest.mark.parametrize("penalty", [1.5, 0.8])
def test_greedy_tokens_with_a_repetition_penalty_are_transformers(pair, penalty):
    lm, model = pair
    config = SamplingConfig(temperature=0, repetition_penalty=penalty)
    for prompt in PROMPTS:
        generated = model.generate(
            torch.tensor([prompt]), max_new_tokens=STEPS, do_sample=False, repetition_penalty=penalty,
            eos_token_id=list(lm.eos_token_ids), pad_token_id=0,
        )[0, len(prompt):].tolist()  # fmt: skip
        mine = ours(lm, prompt, config)
        assert mine == generated[: len(mine)], prompt
        assert len(mine) == STEPS or mine[-1] in lm.eos_token_ids


HELD_OUT = [
    SamplingConfig(temperature=0, frequency_penalty=0.7),
    SamplingConfig(temperature=0, presence_penalty=1.5),
    SamplingConfig(temperature=0, repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.3),
    SamplingConfig(temperature=0, repetition_penalty=2.0, penalize_prompt=False),
    SamplingConfig(temperature=0, presence_penalty=-0.5, forbidden_token_ids=(3, 11)),
]


@pytest.mark.slow  # 3 tiny HF families × 5 settings, each against a PyTorch greedy loop
@pytest.mark.parametrize("config", HELD_OUT, ids=range(len(HELD_OUT)))
def test_greedy_tokens_with_penalties_are_the_plain_python_ones(pair, config):
    lm, model = pair
    for prompt in PROMPTS:
        assert ours(lm, prompt, config) == reference_greedy(model, prompt, lm.eos_token_ids, config), prompt


@pytest.mark.slow  # 3 tiny HF families: greedy decoding of 3 prompts under 7 penalty settings
def test_the_penalties_change_what_greedy_decoding_picks(pair):
    """A control of the tests above: on these prompts the penalties change the tokens."""
    lm, _ = pair
    plain = [ours(lm, p, SamplingConfig(temperature=0)) for p in PROMPTS]
    for config in HELD_OUT:
        assert [ours(lm, p, config) for p in PROMPTS] != plain, config
    with_prompt = dataclasses.replace(HELD_OUT[3], penalize_prompt=True)
    assert [ours(lm, p, with_prompt) for p in PROMPTS] != [ours(lm, p, HELD_OUT[3]) for p in PROMPTS]


@pytest.fixture(scope="module")
def lm():
    return tiny_model(seed=0, eos_token_ids=(3,))


@pytest.mark.slow  # compiles and runs 64 samples of 24 tokens with forbidden ids
def test_forbidden_ids_are_never_drawn(lm):
    sampling = SamplingConfig(temperature=1.5, top_k=0, forbidden_token_ids=(4, 7, 9))
    [result] = jaxsr.generate(lm, [[1, 2]], max_new_tokens=24, num_samples=64, sampling=sampling)
    drawn = {t for s in result.samples for t in s.token_ids}
    assert not drawn & {4, 7, 9} and len(drawn) > 10


def test_forbidding_every_token_is_refused_before_anything_compiles(lm):
    """With every id forbidden a step has nothing to draw (it once drew id 0, itself forbidden)."""
    vocab = lm.config.vocab_size
    everything = SamplingConfig(forbidden_token_ids=range(vocab))
    with pytest.raises(
        ValueError, match=f"forbidden_token_ids: forbids every token the model can draw \\({vocab}\\)"
    ):
        jaxsr.generate(lm, [[1, 2]], max_new_tokens=2, sampling=everything)
    check_forbidden(lm, tuple(range(1, vocab)))  # one id left to draw


SWEEPS = {
    "temperature": [SamplingConfig(temperature=t, top_k=20) for t in (0.5, 0.7, 0.9, 1.2, 1.6)],
    "top_p": [SamplingConfig(top_p=p, top_k=0) for p in (0.5, 0.6, 0.7, 0.8, 0.95)],
    "min_p": [SamplingConfig(min_p=p) for p in (0.01, 0.05, 0.1, 0.2, 0.3)],
    "penalties": [
        SamplingConfig(repetition_penalty=r, frequency_penalty=f, presence_penalty=p)
        for r, f, p in ((1.1, 0.1, 0.0), (1.2, 0.2, 0.1), (0.9, 0.0, 0.3), (1.5, 0.5, 0.5), (2.0, 1.0, 1.0))
    ],
}


@pytest.mark.slow  # per sweep: compiles one sampling program, then 4 more runs of 5 samples
@pytest.mark.parametrize("sweep", list(SWEEPS))
def test_a_sweep_of_five_values_compiles_one_program(lm, sweep):
    """Values are traced: the first setting compiles (or finds) the programs, the other four reuse them
    and still sample differently."""
    kwargs = dict(max_new_tokens=20, num_samples=5, seed=1)
    configs = SWEEPS[sweep]
    results = [jaxsr.generate(lm, [[1, 2, 3]], sampling=configs[0], **kwargs)]
    with compilations() as names:
        results += [jaxsr.generate(lm, [[1, 2, 3]], sampling=c, **kwargs) for c in configs[1:]]
    assert names == [], names
    assert len({str([s.token_ids for s in r[0].samples]) for r in results}) > 1


@pytest.mark.slow  # compiles plain and speculative decoding with penalties
def test_generate_takes_a_speculative_decoder_and_its_greedy_tokens_are_the_targets(lm):
    draft = tiny_model(seed=5, eos_token_ids=(3,))
    sampling = SamplingConfig(temperature=0, repetition_penalty=1.4, presence_penalty=0.5)
    kwargs = dict(max_new_tokens=16, sampling=sampling)
    plain = jaxsr.generate(lm, PROMPTS, **kwargs)
    speculative = jaxsr.generate(jaxsr.speculative_decoder(lm, draft, gamma=3), PROMPTS, **kwargs)
    for a, b in zip(plain, speculative, strict=True):
        assert a.samples[0].token_ids == b.samples[0].token_ids
    assert "acceptance_rate" in speculative[0].stats


def test_generate_refuses_what_is_not_a_model_or_a_sampler():
    with pytest.raises(TypeError, match=r"model: expected a jaxsr\.Model"):
        jaxsr.generate("smollm2", ["hi"], max_new_tokens=2)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(min_p=1.5), "min_p: expected a value in"),
        (dict(repetition_penalty=0.0), "repetition_penalty: expected a value > 0"),
        (dict(frequency_penalty=float("nan")), "frequency_penalty"),
        (dict(frequency_penalty=1e39), "frequency_penalty: expected a value within float32's range"),
        (dict(presence_penalty=-4e38), "presence_penalty: expected a value within float32's range"),
        (dict(forbidden_token_ids=(-1,)), "forbidden_token_ids: token ids are >= 0"),
        (dict(forbidden_token_ids="12"), "forbidden_token_ids: expected a sequence"),
        (dict(forbidden_token_ids=6), "forbidden_token_ids: expected a sequence"),
        (dict(penalize_prompt=1), "penalize_prompt: expected a bool"),
    ],
)
def test_bad_controls_are_refused_naming_them(kwargs, message):
    with pytest.raises((ValueError, TypeError), match=message):
        SamplingConfig(**kwargs)


@pytest.mark.slow  # runs a job on a byte-level Llama from the CLI, then the same through the API
def test_a_job_samples_with_the_controls_the_api_does(tmp_path):
    directory = hf_fixtures.build_llama_with_tokenizer(
        "LlamaForCausalLM", hf_fixtures.byte_tokenizer(), tmp_path / "llama", 31
    )
    data, output = tmp_path / "prompts.jsonl", tmp_path / "out.jsonl"
    prompts = ["Name a color.", "Say hi."]
    data.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    keys = dict(
        max_new_tokens=12, temperature=0.9, top_k=0, min_p=0.05, repetition_penalty=1.3,
        frequency_penalty=0.2, presence_penalty=0.1,
    )  # fmt: skip
    config = tmp_path / "job.yaml"
    config.write_text(
        f"model: {directory}\ndata: {data}\noutput: {output}\nforbidden_token_ids: [101, 102]\n"
        'stop_token_ids: [46]\nstop: ["o", "e"]\n' + "".join(f"{k}: {v}\n" for k, v in keys.items())
    )
    assert main(["run", str(config), "--no-progress"]) == 0
    records = sorted((json.loads(line) for line in output.read_text().splitlines()), key=lambda r: r["index"])
    lm = jaxsr.load_model(str(directory))
    del keys["max_new_tokens"]
    sampling = SamplingConfig(**keys, forbidden_token_ids=(101, 102))
    api = jaxsr.generate(
        lm, prompts, max_new_tokens=12, sampling=sampling, stop_token_ids=[46], stop=["o", "e"]
    )
    for record, result in zip(records, api, strict=True):
        assert record["samples"][0]["token_ids"] == result.samples[0].token_ids
        assert record["samples"][0]["text"] == result.samples[0].text


@dataclasses.dataclass(frozen=True)
class Favour(PlainSampling):
    """A method of one's own: the target's logits with one token made near certain."""

    token: int = 6

    def scores(self, logits, controls, past):
        return logits[0].at[..., self.token].add(1e4)


def test_a_method_of_ones_own_samples_in_generate_and_the_searches(lm):
    sampler = jaxsr.Sampler((lm,), Favour())
    [plain] = jaxsr.generate(sampler, [[1, 2]], max_new_tokens=8, num_samples=4)
    assert all(s.token_ids == [6] * 8 for s in plain.samples)
    [best] = jaxsr.best_of_n(sampler, jaxsr.rewards.SelfLikelihood(), [[1, 2]], n=4, max_new_tokens=8)
    assert best.best.token_ids == [6] * 8


@dataclasses.dataclass(frozen=True)
class NoEcho(PlainSampling):
    """A control that reads the row's tokens: never the token just generated."""

    def scores(self, logits, controls, past):
        echo = past.last()[..., None] == jnp.arange(logits[0].shape[-1])
        return jnp.where(echo, -jnp.inf, logits[0])


@dataclasses.dataclass(frozen=True)
class NoEchoSD(SpeculativeDecoding):
    scores = NoEcho.scores


@dataclasses.dataclass(frozen=True)
class Fresh(PlainSampling):
    """A presence penalty of one's own, from the counts of the row's tokens."""

    weight: float = 2.0

    def scores(self, logits, controls, past):
        return logits[0] - self.weight * (past.counts(logits[0].shape[-1]) > 0)


@dataclasses.dataclass(frozen=True)
class FreshSD(SpeculativeDecoding):
    weight: float = 2.0
    scores = Fresh.scores


def echoes(tokens: list[int]) -> int:
    return sum(a == b for a, b in itertools.pairwise(tokens))


@pytest.mark.slow  # compiles a method's plain and speculative loops, greedy and at 32 samples
def test_a_method_reads_each_rows_tokens_so_far(lm):
    """Greedy `NoEcho` equals a plain-Python greedy loop over full forward passes with the same ban; a
    speculative sampler with those scores gives the same tokens (its look-ahead positions see the
    drafts before them), and sampled rows of either never echo, where plain sampling does."""
    greedy, kwargs = SamplingConfig(temperature=0), dict(max_new_tokens=STEPS)
    expected = []
    for prompt in PROMPTS:
        out: list[int] = []
        while len(out) < STEPS and (not out or out[-1] != 3):
            z = np.array(lm.logits([prompt + out])[0, -1])
            if out:
                z[out[-1]] = -np.inf
            out.append(int(np.argmax(z)))
        expected.append(out)
    draft = tiny_model(seed=5, eos_token_ids=(3,))
    for sampler in (jaxsr.Sampler((lm,), NoEcho()), jaxsr.Sampler((lm, draft), NoEchoSD(gamma=3))):
        results = jaxsr.generate(sampler, PROMPTS, sampling=greedy, **kwargs)
        assert [ours_of(r) for r in results] == expected
    plain = jaxsr.Sampler((lm,), PlainSampling())
    sampled = dict(max_new_tokens=24, num_samples=32, sampling=SamplingConfig(temperature=1.5, top_k=0))
    assert sum(echoes(s.token_ids) for s in jaxsr.generate(plain, [[1, 2]], **sampled)[0].samples) > 5
    for sampler in (jaxsr.Sampler((lm,), NoEcho()), jaxsr.Sampler((lm, draft), NoEchoSD(gamma=3))):
        assert sum(echoes(s.token_ids) for s in jaxsr.generate(sampler, [[1, 2]], **sampled)[0].samples) == 0


def ours_of(result) -> list[int]:
    sample = result.samples[0]
    return sample.token_ids + ([sample.stop_token] if sample.finished else [])


@pytest.mark.slow  # compiles a method's and the presence penalty's loops, sampled, greedy and speculative
def test_counts_of_the_rows_tokens_are_the_presence_penalty(lm):
    """`Past.counts` read by a method of one's own samples the tokens that the presence penalty does
    (same seed, same streams); greedy, a speculative sampler with those scores picks them too (the
    draft proposes without the penalty there, so only greedy tokens are comparable)."""
    draft = tiny_model(seed=5, eos_token_ids=(3,))
    kwargs = dict(max_new_tokens=20, num_samples=6, seed=4)
    sampled, penalty = SamplingConfig(top_k=0), SamplingConfig(top_k=0, presence_penalty=2.0)
    mine = jaxsr.generate(jaxsr.Sampler((lm,), Fresh()), PROMPTS, sampling=sampled, **kwargs)
    theirs = jaxsr.generate(lm, PROMPTS, sampling=penalty, **kwargs)
    assert [[s.token_ids for s in r.samples] for r in mine] == [
        [s.token_ids for s in r.samples] for r in theirs
    ]
    greedy = dict(max_new_tokens=STEPS, sampling=SamplingConfig(temperature=0))
    library = jaxsr.generate(
        lm, PROMPTS, max_new_tokens=STEPS, sampling=SamplingConfig(temperature=0, presence_penalty=2.0)
    )
    speculative = jaxsr.generate(jaxsr.Sampler((lm, draft), FreshSD(gamma=3)), PROMPTS, **greedy)
    assert [ours_of(r) for r in speculative] == [ours_of(r) for r in library]


# -- per-row values -----------------------------------------------------------------------------------

ROWS = [
    SamplingConfig(temperature=0.6, top_k=20),
    SamplingConfig(temperature=1.3, top_k=20, top_p=0.8),
    SamplingConfig(temperature=1.0, top_k=20, min_p=0.1, repetition_penalty=1.3),
    SamplingConfig(temperature=0.9, top_k=20, frequency_penalty=0.5, presence_penalty=0.3),
]


def decode_rows(lm, prompt: list[int], sampling, rows: int, steps: int = 16) -> np.ndarray:
    """Tokens [rows, steps] of `rows` samples of `prompt` decoded by the loop's programs under
    `sampling` (a `Sampling`)."""
    tokens, mask = map(jnp.asarray, left_pad([prompt], 1, 16))
    logits, cache = loop.prefill(lm.graph, lm.params, tokens, mask)
    new = loop.NewRows(
        seed=np.uint32(7), prompt_ids=jnp.zeros(1, jnp.int32), sample_ids=jnp.arange(rows, dtype=jnp.int32),
        alive=jnp.ones(rows, bool), max_new_tokens=jnp.full(rows, steps, jnp.int32),
        stop_ids=jnp.full((rows, 1), -1, jnp.int32),
    )  # fmt: skip
    controls, method = Controls(sampling), PlainSampling()
    state = loop.init_state((logits,), (cache,), controls, new, method=method, capacity=steps)
    state = loop.decode_loop((lm.graph,), (lm.params,), state, (cache,), controls, method=method)
    return np.asarray(state.tokens)


@pytest.mark.slow  # compiles the decode loop for per-row values, then each row's values alone
def test_each_row_samples_with_its_own_values(lm):
    """Row b under `per_row(ROWS)` draws the tokens it draws under `ROWS[b]` alone (its stream is
    its own), and another set of values of the same form compiles nothing."""
    mixed = decode_rows(lm, PROMPTS[1], per_row(ROWS), len(ROWS))
    for b, config in enumerate(ROWS):
        alone = decode_rows(lm, PROMPTS[1], per_row([config] * len(ROWS)), len(ROWS))
        np.testing.assert_array_equal(mixed[b], alone[b], err_msg=str(config))
    assert len({tuple(row) for row in mixed}) == len(ROWS)
    other = [dataclasses.replace(c, temperature=c.temperature + 0.2) for c in ROWS]
    with compilations() as names:
        decode_rows(lm, PROMPTS[1], per_row(other), len(ROWS))
    assert not {"init_state", "decode_loop"} & set(names), names


@pytest.mark.parametrize(
    "configs, message",
    [
        ([], "at least one"),
        ([SamplingConfig(temperature=0), SamplingConfig()], "greedy"),
        ([SamplingConfig(top_k=5), SamplingConfig(top_k=6)], "top_k"),
        ([SamplingConfig(forbidden_token_ids=(1,)), SamplingConfig()], "forbidden"),
        ([SamplingConfig(penalize_prompt=False), SamplingConfig()], "penalize_prompt"),
    ],
)
def test_rows_that_cannot_share_a_program_are_refused(configs, message):
    with pytest.raises(ValueError, match=message):
        per_row(configs)


# -- stop strings --------------------------------------------------------------------------------------


def expected_stop(tokenizer, token_ids: list[int], stop: list[str]) -> tuple[list[int], str | None]:
    """Plain Python: the shortest prefix of `token_ids` whose text contains a stop string (all of them
    when none does), and the string found."""
    for t in range(1, len(token_ids) + 1):
        text = tokenizer.decode(token_ids[:t], skip_special_tokens=True)
        found = [s for s in stop if s in text]
        if found:
            return token_ids[:t], min(found, key=lambda s: (text.index(s), -len(s)))
    return token_ids, None


@pytest.fixture(scope="module")
def byte_lm(tmp_path_factory):
    directory = hf_fixtures.build_llama_with_tokenizer(
        "LlamaForCausalLM", hf_fixtures.byte_tokenizer(), tmp_path_factory.mktemp("byte-llama"), 17
    )
    return jaxsr.load_model(str(directory))


def ascii_runs(texts: list[str], length: int) -> list[str]:
    """Runs of `length` printable ASCII characters in `texts`: stop strings that occur (a random byte
    model's text is mostly invalid UTF-8, whose replacement characters no token's bytes spell)."""
    return re.findall(f"[ -~]{{{length}}}", "\0".join(texts))


STOPS = {
    "characters": lambda texts: ["e", "a", " "],
    "spanning tokens": lambda texts: [ascii_runs(texts, 2)[0], ascii_runs(texts, 3)[1]],
    "mixed": lambda texts: [ascii_runs(texts, 2)[3], "q", ascii_runs(texts, 4)[0]],
}
"""Stop strings, some cut out of the texts generated without stops (so they occur, over 2–4 tokens)."""


@pytest.mark.slow  # per kind: 24 rows of a byte-level Llama, 40 tokens, with and without stops
@pytest.mark.parametrize("kind", list(STOPS))
def test_a_row_stops_where_its_text_first_shows_a_stop_string(byte_lm, kind):
    """Against generating without stops (the same random streams) and cutting in plain Python."""
    prompts, kwargs = ["Name a color.", "Say hi."], dict(max_new_tokens=40, num_samples=12, seed=4)
    sampling = SamplingConfig(temperature=1.0, top_k=0)
    free = jaxsr.generate(byte_lm, prompts, sampling=sampling, **kwargs)
    stop = STOPS[kind]([s.text for r in free for s in r.samples])
    assert all(stop) and any(len(s) > 1 for s in stop) == (kind != "characters")
    stopped = jaxsr.generate(byte_lm, prompts, sampling=sampling, stop=stop, **kwargs)
    hits = 0
    for a, b in zip(free, stopped, strict=True):
        for whole, cut in zip(a.samples, b.samples, strict=True):
            ids = whole.token_ids + ([whole.stop_token] if whole.finished else [])
            expected, found = expected_stop(byte_lm.tokenizer, ids, stop)
            assert cut.stop_string == found
            if found is None:
                assert (cut.token_ids, cut.text) == (whole.token_ids, whole.text)
                assert cut.finished == whole.finished
                continue
            hits += 1
            assert cut.token_ids == expected and cut.finished and cut.stop_token is None
            text = byte_lm.tokenizer.decode(expected, skip_special_tokens=True)
            assert cut.text == text[: text.index(found)]
    assert hits >= 2


@pytest.mark.slow  # compiles SD, Best-of-N and SR with stop strings on a byte-level Llama
def test_stop_strings_hold_in_speculative_decoding_and_the_searches(byte_lm):
    greedy = dict(max_new_tokens=24, sampling=SamplingConfig(temperature=0))
    [free] = jaxsr.generate(byte_lm, ["Name a color."], **greedy)
    kwargs = dict(greedy, stop=[ascii_runs([free.samples[0].text], 1)[1]])
    plain = jaxsr.generate(byte_lm, ["Name a color."], **kwargs)
    # the target as its own draft: every draft is accepted, γ tokens a step, a stop string among them
    pair = jaxsr.speculative_decoder(byte_lm, byte_lm, gamma=4)
    speculative = jaxsr.generate(pair, ["Name a color."], **kwargs)
    assert speculative[0].samples[0].token_ids == plain[0].samples[0].token_ids
    assert plain[0].samples[0].stop_string is not None
    likelihood, stop = jaxsr.rewards.SelfLikelihood(), list("etaoinshrd")
    for search in (
        jaxsr.best_of_n(byte_lm, likelihood, ["Say hi."], n=6, max_new_tokens=24, stop=stop),
        jaxsr.speculative_rejection(
            byte_lm, likelihood, ["Say hi."], rejection_rate=0.5, memory_budget=256, max_new_tokens=24,
            stop=stop,
        ),
    ):  # fmt: skip
        for sample in search[0].samples:
            assert not any(s in sample.text for s in stop)
        assert any(s.stop_string is not None for s in search[0].samples)


@pytest.mark.parametrize("bad", [b"e", "", [""], [3]])
def test_bad_stop_strings_are_refused_naming_stop(byte_lm, bad):
    with pytest.raises((TypeError, ValueError), match="stop"):
        jaxsr.generate(byte_lm, ["hi"], max_new_tokens=4, stop=bad)


@pytest.mark.slow  # compiles greedy and sampled decoding and Best-of-N of a Sampler
def test_a_samplers_own_sampling_holds_unless_the_call_gives_one(lm):
    greedy = jaxsr.Sampler((lm,), PlainSampling(), sampling=SamplingConfig(temperature=0))
    kwargs = dict(max_new_tokens=12, num_samples=4, seed=2)
    [own] = jaxsr.generate(greedy, [[1, 2]], **kwargs)
    assert len({tuple(s.token_ids) for s in own.samples}) == 1  # greedy: every sample alike
    [given] = jaxsr.generate(greedy, [[1, 2]], sampling=SamplingConfig(temperature=1.5, top_k=0), **kwargs)
    assert len({tuple(s.token_ids) for s in given.samples}) > 1
    [best] = jaxsr.best_of_n(greedy, jaxsr.rewards.SelfLikelihood(), [[1, 2]], n=3, max_new_tokens=12)
    assert len({tuple(s.token_ids) for s in best.samples}) == 1
