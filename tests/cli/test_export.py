"""`python -m keras_transformer.export`: what it exports by default, and what it refuses."""

from __future__ import annotations

import json

from keras_transformer.export import main
from keras_transformer.run_directory import run_decoding


def test_a_run_is_exported_with_the_decoding_it_chose_on_val(tmp_path):
    """Training exports its val-chosen beam and alpha; exporting the run again does too."""
    assert run_decoding(tmp_path, None, None) == (4, 0.6)  # no results.json: the defaults
    (tmp_path / "results.json").write_text(json.dumps({"beam": 6, "alpha": 1.4}))
    assert run_decoding(tmp_path, None, None) == (6, 1.4)
    assert run_decoding(tmp_path, 2, 0.0) == (2, 0.0)  # the flags given win
    (tmp_path / "results.json").write_text(json.dumps({"beam": None, "alpha": None}))
    assert run_decoding(tmp_path, None, None) == (4, 0.6)
    # Without a test split the val choice is only in "decoding".
    (tmp_path / "results.json").write_text(json.dumps({"decoding": {"beam": 6, "alpha": 1.0}}))
    assert run_decoding(tmp_path, None, None) == (6, 1.0)


def test_a_decoding_the_signatures_would_clip_is_refused(tmp_path, capsys):
    for flags in (["--beam", "20"], ["--alpha", "-1"], ["--alpha", "nan"]):
        status = main(["--model", str(tmp_path), "--export-base", str(tmp_path / "out"),
                       *flags])
        assert status == 1
        assert "--beam must be in [1, 16] and --alpha in [0, 10]" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    (tmp_path / "results.json").write_text("{")
    assert main(["--model", str(tmp_path), "--export-base", str(tmp_path / "out")]) == 1
    assert capsys.readouterr().err.startswith(f"export: error: {tmp_path}: ")  # one line
