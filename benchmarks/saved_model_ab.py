"""An A/B of two SavedModels' decoding speed in one process, their calls alternated.

Both exports (e.g. of one run, by two versions of the code: `export_saved_model` from two
checkouts) are loaded side by side; each round translates the whole split through the
`translate` signature in requests of 32 sentences (sorted by length, as a server batching
by length sends them), the two models taking turns (their order swapped every round), so
that a machine whose speed drifts slows both alike. Prints one JSON line: each model's
seconds per round and median, the ratio of the medians (A / B) and how many outputs are the
same string.

    python benchmarks/saved_model_ab.py NEW_EXPORT/1 OLD_EXPORT/1 --beam 1 --rounds 8
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REQUEST = 32


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("a", help="a SavedModel version folder")
    parser.add_argument("b", help="another one")
    parser.add_argument("--data", default=str(ROOT.parent / "shared" / "data" / "multi30k"))
    parser.add_argument("--split", default="test_2016_flickr")
    parser.add_argument("--src", default="de")
    parser.add_argument("--tgt", default="en")
    parser.add_argument("--beam", type=int, default=4)
    parser.add_argument("--alpha", type=float, default=0.6)
    parser.add_argument("--rounds", type=int, default=8)
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import tensorflow as tf
    import tensorflow_text  # noqa: F401  (the SentencePiece ops)

    from pipelines.corpora import load_corpus

    texts = sorted(load_corpus(args.data, args.split, args.src, args.tgt).sources, key=len)
    models = {"a": tf.saved_model.load(args.a), "b": tf.saved_model.load(args.b)}

    def translate(model) -> tuple[float, list[bytes]]:
        signature, outputs = model.signatures["translate"], []
        start = time.perf_counter()
        for index in range(0, len(texts), REQUEST):
            result = signature(inputs=tf.constant(texts[index: index + REQUEST]),
                               beam_size=tf.constant(args.beam),
                               alpha=tf.constant(args.alpha))
            outputs += result["outputs"].numpy().tolist()
        return time.perf_counter() - start, outputs

    for model in models.values():
        translate(model)  # warm-up: the first calls optimize the graphs
    seconds: dict[str, list[float]] = {"a": [], "b": []}
    outputs: dict[str, list[bytes]] = {}
    for round_index in range(args.rounds):
        for name in ("a", "b") if round_index % 2 == 0 else ("b", "a"):
            elapsed, outputs[name] = translate(models[name])
            seconds[name].append(round(elapsed, 3))
    medians = {name: statistics.median(values) for name, values in seconds.items()}
    print(json.dumps({
        "a": args.a, "b": args.b, "beam": args.beam, "sentences": len(texts),
        "seconds": seconds, "medians": medians,
        "ratio_a_to_b": round(medians["a"] / medians["b"], 3),
        "same_outputs": sum(x == y for x, y in zip(outputs["a"], outputs["b"], strict=True)),
    }))


if __name__ == "__main__":
    main()
