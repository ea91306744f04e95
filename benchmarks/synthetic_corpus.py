"""A WMT-sized synthetic parallel corpus from Multi30k, for the scale benchmarks.

Each synthetic pair joins 2 or 3 random Multi30k train pairs (the same ones on both sides,
so the pair stays a translation), about 25-30 words a sentence as in WMT14. Written as
``train.{src}`` / ``train.{tgt}`` (plain UTF-8, one sentence per line) plus Multi30k's own
``val`` and ``test_2016_flickr`` files, into a folder you choose (a temporary one: never
commit it).

    python benchmarks/synthetic_corpus.py --pairs 4500000 --out /tmp/wmt-like
"""

from __future__ import annotations

import argparse
import gzip
import shutil
import time
from pathlib import Path

import numpy as np

DEFAULT_MULTI30K = Path(__file__).resolve().parents[2] / "shared/data/multi30k"


def read_lines(path: Path) -> list[str]:
    with gzip.open(path, "rt", encoding="utf-8") as handle:
        return [line.strip() for line in handle]


def write_corpus(multi30k: Path, out: Path, pairs: int, src: str = "de", tgt: str = "en",
                 seed: int = 0) -> None:
    """Writes ``pairs`` synthetic train pairs and copies val/test into ``out``."""
    sources = np.array(read_lines(multi30k / f"train.{src}.gz"), dtype=object)
    targets = np.array(read_lines(multi30k / f"train.{tgt}.gz"), dtype=object)
    rng = np.random.default_rng(seed)
    out.mkdir(parents=True, exist_ok=True)
    chunk = 100_000
    with open(out / f"train.{src}", "w", encoding="utf-8") as fs, \
            open(out / f"train.{tgt}", "w", encoding="utf-8") as ft:
        for start in range(0, pairs, chunk):
            n = min(chunk, pairs - start)
            parts = rng.integers(2, 4, size=n)  # 2 or 3 Multi30k pairs per synthetic pair
            picks = rng.integers(0, len(sources), size=(n, 3))
            for count, row in zip(parts, picks, strict=True):
                fs.write(" ".join(sources[row[:count]]) + "\n")
                ft.write(" ".join(targets[row[:count]]) + "\n")
    for split in ("val", "test_2016_flickr"):
        for lang in (src, tgt):
            shutil.copyfile(multi30k / f"{split}.{lang}.gz", out / f"{split}.{lang}.gz")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--multi30k", type=Path, default=DEFAULT_MULTI30K)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    started = time.perf_counter()
    write_corpus(args.multi30k, args.out, args.pairs, seed=args.seed)
    size = sum(p.stat().st_size for p in args.out.glob("train.*"))
    print(f"{args.pairs:,} pairs, {size / 1e6:.0f} MB in {args.out} "
          f"({time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
