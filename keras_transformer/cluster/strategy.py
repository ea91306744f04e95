"""Distribution strategy selection.

Strategies:
  * `TF_CONFIG` naming two or more tasks -> `MultiWorkerMirroredStrategy` (one process per
    worker; every worker runs the same command; see `keras_transformer.cluster.workers`);
  * several local GPUs (or several logical CPUs, as the tests configure) -> `MirroredStrategy`;
  * otherwise the default strategy (one device; no mirrored-variable overhead).

The loss that makes replicas add up to one device's update is
`keras_transformer.training.losses.GlobalTokenCrossEntropy`; the Keras workarounds are in
`keras_transformer.cluster.keras_patches`.
"""

from __future__ import annotations

import tensorflow as tf

from keras_transformer.cluster.keras_patches import patch_keras_multi_worker_logs
from keras_transformer.cluster.workers import (
    DEFAULT_JOIN_TIMEOUT,
    Cluster,
    read_cluster,
    start_multi_worker_strategy,
)


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
