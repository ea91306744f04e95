"""What a process keeps after each model it trains, evaluates, decodes and drops.

A notebook trains model after model; back-translation trains two in one run; a server
reloads models. Each round here builds a model, trains it a few steps (`fit`), evaluates it,
beam-decodes a few sentences, then drops it (and calls `keras.backend.clear_session()`);
with `--saved-model`, it also exports the model as a SavedModel, loads it with
`tf.saved_model.load`, translates a sentence with it and drops that too.
After each round it prints one JSON line: the TensorFlow graphs (`FuncGraph`s) still alive
and their operations, the custom-gradient entries in TensorFlow's gradient registry, and the
process's resident memory. With nothing kept, every count is flat after the first round
(`keras_transformer/kernels/custom_gradient.py` says what used to keep every graph).

    python benchmarks/graph_memory.py                       # small, the paper's Adam
    python benchmarks/graph_memory.py --optimizer adam      # Keras' own Adam
    python benchmarks/graph_memory.py --optimizer adam --model trainer  # kt.build_trainer's
    python benchmarks/graph_memory.py --saved-model         # and an export, loaded
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("KERAS_BACKEND", "tensorflow")  # Keras reads it once, at its import
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _resident_mib() -> float:
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--vocab", type=int, default=8000)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--optimizer", choices=("paper", "adam"), default="paper",
                        help="paper: kt.paper_adam (FusedAdam); adam: Keras' own Adam")
    parser.add_argument("--model", choices=("transformer", "trainer"), default="transformer",
                        help="transformer: kt.build_transformer; trainer: kt.build_trainer "
                             "(a TransformerTrainer, the train command's model)")
    parser.add_argument("--saved-model", action="store_true",
                        help="also export each model, load the export and translate with it")
    args = parser.parse_args(argv)

    import numpy as np

    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory(prefix="graph_memory-") as scratch:
        tokenizer = (_synthetic_tokenizer(Path(scratch), args.vocab, rng) if args.saved_model
                     else None)
        for round_index in range(args.rounds):
            _round(args, round_index, rng, tokenizer, Path(scratch))


def _round(args, round_index: int, rng, tokenizer, scratch: Path) -> None:
    """Builds, trains, evaluates, decodes (exports, loads) and drops one model; prints."""
    import keras
    from tensorflow.python.framework import ops
    from tensorflow.python.framework.func_graph import FuncGraph

    import keras_transformer as kt
    from keras_transformer.decoding.search import beam_search

    build = kt.build_trainer if args.model == "trainer" else kt.build_transformer
    model = build(args.preset, vocab_size=args.vocab)
    optimizer = (kt.paper_adam(model.config.d_model, 100) if args.optimizer == "paper"
                 else "adam")
    model.compile(optimizer=optimizer, loss=kt.LabelSmoothedCrossEntropy(0.1))
    source = rng.integers(4, args.vocab, (16, 20)).astype("int32")
    target = rng.integers(4, args.vocab, (16, 21)).astype("int32")
    features = {"source": source, "target": target[:, :-1]}
    model.fit(features, target[:, 1:], batch_size=8, epochs=1, verbose=0)
    model.evaluate(features, target[:, 1:], batch_size=16, verbose=0)
    beam_search(model, source[:2], beam_size=2, max_length=5)
    if tokenizer is not None:
        _export_load_translate(model, tokenizer, scratch / f"export-{round_index}")
    del model
    keras.backend.clear_session()
    gc.collect()
    graphs = [obj for obj in gc.get_objects() if isinstance(obj, FuncGraph)]
    entries = [name for name in ops._gradient_registry._registry
               if name.startswith("CustomGradient")]
    print(json.dumps({
        "round": round_index + 1, "preset": args.preset, "optimizer": args.optimizer,
        "model": args.model,
        "saved_model": args.saved_model,
        "graphs_alive": len(graphs),
        "graph_operations": sum(len(graph.get_operations()) for graph in graphs),
        "custom_gradient_entries": len(entries),
        "resident_mib": round(_resident_mib()),
    }), flush=True)


def _synthetic_tokenizer(directory: Path, vocab_size: int, rng):
    """A `vocab_size`-piece tokenizer trained on sentences of random syllable words."""
    from pipelines.tokenizer import train_tokenizer

    syllables = "ka lo mi ne su ta ri po ve da gu zo fe hi ju ma be ro".split()
    words = ["".join(rng.choice(syllables, size=rng.integers(1, 5))) for _ in range(20_000)]
    sentences = [" ".join(rng.choice(words, size=12)) + " ." for _ in range(20_000)]
    return train_tokenizer(sentences, directory / "tokenizer", vocab_size=vocab_size)


def _export_load_translate(model, tokenizer, directory: Path) -> None:
    """Exports `model`, loads the export as a server would and translates one sentence."""
    import tensorflow as tf

    from keras_transformer.serving.saved_model import export_saved_model

    version = export_saved_model(model, tokenizer, directory, max_input_tokens=32,
                                 max_extra_length=5)
    loaded = tf.saved_model.load(str(version))
    loaded.signatures["serving_default"](tf.constant(["kalo mine suta ."]))


if __name__ == "__main__":
    main()
