"""Alignment error rate of attention alignments against the hand-aligned Multi30k val pairs.

    python benchmarks/alignment_error_rate.py --run RUN_DIR [--data ../shared/data/multi30k]

RUN_DIR is a de->en run directory. Each gold pair (tests/data/alignments/
multi30k_val_de_en.gold: val line indices and sure/possible links) is forced through the model
(`kt.force_decode`, the reference as the target), and its word alignment read from every
decoder layer, with and without the shift, with diagonal priors of several tensions
(`decoding.alignment`). The layer, shift and tension are chosen on the first half of the pairs
(by AER) and reported on the second half and on all, with the diagonal baseline. Prints one
JSON object.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from keras_transformer import run_directory  # noqa: E402
from keras_transformer.decoding.alignment import (  # noqa: E402
    alignment_error_rate,
    diagonal_alignment,
    parse_pharaoh,
    word_alignment,
)
from keras_transformer.decoding.translator import force_decode  # noqa: E402

GOLD = REPO / "tests" / "data" / "alignments" / "multi30k_val_de_en.gold"
TENSIONS = (0.0, 2.0, 4.0, 8.0, 16.0)


def read_gold(path: Path = GOLD) -> list[tuple[int, tuple[set, set]]]:
    """[(val line index, (sure, possible))] in file order."""
    pairs = []
    for line in path.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            index, _, links = line.partition("\t")
            pairs.append((int(index), parse_pharaoh(links)))
    return pairs


def read_split(data: Path, split: str, language: str) -> list[str]:
    with gzip.open(data / f"{split}.{language}.gz", "rt", encoding="utf-8") as file:
        return file.read().splitlines()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", required=True, help="a de->en run directory")
    parser.add_argument("--data", default=str(REPO.parent / "shared" / "data" / "multi30k"))
    args = parser.parse_args()
    gold = read_gold()
    german, english = read_split(Path(args.data), "val", "de"), read_split(Path(args.data),
                                                                           "val", "en")
    sources = [german[index] for index, _ in gold]
    targets = [english[index] for index, _ in gold]
    model, tokenizer = run_directory.load_run(args.run)
    layers = len(model.decoder_layers)
    half = len(gold) // 2
    table = {}
    for layer in range(layers):
        results = force_decode(model, tokenizer, sources, targets, return_attention=True,
                               alignment_layer=layer)
        for shift in (False, True):
            for tension in TENSIONS:
                links = [word_alignment(r.hypotheses[0].attention, r.source_pieces,
                                        r.hypotheses[0].pieces, shift=shift, tension=tension)
                         for r in results]
                table[f"layer {layer - layers}, shift {shift}, tension {tension}"] = {
                    "dev": alignment_error_rate(links[:half], [g for _, g in gold[:half]]),
                    "held_out": alignment_error_rate(links[half:], [g for _, g in gold[half:]]),
                    "all": alignment_error_rate(links, [g for _, g in gold]),
                }
    diagonal = [diagonal_alignment(len(s.split()), len(t.split()))
                for s, t in zip(sources, targets, strict=True)]
    chosen = min(table, key=lambda name: table[name]["dev"])
    print(json.dumps({
        "run": args.run, "pairs": len(gold), "dev_pairs": half,
        "chosen_on_dev": chosen, "chosen": table[chosen],
        "diagonal": {"dev": alignment_error_rate(diagonal[:half], [g for _, g in gold[:half]]),
                     "held_out": alignment_error_rate(diagonal[half:], [g for _, g in gold[half:]]),
                     "all": alignment_error_rate(diagonal, [g for _, g in gold])},
        "by_layer": table,
    }, indent=1))


if __name__ == "__main__":
    main()
