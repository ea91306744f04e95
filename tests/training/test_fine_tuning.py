"""Fine-tuning from a trained run (`--init-from`, `keras_transformer.training.fine_tuning`) and
training on a mix of corpora (`--add-data`, `--synthetic`, `--upsample-real`): real runs of
the tiny preset on two toy language pairs of the same languages (two "domains")."""

from __future__ import annotations

import hashlib
import json

import pytest

from keras_transformer.decoding.scoring import paired_bootstrap
from keras_transformer.errors import UsageError
from keras_transformer.training.config import train_config
from keras_transformer.training.fine_tuning import InitialRun, old_test_corpus
from keras_transformer.training.run import run_training
from pipelines.corpora import load_corpus
from tests.cli.test_train import write_toy_corpus

TINY = dict(src="xx", tgt="yy", preset="tiny", vocab_size=300, tokens_per_batch=512,
            max_length=32, precision="float32", checkpoint_every=4, average_last=1, beam=2,
            no_export=True, test_limit=10)


@pytest.fixture(scope="module")
def old_run(tmp_path_factory):
    """A finished tiny run on the first domain (8 steps)."""
    root = tmp_path_factory.mktemp("fine_tuning")
    data = write_toy_corpus(root / "old_domain", pairs=200, seed=0)
    out = root / "old_run"
    results = run_training(train_config(data=str(data), out=str(out), max_steps=8, **TINY))
    return {"root": root, "data": data, "out": out, "results": results}


def _sha256(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_new_vocabulary_for_a_fine_tuned_run_is_refused(tmp_path):
    with pytest.raises(UsageError, match="--tokenizer-data trains a new vocabulary"):
        train_config(data="data", out=str(tmp_path / "run"), init_from="old", max_steps=2,
                     tokenizer_data="news", **TINY).check()


def test_another_architecture_or_vocabulary_is_refused_before_anything_is_made(old_run):
    root = old_run["root"]
    new_data = write_toy_corpus(root / "refused_domain", pairs=50, seed=1)
    for change, named in (({"preset": "small"}, "--preset tiny"),
                          ({"vocab_size": 400}, "--vocab-size 300"),
                          ({"d_model": 64}, "d_model")):
        out = root / f"refused_{next(iter(change))}"
        with pytest.raises(UsageError) as refused:
            run_training(train_config(data=str(new_data), out=str(out), max_steps=2,
                                      **{**TINY, **change, "init_from": str(old_run["out"])}))
        assert named in str(refused.value) and "Fine-tuning keeps" in str(refused.value)
        assert not out.exists()
    with pytest.raises(UsageError, match="not a finished training run"):
        run_training(train_config(data=str(new_data), out=str(root / "refused_missing"),
                                  max_steps=2, init_from=str(root / "no_such_run"), **TINY))
    # The flags to pass are ones argparse takes: a switch without a value.
    pre_norm_run = root / "pre_norm_run"
    pre_norm_run.mkdir()
    for name in ("model.keras", "tokenizer"):
        (pre_norm_run / name).touch()
    config = json.loads((old_run["out"] / "config.json").read_text())
    config["model"]["pre_norm"] = config["arguments"]["pre_norm"] = True
    (pre_norm_run / "config.json").write_text(json.dumps(config))
    with pytest.raises(UsageError, match=r"pre_norm: True there, False here") as refused:
        run_training(train_config(data=str(new_data), out=str(root / "refused_pre_norm"),
                                  max_steps=2, init_from=str(pre_norm_run), **TINY))
    assert "--pre-norm --vocab-size 300" in str(refused.value)


def test_fine_tuning_starts_from_the_run_and_scores_both_domains_before_and_after(old_run):
    root, old_out = old_run["root"], old_run["out"]
    new_data = write_toy_corpus(root / "new_domain", pairs=120, seed=1)
    out = root / "fine_tuned"
    results = run_training(train_config(
        data=str(new_data), out=str(out), max_steps=4, warmup_steps=2,
        init_from=str(old_out), add_data=str(old_run["data"]), **TINY))
    # The vocabulary is the old run's, byte for byte, in the run and in its prepared data.
    old_model = old_out / "tokenizer" / "spm.model"
    assert _sha256(out / "tokenizer" / "spm.model") == _sha256(old_model)
    manifest = json.loads((out / "prepared" / "manifest.json").read_text())
    assert manifest["settings"]["tokenizer_given"] == _sha256(old_model)
    # The old domain's 200 pairs were trained on with the new domain's 120.
    assert manifest["pairs_total"] == 320
    assert [part["origin"] for part in manifest["corpus"]["parts"]] == [
        str(new_data), str(old_run["data"])]
    tuning = results["fine_tuning"]
    assert tuning["init_from"] == str(old_out)
    # "Before" is the old run's own model: on its own test split it scores what that run
    # reported (same test pairs, beam and alpha).
    assert tuning["old_test"]["data"] == str(old_run["data"])
    assert tuning["old_test"]["bleu_before"] == pytest.approx(old_run["results"]["bleu"])
    for role in ("test", "old_test"):
        entry = tuning[role]
        assert entry["bleu_change"] == pytest.approx(
            entry["bleu_after"] - entry["bleu_before"], abs=0.01)
        # The translations before and after are kept, one line a sentence, and the change's
        # p-value is the paired bootstrap's on them (sacreBLEU's, as its command line gives).
        after_file = out / ("test.hyp.txt" if role == "test" else f"{role}.hyp.txt")
        before = (out / f"{role}.before.hyp.txt").read_text().splitlines()
        after = after_file.read_text().splitlines()
        assert len(before) == len(after) == entry["sentences"] == 10
        corpus = load_corpus(entry["data"], entry["split"], "xx", "yy")
        bootstrap = paired_bootstrap(before, after, corpus.targets[:10])
        assert entry["p_value"] == pytest.approx(bootstrap["p_value"])
        assert bootstrap["bleu_system"] == pytest.approx(entry["bleu_after"])
    assert tuning["test"]["bleu_after"] == results["bleu"]
    # The optimizer was fresh: the run counts its own 4 steps, not 8 + 4.
    assert results["steps"] == 4
    # One validation (at step 4): too few to judge convergence, and results.json says so.
    assert results["convergence"]["verdict"] == "unknown"
    recorded = json.loads((out / "config.json").read_text())
    assert recorded["identity"]["init_from"] == str(old_out)
    # Prepared data of another vocabulary are refused for a fine-tuning run.
    from pipelines.corpora import open_corpus
    from pipelines.prepared import prepare_corpus

    unrelated = root / "unrelated_prepared"
    prepare_corpus(open_corpus(new_data, "train", "xx", "yy"), unrelated, vocab_size=300,
                   max_length=32)
    with pytest.raises(UsageError, match="another vocabulary"):
        run_training(train_config(data=str(new_data), out=str(root / "other_prepared"),
                                  max_steps=4, init_from=str(old_out), prepared=str(unrelated),
                                  **TINY))


def test_the_old_test_split_is_read_where_the_old_run_read_it(tmp_path):
    """A tfds run read its data from its --data-dir (and --manual-dir): the old test split
    is loaded from there too, not downloaded into tfds' default folder."""
    arguments = {"data": "tfds:wmt14_translate/de-en", "src": "de,fr", "tgt": "en",
                 "test_split": "test", "data_dir": str(tmp_path / "tfds"), "manual_dir": None}
    calls = []

    def load(*args, **kwargs):
        calls.append((args, kwargs))
        return "the test split"

    run = InitialRun(tmp_path, {"arguments": arguments}, {})
    assert old_test_corpus(run, load) == "the test split"
    assert calls == [(("tfds:wmt14_translate/de-en", "test", "de", "en"),
                      {"data_dir": str(tmp_path / "tfds"), "manual_dir": None})]
    assert old_test_corpus(InitialRun(tmp_path, {"arguments": {**arguments,
                                                               "test_split": "none"}}, {}),
                           load) is None
    # A --manual-dir is only needed to build tfds' data: one since deleted is not passed.
    for manual_dir, passed in ((tmp_path / "gone", None), (tmp_path, str(tmp_path))):
        calls.clear()
        old_test_corpus(InitialRun(tmp_path, {"arguments": {
            **arguments, "manual_dir": str(manual_dir)}}, {}), load)
        assert calls[0][1]["manual_dir"] == passed
