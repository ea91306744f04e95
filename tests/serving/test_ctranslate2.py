"""Export to CTranslate2 (`keras_transformer.serving.ctranslate2`): the converted model gives
the same per-token log-probabilities as ours, and the export CLI writes a loadable model."""

from __future__ import annotations

import errno
import json
import shutil
import subprocess
from pathlib import Path

import ctranslate2
import keras
import numpy as np
import pytest
import sentencepiece as spm

from keras_transformer import run_directory
from keras_transformer.errors import EXIT_STORAGE
from keras_transformer.export import main as export_main
from keras_transformer.model.transformer import build_transformer
from keras_transformer.serving.ctranslate2 import (
    export_ctranslate2,
    transformer_spec,
    translate_with_ctranslate2,
)
from pipelines.constants import BOS_ID, EOS_ID
from pipelines.storage import StorageError
from pipelines.tokenizer import train_tokenizer
from tests.cli.test_train import write_toy_corpus
from tests.storage_faults import small_filesystem, snapshot


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """A run directory: a random `tiny` model (post-norm, tied embeddings) and a tokenizer."""
    folder = tmp_path_factory.mktemp("ct2")
    corpus = write_toy_corpus(folder / "corpus")
    texts = [line for lang in ("xx", "yy")
             for line in (corpus / f"train.{lang}").read_text().splitlines()]
    tokenizer = train_tokenizer(texts, folder / "run" / run_directory.TOKENIZER_DIR, vocab_size=300)
    keras.utils.set_random_seed(0)
    model = build_transformer("tiny", vocab_size=tokenizer.vocab_size)
    model.save(folder / "run" / run_directory.MODEL_FILE)
    return folder / "run"


def our_log_probs(model, source_ids: list[int], target_ids: list[int]) -> np.ndarray:
    """log p(target token t | source, target < t) of our model, EOS included."""
    source = np.array([source_ids + [EOS_ID]], "int32")
    target = np.array([[BOS_ID] + target_ids], "int32")
    logits = model({"source": source, "target": target}, training=False)
    log_probs = keras.ops.convert_to_numpy(keras.ops.log_softmax(logits, axis=-1))[0]
    return log_probs[np.arange(len(target_ids) + 1), target_ids + [EOS_ID]]


@pytest.mark.parametrize("cli", [False, True])
def test_ctranslate2_scores_every_token_as_our_model(run, tmp_path, cli):
    model, tokenizer = run_directory.load_run(run)
    out = tmp_path / "ct2"
    if cli:  # the run's val choice goes to decoding.json, as to a SavedModel's serving_default
        (run / run_directory.RESULTS_FILE).write_text(json.dumps({"beam": 6, "alpha": 1.4}))
        try:
            assert export_main(["--model", str(run), "--format", "ctranslate2",
                                "--export-base", str(out)]) == 0
        finally:
            (run / run_directory.RESULTS_FILE).unlink()
    else:
        export_ctranslate2(model, tokenizer, out)
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json", "decoding.json", "model.bin", "sentencepiece.model",
        "shared_vocabulary.json"]
    assert json.loads((out / "decoding.json").read_text()) == (
        {"beam_size": 6, "alpha": 1.4} if cli else {"beam_size": 4, "alpha": 0.6})
    pieces = spm.SentencePieceProcessor(model_file=str(out / "sentencepiece.model"))
    translator = ctranslate2.Translator(str(out), device="cpu", intra_threads=1)
    sources = ["bada kemo lira", "dusa", "pemo kisa bada lira mudo tera"]
    targets = ["kisax pora", "mudax lirax dosax", "a"]
    scored = translator.score_batch([pieces.encode(s, out_type=str) for s in sources],
                                    [pieces.encode(t, out_type=str) for t in targets])
    for source, target, result in zip(sources, targets, scored, strict=True):
        ours = our_log_probs(model, pieces.encode(source), pieces.encode(target))
        # float32 in both, different kernels: round-off only.
        np.testing.assert_allclose(result.log_probs, ours, atol=2e-4)


def test_untied_embeddings_and_another_wavelength_convert_too(run, tmp_path):
    """The target embedding and the output projection are their own matrices when untied
    (`tie_embeddings=False`), and the positions follow the model's max_wavelength."""
    _, tokenizer = run_directory.load_run(run)
    keras.utils.set_random_seed(1)
    model = build_transformer("tiny", vocab_size=tokenizer.vocab_size, tie_embeddings=False,
                              max_wavelength=500.0)
    export_ctranslate2(model, tokenizer, tmp_path / "ct2")
    pieces = spm.SentencePieceProcessor(model_file=str(tmp_path / "ct2" / "sentencepiece.model"))
    translator = ctranslate2.Translator(str(tmp_path / "ct2"), device="cpu", intra_threads=1)
    source, target = "pemo kisa bada lira mudo tera", "mudax lirax dosax"
    scored = translator.score_batch([pieces.encode(source, out_type=str)],
                                    [pieces.encode(target, out_type=str)])
    np.testing.assert_allclose(scored[0].log_probs, our_log_probs(
        model, pieces.encode(source), pieces.encode(target)), atol=2e-4)


def test_export_refuses_an_existing_directory_and_pre_norm_models(run, tmp_path):
    model, tokenizer = run_directory.load_run(run)
    (tmp_path / "taken").mkdir()
    with pytest.raises(FileExistsError, match="exists"):
        export_ctranslate2(model, tokenizer, tmp_path / "taken")
    assert export_main(["--model", str(run), "--format", "ctranslate2",
                        "--export-base", str(tmp_path / "taken")]) == 1
    pre_norm = build_transformer("tiny", vocab_size=tokenizer.vocab_size, pre_norm=True)
    with pytest.raises(ValueError, match="only post-norm"):
        transformer_spec(pre_norm, tokenizer)
    assert not list(tmp_path.glob(".*tmp*"))  # nothing half-written


def _serialize_on_a_full_disk(spec, path):
    """`ModelSpec._serialize` (model.bin) on a full disk: part written, then Python's ENOSPC."""
    with open(path, "wb") as handle:
        handle.write(bytes(4096))
    raise OSError(errno.ENOSPC, "No space left on device")


@pytest.mark.parametrize("cli", [False, True])
def test_a_full_disk_stops_the_export_and_leaves_nothing(run, tmp_path, capfd, monkeypatch,
                                                         cli):
    model, tokenizer = run_directory.load_run(run)
    earlier = tmp_path / "ct2"
    export_ctranslate2(model, tokenizer, earlier)
    size = sum(file.stat().st_size for file in earlier.iterdir())
    disk = tmp_path / "disk"
    # Room for a copy of the earlier export and half of a new one (340 KB of weights).
    with small_filesystem(disk, size + 160_000) as mounted:
        shutil.copytree(earlier, disk / "ct2-old")
        before = snapshot(disk / "ct2-old")
        if not mounted:
            monkeypatch.setattr(ctranslate2.specs.model_spec.ModelSpec, "_serialize",
                                _serialize_on_a_full_disk)
        new = disk / "ct2-new"
        if cli:
            capfd.readouterr()
            assert export_main(["--model", str(run), "--format", "ctranslate2",
                                "--export-base", str(new)]) == EXIT_STORAGE
            err = capfd.readouterr().err
            errors = [line for line in err.splitlines() if "error" in line.lower()]
            assert len(errors) == 1 and errors[0].startswith("export: error: no space left")
            assert str(new) in errors[0] and "needed" in errors[0]
            assert "Traceback" not in err
        else:
            with pytest.raises(StorageError) as failure:
                export_ctranslate2(model, tokenizer, new)
            assert failure.value.errno == errno.ENOSPC and failure.value.path == new
            assert abs(failure.value.needed - size) < 0.05 * size  # from the spec's arrays
        assert sorted(p.name for p in disk.iterdir()) == ["ct2-old"]  # no staging, no half
        assert snapshot(disk / "ct2-old") == before
        if mounted:  # free space: the same export now succeeds
            subprocess.run(["mount", "-o", "remount,size=4m", str(disk)], check=True)
        monkeypatch.undo()
        assert snapshot(export_ctranslate2(model, tokenizer, new)) == snapshot(earlier)


class FixedTranslator:
    """Returns fixed hypotheses and scores, and records what it was asked."""

    def __init__(self, hypotheses, scores):
        self.result = type("Result", (), {"hypotheses": hypotheses, "scores": scores})
        self.asked = {}

    def translate_batch(self, pieces, **options):
        self.asked = {"pieces": pieces, **options}
        return [self.result for _ in pieces]


def test_translate_ranks_beam_hypotheses_by_our_length_penalty(run):
    pieces = spm.SentencePieceProcessor(model_proto=run_directory.load_run(run)[1].model_proto)
    short = pieces.encode("kisax", out_type=str)
    long = pieces.encode("kisax pora mudax lirax dosax kisax", out_type=str)
    penalty = [((5 + len(h) + 1) / 6) for h in (short, long)]  # alpha 1, EOS counted
    # The long hypothesis is worse summed, better per GNMT-normalised score (0.9x the short's).
    scores = [-2.0, -2.0 / penalty[0] * penalty[1] * 0.9]
    assert scores[1] < scores[0]
    translator = FixedTranslator([short, long], scores)
    best = translate_with_ctranslate2(translator, pieces, ["x"], beam_size=4, alpha=1.0)
    assert best == [pieces.decode(long)]
    assert translator.asked["num_hypotheses"] == 4 and translator.asked["patience"] == 2
    assert translator.asked["max_decoding_length"] == len(pieces.encode("x")) + 1 + 50
    # Without a length penalty (alpha 0) the higher summed score wins.
    best = translate_with_ctranslate2(translator, pieces, ["x"], beam_size=4, alpha=0.0)
    assert best == [pieces.decode(short)]


def test_a_prefix_longer_than_the_limit_is_kept_whole_and_scored_as_ours(run, tmp_path):
    """Our engine raises a line's length limit to fit a forced prefix; CTranslate2 counts the
    prefix in max_decoding_length and would cut it. The wrapper keeps it whole, and scores it
    as ours (CTranslate2's own scores leave the prefix out)."""
    from keras_transformer.decoding.translator import force_decode, translate_batch
    from keras_transformer.serving.ctranslate2_translation import (
        translate_batch_with_ctranslate2,
    )

    model, tokenizer = run_directory.load_run(run)
    export_ctranslate2(model, tokenizer, tmp_path / "ct2")
    translator = ctranslate2.Translator(str(tmp_path / "ct2"), device="cpu", intra_threads=1)
    pieces = spm.SentencePieceProcessor(model_file=str(tmp_path / "ct2" / "sentencepiece.model"))
    sources = ["dusa", "bada kemo lira"]
    prefixes = ["kisax pora mudax lirax dosax kisax pora mudax", None]
    assert len(pieces.encode(prefixes[0])) > len(pieces.encode(sources[0])) + 1 + 3
    options = dict(beam_size=2, target_prefix=prefixes, extra_length=3)
    ours = translate_batch(model, tokenizer, sources, **options)
    theirs = translate_batch_with_ctranslate2(translator, pieces, sources, **options)
    assert theirs[0].text.startswith(prefixes[0])
    assert len(theirs[0].hypotheses[0].pieces) == len(ours[0].hypotheses[0].pieces)
    forced = force_decode(model, tokenizer, sources[:1], [theirs[0].hypotheses[0].pieces])
    hypothesis = theirs[0].hypotheses[0]
    expected = (forced[0].hypotheses[0].log_prob if hypothesis.finished else
                sum(forced[0].hypotheses[0].token_log_probs[:-1]))
    assert hypothesis.log_prob == pytest.approx(expected, abs=1e-3)
