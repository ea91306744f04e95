"""Reading and validating line-aligned parallel text files (``{split}.{lang}[.gz]``).

Every problem with the files becomes one :class:`CorpusError` that names the file, the
1-based line number where there is one, and how to fix it, so that a bad corpus fails
at load time instead of deep inside TensorFlow.
"""

from __future__ import annotations

import gzip
import logging
import re
import zlib
from collections.abc import Mapping
from pathlib import Path

_LOG = logging.getLogger("pipelines")

# Language suffixes look like "de", "eng", "pt_br" or "zh-cn". README.md still matches;
# callers treat a split as parallel only when it has two or more languages.
_LANG_RE = re.compile(r"^[A-Za-z]{2,3}(?:[-_][A-Za-z0-9]{2,8})?$")


class CorpusError(ValueError):
    """A parallel corpus is missing, malformed or misaligned.

    The message names the offending file (and 1-based line or example number where
    there is one) and says how to fix it.
    """


def find_parallel_files(folder: str | Path) -> dict[str, dict[str, Path]]:
    """Index the ``{split}.{lang}`` / ``{split}.{lang}.gz`` files of ``folder``.

    Returns ``{split: {lang: path}}`` for every split with at least one language file.
    Raises :class:`CorpusError` if the folder does not exist or a file is present both
    plain and gzipped (which one would be meant is ambiguous).
    """
    root = Path(folder)
    if not root.is_dir():
        raise CorpusError(
            f"{root}: corpus folder does not exist (or is not a directory); pass the folder "
            "holding the {split}.{lang} or {split}.{lang}.gz files"
        )
    index: dict[str, dict[str, Path]] = {}
    for path in sorted(root.iterdir()):
        if path.name.startswith(".") or not path.is_file():
            continue
        name = path.name[:-3] if path.name.endswith(".gz") else path.name
        split, dot, lang = name.rpartition(".")
        if not dot or not split or not _LANG_RE.match(lang):
            continue
        langs = index.setdefault(split, {})
        if lang in langs:
            raise CorpusError(
                f"{root}: both {langs[lang].name} and {path.name} exist; keep only one of them"
            )
        langs[lang] = path
    return index


def read_text_file(path: str | Path) -> list[str]:
    """Read a UTF-8 text file (plain or gzip-compressed), one sentence per line.

    Lines are split at ``\\n`` only (other Unicode line breaks stay inside the text, so
    alignment cannot shift). A byte-order mark and the whitespace around each line (the
    ``\\r`` of CRLF files, stray spaces) are removed; the text and its inner whitespace
    are kept verbatim. Surrounding whitespace carries no content, and the in-graph
    sentencepiece decoder could not reproduce leading spaces anyway.

    Raises :class:`CorpusError` for an unreadable or corrupt file, invalid UTF-8 (with
    the 1-based line number) or an empty file.
    """
    path = Path(path)
    try:
        data = path.read_bytes()
        # Sniff the gzip magic rather than trust the name: downloads get hashed names.
        if data[:2] == b"\x1f\x8b" or path.name.endswith(".gz"):
            data = gzip.decompress(data)
    except FileNotFoundError:
        raise CorpusError(f"{path}: file not found") from None
    except (gzip.BadGzipFile, EOFError, zlib.error) as error:
        raise CorpusError(
            f"{path}: not a valid gzip file ({error}); re-download it, or gunzip/rename it"
        ) from None
    except OSError as error:
        raise CorpusError(f"{path}: cannot be read ({error})") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        line = data.count(b"\n", 0, error.start) + 1
        column = error.start - (data.rfind(b"\n", 0, error.start) + 1) + 1
        raise CorpusError(
            f"{path}: line {line}: invalid UTF-8 (byte 0x{data[error.start]:02x} at byte "
            f"{column} of the line); the corpus must be UTF-8: convert the file (e.g. "
            "`iconv -f LATIN1 -t UTF-8`) or fix that line"
        ) from None
    text = text.removeprefix("\ufeff")
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()  # the final newline ends the last line; it does not start a new one
    if not lines:
        raise CorpusError(f"{path}: file is empty; it must hold one sentence per line")
    return [line.strip() for line in lines]


def validate_aligned(
    columns: Mapping[str, list[str]], names: Mapping[str, str], *, unit: str = "line"
) -> dict[str, list[str]]:
    """Check parallel columns for equal length and one-sided empty entries.

    ``columns`` maps a language to its sentences, ``names`` maps it to the file (or
    dataset) name used in messages, ``unit`` names an entry ("line", "example"). An
    entry counts as empty when it is only whitespace. Raises :class:`CorpusError` for
    mismatched counts or an entry empty on some sides only. Entries empty on *every*
    side carry no pair: they are dropped and counted in a warning.

    Returns:
      ``{lang: sentences}`` with those all-blank entries removed.
    """
    langs = list(columns)
    counts = {lang: len(columns[lang]) for lang in langs}
    if len(set(counts.values())) > 1:
        listing = ", ".join(
            f"{names[lang]} has {counts[lang]} {unit}{'' if counts[lang] == 1 else 's'}"
            for lang in langs
        )
        raise CorpusError(
            f"{unit} counts differ: {listing}; they must be aligned ({unit} i of each is a "
            "translation of the others): check for a truncated file or stray newlines"
        )
    blank: list[int] = []
    for index, row in enumerate(zip(*(columns[lang] for lang in langs), strict=True)):
        empty = [not text.strip() for text in row]
        if all(empty):
            blank.append(index)
        elif any(empty):
            empty_names = [
                names[lang] for lang, is_empty in zip(langs, empty, strict=True) if is_empty
            ]
            full_names = [
                names[lang] for lang, is_empty in zip(langs, empty, strict=True) if not is_empty
            ]
            raise CorpusError(
                f"{', '.join(empty_names)}: {unit} {index + 1} is empty but {unit} {index + 1} of "
                f"{', '.join(full_names)} is not; fill in the missing translation or delete "
                f"that {unit} from every side"
            )
    if not blank:
        return dict(columns)
    _LOG.warning(
        "%s: dropped %d %s(s) blank on every side (first: %s %d)",
        ", ".join(names.values()),
        len(blank),
        unit,
        unit,
        blank[0] + 1,
    )
    drop = set(blank)
    return {
        lang: [text for i, text in enumerate(lines) if i not in drop]
        for lang, lines in columns.items()
    }


def read_aligned(paths: Mapping[str, str | Path]) -> dict[str, list[str]]:
    """Read several line-aligned files, ``{lang: path}`` -> ``{lang: sentences}``.

    All validation of :func:`read_text_file` and :func:`validate_aligned` applies.
    """
    columns = {lang: read_text_file(path) for lang, path in paths.items()}
    return validate_aligned(columns, {lang: str(path) for lang, path in paths.items()})
