"""Workarounds for two Keras 3.15 behaviours under `tf.distribute`.

`build_for_distributed_fit`: fit's first-batch pull fails on differently shaped replica
batches and drops a batch. `patch_keras_multi_worker_logs`: scalar logs cannot be reduced
across workers (tensorflow/tensorflow#72388).
"""

from __future__ import annotations


def build_for_distributed_fit(model, sample_batch) -> None:
    """Builds the compiled loss/metrics from `sample_batch` and stops `fit` from doing so.

    Under a strategy, Keras 3's `fit` first pulls one batch from the training iterator and
    averages it over replicas to build metrics symbolically
    (`TensorFlowTrainer._maybe_symbolic_build`). With token-budget batches that fails
    (replicas hold differently shaped batches), and with `steps_per_epoch` the pulled
    batch is never trained on, which would shift a resumed run's data by one batch. So the
    build happens here, from a local batch, and the per-`fit` pull is disabled.

    Args:
        model: a compiled model, created under `strategy.scope()`.
        sample_batch: `(features, labels)` of one (non-distributed) batch; only shapes and
            dtypes are used.
    """
    # Private Keras API, on purpose (checked against Keras 3.15.1): Keras exports no way to
    # build the compiled loss/metrics from a given batch, nor to stop `fit`'s pull of one
    # (`Model._symbolic_build`, `TensorFlowTrainer._maybe_symbolic_build`). Recheck both
    # when upgrading Keras (tests/cluster/test_strategy.py and test_accumulation.py run this).
    features, labels = sample_batch
    with model.distribute_strategy.scope():
        model._symbolic_build(data_batch=(features, labels, None))
    model._maybe_symbolic_build = lambda iterator=None, data_batch=None: None


def patch_keras_multi_worker_logs() -> None:
    """Lets Keras 3 `fit`/`evaluate` run under `MultiWorkerMirroredStrategy`.

    Keras 3.15 reduces each step's logs (scalar metric results) across workers with
    `strategy.reduce("MEAN", value, axis=0)`, which fails for scalars ("Invalid reduction
    dimension 0 for input with 0 dimensions", tensorflow/tensorflow#72388). This wraps the
    module's `reduce_per_replica` so that, in multi-worker mode only, "auto"/"mean" logs are
    averaged element-wise (`axis=None`); everything else goes to the original. Idempotent.
    """
    import keras

    # Private Keras API, on purpose (checked against Keras 3.15.1): the function patched,
    # `reduce_per_replica`, and `_collective_all_reduce_multi_worker` live only in the private
    # module keras.src.backend.tensorflow.trainer, which `fit`/`evaluate` call them from;
    # Keras exports no hook for how logs are reduced across workers. Recheck on upgrade.
    from keras.src.backend.tensorflow import trainer as tf_trainer

    original = tf_trainer.reduce_per_replica
    if getattr(original, "keras_transformer_patch", False):
        return

    def reduce_per_replica(values, strategy, reduction):
        if reduction in ("auto", "mean") and tf_trainer._collective_all_reduce_multi_worker(
                strategy):
            return keras.tree.map_structure(
                lambda v: strategy.reduce("MEAN", v, axis=None), values)
        return original(values, strategy, reduction)

    reduce_per_replica.keras_transformer_patch = True
    tf_trainer.reduce_per_replica = reduce_per_replica
