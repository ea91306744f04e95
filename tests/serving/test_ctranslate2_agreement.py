"""CTranslate2 translates as we do on real sentences (issue 17's equivalence bars): a model
trained briefly on Multi30k, exported, and both engines run on 200 test sentences.

The model is tiny and barely trained (tens of seconds), so its translations are poor, but they
are real: sentences of varied lengths that end with EOS, with near-ties between tokens where
two engines' round-off could part ways. `benchmarks/ctranslate2_agreement.py` runs the same
comparison on a fully trained model.
"""

from __future__ import annotations

import dataclasses

import ctranslate2
import keras
import pytest
import sacrebleu
import sentencepiece as spm

from keras_transformer.decoding.translator import translate_texts
from keras_transformer.serving.ctranslate2 import export_ctranslate2, translate_with_ctranslate2
from keras_transformer.training.losses import LabelSmoothedCrossEntropy
from keras_transformer.training.optimizer import paper_adam
from keras_transformer.training.trainer_model import build_trainer
from pipelines.batching import make_batches
from pipelines.corpora import load_corpus
from pipelines.tokenizer import train_tokenizer

SENTENCES = 200
TRAIN_PAIRS = 10_000
STEPS = 400


@pytest.fixture(scope="module")
def trained(multi30k_dir, tmp_path_factory):
    """(model, tokenizer, CTranslate2 translator, its SentencePiece processor, test split)."""
    folder = tmp_path_factory.mktemp("agreement")
    train = load_corpus(str(multi30k_dir), "train", "de", "en")
    train = dataclasses.replace(train, sources=train.sources[:TRAIN_PAIRS],
                                targets=train.targets[:TRAIN_PAIRS])
    tokenizer = train_tokenizer(train.sources + train.targets, folder / "tokenizer",
                                vocab_size=2000)
    keras.utils.set_random_seed(0)
    model = build_trainer("tiny", vocab_size=tokenizer.vocab_size, d_model=64, d_ff=256)
    model.compile(optimizer=paper_adam(64, warmup_steps=100),
                  loss=LabelSmoothedCrossEntropy(0.1))
    batches = make_batches(train, tokenizer, tokens_per_batch=2048, repeat=True)
    model.fit(batches, steps_per_epoch=STEPS, epochs=1, verbose=0)
    export_ctranslate2(model, tokenizer, folder / "ct2")
    translator = ctranslate2.Translator(str(folder / "ct2"), device="cpu", intra_threads=2)
    pieces = spm.SentencePieceProcessor(model_file=str(folder / "ct2" / "sentencepiece.model"))
    test = load_corpus(str(multi30k_dir), "test", "de", "en")
    return model, tokenizer, translator, pieces, test


def test_greedy_outputs_are_the_same_strings(trained):
    model, tokenizer, translator, pieces, test = trained
    sources = test.sources[:SENTENCES]
    ours = translate_texts(model, tokenizer, sources, beam_size=1)
    theirs = translate_with_ctranslate2(translator, pieces, sources, beam_size=1)
    assert len(set(ours)) > SENTENCES // 4  # real, varied translations
    different = [(a, b) for a, b in zip(ours, theirs, strict=True) if a != b]
    print(f"{len(set(ours))} distinct translations, {len(different)} different")
    assert len(different) <= 0.02 * SENTENCES, different[:5]


def test_beam_search_bleu_is_the_same(trained):
    model, tokenizer, translator, pieces, test = trained
    sources, references = test.sources[:SENTENCES], [test.targets[:SENTENCES]]
    ours = translate_texts(model, tokenizer, sources, beam_size=4, alpha=0.6)
    theirs = translate_with_ctranslate2(translator, pieces, sources, beam_size=4, alpha=0.6)
    ours_bleu = sacrebleu.corpus_bleu(ours, references).score
    theirs_bleu = sacrebleu.corpus_bleu(theirs, references).score
    print(f"BLEU ours {ours_bleu:.2f}, CTranslate2 {theirs_bleu:.2f}")
    assert ours_bleu > 1.0  # the model has learnt something to agree on
    assert abs(ours_bleu - theirs_bleu) <= 0.3, (ours_bleu, theirs_bleu)
