"""Inputs longer than the model takes are never cut silently: split, truncated or refused.

A line over `max_input_tokens` subword tokens (EOS included) is, as the caller asks:
- "split" (the default): cut into sentences (after `.`, `!`, `?`, `…` and closing quotes or
  brackets, before a space); a sentence that alone does not fit is cut between words. Each
  sentence (segment) is translated on its own, as the model was trained, and the outputs
  are joined with a space: still one output line per input line. Flagged "split".
- "truncate": its first tokens kept (EOS last). Flagged "truncated".
- "error": `InputTooLong` before anything is decoded, naming the line.
A single word longer than the limit (no space to cut at) is truncated, flagged "truncated".
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

__all__ = ["LONG_INPUT_MODES", "InputTooLong", "Segment", "segment_lines", "split_sentences"]

LONG_INPUT_MODES = ("split", "truncate", "error")
_SENTENCE_END = re.compile(r"(?<=[.!?…])[\"'”’»)\]]*\s+")

TokenCounter = Callable[[Sequence[str]], list[int]]


class InputTooLong(ValueError):
    """A line has more subword tokens than allowed and `long_inputs="error"` was asked."""

    def __init__(self, line: int, tokens: int, limit: int):
        self.line, self.tokens, self.limit = line, tokens, limit
        super().__init__(
            f"input line {line + 1} has {tokens} subword tokens (EOS included), more than "
            f"max_input_tokens={limit}; raise the limit, or have long inputs split into "
            f"sentences or truncated (long_inputs / --long-inputs).")


@dataclass
class Segment:
    """Text decoded on its own: a whole line or a piece of a long one."""

    line: int
    text: str
    flags: list[str] = field(default_factory=list)


def split_sentences(text: str) -> list[str]:
    """Sentences of `text`: cut after sentence-final punctuation followed by a space."""
    ends = [match.end() for match in _SENTENCE_END.finditer(text)]
    starts = [0, *ends]
    pieces = [text[start:end].strip() for start, end in zip(starts, [*ends, len(text)],
                                                              strict=True)]
    return [piece for piece in pieces if piece]


def _pack(units: list[str], counts: list[int], budget: int) -> list[str]:
    """Consecutive units joined by spaces into as few groups as fit `budget` tokens each
    (by the units' own counts; a unit over budget alone is a group)."""
    groups, current, used = [], [], 0
    for unit, count in zip(units, counts, strict=True):
        if current and used + count > budget:
            groups.append(" ".join(current))
            current, used = [], 0
        current.append(unit)
        used += count
    if current:
        groups.append(" ".join(current))
    return groups


def _split_line(text: str, count_tokens: TokenCounter, budget: int) -> list[str]:
    """One segment per sentence (a model trained on sentences translates several packed
    together badly: it tends to stop after the first few); a sentence over the budget is
    cut between words into as few segments as fit."""
    segments = []
    sentences = split_sentences(text)
    for sentence, count in zip(sentences, count_tokens(sentences), strict=True):
        if count <= budget:
            segments.append(sentence)
        else:
            words = sentence.split()
            segments += _pack(words, count_tokens(words), budget)
    return segments


def segment_lines(texts: Sequence[str], count_tokens: TokenCounter, max_input_tokens: int,
                  long_inputs: str = "split") -> tuple[list[Segment], list[list[str]]]:
    """The segments to decode for cleaned `texts`, and each line's flags.

    Args:
        texts: N cleaned lines (`search.clean_texts`); empty ones get no segment.
        count_tokens: subword tokens (without EOS) of each of a list of texts.
        max_input_tokens: the most tokens a segment may have, EOS included.
        long_inputs: "split", "truncate" or "error" (see the module docstring).

    Returns:
        (segments in line order, flags per line: "empty_input", "split", "truncated").

    Raises:
        InputTooLong: a line over the limit with long_inputs "error".
    """
    if long_inputs not in LONG_INPUT_MODES:
        raise ValueError(f"long_inputs must be one of {LONG_INPUT_MODES}, got {long_inputs!r}.")
    budget = max_input_tokens - 1  # EOS takes a place
    counts = count_tokens(texts)
    segments, flags = [], [[] for _ in texts]
    for line, (text, count) in enumerate(zip(texts, counts, strict=True)):
        if not text:
            flags[line].append("empty_input")
            continue
        if count <= budget:
            segments.append(Segment(line, text))
            continue
        if long_inputs == "error":
            raise InputTooLong(line, count + 1, max_input_tokens)
        if long_inputs == "truncate":
            flags[line].append("truncated")
            segments.append(Segment(line, text, ["truncated"]))
            continue
        parts = _split_line(text, count_tokens, budget)
        flags[line].append("split")
        for part, part_count in zip(parts, count_tokens(parts), strict=True):
            truncated = part_count > budget  # a single word over the limit
            if truncated and "truncated" not in flags[line]:
                flags[line].append("truncated")
            segments.append(Segment(line, part, ["truncated"] if truncated else []))
    return segments, flags
