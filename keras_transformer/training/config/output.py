"""`OutputConfig` (the run directory, checkpoints, the export) and `ClusterConfig` (several
machines)."""

from __future__ import annotations

import dataclasses

from keras_transformer.cluster.workers import DEFAULT_JOIN_TIMEOUT
from keras_transformer.training.config.fields import positive, setting


@dataclasses.dataclass
class OutputConfig:
    """The run directory, how often it is checkpointed, and the SavedModel export."""

    out: str = setting(help="run directory")
    checkpoint_every: int = setting(200, "steps between checkpoints (and resumable backups)",
                                     positive)
    export_dir: str | None = setting(None, "SavedModel base (default saved_models/<run name>)")
    no_export: bool = setting(False, "skip the SavedModel export")
    overwrite: bool = setting(False, "delete an existing run directory and start over")
    resume: bool = setting(False, "require an interrupted run to resume (it is resumed anyway "
                            "if found)")
    verbose: bool = setting(False, "also show TensorFlow's own C++ logs and Keras' "
                             "per-interval lines (hidden by default, unless you set "
                             "TF_CPP_MIN_LOG_LEVEL yourself)")


@dataclasses.dataclass
class ClusterConfig:
    """Several machines (`TF_CONFIG`): see `keras_transformer.cluster.workers`."""

    join_timeout: float = setting(DEFAULT_JOIN_TIMEOUT, "seconds each worker waits for all "
                                   "the others to start", positive)
