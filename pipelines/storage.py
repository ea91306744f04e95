"""Files written so that a kill or a full disk never leaves half of one.

Every file the project writes (prepared shards and manifests, tokenizers, a run's config,
checkpoints, backups, results, exports) goes through here: it is written under a temporary
name beside its destination, flushed and fsynced, renamed over the destination, and the
folder is fsynced, so that after a kill or a power loss a reader finds the old file or the
new one, never a part (Orbax and `tf.train.CheckpointManager` finalize a step the same way).
A folder of files that belong together is built as a temporary sibling, fsynced file by file
(`sync_tree`) and renamed into place last (`replace_folder`).

A write that fails because of the storage — no space left (ENOSPC), a quota (EDQUOT), a
read-only (EROFS) or failing (EIO) disk — raises `StorageError`, one sentence naming the
path, the bytes it needed and what is free; the temporary file is removed and the
destination is untouched. The lowest layer of the project: `pipelines` and
`keras_transformer` both write through it, and it imports neither.

One process writes a folder at a time: `FolderLock` takes an exclusive `flock` on the
folder's `.lock` file, which the kernel drops when the process ends, however it ends (a
`kill -9` or a lost container too), so a lock never outlives its process and never blocks
the resume that follows.
"""

from __future__ import annotations

import contextlib
import errno
import glob
import json
import logging
import os
import secrets
import shutil
import socket
import stat
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["LOCK_FILE", "FolderInUse", "FolderLock", "StorageError", "checksum",
           "errors_about", "file_checksum", "folder_bytes", "holds_files",
           "remove_stale_temporaries", "replace_folder", "replacing", "staging_folder",
           "storage_error",
           "sync_file", "sync_tree", "write_bytes", "write_json", "write_text"]

# Failures of the storage, not of the input: free space or fix the disk, then run again.
STORAGE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EROFS})
_REASONS = {errno.ENOSPC: "no space left on the device", errno.EDQUOT: "disk quota exceeded",
            errno.EROFS: "read-only file system", errno.EIO: "input/output error (a failing disk?)"}
# C libraries (HDF5, TensorFlow) report errno 28 inside their own messages.
_MESSAGES = {"No space left on device": errno.ENOSPC, "Disk quota exceeded": errno.EDQUOT,
             "Read-only file system": errno.EROFS, "Input/output error": errno.EIO}
_CHUNK = 8 << 20
_LOG = logging.getLogger("pipelines")
TEMPORARY_PREFIX = ".tmp-"
LOCK_FILE = ".lock"


class StorageError(OSError):
    """Writing `path` failed because of the storage (full, over quota, read-only, failing).

    Nothing was half-written: the file being written was removed and what was on disk
    before is untouched. Free space (or fix the disk) and run the same command again.

    Attributes:
        path: the file or folder being written.
        needed: bytes the write needed (None: unknown).
        free: bytes free on that file system when it failed (None: unknown).
    """

    def __init__(self, code: int, path: str | os.PathLike, needed: int | None = None):
        self.path, self.needed = Path(path), needed
        self.free = _free_bytes(self.path)
        sizes = []
        if needed is not None:
            sizes.append(f"{_size(needed)} needed")
        if self.free is not None:
            sizes.append(f"{_size(self.free)} free")
        detail = f" ({', '.join(sizes)})" if sizes else ""
        super().__init__(code, f"{_REASONS.get(code, os.strerror(code))} writing {self.path}"
                         f"{detail}; nothing was half-written: free space (or fix the disk) "
                         "and run the same command again", str(self.path))

    def __str__(self) -> str:
        return self.strerror


def storage_error(error: BaseException, path: str | os.PathLike,
                  needed: int | None = None) -> StorageError | None:
    """`error` as a `StorageError` about `path`, if it is a failure of the storage (by its
    errno, or by the errno text a C library put into its message); otherwise None."""
    if isinstance(error, StorageError):
        return error
    code = getattr(error, "errno", None)
    if code not in STORAGE_ERRNOS:
        text = str(error)
        code = next((number for message, number in _MESSAGES.items() if message in text), None)
    return StorageError(code, path, needed) if code is not None else None


@contextlib.contextmanager
def errors_about(path: str | os.PathLike, needed: int | None = None) -> Iterator[None]:
    """Within it, a failure of the storage (see `storage_error`) is raised as a
    `StorageError` about `path`; other errors pass unchanged."""
    try:
        yield
    except Exception as error:
        failure = storage_error(error, path, needed)
        if failure is None or failure is error:
            raise
        raise failure from None


@contextlib.contextmanager
def replacing(path: str | os.PathLike, needed: int | None = None) -> Iterator[Path]:
    """Yields a temporary path to write `path`'s new content to; on leaving, the content
    is fsynced and renamed over `path` (and the folder fsynced).

    A symbolic link is followed (the file it points to is replaced); a device or a pipe
    (`/dev/stdout`) is written in place.

    Args:
        path: the destination file; its folder must exist.
        needed: the bytes the write needs, for the message of a full disk.

    Raises:
        StorageError: the storage failed (the temporary file is removed, `path` untouched).
    """
    path = Path(path)
    if path.is_symlink():
        path = path.resolve()  # replace the file it points to, not the link
    if path.exists() and not path.is_file():  # /dev/stdout, a pipe: written in place
        with errors_about(path, needed):
            yield path
        return
    temporary = path.with_name(f"{TEMPORARY_PREFIX}{os.getpid()}-{path.name}")
    with errors_about(path, needed):
        try:
            yield temporary
            sync_file(temporary)
            if path.exists():  # keep the permissions of the file it replaces
                os.chmod(temporary, stat.S_IMODE(path.stat().st_mode))
            os.replace(temporary, path)
            _sync_folder(path.parent)
        except BaseException:
            with contextlib.suppress(OSError):
                temporary.unlink()
            raise


def write_bytes(path: str | os.PathLike, data: bytes | memoryview) -> None:
    """Writes `data` to `path` durably and atomically (see `replacing`)."""
    with replacing(path, needed=len(data)) as temporary, open(temporary, "wb") as handle:
        handle.write(data)


def write_text(path: str | os.PathLike, text: str) -> None:
    """Writes `text` (UTF-8) to `path` durably and atomically."""
    write_bytes(path, text.encode("utf-8"))


def write_json(path: str | os.PathLike, data: Any, indent: int = 2) -> None:
    """Writes `data` as JSON (sorted keys) to `path` durably and atomically."""
    write_text(path, json.dumps(data, indent=indent, sort_keys=True) + "\n")


def sync_file(path: str | os.PathLike) -> None:
    """Flushes a written file's data to the disk (fsync)."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _sync_folder(path: Path) -> None:
    """Makes a rename or a new file in folder `path` durable (fsync of the folder)."""
    try:
        descriptor = os.open(path, os.O_RDONLY)
    except OSError:
        return  # e.g. a platform without folder descriptors
    try:
        os.fsync(descriptor)
    except OSError as error:
        if error.errno in STORAGE_ERRNOS:
            raise
    finally:
        os.close(descriptor)


def sync_tree(folder: str | os.PathLike) -> None:
    """fsyncs every file and folder under `folder` (a staging folder before its rename)."""
    folder = Path(folder)
    for root, _, files in os.walk(folder):
        for name in sorted(files):
            sync_file(Path(root) / name)
        _sync_folder(Path(root))


def staging_folder(parent: str | os.PathLike, prefix: str) -> Path:
    """A new, empty folder `parent/<prefix><random>` to build a folder in before
    `replace_folder` moves it into place. Made by `mkdir`, so it gets the permissions any
    folder of this user gets (the umask's: 0755 by default, 0700 under a strict umask);
    `tempfile.mkdtemp`'s fixed 0700 would keep the other users of a shared export or
    prepared folder (a TF Serving user) out."""
    while True:
        folder = Path(parent) / f"{prefix}{secrets.token_hex(4)}"
        try:
            folder.mkdir()
            return folder
        except FileExistsError:  # another process drew the same name: draw again
            continue


def replace_folder(staging: str | os.PathLike, folder: str | os.PathLike,
                   synced: bool = False) -> None:
    """Moves a complete staging folder to `folder` (which must not exist, or be empty),
    after fsyncing its content (unless `synced`: its files were written with `replacing`),
    then fsyncs the parent: readers see all of it or nothing."""
    staging, folder = Path(staging), Path(folder)
    try:
        if synced:
            _sync_folder(staging)
        else:
            sync_tree(staging)
        if folder.is_dir() and not any(folder.iterdir()):
            folder.rmdir()
        os.replace(staging, folder)
        _sync_folder(folder.parent)
    except OSError as error:
        failure = storage_error(error, folder, needed=folder_bytes(staging))
        if failure is not None:
            raise failure from None
        raise


def checksum(data: bytes | memoryview, previous: int = 0) -> int:
    """CRC-32 of `data` (continuing `previous`): 4 GB/s here, far above what training reads."""
    return zlib.crc32(data, previous)


def file_checksum(path: str | os.PathLike) -> int:
    """CRC-32 of a file's content, read in chunks."""
    value, buffer = 0, bytearray(_CHUNK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as handle:
        # One reused buffer: twice as fast as a new bytes object per chunk.
        while count := handle.readinto(buffer):
            value = zlib.crc32(view[:count], value)
    return value


def folder_bytes(folder: str | os.PathLike) -> int:
    """Bytes of the files under `folder` (0 if it is gone), e.g. what a failed write wrote."""
    total = 0
    for root, _, files in os.walk(folder):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.path.getsize(os.path.join(root, name))
    return total


def _free_bytes(path: Path) -> int | None:
    for folder in (path, *path.parents):
        if folder.exists():
            try:
                return shutil.disk_usage(folder).free
            except OSError:
                return None
    return None


def _size(count: int) -> str:
    for unit in ("bytes", "KB", "MB", "GB"):
        if count < 1024 or unit == "GB":
            return f"{count:,} {unit}" if unit == "bytes" else f"{count:.1f} {unit}"
        count /= 1024
    return f"{count:.1f} TB"


def remove_stale_temporaries(folder: str | os.PathLike, prefix: str = TEMPORARY_PREFIX) -> None:
    """Removes the temporary files and folders that killed processes left in `folder`.

    Args:
        folder: where to look.
        prefix: the temporaries' names are `<prefix><pid>-...` (`replacing` makes
            `.tmp-<pid>-<name>`); a prefix naming the host keeps other hosts' alone on a
            shared filesystem, whose processes cannot be seen from here.

    A temporary is stale when its process is gone, or is this process (which has not made
    its own yet: a container restarted under the same pid); those of live processes stay.
    """
    folder = Path(folder)
    if not folder.is_dir():
        return
    for leftover in folder.glob(f"{glob.escape(prefix)}*"):
        pid = leftover.name[len(prefix):].split("-", 1)[0]
        if pid.isdigit() and (int(pid) == os.getpid() or not _alive(int(pid))):
            if leftover.is_dir():
                shutil.rmtree(leftover, ignore_errors=True)
            else:
                leftover.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def holds_files(folder: str | os.PathLike) -> bool:
    """True if `folder` holds anything besides temporaries of killed writes and its lock
    file: the test of an empty output folder."""
    return any(not entry.name.startswith(TEMPORARY_PREFIX) and entry.name != LOCK_FILE
               for entry in Path(folder).iterdir())


class FolderInUse(RuntimeError):
    """Another live process holds the lock of the folder (`FolderLock.acquire`).

    Attributes:
        folder: the folder.
        holder: what the holder wrote in the lock file ("pid N on HOST since TIME"), or "".
    """

    def __init__(self, folder: Path, holder: str):
        self.folder, self.holder = folder, holder
        super().__init__(f"{folder} is in use by another process"
                         + (f" ({holder})" if holder else ""))


class FolderLock:
    """One writer per folder: an exclusive, non-blocking `flock` on `<folder>/.lock`.

    Two commands given the same output folder (a training run started twice, a resume while
    the first run still lives) would otherwise interleave their checkpoints and appends.
    The kernel releases the lock when its process ends, however it ends, so a killed run's
    lock never blocks the resume. Locks conflict between processes, also on NFS (where Linux
    makes `flock` a POSIX lock; within one process those do not conflict, so each process
    takes a folder's lock once). Where locks cannot be had — no `fcntl` (Windows), a file
    system without them (ENOLCK, ENOSYS, EOPNOTSUPP), a folder this process may not write to
    — `acquire` logs why and goes on unlocked: one writer is then the user's to ensure. The
    lock file stays, empty once released; `holds_files` does not count it. Files Python
    opens are not inherited by child processes (PEP 446), so a subprocess does not hold its
    parent's lock.

    Use `with FolderLock(folder):`, or `acquire()` and `release()` (both idempotent).
    """

    def __init__(self, folder: str | os.PathLike):
        self.folder = Path(folder)
        self._descriptor: int | None = None

    @property
    def held(self) -> bool:
        return self._descriptor is not None

    def acquire(self) -> None:
        """Takes the lock, creating `.lock` in the (existing) folder.

        Raises:
            FolderInUse: another process holds it (naming that process).
            StorageError: the lock file cannot be created on a full or failing disk.
        """
        if self._descriptor is not None:
            return
        try:
            import fcntl
        except ImportError:
            return
        descriptor = self._open(self.folder / LOCK_FILE)
        if descriptor is None:
            return
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as error:
            holder = ""
            with contextlib.suppress(OSError):
                holder = os.pread(descriptor, 4096, 0).decode("utf-8", "replace").strip()
            os.close(descriptor)
            if error.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise FolderInUse(self.folder, holder) from None
            _LOG.warning("%s: no lock (%s): make sure no other process writes there",
                         self.folder, os.strerror(error.errno or 0))
            return
        self._descriptor = descriptor
        holder = (f"pid {os.getpid()} on {socket.gethostname()} since "
                  f"{time.strftime('%Y-%m-%d %H:%M:%S %Z')}")
        with contextlib.suppress(OSError):  # who holds it, for another process's refusal
            os.ftruncate(descriptor, 0)
            os.pwrite(descriptor, holder.encode() + b"\n", 0)

    def _open(self, path: Path) -> int | None:
        """The lock file's descriptor (read-write, else read-only: `flock` needs neither
        mode in particular), or None where this process can do neither (logged)."""
        try:  # a full or failing disk: `StorageError`, as any other write of the project
            with errors_about(path):
                return os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        except OSError as error:
            if error.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
                raise
            try:
                return os.open(path, os.O_RDONLY)
            except OSError:
                _LOG.warning("%s: no lock (%s)", self.folder, os.strerror(error.errno))
                return None

    def release(self) -> None:
        """Lets the lock go (closing the file releases the `flock`); the file is emptied
        first, so that it names only a live holder (a killed one's line is overwritten)."""
        if self._descriptor is not None:
            with contextlib.suppress(OSError):
                os.ftruncate(self._descriptor, 0)
            os.close(self._descriptor)
            self._descriptor = None

    def __enter__(self) -> FolderLock:
        self.acquire()
        return self

    def __exit__(self, *exc_info) -> None:
        self.release()
