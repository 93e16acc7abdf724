"""Stop strings: the on-device matcher against plain Python over random token streams (strings spanning
tokens, prefixes and suffixes of each other, UTF-8 characters split across tokens, inactive steps), the
token byte tables against real tokenizers' decoding, the host-side cut, refused input and fixed shapes."""

from __future__ import annotations

import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hf_fixtures import byte_tokenizer

import jaxsr
from jaxsr.decoding.stops import StopStrings, advance, check_stops, cut, initial_tail, stop_strings
from jaxsr.jobs.config import JobConfig, load_job_config
from jaxsr.loading.gguf import smollm2_path

CHARS = "ab é€😀\n"
"""Characters of random texts: 1 to 4 UTF-8 bytes each, few enough that stop strings occur often."""


def random_text(rng: random.Random, low: int, high: int) -> str:
    return "".join(rng.choice(CHARS) for _ in range(rng.randint(low, high)))


def random_stops(rng: random.Random) -> list[str]:
    """1 to 6 stop strings, some a prefix or a suffix of another."""
    stops = [random_text(rng, 1, 4) for _ in range(rng.randint(1, 3))]
    for s in list(stops):
        if len(s) > 1 and rng.random() < 0.5:
            stops.append(rng.choice([s[1:], s[:-1]]))
    return stops


def random_rows(rng: random.Random, stops: list[str], rows: int):
    """A vocabulary of token byte strings (the first empty, as a special token's) and [rows, steps] tokens
    and activity: each row's active tokens spell random text with stop strings in it, cut anywhere into
    pieces of up to 6 bytes (so strings span tokens and characters split across them); inactive steps
    draw any token."""
    vocab: dict[bytes, int] = {b"": 0}
    steps: list[list[tuple[int | None, bool]]] = []
    for _ in range(rows):
        data = "".join(rng.choice(stops) if rng.random() < 0.1 else rng.choice(CHARS) for _ in range(30))
        data, row = data.encode(), []
        while data:
            if rng.random() < 0.2:
                row.append((None, False))
                continue
            size = rng.randint(0, 6) if rng.random() < 0.1 else rng.randint(1, 6)
            piece, data = data[:size], data[size:]
            row.append((vocab.setdefault(piece, len(vocab)), True))
        steps.append(row)
    length = max(map(len, steps))
    steps = [row + [(None, False)] * (length - len(row)) for row in steps]
    tokens = [[rng.randrange(len(vocab)) if t is None else t for t, _ in row] for row in steps]
    return list(vocab), tokens, [[a for _, a in row] for row in steps]


def with_pieces(stops: StopStrings, pieces: list[bytes]) -> StopStrings:
    """`stops` with its token table replaced by `pieces`."""
    table = np.zeros((len(pieces), 8), np.uint8)
    for i, piece in enumerate(pieces):
        table[i, : len(piece)] = list(piece)
    return stops.replace(token_bytes=jnp.asarray(table), token_length=jnp.array([len(p) for p in pieces]))


@jax.jit
def run_steps(stops: StopStrings, tokens: jax.Array, active: jax.Array) -> tuple[jax.Array, jax.Array]:
    """[T, B, window] tails and [T, B] hits of `advance` over [B, T] tokens, as the decode loop runs it."""

    def step(tail, inputs):
        tail, hit = advance(stops, tail, *inputs)
        return tail, (tail, hit)

    _, (tails, hits) = jax.lax.scan(step, initial_tail(stops, tokens.shape[0]), (tokens.T, active.T))
    return tails, hits


@pytest.mark.parametrize("seed", range(8))
def test_advance_matches_python(seed):
    rng = random.Random(seed)
    stops = random_stops(rng)
    rows = 8
    pieces, tokens, active = random_rows(rng, stops, rows)
    tables = with_pieces(stop_strings(byte_tokenizer(), 259, stops), pieces)
    tails, hits = map(np.asarray, run_steps(tables, jnp.array(tokens), jnp.array(active)))

    encoded = [s.encode() for s in stops]
    window = tables.window
    for b in range(rows):
        text, first = b"", None
        for t in range(len(tokens[b])):
            before = len(text)
            if active[b][t]:
                text += pieces[tokens[b][t]]
            # a stop string ends inside the bytes this step added
            ends_here = any(s in text[max(0, before - len(s) + 1) :] for s in encoded)
            assert hits[t, b] == (active[b][t] and ends_here), (b, t, text, stops)
            if first is None and any(s in text for s in encoded):
                first = t
            last = list(text[-window:]) if text else []
            assert tails[t, b].tolist() == [-1] * (window - len(last)) + last
        assert first == (int(np.argmax(hits[:, b])) if hits[:, b].any() else None)
    assert hits.sum() >= rows  # the streams hold stop strings


def test_inactive_rows_and_empty_tokens_keep_their_tail():
    tables = stop_strings(byte_tokenizer(), 259, ["ab"])
    a, b = (byte_tokenizer().convert_tokens_to_ids(c) for c in "ab")
    tail, _ = advance(tables, initial_tail(tables, 2), jnp.array([a, a]), jnp.array([True, True]))
    # row 0 is inactive, row 1 draws the special token 0 (no bytes): neither text changes
    same, no_hit = advance(tables, tail, jnp.array([b, 0]), jnp.array([False, True]))
    assert (np.asarray(same) == np.asarray(tail)).all() and not np.asarray(no_hit).any()
    _, both = advance(tables, same, jnp.array([b, b]), jnp.array([True, True]))
    assert np.asarray(both).tolist() == [True, True]


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    return jaxsr.load_model(smollm2_path()).tokenizer


def joined(stops: StopStrings, ids: list[int]) -> bytes:
    table, lengths = np.asarray(stops.token_bytes), np.asarray(stops.token_length)
    return b"".join(table[i, : lengths[i]].tobytes() for i in ids)


def test_byte_level_bpe_tables_match_decode(smollm2_tokenizer):
    tokenizer = smollm2_tokenizer
    vocab = len(tokenizer) + 3  # ids past the tokenizer's vocabulary add nothing
    stops = stop_strings(tokenizer, vocab, ["\n"])
    assert stops.token_bytes.shape[0] == vocab and stops.token_bytes.shape[1] % 8 == 0
    assert (np.asarray(stops.token_length)[len(tokenizer) :] == 0).all()
    special = sorted(i for i, t in tokenizer.added_tokens_decoder.items() if t.special)
    assert (np.asarray(stops.token_length)[special] == 0).all()

    def decode(ids):
        return tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    # ordinary tokens that are whole UTF-8 on their own, mixed with special ones
    whole = [i for i in range(len(tokenizer)) if _is_utf8(joined(stops, [i])) and i not in special]
    rng = random.Random(0)
    for _ in range(300):
        ids = [rng.choice(whole if rng.random() < 0.9 else special) for _ in range(rng.randint(1, 12))]
        assert joined(stops, ids).decode() == decode(ids), ids
    # texts whose characters split across tokens
    for _ in range(100):
        text = random_text(rng, 1, 30) + " Hello, world! ünïcödé 日本語"
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert joined(stops, ids).decode() == decode(ids) == text


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode()
    except UnicodeDecodeError:
        return False
    return True


def test_byte_tokenizer_tables():
    tokenizer = byte_tokenizer()
    stops = stop_strings(tokenizer, 259, ["x"])
    lengths = np.asarray(stops.token_length)
    assert lengths[:3].tolist() == [0, 0, 0] and (lengths[3:] == 1).all()
    assert sorted(np.asarray(stops.token_bytes)[3:, 0].tolist()) == list(range(256))
    rng = random.Random(1)
    for _ in range(50):
        text = random_text(rng, 1, 20)
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert joined(stops, ids).decode() == tokenizer.decode(ids, skip_special_tokens=True) == text


def sentencepiece_tokenizer():
    """A Llama-2-style SentencePiece tokenizer: '▁' pieces, '<0xNN>' byte fallback, the decoder's leading
    space stripped."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, normalizers

    vocab = [("<unk>", 0.0), ("<s>", 0.0), ("</s>", 0.0)] + [(f"<0x{b:02X}>", 0.0) for b in range(256)]
    vocab += [(p, -1.0) for p in ["▁", "▁a", "▁b", "ab", "ba", "a", "b", "é", "▁é", "€", "\n"]]
    backend = Tokenizer(models.Unigram(vocab, unk_id=0, byte_fallback=True))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )


def test_sentencepiece_tables():
    tokenizer = sentencepiece_tokenizer()
    stops = stop_strings(tokenizer, len(tokenizer), ["b"])
    assert np.asarray(stops.token_length)[:3].tolist() == [0, 0, 0]
    assert joined(stops, tokenizer.convert_tokens_to_ids(["<0x0A>", "▁a", "€"])) == "\n a€".encode()
    rng = random.Random(2)
    for _ in range(50):
        text = random_text(rng, 1, 20)
        ids = tokenizer.encode(text, add_special_tokens=True)
        # the decoder strips the space SentencePiece puts before the text; the token bytes keep it
        assert joined(stops, ids).decode() == " " + tokenizer.decode(ids, skip_special_tokens=True)
        assert tokenizer.decode(ids, skip_special_tokens=True) == text


def test_other_tokenizers_decode_token_by_token():
    """A vocabulary in neither scheme (here word-level): each token as `decode` writes it alone."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "[SEP]": 1, "a": 2, "bé": 3, "€!": 4}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="[UNK]", sep_token="[SEP]"
    )
    stops = stop_strings(tokenizer, 6, ["a"])
    assert [joined(stops, [i]) for i in range(6)] == [b"", b"", b"a", "bé".encode(), "€!".encode(), b""]


def reference_cut(text: str, stops: list[str]) -> tuple[str, str | None]:
    for at in range(len(text)):
        found = [s for s in stops if text.startswith(s, at)]
        if found:
            return text[:at], max(found, key=len)
    return text, None


def test_cut_matches_python():
    rng = random.Random(3)
    for _ in range(500):
        stops, text = random_stops(rng), random_text(rng, 0, 12)
        assert cut(text, stops) == reference_cut(text, stops), (text, stops)
    assert cut("ab", ["b", "ab"]) == ("", "ab")
    assert cut("no stop here", ["STOP", "\n"]) == ("no stop here", None)
    assert cut("text", []) == ("text", None)


@pytest.mark.parametrize(
    ("stops", "error", "message"),
    [
        ([""], ValueError, "stop: expected non-empty strings, got ''"),
        (["a", 3], TypeError, "stop: expected non-empty strings, got int"),
        (b"a", TypeError, "stop: expected a string or a list of strings, got bytes"),
        (3, TypeError, "stop: expected a string or a list of strings, got int"),
    ],
)
def test_bad_stops_refused(stops, error, message):
    with pytest.raises(error, match=message):
        stop_strings(byte_tokenizer(), 259, stops)
    with pytest.raises(error, match=message):
        cut("text", stops)


def test_one_string_is_a_list_of_one():
    """`stop="\\n"`, as vLLM and transformers take it, in the Python API and a job's config alike."""
    tokenizer = byte_tokenizer()
    one, listed = stop_strings(tokenizer, 259, "\n"), stop_strings(tokenizer, 259, ["\n"])
    assert jax.tree.all(jax.tree.map(lambda a, b: bool((a == b).all()), one, listed))
    assert cut("a line\nmore", "\n") == ("a line", "\n")


@pytest.mark.parametrize(
    ("text", "refused"),
    [('"\\n"', None), ('["\\n"]', None), ("''", "stop: expected non-empty strings"), ("3", "stop: expected")],
)
def test_a_jobs_stop_is_one_string_or_a_list(tmp_path, text, refused):
    path = tmp_path / "job.yaml"
    path.write_text(f"stop: {text}\n")
    if refused is not None:
        with pytest.raises(ValueError, match=refused):
            load_job_config(path)
        return
    config = load_job_config(path)
    assert config.stop == ["\n"] and config.fingerprint() == JobConfig(stop=["\n"]).fingerprint()


def test_a_lone_surrogate_is_refused_naming_its_key():
    """A lone surrogate has no UTF-8 bytes: no stop string can match it, and no job file or record's
    provenance can hold it (it once failed as "'utf-8' codec can't encode…", naming nothing)."""
    with pytest.raises(ValueError, match=r"^stop: not valid Unicode text"):
        check_stops(["ok", "\ud800"])
    for key, value in [("stop", ["\ud800"]), ("system_prompt", "be \udfff brief")]:
        with pytest.raises(ValueError, match=rf"^{key}: not valid Unicode text"):
            JobConfig(**{key: value})


def test_no_stops_and_no_tokenizer():
    assert stop_strings(None, 259, []) is None and stop_strings(byte_tokenizer(), 259, None) is None
    with pytest.raises(ValueError, match="stop: the model has no tokenizer"):
        stop_strings(None, 259, ["a"])


def test_shapes_come_from_a_ladder():
    tokenizer = byte_tokenizer()
    first = stop_strings(tokenizer, 259, ["a", "bc", "def"])
    second = stop_strings(tokenizer, 259, ["Answer:", "\n\n", "x", "yy"])
    shapes = [jax.tree.map(lambda x: (x.shape, x.dtype), s) for s in (first, second)]
    assert shapes[0] == shapes[1]
    assert first.strings.shape == (4, 8) and first.window == 7 and first.token_bytes.shape == (259, 8)
    assert np.asarray(first.lengths).tolist() == [1, 2, 3, 0]
    assert stop_strings(tokenizer, 259, ["a" * 9]).strings.shape == (1, 16)
