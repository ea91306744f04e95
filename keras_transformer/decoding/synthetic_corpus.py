"""The folder `back_translate` writes, and how a run in it resumes exactly.

The folder holds `train.{src_lang}` (the synthetic translations) and `train.{tgt_lang}` (the
monolingual lines), aligned line by line; `provenance.json`: what made it (the reverse
model's fingerprint, the input's hash, every option, the counts, the speed, the code version)
and whether it is `complete`; and `progress.json`: the lines done, the byte size of each file
after them, the counts and the sessions so far.

Resumption is exact: a folder is resumed only by a call whose options, model and input match
what its provenance records (`check_folder`); the files are cut back to the sizes
`progress.json` recorded (`cut_back`: a kill between an append and its record leaves extra
bytes); each chunk's lines are appended, flushed and fsynced (`append_pairs`) before
`progress.json` and `provenance.json` are replaced atomically. With each line's output a
function of the model, the options, the line and its number, a resumed run writes the same
bytes as one that was never interrupted. One process writes a folder at a time (`writing`,
its `.lock`), so a second command given the same folder is refused, not interleaved.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import hashlib
import json
import os
import platform
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from keras_transformer import run_directory
from keras_transformer.errors import UsageError
from pipelines import storage
from pipelines.textfiles import CorpusError, iter_text_lines

__all__ = ["FORMAT", "PROGRESS_FILE", "PROVENANCE_FILE", "BackTranslationError", "LineCounts",
           "append_pairs", "check_folder", "code_version", "cut_back", "file_sha256",
           "input_record", "open_folder", "read_provenance", "utc_now", "write_provenance"]

PROVENANCE_FILE = "provenance.json"
PROGRESS_FILE = "progress.json"
FORMAT = 1
_HASH_BLOCK = 8 << 20


class BackTranslationError(UsageError):
    """The output folder, the model or the options cannot be used as asked: one line saying
    what and how to fix it."""


@dataclasses.dataclass
class LineCounts:
    """What happened to the lines read (cumulative over resumed sessions)."""

    lines_read: int = 0
    pairs_written: int = 0
    empty_lines: int = 0                 # skipped: nothing to translate
    cleanup_dropped: int = 0             # "filter": lines dropped (either reason or both)
    lowercase_start: int = 0             # lines starting in lower case (kept, dropped or fixed)
    no_final_punctuation: int = 0        # lines without final punctuation (the same)
    cleanup_changed: int = 0             # "normalize": lines changed
    empty_translations: int = 0          # dropped: the translation was empty
    lines_translated: int = 0
    output_tokens: int = 0               # subword tokens the reverse model produced (no EOS)
    decode_seconds: float = 0.0
    flags: dict[str, int] = dataclasses.field(default_factory=dict)  # translate_batch's


def input_record(path: Path) -> dict[str, Any]:
    """The input's path, size, sha256 and line count (one validating pass: invalid UTF-8 or
    a broken gzip is reported before anything is translated)."""
    if not path.is_file():
        raise BackTranslationError(f"{path}: no such file (the monolingual text, one sentence "
                                   "per line, UTF-8, plain or .gz).")
    try:
        count = sum(1 for _ in iter_text_lines(path))
    except CorpusError as error:
        raise BackTranslationError(str(error)) from None
    fingerprint = {"sha256": file_sha256(path), "bytes": path.stat().st_size}
    return {"path": str(path.resolve()), "lines": count, "fingerprint": fingerprint}


def file_sha256(path: Path) -> str:
    """The sha256 of a file's bytes (hex), read in blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(_HASH_BLOCK):
            digest.update(block)
    return digest.hexdigest()


def _identity(record: dict) -> dict[str, Any]:
    """What fixes a folder's content, from its provenance: a resume must match it (not the
    paths: a moved model or input file is the same one)."""
    return {"format": record.get("format"), "src_lang": record.get("src_lang"),
            "tgt_lang": record.get("tgt_lang"), "cleanup": record.get("cleanup"),
            "model": (record.get("model") or {}).get("fingerprint"),
            "input": (record.get("input") or {}).get("fingerprint"),
            "decoding": record.get("decoding")}


def check_folder(out: Path, fixed: dict) -> None:
    """Refuses a file, a folder that is not a back-translation folder, or one made with other
    options (`_identity`; the model is compared when `fixed` has it)."""
    if out.exists() and not out.is_dir():
        raise BackTranslationError(f"{out} exists and is not a folder: pass another --out.")
    provenance_path = out / PROVENANCE_FILE
    if not provenance_path.is_file():
        if out.is_dir() and storage.holds_files(out):
            raise BackTranslationError(
                f"{out} is a non-empty folder without {PROVENANCE_FILE}: not a "
                "back-translation folder; pass a new or empty --out.")
        return
    recorded, wanted = _identity(_read_json(provenance_path)), _identity(
        json.loads(json.dumps(fixed)))
    if wanted["model"] is None:
        recorded["model"] = None
    differences = _differences(recorded, wanted)
    if differences:
        raise BackTranslationError(
            f"{out} was made with other options ({'; '.join(differences)}): run the same "
            "command as before to resume it, or pass a new --out for these options.")


@contextlib.contextmanager
def writing(out: Path) -> Iterator[None]:
    """Holds `out`'s lock (`storage.FolderLock`; the folder is created) while one process
    writes it.

    Raises:
        BackTranslationError: another process is writing the folder (naming it).
    """
    out.mkdir(parents=True, exist_ok=True)
    lock = storage.FolderLock(out)
    try:
        lock.acquire()
    except storage.FolderInUse as error:
        raise BackTranslationError(
            f"{error}: another back-translation is writing it. Wait for it to end (or stop "
            "it), then run this command again to resume; or pass another --out.") from None
    try:
        yield
    finally:
        lock.release()


def open_folder(out: Path, fixed: dict, started: str) -> dict[str, Any]:
    """The progress state of `out`: a new folder's (its provenance written first), or the
    recorded one after checking that it was made with the same `_identity`."""
    check_folder(out, fixed)
    if not (out / PROVENANCE_FILE).is_file():
        out.mkdir(parents=True, exist_ok=True)
        storage.write_json(out / PROVENANCE_FILE, {**fixed, "complete": False,
                                                   "started": started})
        return _new_state()
    storage.remove_stale_temporaries(out)
    progress_path = out / PROGRESS_FILE
    return _read_json(progress_path) if progress_path.is_file() else _new_state()


def _new_state() -> dict[str, Any]:
    return {"format": FORMAT, "lines_done": 0, "bytes": {}, "sessions": [],
            "counts": dataclasses.asdict(LineCounts())}


def read_provenance(out: Path) -> dict[str, Any]:
    """The folder's provenance.json (`BackTranslationError` when it is damaged)."""
    return _read_json(out / PROVENANCE_FILE)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return run_directory.read_json(path)
    except run_directory.DamagedFileError as error:
        raise BackTranslationError(f"{error} (or start again with a new --out)") from None


def _differences(recorded: Any, wanted: Any, where: str = "") -> list[str]:
    """'key: recorded X, now Y' for each value that differs (nested keys joined by dots)."""
    if isinstance(recorded, dict) and isinstance(wanted, dict):
        return [difference for key in sorted(set(recorded) | set(wanted))
                for difference in _differences(recorded.get(key), wanted.get(key),
                                               f"{where}.{key}" if where else key)]
    if recorded == wanted:
        return []
    return [f"{where or 'options'}: recorded {recorded!r}, now {wanted!r}"]


def cut_back(files: dict[str, Path], sizes: dict[str, int], out: Path) -> None:
    """Creates the files, or cuts them to the recorded sizes (bytes a killed run appended
    after its last progress record)."""
    for path in files.values():
        size = sizes.get(path.name, 0)
        if not path.exists():
            if size:
                raise BackTranslationError(
                    f"{path} is missing but {out / PROGRESS_FILE} records {size} bytes of it: "
                    "the folder was changed; start again with a new --out.")
            with storage.errors_about(path):
                path.touch()
            continue
        actual = path.stat().st_size
        if actual < size:
            raise BackTranslationError(
                f"{path} has {actual} bytes, {out / PROGRESS_FILE} records {size}: the file "
                "was cut or changed; start again with a new --out.")
        if actual > size:
            with storage.errors_about(path):
                os.truncate(path, size)
                storage.sync_file(path)
        sizes[path.name] = size


def append_pairs(files: dict[str, Path], pairs: list[tuple[str, str]], sizes: dict[str, int]):
    """Appends one line per pair to each file, flushed and fsynced; records the new sizes."""
    for side, path in enumerate(files.values()):  # src (synthetic), then tgt (genuine)
        data = "".join(pair[side] + "\n" for pair in pairs).encode("utf-8")
        with storage.errors_about(path, len(data)):
            with open(path, "ab") as handle:
                handle.write(data)
                handle.flush()
                os.fsync(handle.fileno())
        sizes[path.name] = sizes.get(path.name, 0) + len(data)


def write_provenance(out: Path, state: dict, fixed: dict, counts: LineCounts) -> dict:
    """provenance.json: what made the folder, and the progress so far (atomically)."""
    sessions = state["sessions"]
    seconds = counts.decode_seconds
    record = {
        **fixed,
        "complete": state["lines_done"] >= fixed["input"]["lines"],
        "lines_done": state["lines_done"],
        "counts": dataclasses.asdict(counts),
        "throughput": {
            "lines_per_second": round(counts.lines_translated / seconds, 2) if seconds else None,
            "output_tokens_per_second": (round(counts.output_tokens / seconds, 1)
                                         if seconds else None),
            "decode_seconds": round(seconds, 3),
            "machine": _machine(),
        },
        "started": read_provenance(out).get("started"),
        "finished": sessions[-1]["finished"],
        "code_version": sessions[-1]["code_version"],
        "sessions": sessions,
    }
    storage.write_json(out / PROVENANCE_FILE, record)
    return record


def utc_now() -> str:
    """The time now in UTC, ISO 8601 to the second."""
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def code_version() -> dict[str, Any]:
    """The package version and, from a git checkout, its commit and whether it was edited."""
    from importlib import metadata

    try:
        version = metadata.version("keras-transformer")
    except metadata.PackageNotFoundError:
        version = None
    record: dict[str, Any] = {"package": version, "git_commit": None, "git_dirty": None}
    root = Path(__file__).resolve().parents[2]
    if (root / ".git").exists():
        try:
            commit = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"],
                                    capture_output=True, text=True, timeout=10)
            status = subprocess.run(["git", "-C", str(root), "status", "--porcelain",
                                     "--untracked-files=no"],
                                    capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.SubprocessError):
            return record
        if commit.returncode == 0:
            record["git_commit"] = commit.stdout.strip()
            record["git_dirty"] = bool(status.stdout.strip()) if status.returncode == 0 else None
    return record


def _machine() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            cpu = next((line.split(":", 1)[1].strip() for line in handle
                        if line.startswith("model name")), cpu)
    except OSError:
        pass
    return {"cpu": cpu, "cpu_count": os.cpu_count(), "platform": platform.platform()}

