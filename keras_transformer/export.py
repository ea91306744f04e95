"""Export a trained run: `python -m keras_transformer.export --model RUN_DIR --export-base DIR`.

`--format saved_model` (default) writes a versioned SavedModel for TF Serving
(`keras_transformer.serving.saved_model`); `--format ctranslate2` a CTranslate2 model directory
(`keras_transformer.serving.ctranslate2`).

Exit status: 0 exported (its path on stdout); 1 a bad run directory, an existing version or
directory, or ctranslate2 not installed (one `error:` line); 2 a malformed flag (argparse);
4 (`EXIT_STORAGE`) the disk is full, over quota, read-only or failing (one `error:` line
naming the export and the bytes it needed; nothing of it is left, earlier versions are
untouched): free space and run the same command again.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import sys
from collections.abc import Sequence
from pathlib import Path

from keras_transformer.decoding.search import (
    DEFAULT_ALPHA,
    DEFAULT_BEAM_SIZE,
    DEFAULT_EXTRA_LENGTH,
    DEFAULT_MAX_INPUT_TOKENS,
)
from keras_transformer.errors import EXIT_STORAGE, StorageError
from keras_transformer.flags import add_verbose_flag
from keras_transformer.logs import show_project_logs
from keras_transformer.run_directory import load_run, run_decoding
from keras_transformer.serving.ctranslate2 import export_ctranslate2
from keras_transformer.serving.detailed_signatures import MAX_ALPHA, MAX_BEAM_SIZE
from keras_transformer.serving.saved_model import export_saved_model


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m keras_transformer.export --model RUN_DIR --export-base saved_models/NAME`."""
    show_project_logs(to_stderr=True)  # stdout holds the export's path
    parser = argparse.ArgumentParser(prog="python -m keras_transformer.export",
                                     description="Export a run directory for TF Serving "
                                     "(a versioned SavedModel) or for CTranslate2.")
    parser.add_argument("--model", required=True, help="run directory (model.keras, tokenizer/)")
    parser.add_argument("--export-base", required=True,
                        help="e.g. saved_models/de-en; with --format ctranslate2, the new "
                        "CTranslate2 model directory")
    parser.add_argument("--format", choices=("saved_model", "ctranslate2"),
                        default="saved_model", help="ctranslate2 needs the `ctranslate2` extra")
    parser.add_argument("--quantization", help="ctranslate2 only: e.g. int8 (default: float32 "
                        "weights; CTranslate2 can also quantize when loading)")
    parser.add_argument("--version", type=int, help="default: highest existing + 1")
    parser.add_argument("--beam", type=int, help="serving_default's beam size (ctranslate2: "
                        "decoding.json's; default: the run's, as run_directory.run_decoding "
                        "reads it: its val choice, else its own --beam; else "
                        f"{DEFAULT_BEAM_SIZE})")
    parser.add_argument("--alpha", type=float, help="serving_default's length penalty "
                        "(ctranslate2: decoding.json's; default: the run's, as --beam; else "
                        f"{DEFAULT_ALPHA})")
    parser.add_argument("--max-input-tokens", type=int, default=DEFAULT_MAX_INPUT_TOKENS)
    parser.add_argument("--max-extra-length", type=int, default=DEFAULT_EXTRA_LENGTH)
    parser.add_argument("--jit-compile", action="store_true",
                        help="saved_model only: run the decoding loop as XLA-compiled segments "
                        "(faster for single sentences, slower for beam search over large "
                        "batches; TF Serving on CPU then needs --xla_cpu_compilation_enabled=true)")
    add_verbose_flag(parser)
    args = parser.parse_args(argv)
    if args.format == "ctranslate2" and importlib.util.find_spec("ctranslate2") is None:
        print("export: error: --format ctranslate2 needs the ctranslate2 package: "
              "pip install -e '.[ctranslate2]'", file=sys.stderr)
        return 1

    try:
        beam, alpha = run_decoding(Path(args.model), args.beam, args.alpha)
    except ValueError as error:  # a damaged results.json or config.json (names it)
        print(f"export: error: {error}", file=sys.stderr)
        return 1
    # The signatures clip a beam over MAX_BEAM_SIZE and an alpha over MAX_ALPHA;
    # CTranslate2 takes any, but decoding.json must hold a usable pair.
    highest_beam, highest_alpha = ((MAX_BEAM_SIZE, MAX_ALPHA) if args.format == "saved_model"
                                   else (math.inf, math.inf))
    if not (1 <= beam <= highest_beam and 0 <= alpha <= highest_alpha
            and math.isfinite(alpha)):
        print(f"export: error: --beam must be in [1, {highest_beam}] and --alpha a finite "
              f"number in [0, {highest_alpha:g}] for --format {args.format}, got {beam} and "
              f"{alpha}", file=sys.stderr)
        return 1
    try:
        model, tokenizer = load_run(args.model)
        if args.format == "ctranslate2":
            print(export_ctranslate2(model, tokenizer, args.export_base, args.quantization,
                                     beam_size=beam, alpha=alpha))
            return 0
        path = export_saved_model(
            model, tokenizer, args.export_base, version=args.version,
            max_input_tokens=args.max_input_tokens, max_extra_length=args.max_extra_length,
            beam_size=beam, alpha=alpha, jit_compile=args.jit_compile)
    except StorageError as error:
        print(f"export: error: {error}", file=sys.stderr)
        return EXIT_STORAGE
    except (FileNotFoundError, FileExistsError, ValueError) as error:
        print(f"export: error: {error}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
