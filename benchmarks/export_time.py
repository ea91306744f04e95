"""How long `export_saved_model` takes, how large its graph is, and how long a load takes.

A `small` model (random weights, vocabulary 400, a tokenizer trained on synthetic sentences)
is exported `--exports` times in one process, then the last export is loaded once with
`tf.saved_model.load` and translates one sentence. Prints one JSON line. To compare two
commits, run it alternately against each checkout (the script imports the project from
`PYTHONPATH`, else from the checkout it sits in):

    PYTHONPATH=/path/to/checkout-a python benchmarks/export_time.py
    PYTHONPATH=/path/to/checkout-b python benchmarks/export_time.py
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("KERAS_BACKEND", "tensorflow")  # Keras reads it once, at its import
sys.path.append(str(Path(__file__).resolve().parents[1]))  # after PYTHONPATH


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--exports", type=int, default=3)
    args = parser.parse_args(argv)

    import tensorflow as tf

    import keras_transformer
    from keras_transformer.model.transformer import build_transformer
    from keras_transformer.serving.saved_model import export_saved_model
    from pipelines.tokenizer import train_tokenizer

    with tempfile.TemporaryDirectory(prefix="export_time-") as scratch:
        scratch = Path(scratch)
        texts = ([f"das ist satz nummer {i} und er ist gut ." for i in range(300)]
                 + [f"this is sentence {i} and it is good ." for i in range(300)])
        tokenizer = train_tokenizer(texts, scratch / "tokenizer", vocab_size=400)
        model = build_transformer("small", vocab_size=400)
        model({"source": tf.ones((1, 5), tf.int32), "target": tf.ones((1, 5), tf.int32)})
        export_seconds, export_cpu_seconds = [], []
        for _ in range(args.exports):
            start, start_cpu = time.perf_counter(), time.process_time()
            version = export_saved_model(model, tokenizer, scratch / "export")
            export_seconds.append(round(time.perf_counter() - start, 2))
            export_cpu_seconds.append(round(time.process_time() - start_cpu, 2))
        start = time.perf_counter()
        loaded = tf.saved_model.load(str(version))
        load_seconds = time.perf_counter() - start
        start = time.perf_counter()
        loaded.signatures["serving_default"](tf.constant(["das ist satz nummer 3 ."]))
        first_call_seconds = time.perf_counter() - start
        print(json.dumps({
            "project": str(Path(keras_transformer.__file__).parents[1]),
            "export_seconds": export_seconds,
            # CPU time of this process: steadier than wall time on a machine shared with
            # other work (most of an export is single-threaded tracing).
            "export_cpu_seconds": export_cpu_seconds,
            "load_seconds": round(load_seconds, 2),
            "first_call_seconds": round(first_call_seconds, 2),
            "saved_model_pb_mib": round((version / "saved_model.pb").stat().st_size / 2**20, 2),
        }), flush=True)


if __name__ == "__main__":
    main()
