"""Do a run's CTranslate2 export and the run itself translate alike? (issue 17)

Exports the run to a temporary CTranslate2 directory (float32), translates the first `--limit`
sentences of a split with our decoding (`translate_texts`) and with CTranslate2
(`kt.translate_with_ctranslate2`), greedy and beam `--beam`, and prints how many outputs are
identical strings and both sacreBLEU scores.

    python benchmarks/ctranslate2_agreement.py --model runs/multi30k-de-en \\
        --data ../shared/data/multi30k --split test_2016_flickr --src de --tgt en --limit 200
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ctranslate2  # noqa: E402
import sacrebleu  # noqa: E402
import sentencepiece as spm  # noqa: E402

from benchmarks.serving import add_run_and_split_flags  # noqa: E402
from keras_transformer import run_directory  # noqa: E402
from keras_transformer.decoding.translator import translate_texts  # noqa: E402
from keras_transformer.serving.ctranslate2 import (  # noqa: E402
    export_ctranslate2,
    translate_with_ctranslate2,
)
from pipelines.corpora import load_corpus  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_run_and_split_flags(parser)
    parser.add_argument("--limit", type=int, default=200)
    parser.add_argument("--beam", type=int, default=4)
    parser.add_argument("--alpha", type=float, default=0.6)
    args = parser.parse_args()
    corpus = load_corpus(args.data, args.split, args.src, args.tgt)
    sources, references = corpus.sources[:args.limit], corpus.targets[:args.limit]
    model, tokenizer = run_directory.load_run(args.model)
    with tempfile.TemporaryDirectory() as temporary:
        directory = export_ctranslate2(model, tokenizer, Path(temporary) / "ct2")
        translator = ctranslate2.Translator(str(directory), device="cpu")
        processor = spm.SentencePieceProcessor(model_file=str(directory / "sentencepiece.model"))
        for beam in (1, args.beam):
            ours = translate_texts(model, tokenizer, sources, beam_size=beam, alpha=args.alpha)
            theirs = translate_with_ctranslate2(translator, processor, sources, beam_size=beam,
                                                alpha=args.alpha)
            same = sum(a == b for a, b in zip(ours, theirs, strict=True))
            bleu = [sacrebleu.corpus_bleu(h, [references]).score for h in (ours, theirs)]
            print(f"beam {beam}: identical {same}/{len(sources)} ({same / len(sources):.1%}); "
                  f"BLEU ours {bleu[0]:.2f}, CTranslate2 {bleu[1]:.2f}", flush=True)


if __name__ == "__main__":
    main()
