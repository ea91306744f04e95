"""Distribution strategy selection and a replica-count-invariant loss.

Strategies:
  * `TF_CONFIG` naming two or more tasks -> `MultiWorkerMirroredStrategy` (one process per
    worker; every worker runs the same command; see `keras_transformer.cluster`);
  * several local GPUs (or several logical CPUs, as the tests configure) -> `MirroredStrategy`;
  * otherwise the default strategy (one device; no mirrored-variable overhead).

How Keras 3's TF trainer combines replicas (keras/src/backend/tensorflow/trainer.py,
losses/loss.py, optimizer.py): each replica computes its loss, `Loss.__call__` divides it by
the number of replicas only when the loss is not already a scalar (ours is: a masked mean),
the gradients are *summed* over replicas, and the logged loss is the replica value times the
replica count, averaged with batch-size weights. With token-budget batches the replicas hold
different numbers of tokens, so no per-replica mean reproduces the single-device update.
`GlobalTokenCrossEntropy` divides each replica's token-loss sum by the *global* token count
(one all-reduce): the summed gradients are then exactly those of the global-batch mean.

Two Keras 3.15 behaviours are worked around (see the functions' docstrings):
`build_for_distributed_fit` (fit's first-batch pull fails on differently shaped replica
batches and drops a batch) and `patch_keras_multi_worker_logs` (scalar logs cannot be
reduced across workers, tensorflow/tensorflow#72388).
"""

from __future__ import annotations

import tensorflow as tf
from keras import ops

from keras_transformer.cluster import (
    DEFAULT_JOIN_TIMEOUT,
    Cluster,
    read_cluster,
    start_multi_worker_strategy,
)
from keras_transformer.losses import LabelSmoothedCrossEntropy


def select_strategy(cluster: Cluster | None = None,
                    join_timeout: float = DEFAULT_JOIN_TIMEOUT) -> tf.distribute.Strategy:
    """The strategy for this machine/cluster (see module docstring).

    Must run before other TensorFlow work: `MultiWorkerMirroredStrategy` has to be created
    before the runtime is initialized.

    Args:
        cluster: the `TF_CONFIG` cluster (read from the environment if None).
        join_timeout: seconds a worker waits for the others to start.

    Raises:
        ClusterConfigError: a bad `TF_CONFIG`, a port in use, or a peer that never came up.
    """
    cluster = read_cluster() if cluster is None else cluster
    if cluster.is_multi_worker:
        patch_keras_multi_worker_logs()
        return start_multi_worker_strategy(cluster, join_timeout)
    gpus = tf.config.list_logical_devices("GPU")
    if len(gpus) > 1:
        return tf.distribute.MirroredStrategy([gpu.name for gpu in gpus])
    if gpus:
        return tf.distribute.OneDeviceStrategy(gpus[0].name)
    cpus = tf.config.list_logical_devices("CPU")
    if len(cpus) > 1:
        return tf.distribute.MirroredStrategy([cpu.name for cpu in cpus])
    return tf.distribute.get_strategy()


class GlobalTokenCrossEntropy(LabelSmoothedCrossEntropy):
    """`LabelSmoothedCrossEntropy` normalized by the token count of the *global* batch.

    With S_r the summed token losses of replica r, S their sum over replicas, N the global
    token count and R the replica count, each replica's gradient is that of S_r / N; Keras
    sums them over replicas: the gradient of S / N, the single-device loss of the global
    batch. The *value* returned is S / (N R) (a stop-gradient term), because Keras logs the
    value times R: the logged loss is then S / N too.

    Call arguments:
        y_true: int labels (batch, length), 0 = padding.
        y_pred: logits (batch, length, vocab).

    Returns:
        float32 scalar.
    """

    def call(self, y_true, y_pred):
        local, local_tokens = self.sum_and_count(y_true, y_pred)
        context = tf.distribute.get_replica_context()
        if context is None or context.num_replicas_in_sync == 1:
            return local / ops.maximum(local_tokens, 1.0)
        replicas = context.num_replicas_in_sync
        local_and_tokens = ops.stack([ops.stop_gradient(local), local_tokens])
        total, tokens = ops.unstack(context.all_reduce(tf.distribute.ReduceOp.SUM,
                                                       local_and_tokens))
        tokens = ops.maximum(tokens, 1.0)
        gradient_part = local / tokens
        return gradient_part + ops.stop_gradient(total / (tokens * replicas) - gradient_part)


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
    from keras.src import tree
    from keras.src.backend.tensorflow import trainer as tf_trainer

    original = tf_trainer.reduce_per_replica
    if getattr(original, "keras_transformer_patch", False):
        return

    def reduce_per_replica(values, strategy, reduction):
        if reduction in ("auto", "mean") and tf_trainer._collective_all_reduce_multi_worker(
                strategy):
            return tree.map_structure(lambda v: strategy.reduce("MEAN", v, axis=None), values)
        return original(values, strategy, reduction)

    reduce_per_replica.keras_transformer_patch = True
    tf_trainer.reduce_per_replica = reduce_per_replica
