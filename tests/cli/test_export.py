"""`python -m keras_transformer.export`: what it exports by default, and what it refuses."""

from __future__ import annotations

from keras_transformer.export import main


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
