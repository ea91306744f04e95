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

from keras_transformer.decoding.alignment import format_pharaoh

__all__ = ["FLAGS", "Hypothesis", "Translation", "penalized_score"]

# Line flags: what happened to a line on the way (docs/translating.md).
FLAGS = {
    "empty_input": "the line was empty (or only spaces): empty output, not decoded",
    "split": "longer than max_input_tokens: split into sentences, translated one by one, "
             "joined with spaces",
    "truncated": "longer than max_input_tokens: only its first tokens were translated",
    "length_limit": "the best output reached the output length limit without EOS",
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

    def as_json(self, line: int) -> dict[str, Any]:
        """One JSONL record: the best hypothesis' fields at the top, all of them in `nbest`."""
        best = self.hypotheses[0].as_json()
        record = {"line": line, "translation": best.pop("text"), **best,
                  "flags": self.flags, "source_pieces": self.source_pieces}
        if len(self.hypotheses) > 1:
            record["nbest"] = [hypothesis.as_json() for hypothesis in self.hypotheses]
        return record


def _finite(value: float) -> float | None:
    """JSON has no infinities or NaN: None for those (never expected from a search)."""
    value = float(value)
    return round(value, 6) if math.isfinite(value) else None
