"""`pipelines.storage`: a file is replaced whole or not at all, a full disk is a
`StorageError` naming the path, and killed writers' temporaries are cleaned up."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipelines import storage


def test_a_writer_that_dies_midway_leaves_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "results.json"
    storage.write_json(path, {"bleu": 41.0})

    class Killed(Exception):
        pass

    with pytest.raises(Killed), storage.replacing(path) as temporary:
        temporary.write_text('{"bleu": 4')  # half of the new content
        raise Killed
    assert path.read_text() == '{\n  "bleu": 41.0\n}\n'
    assert [p.name for p in tmp_path.iterdir()] == ["results.json"]


def test_a_full_disk_is_a_storage_error_naming_the_file_and_the_bytes(tmp_path, monkeypatch):
    original = storage.sync_file

    def no_space(path):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(storage, "sync_file", no_space)
    with pytest.raises(storage.StorageError) as raised:
        storage.write_bytes(tmp_path / "ckpt.weights.h5", bytes(3000))
    monkeypatch.setattr(storage, "sync_file", original)
    error = raised.value
    assert error.errno == errno.ENOSPC and error.path == tmp_path / "ckpt.weights.h5"
    assert str(error).startswith(f"no space left on the device writing {tmp_path}/ckpt")
    assert "2.9 KB needed" in str(error) and "free space" in str(error)
    assert list(tmp_path.iterdir()) == []
    # A C library's error carrying the errno text is one too; other errors are not.
    assert storage.storage_error(RuntimeError("write failed, errno = 28, error message = "
                                              "'No space left on device'"), tmp_path).errno \
        == errno.ENOSPC
    assert storage.storage_error(PermissionError(errno.EACCES, "denied"), tmp_path) is None


def test_links_are_followed_devices_written_in_place_and_permissions_kept(tmp_path):
    target = tmp_path / "out.txt"
    target.write_text("old")
    target.chmod(0o640)
    link = tmp_path / "link.txt"
    link.symlink_to(target)
    storage.write_text(link, "new")
    assert link.is_symlink() and target.read_text() == "new"
    assert target.stat().st_mode & 0o777 == 0o640
    storage.write_text("/dev/null", "discarded")  # not replaced by a regular file
    assert not os.path.isfile("/dev/null")


def test_temporaries_of_dead_processes_are_removed_those_of_live_ones_kept(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    (tmp_path / f".tmp-{dead}-ckpt.weights.h5").write_bytes(b"half")
    (tmp_path / f".tmp-{dead}-step-00000020").mkdir()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        (tmp_path / f".tmp-{live.pid}-state.json").write_text("{")
        storage.remove_stale_temporaries(tmp_path)
        assert [p.name for p in tmp_path.iterdir()] == [f".tmp-{live.pid}-state.json"]
    finally:
        live.kill()
        live.wait()


def test_a_folder_lock_refuses_a_second_writer_naming_the_first(tmp_path):
    first = storage.FolderLock(tmp_path)
    first.acquire()
    first.acquire()  # idempotent
    assert first.held
    # flock locks belong to open files: a second one in this process conflicts as another
    # process's would.
    with pytest.raises(storage.FolderInUse, match=rf"{tmp_path} is in use by another process "
                       rf"\(pid {os.getpid()} on .+ since "):
        storage.FolderLock(tmp_path).acquire()
    first.release()
    assert (tmp_path / storage.LOCK_FILE).read_text() == ""  # names only a live holder
    with storage.FolderLock(tmp_path) as second:
        assert second.held
    assert not second.held


def test_a_killed_holder_never_blocks_the_next_writer(tmp_path):
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from pipelines import storage; "
         "storage.FolderLock(sys.argv[1]).acquire(); print('held', flush=True); time.sleep(60)",
         str(tmp_path)],
        stdout=subprocess.PIPE, text=True, cwd=Path(__file__).parents[2],
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])})
    try:
        assert holder.stdout.readline() == "held\n"
        with pytest.raises(storage.FolderInUse, match=rf"\(pid {holder.pid} on "):
            storage.FolderLock(tmp_path).acquire()
    finally:
        holder.kill()  # SIGKILL: no cleanup of its own runs
        holder.wait()
    with storage.FolderLock(tmp_path) as lock:
        assert lock.held
        assert f"pid {os.getpid()} on " in (tmp_path / storage.LOCK_FILE).read_text()


def test_only_real_files_make_a_folder_non_empty(tmp_path):
    with storage.FolderLock(tmp_path):
        (tmp_path / ".tmp-123-config.json").write_text("{")
        assert not storage.holds_files(tmp_path)
        (tmp_path / "config.json").write_text("{}")
        assert storage.holds_files(tmp_path)


def test_a_file_system_without_locks_is_written_unlocked_with_a_warning(tmp_path, monkeypatch,
                                                                         caplog):
    import fcntl

    def no_locks(descriptor, operation):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(fcntl, "flock", no_locks)
    with caplog.at_level("WARNING", logger="pipelines"), storage.FolderLock(tmp_path) as lock:
        assert not lock.held
    assert f"{tmp_path}: no lock (No locks available)" in caplog.text


def test_a_lock_file_on_a_full_disk_is_a_storage_error(tmp_path, monkeypatch):
    def no_space(path, flags, mode=0o777):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(os, "open", no_space)
    with pytest.raises(storage.StorageError, match=rf"no space left on the device writing "
                       rf"{tmp_path / storage.LOCK_FILE}"):
        storage.FolderLock(tmp_path).acquire()


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_a_staging_folder_gets_the_permissions_the_umask_gives_any_folder(tmp_path, umask):
    """Readable by the other users of a shared export or prepared folder under the usual
    umask (not mkdtemp's fixed 0700), private under a strict one (not a fixed 0755)."""
    previous = os.umask(umask)
    try:
        first = storage.staging_folder(tmp_path, ".prep.tmp-123-")
        second = storage.staging_folder(tmp_path, ".prep.tmp-123-")
        plain = tmp_path / "plain"
        plain.mkdir()
    finally:
        os.umask(previous)
    assert first != second and first.name.startswith(".prep.tmp-123-")
    assert first.is_dir() and not any(first.iterdir())
    assert first.stat().st_mode & 0o777 == plain.stat().st_mode & 0o777 == 0o777 & ~umask
