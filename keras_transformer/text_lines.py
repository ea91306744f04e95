"""Lines in and out for the `translate` and `force_decode` commands: any bytes in, one output
line per input line, written whole or not at all."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pipelines import storage

__all__ = ["LineError", "jsonl", "read_lines", "single_line", "write_lines"]


class LineError(Exception):
    """An input file cannot be read, or two files do not have the same number of lines."""


def read_lines(source: str | None, what: str = "--input") -> list[bytes]:
    """The lines of `source` (stdin if None) as bytes (the model copes with any encoding),
    without line ends."""
    if source is None:
        data = sys.stdin.buffer.read()
    else:
        try:
            data = Path(source).read_bytes()
        except OSError as error:
            raise LineError(f"cannot read {what} {source}: {error.strerror}") from None
    lines = data.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    return [line.removesuffix(b"\r") for line in lines]


def single_line(text: str) -> str:
    """`text` on one line: an output must not break the line-to-line correspondence."""
    return " ".join(text.splitlines())


def jsonl(records: Sequence[dict[str, Any]]) -> list[str]:
    """One compact JSON object per record (UTF-8, not ASCII-escaped)."""
    return [json.dumps(record, ensure_ascii=False) for record in records]


def write_lines(lines: Sequence[str], output: str | None) -> None:
    """`lines` to `output` (atomically: the old file or all of the new one) or stdout."""
    text = "".join(line + "\n" for line in lines)
    if output:
        storage.write_text(output, text)
    else:
        sys.stdout.buffer.write(text.encode("utf-8"))
        sys.stdout.flush()
