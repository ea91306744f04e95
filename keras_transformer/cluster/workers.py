"""Training on several machines without hanging: `TF_CONFIG` checked before TensorFlow
starts, a `MultiWorkerMirroredStrategy` whose waits are bounded, stops taken by every worker
at the same step, and one clear error when a worker is lost.

Every worker runs the same command with its own `TF_CONFIG`; the chief (the "chief" task, or
worker 0 without one) writes the run directory. TensorFlow's coordination service, hosted by
the chief, watches the workers. The bounds (measured on 127.0.0.1, TensorFlow 2.21):

- **Start.** A worker whose peers do not all come up within `join_timeout` seconds fails
  with one error naming them (the coordination service's registration barrier); a port
  already in use, or a malformed `TF_CONFIG`, fails at once.
- **A worker dies** (killed, crashed, stopped by SIGSTOP, its machine lost). The coordination
  service declares it lost when its heartbeats (sent by a thread of their own) stop for
  `HEARTBEAT_SECONDS` and aborts every collective; peers that were talking to it directly
  see their connection reset sooner (~2 s when the chief dies). The survivors raise from the
  step they are in, within `LOST_WORKER_SECONDS`; `cluster_error` turns that into one
  `ClusterFailure`, and the train command leaves without tearing TensorFlow down (which
  waits for the input pipeline's threads). A process that is alive but stuck (a hung filesystem, a deadlock) still
  sends heartbeats and is not detected: collectives have no timeout, since a checkpoint or
  a first compilation can legitimately keep one worker away for minutes.
- **A worker refuses** (a bad flag, corpus, run directory, or settings other than the
  chief's: `check_same_settings`). It tells the others (`report_refusal`), which stop at
  once with its reason (`PeerRefused`) instead of losing its heartbeats.
- **Waiting for the chief's data.** Workers wait at a coordination barrier (`wait_for_all`),
  which fails as soon as a participant is lost, not after its timeout.
- **Stopping.** A worker that leaves the training loop alone would leave the others waiting
  in their next all-reduce forever. Stops decided from all-reduced values (step count, the
  loss for NaN, the validation loss for patience) are the same everywhere; the wall clock
  is not, so every stop is agreed (`any_worker`) at an update boundary.

Restarting every worker with the same command resumes the run from the chief's last backup
(`keras_transformer.training.callbacks.RunCheckpointer`), as Keras' `BackupAndRestore` does.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import re
import signal
import socket
from collections.abc import Callable

# TensorFlow is imported inside the functions that need it: `read_cluster` checks TF_CONFIG
# before TensorFlow starts, and the command lines' flags (which use the constants below) load
# without it (`--help` in 0.1 s instead of ~4 s).

HEARTBEAT_SECONDS = 10  # a worker silent this long is declared lost (TensorFlow's default)
# The stated bound for the survivors of a lost worker to exit: its heartbeats' timeout, then
# the abort of the step in progress (measured: 11 s for a killed worker, 2 s for the chief).
LOST_WORKER_SECONDS = 2 * HEARTBEAT_SECONDS
DEFAULT_JOIN_TIMEOUT = 300  # seconds every worker waits for the others to start
_JOBS = ("chief", "worker")  # MultiWorkerMirroredStrategy's training tasks


class ClusterConfigError(ValueError):
    """The cluster cannot start: a malformed `TF_CONFIG`, a port in use, a missing peer."""


class ClusterFailure(RuntimeError):
    """A started multi-worker run lost a worker; restarting every worker resumes it."""


class PeerRefused(ClusterConfigError):
    """Another worker refused to train (a bad flag, corpus, run directory or setting)."""


# Marks the errors `report_refusal` sends to the other workers.
_REFUSAL = "[keras_transformer refusal] "


@dataclasses.dataclass(frozen=True)
class Cluster:
    """The training tasks of `TF_CONFIG` and which one this process is.

    Attributes:
        jobs: "chief" and/or "worker" -> their "host:port" addresses; empty for one process.
        task_type: this process's job ("chief" or "worker").
        task_index: this process's index in its job.
    """

    jobs: dict[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    task_type: str = "worker"
    task_index: int = 0

    @property
    def num_workers(self) -> int:
        """Training processes (chief and workers); 1 without `TF_CONFIG`."""
        return max(1, sum(len(self.jobs.get(job, ())) for job in _JOBS))

    @property
    def is_multi_worker(self) -> bool:
        return self.num_workers > 1

    @property
    def is_chief(self) -> bool:
        """The task that writes checkpoints, logs and exports: the "chief" task if the
        cluster has one, else worker 0 (TensorFlow's convention)."""
        if self.task_type == "chief":
            return True
        return "chief" not in self.jobs and self.task_index == 0

    @property
    def address(self) -> str:
        return self.jobs[self.task_type][self.task_index]

    @property
    def port(self) -> int:
        return int(self.address.rpartition(":")[2])

    def peers(self) -> list[tuple[str, int]]:
        """(job, index) of every other task."""
        return [(job, index) for job, addresses in self.jobs.items()
                for index in range(len(addresses))
                if (job, index) != (self.task_type, self.task_index)]

    def describe(self, job: str | None = None, index: int | None = None) -> str:
        """E.g. "worker 1 (host2:12345)"; this task by default."""
        job = self.task_type if job is None else job
        index = self.task_index if index is None else index
        return f"{job} {index} ({self.jobs[job][index]})"

    def chief_task(self) -> tuple[str, int]:
        """(job, index) of the chief, which also hosts the coordination service."""
        return ("chief", 0) if "chief" in self.jobs else ("worker", 0)


def read_cluster(raw: str | None = None) -> Cluster:
    """The cluster `TF_CONFIG` (or `raw`) describes, checked before TensorFlow starts.

    Raises:
        ClusterConfigError: not JSON, no "cluster", tasks other than chief/worker, an address
            that is not host:port, a duplicate address, several chiefs, or a task type or
            index that the cluster does not have.
    """
    raw = os.environ.get("TF_CONFIG", "") if raw is None else raw
    if not raw.strip():
        return Cluster()
    try:
        config = json.loads(raw)
    except json.JSONDecodeError as error:
        raise ClusterConfigError(f"TF_CONFIG is not valid JSON ({error}); expected e.g. "
                                 '{"cluster": {"worker": ["host1:12345", "host2:12345"]}, '
                                 '"task": {"type": "worker", "index": 0}}') from None
    if not isinstance(config, dict) or not isinstance(config.get("cluster"), dict):
        raise ClusterConfigError('TF_CONFIG has no "cluster" object (job name -> list of '
                                 '"host:port")')
    cluster, task = config["cluster"], config.get("task", {})
    other = sorted(set(cluster) - set(_JOBS))
    if other:
        raise ClusterConfigError(f"TF_CONFIG names {other} tasks: MultiWorkerMirroredStrategy "
                                 "trains on 'chief' and 'worker' tasks only")
    jobs: dict[str, tuple[str, ...]] = {}
    for job in _JOBS:
        addresses = cluster.get(job, [])
        if not isinstance(addresses, list) or not all(isinstance(a, str) for a in addresses):
            raise ClusterConfigError(f'TF_CONFIG cluster "{job}" must be a list of "host:port" '
                                     f"strings, got {addresses!r}")
        for address in addresses:
            _check_address(address, job)
        if addresses:
            jobs[job] = tuple(addresses)
    if len(jobs.get("chief", ())) > 1:
        raise ClusterConfigError(f"TF_CONFIG names {len(jobs['chief'])} chiefs; a cluster has "
                                 "at most one")
    everyone = [a for job in _JOBS for a in jobs.get(job, ())]
    if len(set(everyone)) != len(everyone):
        raise ClusterConfigError(f"TF_CONFIG lists an address twice: {everyone}")
    if not isinstance(task, dict) or "type" not in task:
        raise ClusterConfigError('TF_CONFIG has no "task" object naming this process, e.g. '
                                 '"task": {"type": "worker", "index": 0}')
    task_type, task_index = task.get("type"), task.get("index", 0)
    if task_type not in jobs:
        raise ClusterConfigError(f'TF_CONFIG task type {task_type!r} is not among the '
                                 f"cluster's jobs {sorted(jobs)}")
    if isinstance(task_index, bool) or not isinstance(task_index, int) or not (
            0 <= task_index < len(jobs[task_type])):
        raise ClusterConfigError(
            f"TF_CONFIG task index {task_index!r} is out of range: the cluster has "
            f"{len(jobs[task_type])} {task_type} task(s), indices 0 to "
            f"{len(jobs[task_type]) - 1}")
    return Cluster(jobs, task_type, task_index)


def _check_address(address: str, job: str) -> None:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ClusterConfigError(f'TF_CONFIG {job} address {address!r} is not "host:port" '
                                 "with a port from 1 to 65535")


def check_port_free(cluster: Cluster) -> None:
    """Refuses to start if this task's port is taken on this machine (TensorFlow's own
    error would be "Could not start gRPC server").

    Raises:
        ClusterConfigError: the port is in use.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC binds
        try:
            probe.bind(("", cluster.port))
        except OSError as error:
            if error.errno != errno.EADDRINUSE:
                raise
            raise ClusterConfigError(_port_in_use(cluster)) from None


def _port_in_use(cluster: Cluster) -> str:
    return (f"this task is {cluster.describe()} in TF_CONFIG, but port "
            f"{cluster.port} is already in use on this machine (another "
            "run, or one still exiting?); stop that process or give this task another port "
            "in every worker's TF_CONFIG")


def start_multi_worker_strategy(cluster: Cluster, join_timeout: float):
    """`MultiWorkerMirroredStrategy` for `cluster`, or one clear error within `join_timeout`.

    Must run before any other TensorFlow work (collectives and the coordination service are
    configured when the runtime starts).

    Raises:
        ClusterConfigError: the port is in use, or not every worker came up in time.
    """
    import tensorflow as tf
    from tensorflow.compiler.xla.tsl.protobuf import coordination_config_pb2
    from tensorflow.python.eager import context

    check_port_free(cluster)
    leader_job, leader_index = cluster.chief_task()
    # Configured before the strategy, which then keeps it (it only fills in a missing one):
    # registration as a barrier bounds the wait for peers that never come up.
    context.context().configure_coordination_service(
        service_type="standalone",
        service_leader=f"/job:{leader_job}/replica:0/task:{leader_index}",
        cluster_register_timeout_in_ms=int(join_timeout * 1000),
        heartbeat_timeout_in_ms=HEARTBEAT_SECONDS * 1000,
        coordinated_jobs=[coordination_config_pb2.CoordinatedJob(name=job, num_tasks=len(tasks))
                          for job, tasks in cluster.jobs.items()])
    context.context().coordination_service.cluster_register_with_barrier = True
    try:
        strategy = tf.distribute.MultiWorkerMirroredStrategy()
    except tf.errors.OpError as error:
        raise ClusterConfigError(_start_failure(cluster, error, join_timeout)) from None
    # The coordination agent catches SIGTERM (for preemption handlers we do not use), which
    # would leave `kill` unable to stop a worker; its peers treat a killed worker as lost.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    return strategy


def _start_failure(cluster: Cluster, error, join_timeout: float) -> str:
    message = str(error)
    if "Could not start gRPC server" in message:
        return _port_in_use(cluster)
    stragglers = message.partition("timed out task names:")[2].split("\n\n")[0]
    missing = sorted(set(re.findall(r"/job:(\w+)/replica:0/task:(\d+)", stragglers)))
    if missing:
        names = ", ".join(cluster.describe(job, int(index)) for job, index in missing)
        return (f"the cluster did not come up within {join_timeout:g} s (--join-timeout): "
                f"{names} never started. Run the same command with its TF_CONFIG on every "
                "machine of the cluster")
    leader = cluster.describe(*cluster.chief_task())
    return (f"could not join the cluster within {join_timeout:g} s (--join-timeout) as "
            f"{cluster.describe()}: {leader} did not answer ({_first_line(message)}). Start "
            "the same command on every machine, and check the addresses in TF_CONFIG")


def _first_line(message: str) -> str:
    return next((line.strip() for line in message.splitlines() if line.strip()), message)


def cluster_error(error: BaseException, cluster: Cluster) -> Exception | None:
    """What a TensorFlow error raised in a multi-worker run means for the user: another
    worker refused to train (`PeerRefused`), or a collective aborted or timed out because a
    worker was lost (`ClusterFailure`); None for other errors and single-process runs."""
    import tensorflow as tf

    message = str(error)
    if not cluster.is_multi_worker:
        return None
    refusal = re.search(re.escape(_REFUSAL) + r"(.*?)(?: \[type\.googleapis|\n|$)", message)
    if refusal:
        return PeerRefused(refusal[1])
    lost = (tf.errors.UnavailableError, tf.errors.DeadlineExceededError,
            tf.errors.AbortedError, tf.errors.CancelledError)
    if not (isinstance(error, lost) or "Collective ops is aborted" in message
            or "coordination" in message.lower()):
        return None
    return ClusterFailure(
        f"{cluster.describe()}: the cluster lost a worker ({_lost_task(message, cluster)}), so "
        "this worker stops too rather than wait forever. Restart every worker with the same "
        "command: the run resumes from its last backup")


def report_refusal(message: str, cluster: Cluster | None) -> None:
    """Tells the other workers that this one refuses to train, and why: they stop at once
    with this message (raised as `PeerRefused` by `cluster_error`) instead of waiting for
    its heartbeats to stop. Nothing happens if the cluster never started."""
    if cluster is None or not cluster.is_multi_worker:
        return
    import tensorflow as tf
    from tensorflow.python.eager import context

    try:
        context.context().report_error_to_cluster(
            tf.errors.INVALID_ARGUMENT, f"{_REFUSAL}{cluster.describe()} refused to train: "
            f"{message}")
    except (ValueError, tf.errors.OpError):
        pass  # not started (the error came first), or already failed: nobody waits for us


def check_same_settings(settings: dict, cluster: Cluster, timeout_seconds: float,
                        key: str = "keras_transformer/settings",
                        advice: str = "Run the same command, with the same --precision and "
                                      "--jit-compile, on every worker") -> None:
    """Refuses to train on settings other than the chief's.

    Workers that disagree (another command, or "auto" precision or XLA resolved otherwise on
    another machine) would build other variables or batches and wait for each other in
    different collectives forever. The chief publishes its settings (JSON-able) through the
    coordination service under `key` (one key per check); the others compare, and refuse
    with `advice` if they differ.

    Raises:
        ClusterConfigError: the settings differ (naming the first differences).
        ClusterFailure: the chief was lost, or did not publish within `timeout_seconds`.
    """
    if not cluster.is_multi_worker:
        return
    import tensorflow as tf
    from tensorflow.python.eager import context

    mine = _flatten(json.loads(json.dumps(settings)))
    if cluster.is_chief:
        context.context().set_config_key_value(key, json.dumps(mine))
        return
    try:
        chief = json.loads(context.context().get_config_key_value(key, int(timeout_seconds * 1000)))
    except tf.errors.OpError as error:
        raise cluster_error(error, cluster) or ClusterFailure(
            f"{cluster.describe()}: the chief's settings did not come within "
            f"{timeout_seconds:g} s") from None
    differences = [name for name in sorted(set(mine) | set(chief))
                   if mine.get(name) != chief.get(name)]
    if differences:
        shown = "; ".join(f"{name} {mine.get(name)!r} on {cluster.describe()}, "
                          f"{chief.get(name)!r} on the chief" for name in differences[:4])
        raise ClusterConfigError(f"settings differ from the chief's "
                                 f"({cluster.describe(*cluster.chief_task())}): {shown}. "
                                 f"{advice}")


def _flatten(settings: dict, prefix: str = "") -> dict:
    flat = {}
    for name, value in settings.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{name}."))
        else:
            flat[f"{prefix}{name}"] = value
    return flat


def _lost_task(message: str, cluster: Cluster) -> str:
    """Which peer an aborted collective's message blames, as "worker 1 (host:port) ..."."""
    peers = cluster.peers()
    silent = re.search(r"unhealthy[^\n]*\n\s*/job:(\w+)/replica:\d+/task:(\d+)", message)
    if silent and (silent[1], int(silent[2])) in peers:
        return f"{cluster.describe(silent[1], int(silent[2]))} stopped sending heartbeats"
    for job, index in re.findall(r"remote target /job:(\w+)/replica:\d+/task:(\d+)", message):
        if (job, int(index)) in peers:
            return f"{cluster.describe(job, int(index))} is unreachable"
    for job, index in peers:
        if re.search(re.escape(cluster.jobs[job][index]) + r"(?!\d)", message):
            return f"{cluster.describe(job, index)} is unreachable"
    cause = _first_line(message.split("Collective ops is aborted by:")[-1])
    if len(peers) == 1:  # the only peer there is
        return f"{cluster.describe(*peers[0])}: {cause}"
    return cause


def wait_for_all(name: str, timeout_seconds: float, cluster: Cluster) -> None:
    """Blocks until every worker has called `wait_for_all(name, ...)`.

    Raises:
        ClusterFailure: a worker was lost, or not all came within `timeout_seconds`.
        PeerRefused: another worker refused to train.
    """
    import tensorflow as tf
    from tensorflow.python.eager import context

    try:
        context.context().wait_at_barrier(f"keras_transformer/{name}",
                                          int(timeout_seconds * 1000))
    except tf.errors.OpError as error:
        if isinstance(error, tf.errors.DeadlineExceededError) and "Barrier timed out" in str(
                error):
            raise ClusterFailure(f"{cluster.describe()}: not every worker reached '{name}' "
                                 f"within {timeout_seconds:g} s") from None
        raise cluster_error(error, cluster) or ClusterFailure(
            f"{cluster.describe()}: waiting for every worker at '{name}' failed: "
            f"{_first_line(str(error))}") from None


def any_worker(strategy) -> Callable[[bool], bool] | None:
    """A function taking this worker's yes/no and returning True if any worker said yes.

    It is a collective: every worker must call it equally often. None where one process
    runs every replica (its decisions are already common to all of them).
    """
    import tensorflow as tf

    if not isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
        return None

    @tf.function
    def count_yes(flag):  # (tf.distribute has no MAX reduction)
        per_replica = strategy.run(tf.identity, args=(flag,))
        return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None)

    return lambda flag: bool(count_yes(tf.constant(1.0 if flag else 0.0)) > 0.0)
