"""Reading and validating line-aligned parallel text files (``{split}.{lang}[.gz]``), as streams.

Every problem with the files becomes one :class:`CorpusError` that names the file, the
1-based line number where there is one, and how to fix it, so that a bad corpus fails
at load time instead of deep inside TensorFlow. Files are read line by line (gzip is
decompressed on the fly), so a corpus of any size is validated in one pass and
constant memory.
"""

from __future__ import annotations

import gzip
import logging
import re
import zlib
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

_LOG = logging.getLogger("pipelines")

# Language suffixes look like "de", "eng", "pt_br" or "zh-cn". README.md still matches;
# callers treat a split as parallel only when it has two or more languages.
_LANG_RE = re.compile(r"^[A-Za-z]{2,3}(?:[-_][A-Za-z0-9]{2,8})?$")
_READ_BUFFER = 1 << 20


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


def iter_text_lines(path: str | Path) -> Iterator[str]:
    """The sentences of a UTF-8 text file (plain or gzip-compressed), one per line, streamed.

    Lines are split at ``\\n`` only (other Unicode line breaks stay inside the text, so
    alignment cannot shift). A byte-order mark and the whitespace around each line (the
    ``\\r`` of CRLF files, stray spaces) are removed; the text and its inner whitespace
    are kept verbatim. Surrounding whitespace carries no content, and the in-graph
    sentencepiece decoder could not reproduce leading spaces anyway.

    Raises :class:`CorpusError` (while iterating) for an unreadable or corrupt file,
    invalid UTF-8 (with the 1-based line number) or an empty file.
    """
    path = Path(path)
    try:
        handle = open(path, "rb", buffering=_READ_BUFFER)  # noqa: SIM115 (closed below)
    except FileNotFoundError:
        raise CorpusError(f"{path}: file not found") from None
    except OSError as error:
        raise CorpusError(f"{path}: cannot be read ({error})") from None
    number = 0
    lines = handle
    try:
        # Sniff the gzip magic rather than trust the name: downloads get hashed names.
        if handle.peek(2)[:2] == b"\x1f\x8b" or path.name.endswith(".gz"):
            lines = gzip.GzipFile(fileobj=handle, mode="rb")
        for number, raw in enumerate(lines, start=1):  # noqa: B007 (number used after)
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                raise CorpusError(
                    f"{path}: line {number}: invalid UTF-8 (byte 0x{raw[error.start]:02x} at byte "
                    f"{error.start + 1} of the line); the corpus must be UTF-8: convert the file "
                    "(e.g. `iconv -f LATIN1 -t UTF-8`) or fix that line"
                ) from None
            if number == 1:
                text = text.removeprefix("\ufeff")
            yield text.strip()
    except (gzip.BadGzipFile, EOFError, zlib.error) as error:
        raise CorpusError(
            f"{path}: not a valid gzip file ({error}); re-download it, or gunzip/rename it"
        ) from None
    except OSError as error:
        raise CorpusError(f"{path}: cannot be read ({error})") from None
    finally:
        lines.close()
        handle.close()
    if number == 0:
        raise CorpusError(f"{path}: file is empty; it must hold one sentence per line")


def read_text_file(path: str | Path) -> list[str]:
    """All sentences of a text file (see :func:`iter_text_lines`), as a list."""
    return list(iter_text_lines(path))


def iter_aligned(
    columns: Mapping[str, Iterable[str]], names: Mapping[str, str], *, unit: str = "line",
    one_sided: bool = False,
) -> Iterator[tuple[str, ...]]:
    """Rows of parallel columns, checked in one streaming pass.

    ``columns`` maps a language to its sentences (any iterable, e.g.
    :func:`iter_text_lines`), ``names`` maps it to the file (or dataset) name used in
    messages, ``unit`` names an entry ("line", "example"). An entry counts as empty when
    it is only whitespace. Rows empty on *every* side carry no pair: they are skipped and
    counted in a warning at the end. With ``one_sided``, rows empty on some sides only are
    yielded too (for a reader that drops and counts them: ``--clean-train``).

    Yields:
      One tuple per row, in the order of ``columns``.

    Raises:
      CorpusError: while iterating, for columns of different lengths (naming every
        column's count) or an entry empty on some sides only (naming file and row).
    """
    langs = list(columns)
    iterators = [iter(columns[lang]) for lang in langs]
    blank = 0
    first_blank = 0
    index = 0
    while True:
        row = []
        for iterator in iterators:
            row.append(next(iterator, None))
        if any(text is None for text in row):
            if all(text is None for text in row):
                break
            counts = {
                lang: index + (text is not None) + sum(1 for _ in iterator)
                for lang, text, iterator in zip(langs, row, iterators, strict=True)
            }
            listing = ", ".join(
                f"{names[lang]} has {counts[lang]} {unit}{'' if counts[lang] == 1 else 's'}"
                for lang in langs
            )
            raise CorpusError(
                f"{unit} counts differ: {listing}; they must be aligned ({unit} i of each is a "
                "translation of the others): check for a truncated file or stray newlines"
            )
        index += 1
        empty = [not text.strip() for text in row]
        if any(empty):
            if all(empty):
                blank += 1
                first_blank = first_blank or index
                continue
            if one_sided:
                yield tuple(row)
                continue
            empty_names = [names[lang] for lang, e in zip(langs, empty, strict=True) if e]
            full_names = [names[lang] for lang, e in zip(langs, empty, strict=True) if not e]
            raise CorpusError(
                f"{', '.join(empty_names)}: {unit} {index} is empty but {unit} {index} of "
                f"{', '.join(full_names)} is not; fill in the missing translation or delete "
                f"that {unit} from every side"
            )
        yield tuple(row)
    if blank:
        _LOG.warning(
            "%s: dropped %d %s(s) blank on every side (first: %s %d)",
            ", ".join(names.values()), blank, unit, unit, first_blank,
        )
