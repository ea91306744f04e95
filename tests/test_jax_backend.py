"""The model and its training step under Keras' JAX backend (issue 36), checked on CPU.

Keras picks its backend once per process, so the JAX side runs in one subprocess
(`tests/jax_backend_checks.py`, KERAS_BACKEND=jax, two host devices) shared by every test
here; this process (TensorFlow) writes what it compares with: a model's weights and its
logits on real Multi30k val sentences.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import keras
import numpy as np
import pytest
import sentencepiece as spm

from keras_transformer.model.transformer import build_transformer
from pipelines.constants import BOS_ID, EOS_ID
from pipelines.textfiles import read_text_file
from tests.cli.test_train import REPO, cli_env

pytestmark = pytest.mark.integration

PARITY_CONFIG = dict(preset="small", vocab_size=1000, num_layers=2)
VAL_PAIRS = 48


def _val_batch(multi30k_dir, model_dir):
    """48 Multi30k val pairs as (source, target) id batches, tokenized by a 1,000-piece BPE
    model trained here on the first 4,000 training pairs."""
    sentences = [line for language in ("de", "en")
                 for line in read_text_file(multi30k_dir / f"train.{language}.gz")[:4000]]
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(sentences), model_prefix=str(model_dir / "bpe"), vocab_size=1000,
        model_type="bpe", pad_id=0, unk_id=1, bos_id=2, eos_id=3, minloglevel=2)
    processor = spm.SentencePieceProcessor(model_file=str(model_dir / "bpe.model"))
    assert (processor.bos_id(), processor.eos_id()) == (BOS_ID, EOS_ID)
    sources = [processor.encode(s) + [EOS_ID]
               for s in read_text_file(multi30k_dir / "val.de.gz")[:VAL_PAIRS]]
    targets = [[BOS_ID] + processor.encode(t)
               for t in read_text_file(multi30k_dir / "val.en.gz")[:VAL_PAIRS]]

    def padded(rows):
        array = np.zeros((len(rows), max(map(len, rows))), "int32")
        for i, row in enumerate(rows):
            array[i, :len(row)] = row
        return array

    return padded(sources), padded(targets)


def _tensorflow_loss_gradient(logits, labels):
    """d/d logits of the label-smoothed (0.1) token losses summed over real tokens, under
    TensorFlow (its own hand-written gradient)."""
    import tensorflow as tf

    from keras_transformer.training.losses import token_cross_entropy

    logits = tf.constant(logits)
    with tf.GradientTape() as tape:
        tape.watch(logits)
        loss = tf.reduce_sum(token_cross_entropy(labels, logits, 0.1)
                             * tf.cast(labels != 0, tf.float32))
    return tape.gradient(loss, logits).numpy()


@pytest.fixture(scope="module")
def jax_results(tmp_path_factory, multi30k_dir) -> dict:
    work = tmp_path_factory.mktemp("jax_backend")
    source, target = _val_batch(multi30k_dir, work)
    keras.utils.set_random_seed(5)
    config = dict(PARITY_CONFIG)
    model = build_transformer(config.pop("preset"), **config)
    logits = np.asarray(model({"source": source, "target": target}, training=False))
    model.save_weights(work / "parity.weights.h5")
    # The loss's labels: the targets shifted left, padded with 0 (weighted 0).
    labels = np.concatenate([target[:, 1:], np.zeros_like(target[:, :1])], 1)
    np.savez(work / "parity_inputs.npz", source=source, target=target, tf_logits=logits,
             labels=labels, tf_gradient=_tensorflow_loss_gradient(logits, labels),
             config=json.dumps(PARITY_CONFIG))
    result = subprocess.run(
        [sys.executable, str(REPO / "tests" / "jax_backend_checks.py"), str(work)],
        env=cli_env(KERAS_BACKEND="jax", JAX_PLATFORMS="cpu",
                    XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} "
                    "--xla_force_host_platform_device_count=2"),
        capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads((work / "jax_results.json").read_text())


def test_the_model_and_training_step_import_no_tensorflow_under_jax(jax_results):
    assert jax_results["imports"] == {"backend": "jax", "tensorflow_imported": False}


def test_tensorflow_weights_give_the_same_logits_under_jax(jax_results):
    parity = jax_results["parity"]
    assert parity["backend_of_parity"] == "jax"
    assert parity["parity_shape"][0] == VAL_PAIRS and parity["parity_shape"][2] == 1000
    assert parity["parity_max_relative_difference"] <= 1e-4


def test_the_loss_gradient_written_by_hand_is_autodiffs_and_tensorflows(jax_results):
    found = jax_results["loss_gradient"]
    assert found["real_tokens"] > 500 and found["custom_vjp_in_the_loss"]
    for dtype in ("float32", "bfloat16", "float16"):
        for eps in (0.1, 0.0):
            case = found[f"{dtype}_eps{eps}"]
            assert case["gradient_dtype"] == dtype  # written in the logits' dtype
            autodiff, closed_form = case["values"]
            assert abs(autodiff - closed_form) <= 1e-6 * abs(autodiff)  # the same loss
            difference = case["gradient_max_difference_to_largest"]
            if dtype == "float32":  # eps / V alone is 1e-4 of the largest element here
                assert difference <= 1e-6, eps
            elif dtype == "bfloat16":  # a unit or two in the last place, element by element
                assert difference <= 2.0**-7, eps  # (one unit is 2^-8 to 2^-7 of a value)
                assert case["gradient_max_elementwise_difference"] <= 2.0**-6, eps
            else:  # float16: a unit in the last place of the largest (small ones are subnormal)
                assert difference <= 2.0**-10, eps
    assert found["float32_eps0.1"]["against_tensorflow"] <= 1e-5
    # Autodiff scatters the label's gather into (tokens, vocab) zeros; the closed form not.
    assert found["scatters"]["closed_form"] == 0


def test_the_logits_statistics_are_one_reduction_on_accelerators_with_the_same_values(
        jax_results):
    found = jax_results["token_statistics"]
    # The one reduction as XLA:CPU runs it (element by element), and its combiner applied
    # as a tree (chunks combined in a shuffled order), against the separate reductions.
    for dtype in ("float32", "bfloat16", "float16"):
        for form in ("one", "tree"):
            case = found[f"{dtype}_{form}"]
            assert case["log_normalizer_relative"] <= 1e-6, (dtype, form)  # summation order
            assert case["label_logit_difference"] == 0.0, (dtype, form)  # the same element
            assert case["mean_logit_difference_to_largest"] <= 1e-6, (dtype, form)
            assert case["argmax_disagreements"] == 0, (dtype, form)
            assert case["loss_relative"] <= 1e-6, (dtype, form)
    # The first of tied maxima wins, as do an inf and a NaN (as jnp.argmax has it), in
    # every form; a row with inf or NaN gives a non-finite loss (loss scaling needs it).
    forms = ("separate", "one", "tree")
    assert found["tricky_best"] == {form: [49, 3, 10, 20] for form in forms}
    finite = [True, True, False, False]
    assert found["non_finite_log_normalizer"] == {form: finite for form in forms}
    assert found["non_finite_loss"] == {form: finite for form in forms}
    # Lowered for a GPU the statistics are one variadic reduction; for a CPU, five.
    assert found["reductions_lowered_for"] == {"cuda": 1, "cpu": 5}


def test_accumulation_is_exact_under_jax(jax_results):
    accumulation = jax_results["accumulation"]
    assert accumulation["adam_iterations"] == [2, 2]  # updates, not micro-batches
    # Adam turns the round-off of near-zero gradients into steps of the learning rate's
    # size (~0.03 here): a bound of a few percent of one step. The SGD step (rate 1: minus
    # the gradient) is the exact check: the token mean over all micro-batches.
    assert accumulation["adam_max_difference"] < 1e-3
    assert accumulation["sgd_same_start"]
    assert accumulation["sgd_relative_error"] < 1e-5


def test_data_parallel_over_two_devices_gives_the_single_device_update(jax_results):
    parallel = jax_results["data_parallel"]
    assert parallel["devices"] == 2
    assert parallel["data_parallel_iterations"] == 1
    assert parallel["data_parallel_relative_error"] < 1e-5  # the SGD step, as above


def test_mixed_float16_skips_overflowing_updates_and_counts_them_as_steps(jax_results):
    # A scale of 2^60 overflows float16: the update is skipped, counted, and the scale halved.
    assert jax_results["loss_scaling"] == {"skipped_updates": 1, "iterations": 1,
                                           "weights_unchanged": True, "scale": 2.0**59}


def test_dropout_draws_16_bit_masks_with_keras_distribution_under_jax(jax_results):
    dropout = jax_results["dropout"]
    assert dropout["backend"] == "jax"
    # 500k Bernoulli draws: the standard error of the kept fraction is under 7e-4.
    assert abs(dropout["kept_fraction"] - 0.7) < 4e-3
    assert len(dropout["survivor_values"]) == 1
    assert abs(dropout["survivor_values"][0] - dropout["scale"]) < 1e-6
    assert abs(dropout["scale"] - 1 / 0.7) < 1e-4  # the rate rounded to 16 bits
    assert dropout["mask_is_the_16_bit_draw"] and dropout["masks_differ_between_calls"]
    assert dropout["gradient_is_the_scaled_mask"]
    assert dropout["bfloat16_dtype"] == "bfloat16"
    assert dropout["devices"] == 2 and dropout["collectives_when_split_by_rows"] == 0
    assert dropout["identity_when_not_training"]


def test_flash_attention_by_lengths_matches_the_explicit_masks_under_jax(jax_results):
    flash = jax_results["flash_attention"]
    assert flash["implementation_on_cpu"] == "xla"  # cuDNN's only on an NVIDIA GPU
    # Every attention of the flash model took the flash path (encoder self, decoder self
    # (causal), cross: 3 a layer pair), none of the other model's.
    assert flash["flash_calls"] == [0, 3 * flash["layers"]]
    assert flash["causal_flash_calls"] == flash["layers"]
    # float32: the same sums in another order (the padding masked by lengths, not a mask).
    assert flash["logits_max_relative_difference"] <= 1e-5
    assert flash["one_token_max_relative_difference"] <= 1e-5
    assert abs(flash["loss"][0] - flash["loss"][1]) <= 1e-5 * abs(flash["loss"][0])
    assert flash["gradient_max_relative_difference"] <= 1e-4
    assert flash["key_bias_gradient_to_largest"] <= 1e-5  # zero, but for round-off
    assert flash["gradients_finite"] and flash["real_target_tokens"] > 0
    # mixed_bfloat16: no further from float32 than the explicit path (0.5% here).
    assert flash["bfloat16_error_flash"] <= 1.5 * flash["bfloat16_error_explicit"] + 1e-3
    assert flash["bfloat16_error_flash"] <= 0.02
    assert "attention dropout 0.1" in flash["refusal_with_attention_dropout"]
