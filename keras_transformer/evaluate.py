"""Translate a test set and score it with sacreBLEU: BLEU (13a, cased, detokenized) and chrF.

The library behind it: `keras_transformer.serving.translator` (loading), `keras_transformer.decoding.translator` and `keras_transformer.decoding.scoring`.

    python -m keras_transformer.evaluate --model DIR --src-file F --ref-file F [--json]
    python -m keras_transformer.evaluate --model DIR --data FOLDER --split test_2016_flickr \\
        --src de --tgt en
`--model` is a run directory, a SavedModel version folder, or a `saved_models/<name>` folder
(its highest version).

Exit status: 0 scored; 1 a problem with the inputs (one `error:` line); 2 a malformed or
missing flag (argparse); 4 (`EXIT_STORAGE`) the disk is full, over quota, read-only or failing
while writing `--output` (one `error:` line naming the file; nothing half-written): free
space and run the same command again.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from keras_transformer.decoding.scoring import score_translations
from keras_transformer.decoding.search import DEFAULT_ALPHA, DEFAULT_BEAM_SIZE
from keras_transformer.errors import UsageError
from keras_transformer.flags import add_verbose_flag, storage_errors_as_status
from keras_transformer.logs import show_project_logs
from keras_transformer.progress import ProgressBar
from keras_transformer.serving.translator import ModelError, load_translator
from pipelines import storage
from pipelines.corpora import load_corpus
from pipelines.textfiles import CorpusError, read_text_file


def _read_pair(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    try:
        if args.data:
            corpus = load_corpus(args.data, args.split, args.src, args.tgt)
            return list(corpus.sources), list(corpus.targets)
        sources, references = read_text_file(args.src_file), read_text_file(args.ref_file)
    except CorpusError as error:
        raise UsageError(str(error)) from None
    if len(sources) != len(references):
        raise UsageError(
            f"{args.src_file} has {len(sources)} lines but {args.ref_file} has "
            f"{len(references)}; line i of the references must translate line i of the source.")
    return sources, references


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m keras_transformer.evaluate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True,
                        help="run directory, SavedModel folder or saved_models/<name>")
    parser.add_argument("--src-file", help="source sentences, one per line (.gz ok)")
    parser.add_argument("--ref-file", help="reference translations, aligned with --src-file")
    parser.add_argument("--data", help="corpus folder ({split}.{lang}[.gz]) or tfds:NAME")
    parser.add_argument("--split", default="test_2016_flickr")
    parser.add_argument("--src", help="source language code (with --data)")
    parser.add_argument("--tgt", help="target language code (with --data)")
    parser.add_argument("--beam", type=int, default=None,
                        help="beam size (1: greedy; default: the model's own, chosen on val "
                             "when it trained, as its test BLEU was scored (a SavedModel: its "
                             f"serving_default's), else {DEFAULT_BEAM_SIZE})")
    parser.add_argument("--alpha", type=float, default=None,
                        help=f"length penalty (default: the model's own, else {DEFAULT_ALPHA})")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--output", help="also write the translations to this file")
    parser.add_argument("--json", action="store_true", help="print the scores as JSON")
    add_verbose_flag(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """The evaluate command; returns the exit status."""
    show_project_logs(to_stderr=True)  # stdout holds the results
    return storage_errors_as_status(_evaluate, argv, "evaluate: error")


def _evaluate(argv: Sequence[str] | None) -> int:
    """The command's work; raises `StorageError` for a full or failing disk."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.data:
        if not (args.src and args.tgt):
            parser.error("--data needs --src and --tgt")
    elif not (args.src_file and args.ref_file):
        parser.error("give --src-file and --ref-file, or --data with --src and --tgt")
    if (args.beam is not None and args.beam < 1) or args.batch_size < 1 or (
            args.alpha is not None and not 0 <= args.alpha < float("inf")):
        parser.error("--beam and --batch-size must be >= 1, --alpha >= 0")
    try:
        sources, references = _read_pair(args)
        translator = load_translator(args.model)
        args.beam, args.alpha = translator.resolve_search(args.beam, args.alpha)
    except (UsageError, ModelError) as error:
        print(f"evaluate: error: {error}", file=sys.stderr)
        return 1
    bar = ProgressBar(len(sources))
    try:
        hypotheses = translator.translate(sources, beam_size=args.beam, alpha=args.alpha,
                                          batch_size=args.batch_size, progress=bar.update)
    except UsageError as error:  # what a SavedModel's export fixes, e.g. its highest beam
        bar.close()
        print(f"evaluate: error: {error}", file=sys.stderr)
        return 1
    bar.close()
    if args.output:
        storage.write_text(args.output, "".join(line + "\n" for line in hypotheses))
    result = score_translations(hypotheses, references)
    result.update(model=str(args.model), beam_size=args.beam, alpha=args.alpha)
    if args.json:
        print(json.dumps(result, indent=2, sort_keys=True))
    else:
        print(f"BLEU = {result['bleu']:.2f}  ({result['bleu_signature']})")
        print(f"       {result['bleu_details']}")
        print(f"chrF = {result['chrf']:.2f}  ({result['chrf_signature']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
