"""Distributed training: 2 replicas == 1 replica on the same global batch (several worker
processes: tests/cluster/test_workers.py).

It runs in a subprocess: logical CPU devices must be configured before TensorFlow starts.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from tests.cli.test_train import REPO, cli_env

# Two logical CPUs under MirroredStrategy vs. the default strategy, same initial weights, same
# global batches (each the union of two per-replica batches with different token counts).
EQUIVALENCE = textwrap.dedent(
    """
    import gc, json, sys
    import numpy as np
    import tensorflow as tf
    from tensorflow.python.framework.func_graph import FuncGraph
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    import keras
    from keras_transformer.cluster.strategy import select_strategy
    from keras_transformer.cluster.keras_patches import build_for_distributed_fit
    from keras_transformer.training.losses import GlobalTokenCrossEntropy
    from keras_transformer.training.losses import LabelSmoothedCrossEntropy
    from keras_transformer.training.optimizer import paper_adam
    from keras_transformer.training.trainer_model import build_trainer

    rng = np.random.default_rng(0)
    STEPS, VOCAB = 4, 40

    def half(batch, length):
        ids = rng.integers(4, VOCAB, size=(batch, length + 1)).astype("int32")
        lengths = rng.integers(2, length + 1, size=batch)
        for row, n in enumerate(lengths):
            ids[row, n:] = 0
        return ids

    # Per step, replica 0 gets 2 sentences, replica 1 gets 5 (different token counts).
    halves = [[(half(2, 6), half(2, 7)), (half(5, 9), half(5, 8))] for _ in range(STEPS)]

    def features(source, target):
        return {"source": source, "target": target[:, :-1]}, target[:, 1:]

    def pad_to(a, width):
        return np.pad(a, [(0, 0), (0, width - a.shape[1])])

    def train(strategy, loss_class):
        keras.utils.set_random_seed(0)
        with strategy.scope():
            model = build_trainer("tiny", vocab_size=VOCAB)
            model.compile(paper_adam(32, 4, 1.0), loss=loss_class(0.1))
        if strategy.num_replicas_in_sync == 1:
            def batches():
                for (s0, t0), (s1, t1) in halves:
                    s = np.concatenate([pad_to(s0, 10), pad_to(s1, 10)])
                    t = np.concatenate([pad_to(t0, 9), pad_to(t1, 9)])
                    yield features(s, t)
        else:
            def batches():  # consecutive elements go to consecutive replicas
                for pair in halves:
                    for s, t in pair:
                        yield features(pad_to(s, 10), pad_to(t, 9))
        spec = ({"source": tf.TensorSpec([None, None], tf.int32),
                 "target": tf.TensorSpec([None, None], tf.int32)},
                tf.TensorSpec([None, None], tf.int32))
        build_for_distributed_fit(model, next(batches()))
        data = strategy.distribute_datasets_from_function(
            lambda ctx: tf.data.Dataset.from_generator(batches, output_signature=spec))
        history = model.fit(data, epochs=STEPS, steps_per_epoch=1, verbose=0)
        # Key biases have a zero true gradient (softmax ignores a shift shared by all keys),
        # so their updates are Adam-normalized round-off noise: left out of the comparison.
        kept = [w.numpy() for w in model.weights if not w.path.endswith("key/bias")]
        return history.history["loss"], kept

    # Which threads' LayerNorms take the hand-written gradient (those a tape records on).
    import threading
    from keras_transformer.layers import normalization
    recorded = []
    def spy(original=normalization.gradients_recorded):
        result = original()
        recorded.append((threading.get_ident(), type(threading.current_thread()).__name__,
                         result))
        return result
    normalization.gradients_recorded = spy

    two = select_strategy()
    assert two.num_replicas_in_sync == 2, two
    one = tf.distribute.get_strategy()
    loss_1, weights_1 = train(one, GlobalTokenCrossEntropy)
    naive_2, naive_weights = train(two, LabelSmoothedCrossEntropy)
    # A model trained over replicas and dropped leaves no graph behind (the all-reduces'
    # custom gradients: keras_transformer/kernels/custom_gradient.py). Caches of the
    # process's own are filled by the run above; `before` holds their graphs.
    gc.collect()
    before = [g for g in gc.get_objects() if isinstance(g, FuncGraph)]
    recorded.clear()
    loss_2, weights_2 = train(two, GlobalTokenCrossEntropy)
    taped = sorted({(ident, kind) for ident, kind, result in recorded if result})
    gc.collect()
    kept = {id(g) for g in before}
    left = [g.name for g in gc.get_objects() if isinstance(g, FuncGraph) and id(g) not in kept]
    print(json.dumps({
        "graphs_left": left, "taped_threads": [kind for _, kind in taped],
        "one": loss_1, "two": loss_2, "naive": naive_2,
        "weight_diff": max(float(np.max(np.abs(a - b))) for a, b in zip(weights_1, weights_2)),
        "naive_weight_diff": max(float(np.max(np.abs(a - b)))
                                 for a, b in zip(weights_1, naive_weights)),
    }))
    """
)


def test_two_replicas_match_one_device_on_the_same_global_batch_and_leave_no_graph():
    # On the TensorFlow-ops path, as on GPUs; with the fused CPU kernels (the default here),
    # tests/training/test_accumulation.py compares 2 replicas with 1 device the same way.
    result = subprocess.run(
        [sys.executable, "-c", EQUIVALENCE], cwd=REPO,
        env=cli_env(KERAS_TRANSFORMER_FUSED_KERNELS="off"), capture_output=True,
        text=True, timeout=240,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    numbers = json.loads(result.stdout.strip().splitlines()[-1])
    assert numbers["graphs_left"] == []
    # Each replica traces its step in a thread of its own, its tape open there: both
    # replicas' LayerNorms take the hand-written gradient.
    assert numbers["taped_threads"] == ["_MirroredReplicaThread"] * 2
    # Tolerance: float32 round-off of a different summation order (per-replica partial
    # sums, then an all-reduce), which Adam amplifies where gradients are near zero:
    # 1e-5 relative on the losses, 1e-4 absolute on the weights after 4 steps.
    assert numbers["two"] == pytest.approx(numbers["one"], rel=1e-5)
    assert numbers["weight_diff"] < 1e-4
    # The plain per-replica mean loss would differ: the test can tell.
    assert numbers["naive"][1:] != pytest.approx(numbers["one"][1:], rel=1e-3)
    assert numbers["naive_weight_diff"] > 1e-3
