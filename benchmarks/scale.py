"""Start-up of the train command at WMT scale (issue 13): memory, time to the first step,
preparation time, and resume far into a run.

For each corpus size, a synthetic corpus (benchmarks/synthetic_corpus.py: joined Multi30k
pairs, WMT-like lengths) is generated into --workdir (a temporary folder; never commit
it), then three runs of `python -m keras_transformer.train` (tiny preset, --max-steps 20):

  fresh:  from the text: validate + sample, SentencePiece, tokenize into shards, 20 steps;
  again:  the same command with --max-steps 40: resumes at step 20 from the prepared shards;
  far:    the backup's step set to 10,000 (optimizer iterations and state.json), then the same
          command with --max-steps 10,020: resumes at step 10,000.

Each run's peak RSS is that process's own (os.wait4); times are seconds from the process
start to lines of its output (validation, preparation, first training step). One JSON line
per run.

    python benchmarks/scale.py --pairs 500000 2000000 4500000 --workdir /tmp/scale
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.synthetic_corpus import DEFAULT_MULTI30K, write_corpus  # noqa: E402

MARKERS = {
    "validating": "validating and sampling",
    "preparing": "preparing ",
    "built": "training ",
    "first_step": "first training step",
}


def run(command: list[str], log: Path) -> dict:
    """Runs `command`, timestamping marker lines; returns times, peak RSS and exit status."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONUNBUFFERED="1", PYTHONPATH=str(REPO))
    started = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, env=env, cwd=REPO)
    seen: dict[str, float] = {}
    with open(log, "w") as handle:
        for line in process.stdout:
            handle.write(line)
            for name, marker in MARKERS.items():
                if name not in seen and line.startswith(marker):
                    seen[name] = round(time.perf_counter() - started, 1)
    _, status, usage = os.wait4(process.pid, 0)
    return {"seconds": seen, "total_seconds": round(time.perf_counter() - started, 1),
            "peak_rss_gb": round(usage.ru_maxrss / 2**20, 2), "exit": os.waitstatus_to_exitcode(
                status)}


def move_backup_to_step(run_dir: Path, step: int) -> None:
    """Moves the newest resumable backup generation to `step` (optimizer step, state.json
    and the weights' recorded size and checksum)."""
    import h5py

    from keras_transformer.training.backup import (
        STATE_FILE,
        WEIGHTS_FILE,
        generation_dir,
        list_generations,
    )
    from pipelines import storage

    _, newest = list_generations(run_dir / "backup")[0]
    moved = generation_dir(run_dir / "backup", step)
    newest.rename(moved)
    with h5py.File(moved / WEIGHTS_FILE, "r+") as weights:
        # Keras 3 stores the optimizer's variables by index; 0 is `iterations`.
        weights["optimizer/vars/0"][()] = step
    state = json.loads((moved / STATE_FILE).read_text())
    state.update(step=step, epochs_done=step // 10,
                 weights={"bytes": (moved / WEIGHTS_FILE).stat().st_size,
                          "crc32": storage.file_checksum(moved / WEIGHTS_FILE)})
    (moved / STATE_FILE).write_text(json.dumps(state))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, nargs="+", default=[500_000, 2_000_000, 4_500_000])
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--multi30k", type=Path, default=DEFAULT_MULTI30K)
    parser.add_argument("--vocab-size", type=int, default=8000)
    parser.add_argument("--far-step", type=int, default=10_000)
    parser.add_argument("--keep", action="store_true", help="keep corpora and runs")
    args = parser.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    for pairs in args.pairs:
        corpus = args.workdir / f"corpus-{pairs}"
        if not (corpus / "train.en").is_file():
            write_corpus(args.multi30k, corpus, pairs)
        run_dir = args.workdir / f"run-{pairs}"
        shutil.rmtree(run_dir, ignore_errors=True)
        base = [sys.executable, "-m", "keras_transformer.train", "--data", str(corpus),
                "--src", "de", "--tgt", "en", "--preset", "tiny", "--vocab-size",
                str(args.vocab_size), "--checkpoint-every", "10", "--patience", "0",
                "--test-split", "none", "--no-export", "--average-last", "1", "--out", str(run_dir)]
        results = {"pairs": pairs, "corpus_mb": round(sum(
            p.stat().st_size for p in corpus.glob("train.*")) / 1e6)}
        results["fresh"] = run(base + ["--max-steps", "20"], args.workdir / f"fresh-{pairs}.log")
        manifest = json.loads((run_dir / "prepared" / "manifest.json").read_text())
        results["prepare_seconds_in_manifest"] = manifest["seconds"]
        (run_dir / "results.json").unlink()  # evaluated, but not finished: resumable
        results["again"] = run(base + ["--max-steps", "40"], args.workdir / f"again-{pairs}.log")
        (run_dir / "results.json").unlink()
        move_backup_to_step(run_dir, args.far_step)
        results["far"] = run(base + ["--max-steps", str(args.far_step + 20)],
                             args.workdir / f"far-{pairs}.log")
        print(json.dumps(results), flush=True)
        if not args.keep:
            shutil.rmtree(run_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
