"""The layout of a run directory: what training should do with `--out` (`inspect_run_dir`),
JSON written atomically, and `load_run` naming what is missing."""

from __future__ import annotations

import json

import pytest

from keras_transformer import run_directory
from keras_transformer.errors import UsageError
from keras_transformer.run_directory import RunDirError, inspect_run_dir
from pipelines import storage

IDENTITY = {"data": "corpus", "src": "de", "tgt": "en", "model": {"d_model": 32}}


def _run(tmp_path, identity=IDENTITY, finished=False):
    run = tmp_path / "run"
    run.mkdir()
    storage.write_json(run / run_directory.CONFIG_FILE, {"identity": identity})
    if finished:
        storage.write_json(run / run_directory.RESULTS_FILE, {"steps": 3})
    return run


def test_fresh_resume_and_finished(tmp_path):
    assert inspect_run_dir(tmp_path / "absent", IDENTITY) == "fresh"
    (tmp_path / "empty").mkdir()
    assert inspect_run_dir(tmp_path / "empty", IDENTITY) == "fresh"
    run = _run(tmp_path)
    assert inspect_run_dir(run, IDENTITY) == "resume"
    assert inspect_run_dir(run, IDENTITY, overwrite=True) == "fresh"
    storage.write_json(run / run_directory.RESULTS_FILE, {"steps": 3})
    assert inspect_run_dir(run, IDENTITY) == "finished"


def test_refusals_name_the_folder_and_the_way_out(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(RunDirError, match="is not a directory"):
        inspect_run_dir(tmp_path / "file", IDENTITY)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("x")
    with pytest.raises(RunDirError, match="not a training run"):
        inspect_run_dir(tmp_path / "mine", IDENTITY)
    with pytest.raises(RunDirError, match="no run to resume"):
        inspect_run_dir(tmp_path / "absent", IDENTITY, resume=True)
    run = _run(tmp_path)
    with pytest.raises(RunDirError, match=r"different settings \(src\).*--overwrite"):
        inspect_run_dir(run, {**IDENTITY, "src": "fr"})
    assert issubclass(RunDirError, UsageError)  # one line, exit status 2, in the command


def test_json_is_replaced_whole_and_reads_back(tmp_path):
    path = tmp_path / "state.json"
    storage.write_json(path, {"step": 1, "tuple": (1, 2)})
    storage.write_json(path, {"step": 2})
    assert run_directory.read_json(path) == {"step": 2}
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]  # no temporary left
    assert json.loads(path.read_text()) == {"step": 2}


def test_load_run_names_what_is_missing(tmp_path):
    run = _run(tmp_path)
    with pytest.raises(FileNotFoundError, match="model.keras is missing"):
        run_directory.load_run(run)
    assert not run_directory.is_run_dir(run)


@pytest.mark.parametrize("name, content, advice", [
    ("config.json", '{"identity": ', "--overwrite"),
    ("results.json", "[1, 2]", "evaluated again"),
    ("results.json", b"\xff\xfe{}", "evaluated again"),
])
def test_a_damaged_json_file_is_named_with_what_to_do(tmp_path, name, content, advice):
    path = tmp_path / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    with pytest.raises(run_directory.DamagedFileError) as raised:
        run_directory.read_json(path)
    assert str(raised.value).startswith(f"{path} is damaged") and advice in str(raised.value)


def test_a_lock_file_alone_is_an_empty_run_dir_and_overwriting_keeps_it(tmp_path):
    out = tmp_path / "new"
    out.mkdir()
    with storage.FolderLock(out):
        assert inspect_run_dir(out, IDENTITY) == "fresh"
    run = _run(tmp_path)
    (run / run_directory.CHECKPOINT_DIR).mkdir()
    (run / run_directory.CHECKPOINT_DIR / "ckpt-10.weights.h5").write_bytes(b"w")
    with storage.FolderLock(run) as lock:
        run_directory.empty_run_dir(run)
        assert [p.name for p in run.iterdir()] == [storage.LOCK_FILE]
        with pytest.raises(storage.FolderInUse):  # still held: no run can start meanwhile
            storage.FolderLock(run).acquire()
    assert not lock.held


def test_a_run_that_began_while_this_one_prepared_is_not_taken_over(tmp_path):
    out = tmp_path / "run"
    mode = inspect_run_dir(out, IDENTITY)  # absent: fresh, judged before the lock
    _run(tmp_path)  # another run began there meanwhile
    lock = storage.FolderLock(out)
    try:
        with pytest.raises(RunDirError, match=f"another run began in {out}"):
            run_directory.take_run_dir(lock, mode, IDENTITY, overwrite=False, resume=False)
    finally:
        lock.release()
    assert (out / run_directory.CONFIG_FILE).is_file()  # left alone
    lock = storage.FolderLock(out)
    try:  # judged under the lock, --overwrite empties it all but the lock
        run_directory.take_run_dir(lock, "fresh", IDENTITY, overwrite=True, resume=False)
        assert [p.name for p in out.iterdir()] == [storage.LOCK_FILE] and lock.held
        (out / "checkpoints").mkdir()
        run_directory.delete_run_dir(out)  # a fresh run that failed leaves nothing
        assert not out.exists()
    finally:
        lock.release()


def test_a_run_decodes_with_what_it_recorded_first_else_the_papers(tmp_path):
    """Training exports (and translate, evaluate and export use) the beam and alpha the run
    scored its test set with, else its val choice, else its own flags, else beam 4, α 0.6."""
    run_decoding = run_directory.run_decoding
    results, config = tmp_path / "results.json", tmp_path / "config.json"
    assert run_decoding(tmp_path) == (4, 0.6)  # nothing recorded: the paper's
    config.write_text(json.dumps({"arguments": {"beam": 6, "alpha": 1.0}}))
    assert run_decoding(tmp_path) == (6, 1.0)  # --choose-by loss, no test split: its flags
    results.write_text(json.dumps({"decoding": {"beam": 5, "alpha": 1.4}}))
    assert run_decoding(tmp_path) == (5, 1.4)  # no test split: the val choice
    results.write_text(json.dumps({"beam": 2, "alpha": 0, "decoding": {"beam": 5}}))
    assert run_decoding(tmp_path) == (2, 0.0)
    assert run_decoding(tmp_path, beam=3) == (3, 0.0)  # what is given wins
    results.write_text(json.dumps({"beam": None, "alpha": None}))
    assert run_decoding(tmp_path) == (6, 1.0)
    for damaged in ({"beam": "four"}, {"beam": 0}, {"beam": 2.5}, {"beam": True},
                    {"alpha": float("nan")}, {"alpha": -1}, {"alpha": [0.6]}):
        results.write_text(json.dumps(damaged))
        name = next(iter(damaged))
        with pytest.raises(run_directory.DamagedFileError, match=f"{results}.*'{name}'"):
            run_decoding(tmp_path)
        assert run_decoding(tmp_path, beam=4, alpha=0.6) == (4, 0.6)  # not read: given
    results.write_text("{")
    with pytest.raises(run_directory.DamagedFileError, match="results.json is damaged"):
        run_decoding(tmp_path)
    # config.json is read only where results.json leaves a value missing.
    results.write_text(json.dumps({"beam": 2, "alpha": 0.5}))
    config.write_text("{")
    assert run_decoding(tmp_path) == (2, 0.5)
    results.write_text(json.dumps({"beam": 2}))
    with pytest.raises(run_directory.DamagedFileError, match="config.json is damaged"):
        run_decoding(tmp_path)
