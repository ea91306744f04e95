"""bfloat16 compute for decoding on CPUs with AVX-512 BF16, weights kept float32 (issue 17).

The same trained weights decode the test split three ways, in one process, with 2 threads:

- `float32`: the float32 model (what the SavedModel runs);
- `mixed_bfloat16`: Keras' mixed policy, which casts each float32 weight to bfloat16 where
  a layer reads it, i.e. at every decoding step;
- `bfloat16_once`: a bfloat16 copy of the model whose weights are the float32 ones cast once
  per call, before the search loop (a `keras.StatelessScope` maps the copy's variables to the
  cast tensors, so the copy's own variables are never read or stored).

Reported: beam-4 and greedy sentences/s on batches of 32 (sorted by length), batch-1 beam-4
latency (median over `--latency` sentences), sacreBLEU, and how many outputs equal float32's.
Decoding only (`decoding.beam_search` / `greedy_search` in a `tf.function`), no tokenization.

    python benchmarks/bf16_decoding.py --model runs/multi30k-de-en-s5 \\
        --data ../shared/data/multi30k --split test_2016_flickr --src de --tgt en
"""

from __future__ import annotations

import argparse
import statistics
import time

import keras
import sacrebleu
import tensorflow as tf

from keras_transformer import run_directory
from keras_transformer.decoding.search import beam_search, encode_texts, greedy_search
from keras_transformer.serving.saved_model import serving_model
from pipelines.corpora import load_corpus

BATCH = 32


def searches(model, variant: str):
    """A tf.function (source_ids, beam_size) -> ids (batch, T) for `variant`."""
    compute = model
    if variant == "mixed_bfloat16":
        compute = type(model).from_config(dict(model.get_config(), dtype="mixed_bfloat16"))
        compute.set_weights(model.get_weights())
    elif variant == "bfloat16_once":
        compute = type(model).from_config(dict(model.get_config(), dtype="bfloat16"))

    def decode(source_ids, beam_size):
        if beam_size == 1:
            return greedy_search(compute, source_ids)[0]
        return beam_search(compute, source_ids, beam_size=beam_size, alpha=0.6)[0]

    def run(source_ids, beam_size: int):
        if variant != "bfloat16_once":
            return decode(source_ids, beam_size)
        values = [tf.cast(weight, copy.dtype) for weight, copy in
                  zip(model.weights, compute.weights, strict=True)]
        with keras.StatelessScope(state_mapping=list(zip(compute.weights, values, strict=True))):
            return decode(source_ids, beam_size)

    spec = tf.TensorSpec([None, None], tf.int32)
    return {beam: tf.function(lambda ids, beam=beam: run(ids, beam), input_signature=[spec],
                              autograph=False) for beam in (1, 4)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="run directory")
    parser.add_argument("--data", required=True)
    parser.add_argument("--split", default="test_2016_flickr")
    parser.add_argument("--src", default="de")
    parser.add_argument("--tgt", default="en")
    parser.add_argument("--latency", type=int, default=100, help="sentences timed one by one")
    args = parser.parse_args()
    tf.config.threading.set_intra_op_parallelism_threads(2)
    tf.config.threading.set_inter_op_parallelism_threads(1)

    model, tokenizer = run_directory.load_run(args.model)
    model = serving_model(model)
    corpus = load_corpus(args.data, args.split, args.src, args.tgt)
    sources = encode_texts(tokenizer, tf.constant(corpus.sources))
    order = sorted(range(len(corpus)), key=lambda i: int(sources.row_lengths()[i]))
    batches = [tf.gather(sources, order[i: i + BATCH]).to_tensor()
               for i in range(0, len(order), BATCH)]
    reference = {}
    for variant in ("float32", "mixed_bfloat16", "bfloat16_once"):
        search = searches(model, variant)
        line = [f"{variant:15}"]
        for beam in (4, 1):
            outputs = [None] * len(order)
            for batch in batches:  # warm-up: tracing
                search[beam](batch)
            started = time.perf_counter()
            position = 0
            for batch in batches:
                texts = tokenizer.detokenize(search[beam](batch)).numpy()
                for text in texts:
                    outputs[order[position]] = text.decode("utf-8")
                    position += 1
            seconds = time.perf_counter() - started
            bleu = sacrebleu.corpus_bleu(outputs, [corpus.targets]).score
            reference.setdefault(beam, outputs)
            same = sum(a == b for a, b in zip(outputs, reference[beam], strict=True))
            line.append(f"beam {beam}: {len(order) / seconds:6.1f} sentences/s, BLEU {bleu:.2f}, "
                        f"{same} same as float32")
        latencies = []
        for index in range(args.latency):
            single = sources[index: index + 1].to_tensor()
            search[4](single)
            started = time.perf_counter()
            search[4](single)
            latencies.append(time.perf_counter() - started)
        line.append(f"batch-1 beam-4 p50 {statistics.median(latencies) * 1000:.1f} ms")
        print(" | ".join(line), flush=True)


if __name__ == "__main__":
    main()
