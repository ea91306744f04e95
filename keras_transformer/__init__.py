"""keras-transformer: the Transformer of "Attention Is All You Need" (Vaswani et al., 2017) in
Keras 3 / TensorFlow, for machine translation.

The public Python API (everything in `__all__`):

    import keras_transformer as kt

    train = kt.load_corpus("../shared/data/multi30k", "train", "de", "en")
    tokenizer = kt.train_tokenizer(train.sources + train.targets, "tokenizer", vocab_size=8000)
    batches = kt.make_batches(train, tokenizer, tokens_per_batch=4096)
    model = kt.build_transformer("small", vocab_size=tokenizer.vocab_size)
    model.compile(optimizer=kt.paper_adam(model.config.d_model),
                  loss=kt.LabelSmoothedCrossEntropy(0.1), metrics=[kt.MaskedAccuracy()])
    model.fit(batches, epochs=1, shuffle=False)  # make_batches shuffles already
    kt.translate_texts(model, tokenizer, ["Ein Hund rennt."], beam_size=4)
    kt.Translator.load("runs/multi30k-de-en").translate(["Ein Hund rennt."])

`kt.build_trainer` builds the same model (same weights) whose `compile` also takes
`accumulate_steps=N` and which, under mixed_float16, counts loss-scale skips as steps.

The whole run of `python -m keras_transformer.train`, from Python:

    config = kt.train_config(recipe="multi30k", data="../shared/data/multi30k", src="de",
                             tgt="en", out="runs/multi30k-de-en")  # the flags, by name
    results = kt.run_training(config)  # prepare, train, average, score, export

Names are imported on first use, so `import keras_transformer` itself is cheap (and the
command-line tools can configure TensorFlow's logging before TensorFlow loads).
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

if sys.argv[:1] == ["-m"]:
    # `python -m keras_transformer.<command>`: Python imports this package before the command
    # (sys.argv[0] is "-m" only then), which is the moment to filter TensorFlow's C++ log
    # lines, before anything loads TensorFlow. Library users' imports are left alone.
    from keras_transformer.logs import start_cli_logging

    start_cli_logging()

# name -> the module that defines it (the one obvious home of each idea).
_EXPORTS = {
    # 3. Model architecture: the model, its presets and its layers.
    "Transformer": "keras_transformer.model.transformer",
    "TransformerConfig": "keras_transformer.model.config",
    "PRESETS": "keras_transformer.model.config",
    "build_transformer": "keras_transformer.model.transformer",
    "transformer_config": "keras_transformer.model.config",
    "MultiHeadAttention": "keras_transformer.layers",
    "PositionalEmbedding": "keras_transformer.layers",
    "EncoderLayer": "keras_transformer.layers",
    "DecoderLayer": "keras_transformer.layers",
    "FeedForward": "keras_transformer.layers",
    # 5.1 Training data: corpora, the shared subword vocabulary, token-budget batches.
    "load_corpus": "pipelines.corpora",
    "open_corpus": "pipelines.corpora",
    "ParallelCorpus": "pipelines.corpora",
    "SubwordTokenizer": "pipelines.tokenizer",
    "train_tokenizer": "pipelines.tokenizer",
    "make_batches": "pipelines.batching",
    "prepare_corpus": "pipelines.prepared",
    "PreparedCorpus": "pipelines.prepared",
    # 5.3 Optimizer (Adam and the warmup schedule), 5.4 regularization (label smoothing).
    "NoamSchedule": "keras_transformer.training.optimizer",
    "paper_adam": "keras_transformer.training.optimizer",
    "LabelSmoothedCrossEntropy": "keras_transformer.training.losses",
    "GlobalTokenCrossEntropy": "keras_transformer.training.losses",
    "MaskedAccuracy": "keras_transformer.training.losses",
    "Perplexity": "keras_transformer.training.losses",
    # 5 Training beyond plain Keras: gradient accumulation, step-counting loss scaling.
    "TransformerTrainer": "keras_transformer.training.trainer_model",
    "build_trainer": "keras_transformer.training.trainer_model",
    "select_strategy": "keras_transformer.cluster.strategy",
    "build_for_distributed_fit": "keras_transformer.cluster.keras_patches",
    "RECIPES": "keras_transformer.training.recipes",
    # 6.1 Checkpoint averaging, beam search, translation and its score.
    "average_checkpoints": "keras_transformer.training.checkpoints",
    "greedy_search": "keras_transformer.decoding.search",
    "beam_search": "keras_transformer.decoding.search",
    "InferenceModel": "keras_transformer.decoding.inference_decoder",
    "translate_texts": "keras_transformer.decoding.translator",
    "translate_batch": "keras_transformer.decoding.translator",
    "force_decode": "keras_transformer.decoding.translator",
    "back_translate": "keras_transformer.decoding.back_translation",
    "Translation": "keras_transformer.decoding.results",
    "Hypothesis": "keras_transformer.decoding.results",
    "word_alignment": "keras_transformer.decoding.alignment",
    "alignment_error_rate": "keras_transformer.decoding.alignment",
    "InputTooLong": "keras_transformer.decoding.long_inputs",
    "Translator": "keras_transformer.serving.translator",
    "load_translator": "keras_transformer.serving.translator",
    "score_translations": "keras_transformer.decoding.scoring",
    "paired_bootstrap": "keras_transformer.decoding.scoring",
    "validation_loss": "keras_transformer.training.losses",
    "attention_weights": "keras_transformer.decoding.attention_plots",
    "plot_attention": "keras_transformer.decoding.attention_plots",
    # A whole run, as `python -m keras_transformer.train`: its typed settings and entry point.
    "TrainConfig": "keras_transformer.training.config",
    "train_config": "keras_transformer.training.config",
    "run_training": "keras_transformer.training.run",
    "TrainingDiverged": "keras_transformer.errors",
    "UsageError": "keras_transformer.errors",
    "StorageError": "keras_transformer.errors",
    # Runs and exports.
    "load_run": "keras_transformer.run_directory",
    "export_saved_model": "keras_transformer.serving.saved_model",
    "export_ctranslate2": "keras_transformer.serving.ctranslate2",
    "translate_with_ctranslate2": "keras_transformer.serving.ctranslate2",
    "translate_batch_with_ctranslate2": "keras_transformer.serving.ctranslate2_translation",
    "force_decode_with_ctranslate2": "keras_transformer.serving.ctranslate2_translation",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'keras_transformer' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
