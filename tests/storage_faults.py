"""A disk that fills up, for the tests of issue 27: a small tmpfs where this user may mount
one (root, as in CI's containers), else writes through `pipelines.storage` made to fail
as a full disk does (ENOSPC)."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import shutil
import subprocess
from pathlib import Path

from pipelines import storage


@contextlib.contextmanager
def small_filesystem(path: Path, size: int):
    """A tmpfs of `size` bytes mounted at `path` (yields True), or a plain folder where
    mounting is not permitted (False): the test then makes its write fail as on a full disk.
    Always unmounted afterwards."""
    path.mkdir(parents=True, exist_ok=True)
    mounted = shutil.which("mount") is not None and subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={-(-size // 4096) * 4}k", "tmpfs", str(path)],
        capture_output=True).returncode == 0
    try:
        yield mounted
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(path)], check=False)


def fill(folder: Path) -> None:
    """Writes `folder`/filler until the file system is full (ENOSPC)."""
    descriptor = os.open(folder / "filler", os.O_WRONLY | os.O_CREAT)
    try:
        while os.write(descriptor, bytes(4096)):
            pass
    except OSError as error:
        assert error.errno == errno.ENOSPC, error
    finally:
        os.close(descriptor)


def no_space_at_sync(monkeypatch, disk: Path) -> None:
    """Where no tmpfs can be mounted: every write through `pipelines.storage` into `disk`
    fails as on a full disk, once its temporary file is written."""
    original = storage.sync_file

    def sync_file(path):
        if Path(path).is_relative_to(disk):
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        original(path)

    monkeypatch.setattr(storage, "sync_file", sync_file)


def snapshot(folder: Path) -> dict[str, str]:
    """Relative path -> SHA-256 of every file under `folder`."""
    return {str(path.relative_to(folder)): hashlib.sha256(path.read_bytes()).hexdigest()
            for path in sorted(folder.rglob("*")) if path.is_file()}
