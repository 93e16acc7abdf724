"""Stop strings, as vLLM defines them: a row stops once its generated text contains one of the strings, and
its text is cut before the earliest one. A string may span several tokens, or end inside a multi-byte
character split across tokens, so matching runs on the bytes each token adds to the decoded text.

Detection runs on device, one token at a time inside the jitted decode loop (no host sync there): each row
keeps the last `window` bytes of its text, and a new token hits when a stop string ends inside its bytes.
The tables have shapes from a small ladder, so different stop lists share one compiled program. The host
then cuts the decoded text (`cut`)."""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxsr.checks import check_unicode
from jaxsr.ladder import bucket

SPACE_PIECE = "\u2581"
"""SentencePiece's '▁': a space in the decoded text."""
BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")
"""SentencePiece's byte-fallback pieces: '<0x0A>' is the byte 0x0A."""


@struct.dataclass
class StopStrings:
    """Traced arrays (no static fields): what the device needs to find stop strings in generated text."""

    token_bytes: jax.Array  # [V, L] uint8: each token id's bytes as they appear in decoded text (zero-padded)
    token_length: jax.Array  # [V] int32: how many of those bytes are real (0 for special/unknown tokens)
    strings: jax.Array  # [S, M] uint8: the stop strings' UTF-8 bytes (zero-padded)
    lengths: jax.Array  # [S] int32: their byte lengths (0 for padding entries, which never match)

    @property
    def window(self) -> int:
        """Bytes of tail each row keeps: enough for the longest string to end in the next token."""
        return self.strings.shape[1] - 1


def check_stops(stops: Any) -> tuple[str, ...]:
    """`stops` as a tuple of distinct non-empty strings (None: none; one string: a list of one, as vLLM
    and transformers take it)."""
    if stops is None:
        return ()
    if isinstance(stops, str):
        stops = [stops]
    if isinstance(stops, bytes) or not isinstance(stops, Sequence):
        raise TypeError(f"stop: expected a string or a list of strings, got {type(stops).__name__}")
    for s in stops:
        if not isinstance(s, str):
            raise TypeError(f"stop: expected non-empty strings, got {type(s).__name__}")
        if not s:
            raise ValueError("stop: expected non-empty strings, got ''")
        check_unicode("stop", s)  # a lone surrogate has no bytes to match
    return tuple(dict.fromkeys(stops))


def stop_strings(tokenizer: Any, vocab_size: int, stops: Sequence[str]) -> StopStrings | None:
    """The device tables for `stops` (None for no stops). Shapes come from a ladder: S rounded up to a
    power of two, M to a multiple of 8; L is the tokenizer's longest token in bytes, rounded up to 8."""
    stops = check_stops(stops)
    if not stops:
        return None
    if tokenizer is None:
        raise ValueError("stop: the model has no tokenizer to decode text with")
    token_bytes, token_length = token_table(tokenizer, vocab_size)
    encoded = [s.encode() for s in stops]
    strings = np.zeros((bucket(len(encoded), 1), _round8(max(map(len, encoded)))), np.uint8)
    lengths = np.zeros(strings.shape[0], np.int32)
    for k, s in enumerate(encoded):
        strings[k, : len(s)] = np.frombuffer(s, np.uint8)
        lengths[k] = len(s)
    return StopStrings(*map(jnp.asarray, (token_bytes, token_length, strings, lengths)))


def _round8(n: int) -> int:
    return max(8, -(-n // 8) * 8)


@functools.lru_cache(maxsize=8)
def token_table(tokenizer: Any, vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """[V, L] uint8 bytes and [V] int32 lengths of what each token id adds to the decoded text (cached:
    a 128k vocabulary takes a moment)."""
    pieces = token_pieces(tokenizer, vocab_size)
    table = np.zeros((vocab_size, _round8(max(map(len, pieces), default=0))), np.uint8)
    for i, piece in enumerate(pieces):
        table[i, : len(piece)] = np.frombuffer(piece, np.uint8)
    return table, np.array([len(p) for p in pieces], np.int32)


def token_pieces(tokenizer: Any, vocab_size: int) -> list[bytes]:
    """Each token id's bytes in the decoded text: special tokens and ids the tokenizer lacks add none,
    other added tokens their content; the vocabulary's own tokens are read in its scheme (byte-level BPE,
    SentencePiece), or else decoded one by one."""
    tokens = tokenizer.convert_ids_to_tokens(list(range(vocab_size)))
    added = {i: t for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items() if i < vocab_size}
    special = set(tokenizer.all_special_ids) | {i for i, t in added.items() if t.special}
    regular = {i: t for i, t in enumerate(tokens) if t is not None and i not in added and i not in special}
    pieces = [b""] * vocab_size
    for i, t in added.items():
        pieces[i] = b"" if i in special else t.content.encode()
    for i, piece in _regular_pieces(tokenizer, regular).items():
        pieces[i] = piece
    return pieces


def _regular_pieces(tokenizer: Any, tokens: dict[int, str]) -> dict[int, bytes]:
    """The bytes of vocabulary tokens (by id), in the scheme their characters show."""
    chars = set().union(*tokens.values())
    alphabet = byte_alphabet()
    if "Ġ" in chars and chars <= alphabet.keys():  # GPT-2's byte-level alphabet ('Ġ' is a space)
        return {i: bytes(alphabet[c] for c in t) for i, t in tokens.items()}
    if SPACE_PIECE in chars:
        return {i: _sentencepiece_bytes(t) for i, t in tokens.items()}
    texts = tokenizer.batch_decode([[i] for i in tokens], skip_special_tokens=True)
    return {i: text.encode() for i, text in zip(tokens, texts, strict=True)}


def _sentencepiece_bytes(token: str) -> bytes:
    if match := BYTE_PIECE.fullmatch(token):
        return bytes([int(match[1], 16)])
    return token.replace(SPACE_PIECE, " ").encode()


@functools.cache
def byte_alphabet() -> dict[str, int]:
    """GPT-2's `bytes_to_unicode`, inverted: printable Latin-1 bytes stand for themselves, the other bytes
    (space, control characters) for chr(256), chr(257), ... in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)]
    others = sorted(set(range(256)) - set(printable))
    return {chr(b): b for b in printable} | {chr(256 + k): b for k, b in enumerate(others)}


def initial_tail(stops: StopStrings, rows: int) -> jax.Array:
    """[rows, window] int32 of -1: no text yet."""
    return jnp.full((rows, stops.window), -1, jnp.int32)


def advance(
    stops: StopStrings, tail: jax.Array, tokens: jax.Array, active: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """Append token `tokens[b]`'s bytes to each active row's text: the new [B, window] tail (the text's last
    bytes, -1 before its start) and [B] bool hits (a stop string ends inside the added bytes). Inactive
    rows keep their tail and do not hit."""
    m, width = stops.strings.shape[1], stops.token_bytes.shape[1]
    n = jnp.where(active, stops.token_length[tokens], 0)  # [B] bytes added
    added = jnp.where(jnp.arange(width) < n[:, None], stops.token_bytes[tokens].astype(jnp.int32), -1)
    text = jnp.concatenate([tail, added], axis=1)  # [B, window + L]: the tail, then the added bytes
    # ends[b, p, k]: the m bytes of text ending at the p-th added byte
    ends = text[:, jnp.arange(width)[:, None] + jnp.arange(m)]
    # each string right-aligned in m bytes, and which of those bytes it has
    shift = m - stops.lengths[:, None]  # [S, 1]
    right = jnp.take_along_axis(stops.strings.astype(jnp.int32), jnp.maximum(jnp.arange(m) - shift, 0), 1)
    used = jnp.arange(m) >= shift
    # a string ending past the added bytes would end on a -1, which no byte equals
    found = jnp.all((ends[:, :, None, :] == right) | ~used, axis=-1) & (stops.lengths > 0)  # [B, L, S]
    hit = jnp.any(found, axis=(1, 2))
    new_tail = jnp.take_along_axis(text, n[:, None] + jnp.arange(stops.window), axis=1)
    return new_tail, hit


def cut(text: str, stops: Sequence[str]) -> tuple[str, str | None]:
    """`text` cut before the earliest stop string (on a tie, the longer one), and that string (None when
    none occurs: `text` is returned whole)."""
    found = [(at, -len(s), s) for s in check_stops(stops) if (at := text.find(s)) >= 0]
    if not found:
        return text, None
    at, _, stop = min(found)
    return text[:at], stop
