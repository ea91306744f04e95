"""What a translation returns: hypotheses with scores of an exact meaning, and line flags.

Scores (the same in the Python API, the command line, the SavedModel and CTranslate2):
- `log_prob`: the sum of the natural-log probabilities of the output tokens, EOS included
  when the output ended with it (`finished`); an output cut at the length limit has no EOS
  and none is scored. Subword tokens, not words; for sampled outputs, the model's
  probabilities (before temperature, top-k or top-p).
- `score`: what beam search ranks by, `log_prob / ((5 + length) / 6) ** alpha` (GNMT's length
  penalty, Wu et al. 2016; paper 6.1: alpha 0.6), with `length` the number of output tokens
  counted in `log_prob` (EOS included when finished). With alpha 0 it is `log_prob`.
- `token_log_probs` (on request): one per output token, EOS last when finished; they sum to
  `log_prob` (within float32 rounding: they come from one forced pass over the output,
  `decoding.forced`).
A forced target prefix is part of the output: its tokens' log-probabilities count.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from keras_transformer.decoding.alignment import format_pharaoh, piece_words

__all__ = ["FLAGS", "Hypothesis", "Translation", "line_translation", "penalized_score"]

# Line flags: what happened to a line on the way (docs/translating.md).
FLAGS = {
    "empty_input": "the line was empty (or only spaces): empty output, not decoded",
    "split": "longer than max_input_tokens: split into sentences, translated one by one, "
             "joined with spaces",
    "truncated": "longer than max_input_tokens: only its first tokens were translated",
    "length_limit": "the best output reached the output length limit without EOS",
    "target_truncated": "forced decoding: the given target was longer than max_output_tokens "
                        "and only its first tokens were scored",
    "retokenized": "a SavedModel's sampled or prefixed output, tokenized again, is not the "
                   "pieces the search produced: pieces, token log-probs and alignment are of "
                   "the text tokenized again (text, score and log_prob are the search's)",
}


def penalized_score(log_prob: float, length: int, alpha: float) -> float:
    """`log_prob / ((5 + length) / 6) ** alpha`: beam search's ranking score."""
    return float(log_prob / ((5.0 + length) / 6.0) ** alpha)


@dataclass
class Hypothesis:
    """One output of a line.

    Attributes:
        text: the detokenized output.
        score, log_prob: see the module docstring.
        finished: the output ended with EOS (False: cut at the length limit).
        pieces: the output's subword pieces (EOS not included).
        token_log_probs: per output token (EOS last when finished), if asked for.
        alignment: source-target word links (i, j), if asked for (`decoding.alignment`).
        attention: float32 (target tokens, source tokens) cross-attention behind the
            alignment (EOS rows/columns included), if an alignment was asked for.
    """

    text: str
    score: float
    log_prob: float
    finished: bool
    pieces: list[str]
    token_log_probs: list[float] | None = None
    alignment: list[tuple[int, int]] | None = None
    attention: np.ndarray | None = field(default=None, repr=False)

    def as_json(self) -> dict[str, Any]:
        """The JSONL fields of this hypothesis (attention is Python-only: too large)."""
        record = {"text": self.text, "score": _finite(self.score),
                  "log_prob": _finite(self.log_prob), "finished": self.finished,
                  "pieces": self.pieces}
        if self.token_log_probs is not None:
            record["token_log_probs"] = [_finite(value) for value in self.token_log_probs]
        if self.alignment is not None:
            record["alignment"] = format_pharaoh(self.alignment)
        return record


@dataclass
class Translation:
    """The result for one input line: hypotheses best first, and what happened to the line.

    Attributes:
        hypotheses: 1 to `num_hypotheses` outputs, best first (a line that was split has one).
        flags: names from `FLAGS`.
        source_pieces: the subword pieces decoded (EOS not included; a split line's
            segments one after another).
    """

    hypotheses: list[Hypothesis]
    flags: list[str]
    source_pieces: list[str]

    @property
    def text(self) -> str:
        """The best output."""
        return self.hypotheses[0].text

    def as_json(self, line: int, nbest: bool = False) -> dict[str, Any]:
        """One JSONL record: the best hypothesis' fields at the top, all of them in `nbest`
        when there are several or `nbest` asks for it (several were asked for: an empty or
        split line has one, and its record keeps the field readers look for)."""
        best = self.hypotheses[0].as_json()
        record = {"line": line, "translation": best.pop("text"), **best,
                  "flags": self.flags, "source_pieces": self.source_pieces}
        if nbest or len(self.hypotheses) > 1:
            record["nbest"] = [hypothesis.as_json() for hypothesis in self.hypotheses]
        return record


def line_translation(parts, flags: list[str], alpha: float, token_scores: bool,
                     alignment: bool) -> Translation:
    """One line's `Translation` from its decoded segments, whichever engine decoded them.

    Args:
        parts: [(segment number, hypotheses best first, source pieces)], in any order;
            empty for an empty line.
        flags: the line's flags so far (`decoding.long_inputs`).
        alpha: the length penalty of a split line's joined score.
        token_scores, alignment: whether the hypotheses carry token log-probs, alignments.
    """
    parts = sorted(parts, key=lambda part: part[0])  # decoded by length: back in text order
    if not parts:
        empty = Hypothesis("", 0.0, 0.0, True, [], [] if token_scores else None,
                           [] if alignment else None)
        return Translation([empty], list(flags), [])
    if len(parts) == 1:
        _, hypotheses, source_pieces = parts[0]
        best = hypotheses[0]
        flags = list(flags) + ([] if best.finished else ["length_limit"])
        return Translation(hypotheses, flags, source_pieces)
    return _joined(parts, flags, alpha, token_scores, alignment)


def _joined(parts, flags, alpha: float, token_scores: bool, alignment: bool) -> Translation:
    """A split line: the best hypotheses of its segments, one after another."""
    bests = [hypotheses[0] for _, hypotheses, _ in parts]
    length = sum(len(best.pieces) + int(best.finished) for best in bests)
    log_prob = sum(best.log_prob for best in bests)
    joined = Hypothesis(
        text=" ".join(best.text for best in bests if best.text),
        score=penalized_score(log_prob, length, alpha), log_prob=log_prob,
        finished=all(best.finished for best in bests),
        pieces=[piece for best in bests for piece in best.pieces])
    if token_scores:
        # One entry per piece, in order; the segments' EOS log-probs (each finished segment
        # ends with one) together in one last entry, so that they still sum to log_prob.
        joined.token_log_probs = [value for best in bests
                                  for value in best.token_log_probs[:len(best.pieces)]]
        if any(best.finished for best in bests):
            joined.token_log_probs.append(sum(best.token_log_probs[-1] for best in bests
                                              if best.finished))
    if alignment:
        links, source_offset, target_offset = [], 0, 0
        for (_, _, source_pieces), best in zip(parts, bests, strict=True):
            links += [(i + source_offset, j + target_offset) for i, j in best.alignment]
            source_offset += len(set(piece_words(source_pieces)))
            target_offset += len(set(piece_words(best.pieces)))
        joined.alignment = links
    flags = list(flags) + ([] if joined.finished else ["length_limit"])
    return Translation([joined], flags, [p for _, _, pieces in parts for p in pieces])


def _finite(value: float) -> float | None:
    """JSON has no infinities or NaN: None for those (never expected from a search)."""
    value = float(value)
    return round(value, 6) if math.isfinite(value) else None
