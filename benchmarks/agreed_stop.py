"""What agreeing on every stop costs a multi-worker run (issue 16): the time of one
`keras_transformer.cluster.workers.any_worker` call (a one-float all-reduce between workers), made
once per optimizer step by `keras_transformer.training.callbacks.AgreedStop`.

Starts `--workers` processes on 127.0.0.1 (a cluster in `TF_CONFIG`), each of which calls the
agreement `--calls` times in `--rounds` rounds; prints the median milliseconds per call of
each worker's rounds. Compare with a training step's time (BENCHMARKS.md).

    python benchmarks/agreed_stop.py --workers 2 --calls 500 --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def worker(calls: int, rounds: int) -> None:
    """One worker: join the cluster, warm up, then time `rounds` x `calls` agreements."""
    sys.path.insert(0, str(REPO))
    from keras_transformer.cluster.strategy import select_strategy
    from keras_transformer.cluster.workers import any_worker

    agree = any_worker(select_strategy())
    for _ in range(20):
        agree(False)
    per_call = []
    for _ in range(rounds):
        started = time.perf_counter()
        for _ in range(calls):
            agree(False)
        per_call.append((time.perf_counter() - started) / calls * 1000)
    print(json.dumps({"ms_per_call": per_call}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--calls", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--worker-index", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker_index is not None:
        worker(args.calls, args.rounds)
        return
    sockets = [socket.socket() for _ in range(args.workers)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    addresses = [f"127.0.0.1:{s.getsockname()[1]}" for s in sockets]
    for s in sockets:
        s.close()
    processes = []
    for index in range(args.workers):
        config = {"cluster": {"worker": addresses}, "task": {"type": "worker", "index": index}}
        env = dict(os.environ, TF_CONFIG=json.dumps(config), TF_CPP_MIN_LOG_LEVEL="3")
        processes.append(subprocess.Popen(
            [sys.executable, __file__, "--worker-index", str(index), "--calls", str(args.calls),
             "--rounds", str(args.rounds)], env=env, stdout=subprocess.PIPE, text=True))
    for index, process in enumerate(processes):
        stdout, _ = process.communicate(timeout=600)
        rounds = json.loads(stdout.strip().splitlines()[-1])["ms_per_call"]
        print(f"worker {index}: {statistics.median(rounds):.3f} ms per agreement (median of "
              f"{len(rounds)} rounds of {args.calls}: "
              + ", ".join(f"{r:.3f}" for r in rounds) + ")")


if __name__ == "__main__":
    main()
