"""What a recorded walk saves on each `.weights.h5` file a run writes or loads.

A preset's trainer (compiled with the paper's Adam, one step taken so that the optimizer
has its variables) is saved `--files` times with and without the optimizer, and loaded
`--files` times, by Keras' own walk (a fresh `WeightsWalk` each time, `model.load_weights`)
and by one `WeightsWalk` that recorded it, alternating; prints one JSON line with the
median CPU seconds of each.

    python benchmarks/weights_walk.py --preset tiny --files 9
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("KERAS_BACKEND", "tensorflow")  # Keras reads it once, at its import
sys.path.append(str(Path(__file__).resolve().parents[1]))  # after PYTHONPATH


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--vocab-size", type=int, default=8000)
    parser.add_argument("--files", type=int, default=9)
    args = parser.parse_args(argv)

    import keras
    import numpy as np

    from keras_transformer.training.losses import GlobalTokenCrossEntropy
    from keras_transformer.training.optimizer import paper_adam
    from keras_transformer.training.trainer_model import build_trainer
    from keras_transformer.training.weights_walk import WeightsWalk

    keras.utils.set_random_seed(0)
    model = build_trainer(args.preset, vocab_size=args.vocab_size)
    model.compile(paper_adam(model.config.d_model, 100), loss=GlobalTokenCrossEntropy(0.1))
    rng = np.random.default_rng(0)
    source = rng.integers(4, args.vocab_size, (4, 6)).astype("int32")
    target = rng.integers(4, args.vocab_size, (4, 7)).astype("int32")
    model.fit({"source": source, "target": target[:, :-1]}, target[:, 1:], verbose=0)

    def keras_bytes(include_optimizer: bool) -> memoryview:
        # A fresh WeightsWalk walks the model as Keras does (what a one-off save costs).
        return WeightsWalk().file_bytes(model, include_optimizer)

    def cpu(call) -> float:
        started = time.process_time()
        call()
        return time.process_time() - started

    walk = WeightsWalk()
    times: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="weights_walk-") as scratch:
        path = Path(scratch) / "model.weights.h5"
        path.write_bytes(keras_bytes(True))
        walk.file_bytes(model, False)  # the walks recorded before the rounds
        walk.file_bytes(model, True)
        for _ in range(args.files):
            for include_optimizer in (False, True):
                name = "with optimizer" if include_optimizer else "model only"
                times.setdefault(f"save {name}, Keras' walk", []).append(
                    cpu(lambda o=include_optimizer: keras_bytes(o)))
                times.setdefault(f"save {name}, recorded walk", []).append(
                    cpu(lambda o=include_optimizer: walk.file_bytes(model, o)))
            times.setdefault("load, Keras' walk", []).append(
                cpu(lambda: model.load_weights(path)))
            times.setdefault("load, recorded walk", []).append(
                cpu(lambda: walk.load(model, path)))
    print(json.dumps({"preset": args.preset, "vocab_size": args.vocab_size,
                      "files": args.files, "keras": keras.__version__,
                      "median_cpu_s": {name: round(statistics.median(values), 4)
                                       for name, values in times.items()}}))


if __name__ == "__main__":
    main()
