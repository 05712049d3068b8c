"""A deterministic, cheap stand-in for a tokenizer, and the filler text the simulated model writes.

A token is a run of up to four non-space characters (about what a BPE tokenizer averages on English
text); its id is a CRC of the piece, so prompts that share a text prefix share a token prefix, in
every process. Generated tokens are short English words, each exactly one token, so feeding a
reply back in a later prompt re-tokenizes to the same ids.
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Sequence

_PIECE = re.compile(r"\S{1,4}")
VOCAB_OFFSET = 1000  # ids below are left for special tokens
VOCAB_SPAN = 120_000

WORDS: tuple[str, ...] = (
    "the", "of", "and", "to", "in", "is", "it", "that", "for", "as", "with", "was", "on", "be", "at", "by",
    "this", "had", "not", "are", "but", "from", "or", "have", "an", "they", "one", "you", "were", "her",
    "all", "she", "we", "him", "been", "has", "when", "who", "will", "more", "no", "if", "out", "so",
    "said", "what", "up", "its", "into", "than", "them", "can", "only", "new", "some", "time", "two",
    "may", "then", "do", "any", "my", "now", "such", "like", "our", "over", "man", "me", "even", "most",
    "made", "also", "did", "many", "must", "back", "much", "your", "way", "well", "down", "each", "just",
    "how", "too", "good", "very", "make", "work", "long", "get", "here", "both", "life", "day", "same",
    "know", "last", "us", "old", "year", "off", "come", "go", "came", "take", "see", "few", "data",
)  # fmt: skip

_piece_ids: dict[str, int] = {}


def piece_id(piece: str) -> int:
    tid = _piece_ids.get(piece)
    if tid is None:
        tid = VOCAB_OFFSET + zlib.crc32(piece.encode()) % VOCAB_SPAN
        if len(_piece_ids) < 1_000_000:
            _piece_ids[piece] = tid
    return tid


def encode(text: str) -> tuple[int, ...]:
    return tuple(piece_id(p) for p in _PIECE.findall(text))


WORD_IDS: tuple[int, ...] = tuple(piece_id(w) for w in WORDS)
_STRIDE = 7  # coprime with len(WORDS): a reply cycles through every word


def output_token_ids(seed: int, start: int, stop: int) -> list[int]:
    return [WORD_IDS[(seed + k * _STRIDE) % len(WORDS)] for k in range(start, stop)]


def output_text(seed: int, start: int, stop: int) -> str:
    """Text of generated tokens ``start..stop-1``: words joined by single spaces."""
    words = [WORDS[(seed + k * _STRIDE) % len(WORDS)] for k in range(start, stop)]
    text = " ".join(words)
    return (" " + text) if start > 0 and words else text


def chat_prompt(messages: Sequence[tuple[str, str]]) -> str:
    """A Llama-3-like chat template: shared system prompts give shared prefixes."""
    parts = ["<|begin_of_text|>"]
    for role, content in messages:
        parts.append(f"<|start_header_id|>{role}<|end_header_id|>\n\n{content}<|eot_id|>")
    parts.append("<|start_header_id|>assistant<|end_header_id|>\n\n")
    return "".join(parts)
