"""`python -m keras_transformer.export`: what it exports by default, and what it refuses."""

from __future__ import annotations

import pytest

from keras_transformer.export import main


@pytest.mark.parametrize("export_format", ["saved_model", "ctranslate2"])
def test_a_decoding_the_signatures_would_clip_or_no_search_could_use_is_refused(
        tmp_path, capsys, export_format):
    refused = [["--beam", "0"], ["--alpha", "-1"], ["--alpha", "nan"], ["--alpha", "inf"]]
    if export_format == "saved_model":
        refused += [["--beam", "20"], ["--alpha", "11"]]
    for flags in refused:
        status = main(["--model", str(tmp_path), "--export-base", str(tmp_path / "out"),
                       "--format", export_format, *flags])
        assert status == 1, flags
        error = capsys.readouterr().err
        assert error.startswith("export: error: --beam must be in [1, ") and (
            f"for --format {export_format}" in error), error
        if export_format == "saved_model":
            assert "[1, 16] and --alpha a finite number in [0, 10]" in error
    assert not (tmp_path / "out").exists()
    (tmp_path / "results.json").write_text("{")
    assert main(["--model", str(tmp_path), "--export-base", str(tmp_path / "out")]) == 1
    error = capsys.readouterr().err
    assert error.startswith(f"export: error: {tmp_path / 'results.json'} is damaged")
    assert error.count(str(tmp_path)) == 1 and len(error.splitlines()) == 1
