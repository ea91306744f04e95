"""`--choose-by bleu` (issue 29): the final weights by val BLEU, then the beam size and length
penalty of test and the export among `--val-beams` x `--val-alphas`, all on val."""

from __future__ import annotations

import json
import math
import random

import numpy as np
import pytest

from keras_transformer.errors import UsageError
from keras_transformer.model.transformer import build_transformer
from keras_transformer.training import val_choice
from keras_transformer.training.checkpoints import checkpoint_path, save_model_weights
from keras_transformer.training.config import EvaluationConfig, train_config
from keras_transformer.training.final_weights import (
    by_val_bleu,
    by_val_loss,
    choose_final_weights,
)
from keras_transformer.training.run import finish_run, run_training
from keras_transformer.training.val_choice import (
    check_serving_options,
    choose_decoding,
    choose_on_val_bleu,
    decoding_grid,
    describe_decoding,
    val_sample,
)
from pipelines.corpora import ParallelCorpus
from tests.training.test_checkpoints import _model_with_constant_weights


@pytest.fixture(scope="module")
def constant_checkpoints(tmp_path_factory):
    """Checkpoints every 100 steps to 1000, whose weights are all `step / 100`, and a best
    checkpoint (step 400) whose weights are all 4."""
    directory = tmp_path_factory.mktemp("checkpoints")
    for step in range(100, 1100, 100):
        save_model_weights(_model_with_constant_weights(step / 100),
                           checkpoint_path(directory, step))
    save_model_weights(_model_with_constant_weights(4.0), directory / "best.weights.h5")
    return directory


def _weight(model) -> float:
    return float(model.get_weights()[0].flat[0])


def test_bleu_criterion_keeps_the_highest_scoring_weights(constant_checkpoints):
    """A "BLEU" that is a function of the loaded weights, highest at weights 9: the average of
    the last 3 checkpoints (8, 9, 10) wins, though validation loss was best at step 400."""
    model = _model_with_constant_weights(0.0)
    choice = choose_final_weights(model, constant_checkpoints, best_step=400, count=3, criterion=by_val_bleu(
        lambda candidate: 50.0 - 10.0 * abs(_weight(candidate) - 9.0)))
    assert choice["chosen"] == "last" and choice["steps"] == [800, 900, 1000]
    assert choice["val_bleu"] == pytest.approx(50.0) and "val_loss" not in choice
    assert {c["name"]: c["val_bleu"] for c in choice["candidates"]} == pytest.approx({
        "last": 50.0, "up to the best step": -10.0, "around the best step": 0.0,
        "best checkpoint": 0.0})
    assert all(set(c) == {"name", "steps", "val_bleu"} for c in choice["candidates"])
    assert choice["reason"].startswith(
        "the average of the last 3 checkpoints, steps [800, 900, 1000]: highest val BLEU, 50.00 "
        "(against ")
    np.testing.assert_allclose(model.get_weights()[0], 9.0)
    assert list(constant_checkpoints.glob("averaged*")) == []


def test_bleu_ties_go_to_the_average_and_the_loss_wording_is_unchanged(constant_checkpoints):
    model = _model_with_constant_weights(0.0)
    # Weights 4 around the best step and in the best checkpoint: equal BLEU, the average wins.
    choice = choose_final_weights(model, constant_checkpoints, best_step=400, count=3, criterion=by_val_bleu(
        lambda candidate: -abs(_weight(candidate) - 4.0)))
    assert choice["chosen"] == "around the best step"
    np.testing.assert_allclose(model.get_weights()[0], 4.0)
    # `criterion=by_val_loss(...)` is what `val_loss=` means, worded as before issue 29.
    loss = by_val_loss(lambda candidate: abs(_weight(candidate) - 9.0))
    choice = choose_final_weights(model, constant_checkpoints, best_step=400, count=3,
                                  criterion=loss)
    assert choice["chosen"] == "last" and choice["val_loss"] == pytest.approx(0.0)
    assert choice["reason"].startswith("the average of the last 3 checkpoints, steps [800, 900, "
                                       "1000]: lowest exact validation loss, 0.0000 (against ")
    with pytest.raises(ValueError, match="not both"):
        choose_final_weights(model, constant_checkpoints, 400, 3, loss.score, criterion=loss)


def test_decoding_grid_sorts_beams_and_keeps_the_alphas_order():
    assert decoding_grid(4, 0.6, "", "") == ([4], [0.6])
    assert decoding_grid(4, 0.6, "6,2, 4,2", "1.0,0.6,1") == ([2, 4, 6], [1.0, 0.6])


def _synthetic_val(count: int) -> ParallelCorpus:
    return ParallelCorpus([f"s{i}" for i in range(count)], [f"t{i}" for i in range(count)],
                          "de", "en", "val", "synthetic")


def test_val_sample_spreads_evenly_and_keeps_the_pairs_together():
    val = _synthetic_val(10)
    assert val_sample(val, 4) == (["s0", "s2", "s5", "s7"], ["t0", "t2", "t5", "t7"])
    sources, references = val_sample(_synthetic_val(3000), 1000)
    assert (len(sources), sources[:3], sources[-1]) == (1000, ["s0", "s3", "s6"], "s2997")
    assert [s[1:] for s in sources] == [r[1:] for r in references]
    for everything in (0, 10, 11):
        assert val_sample(val, everything) == (val.sources, val.targets)


def test_val_sentences_make_every_choice_on_the_same_sample(constant_checkpoints,
                                                            monkeypatch, caplog):
    """The weight candidates and the beam/alpha grid all decode the same 4 of 10 pairs."""
    decoded = []

    def score(candidate, tokenizer, sources, references, beam, alpha):
        decoded.append((list(sources), list(references)))
        return {"bleu": 50.0 - abs(_weight(candidate) - 9.0) - alpha, "bleu_bp": 1.0}

    monkeypatch.setattr(val_choice, "score_decoding", score)
    caplog.set_level("INFO", logger="keras_transformer")
    evaluation = train_config(data="d", src="de", tgt="en", out="o", choose_by="bleu", beam=4,
                              alpha=0.6, val_beams="4,6", val_alphas="0.6,1.0",
                              val_sentences=4, average_last=3).evaluation
    choice, decoding = choose_on_val_bleu(_model_with_constant_weights(0.0), None,
                                          _synthetic_val(10), constant_checkpoints, 400,
                                          evaluation)
    # 4 candidates, then the 3 grid settings not decoded yet.
    assert len(decoded) == 7
    assert all(d == (["s0", "s2", "s5", "s7"], ["t0", "t2", "t5", "t7"]) for d in decoded)
    assert choice["chosen"] == "last" and (decoding["beam"], decoding["alpha"]) == (4, 0.6)
    assert decoding["val_sentences"] == choice["val_sentences"] == 4
    assert ": highest val BLEU on 4 of 10 sentences, " in choice["reason"]
    assert describe_decoding(decoding).endswith("of 4 settings tried on 4 val sentences")
    assert "(4 of the 10 val sentences, spread evenly, beam 4" in caplog.text
    # Without a sample: every pair, and the record says nothing of a sample.
    decoded.clear()
    evaluation.val_sentences = 0
    choice, decoding = choose_on_val_bleu(_model_with_constant_weights(0.0), None,
                                          _synthetic_val(10), constant_checkpoints, 400,
                                          evaluation)
    assert {len(sources) for sources, _ in decoded} == {10}
    assert "val_sentences" not in decoding and "val_sentences" not in choice
    assert ": highest val BLEU, " in choice["reason"]


def _scores(bleu: float, bp: float = 1.0) -> dict[str, float]:
    return {"bleu": bleu, "bleu_bp": bp}


def test_choose_decoding_takes_the_highest_val_bleu_and_the_first_of_ties():
    """Every setting already scored (`known`): nothing is decoded, so no model is needed."""
    known = {(1, None): _scores(20.0, 0.8), (2, 0.6): _scores(25.0), (2, 1.0): _scores(31.0),
             (4, 0.6): _scores(31.0), (4, 1.0): _scores(30.0)}
    decoding = choose_decoding(None, None, ["a"], ["b"], [1, 2, 4], [0.6, 1.0], known)
    assert (decoding["chosen_by"], decoding["beam"], decoding["alpha"],
            decoding["val_bleu"]) == ("val BLEU", 2, 1.0, 31.0)
    # Greedy search ignores alpha: beam 1 is one decoding, listed with each alpha.
    assert decoding["tried"] == [
        {"beam": 1, "alpha": 0.6, "val_bleu": 20.0, "val_bp": 0.8},
        {"beam": 1, "alpha": 1.0, "val_bleu": 20.0, "val_bp": 0.8},
        {"beam": 2, "alpha": 0.6, "val_bleu": 25.0, "val_bp": 1.0},
        {"beam": 2, "alpha": 1.0, "val_bleu": 31.0, "val_bp": 1.0},
        {"beam": 4, "alpha": 0.6, "val_bleu": 31.0, "val_bp": 1.0},
        {"beam": 4, "alpha": 1.0, "val_bleu": 30.0, "val_bp": 1.0}]
    with pytest.raises(ValueError):
        choose_decoding(None, None, ["a"], ["b"], [], [0.6])


def test_finish_run_choosing_by_bleu_decodes_test_with_the_setting_chosen_on_val(
        tmp_path, small_corpus, small_tokenizer, caplog):
    """A run directory as training leaves it (tokenizer, two checkpoints, the best one), with
    an untrained tiny model: finish_run chooses weights and decoding on val only."""
    run = tmp_path / "run"
    small_tokenizer.save(run / "tokenizer")
    (run / "checkpoints").mkdir()
    random.seed(0)
    np.random.seed(0)  # Keras draws its initializers' seeds from these (not tf.random)
    model = build_transformer("tiny", vocab_size=small_tokenizer.vocab_size)
    weights = model.get_weights()
    for step, scale in ((10, 1.0), (20, 3.0)):
        model.set_weights([w * scale for w in weights])
        save_model_weights(model, checkpoint_path(run / "checkpoints", step))
    model.set_weights(weights)
    save_model_weights(model, run / "checkpoints" / "best.weights.h5")
    short = [i for i, s in enumerate(small_corpus.sources) if len(s.split()) <= 4][:10]
    pairs = [(small_corpus.sources[i], small_corpus.targets[i]) for i in short]

    def corpus(split, chosen, language="de"):
        return ParallelCorpus([s for s, _ in chosen], [t for _, t in chosen], language, "en",
                              split, "synthetic")

    # A many-to-one run's corpora (--src de,fr): test of the first language, then the other.
    corpora = {"val": corpus("val", pairs[:6]), "test": corpus("test", pairs[6:]),
               "test:fr": corpus("test", pairs[7:], "fr")}
    config = train_config(data=str(tmp_path), src="de", tgt="en", out=str(run),
                          average_last=2, beam=2, alpha=0.6, choose_by="bleu",
                          val_beams="2,1", val_alphas="0.6,1.0", no_export=True,
                          max_steps=25, cooldown=0.2)
    record = {"model": {"preset": "tiny", "vocab_size": small_tokenizer.vocab_size}}
    # The validations the run logged: a plateau, then the cooldown's drop. The cooldown
    # begins at 80% of the steps the training loop planned (outcome["max_steps"], as for an
    # --epochs run not the config's), not of the steps trained (stopped at 18).
    (run / "logs").mkdir()
    (run / "logs" / "metrics.csv").write_text("step,val_loss\n" + "".join(
        f"{step},{loss}\n" for step, loss in ((4, 6.0), (8, 5.0), (12, 4.99), (16, 4.995),
                                               (18, 4.8))))
    outcome = {"step": 18, "max_steps": 20, "reason": "max minutes", "elapsed": 1.0,
               "tokens_per_sec": 1.0, "best_val_loss": 9.0, "best_step": 10,
               "precision": "float32", "loss_scale": None, "skipped_updates": None,
               "replicas": 1, "workers": 1, "jit_compile": False, "fused_kernels": False}
    caplog.set_level("INFO", logger="keras_transformer")
    results = finish_run(config, record, corpora, outcome)

    assert results == json.loads((run / "results.json").read_text())
    # Judged up to the cooldown (step 16 of 20): converged, the drop after it reported apart.
    convergence = results["convergence"]
    assert (convergence["verdict"], convergence["cooldown_from_step"]) == ("converged", 16)
    assert convergence["cooldown_gain"] == pytest.approx((4.99 - 4.8) / 4.99, abs=1e-5)
    candidates = results["averaging"]["candidates"]
    assert [c["name"] for c in candidates] == ["last", "up to the best step", "best checkpoint"]
    assert all("val_bleu" in c and "val_loss" not in c for c in candidates)
    assert "highest val BLEU" in results["averaging"]["reason"]
    assert math.isfinite(results["final_val_loss"])
    decoding = results["decoding"]
    tried = [(t["beam"], t["alpha"]) for t in decoding["tried"]]
    assert tried == [(1, 0.6), (1, 1.0), (2, 0.6), (2, 1.0)]
    best = max(t["val_bleu"] for t in decoding["tried"])
    first_best = next(t for t in decoding["tried"] if t["val_bleu"] == best)
    assert (decoding["beam"], decoding["alpha"], decoding["val_bleu"]) == (
        first_best["beam"], first_best["alpha"], best)
    assert (results["beam"], results["alpha"]) == (decoding["beam"], decoding["alpha"])
    assert results["test_sentences"] == 4 and "bleu_bp" not in results
    # Every source language's test score; the headline one is the first language's.
    by_source = results["test_by_source"]
    assert list(by_source) == ["de", "fr"] and by_source["de"]["bleu"] == results["bleu"]
    assert len((run / "test.fr.hyp.txt").read_text().splitlines()) == 3
    assert len((run / "test.hyp.txt").read_text().splitlines()) == 4
    # One decoding per candidate, then the two settings not decoded yet: greedy (once for
    # both alphas) and beam 2 with alpha 1.0; beam 2 with alpha 0.6 is the winner's, reused.
    assert caplog.text.count("(already decoded)") == 2
    assert "decoding: beam " in caplog.text


def test_a_decoding_the_export_cannot_serve_is_refused_before_training(tmp_path):
    """The SavedModel serves beams of 1 to 16 and alphas of 0 to 10 (its signatures clip
    others): a run that could choose another is refused at once, not after training."""
    check_serving_options(EvaluationConfig(beam=16, alpha=10.0))
    check_serving_options(EvaluationConfig(val_beams="24"))  # by loss, the grid is not used
    with pytest.raises(UsageError, match=r"--beam/--val-beams 4, 24: .* 1 to 16"):
        check_serving_options(EvaluationConfig(choose_by="bleu", val_beams="4,24"))
    with pytest.raises(UsageError, match="length penalties of 0 to 10"):
        check_serving_options(EvaluationConfig(alpha=12.0))
    with pytest.raises(UsageError, match="--beam/--val-beams 20"):
        run_training(train_config(data=str(tmp_path / "corpus"), src="de", tgt="en",
                                  out=str(tmp_path / "run"), beam=20))
    assert not (tmp_path / "run").exists()
