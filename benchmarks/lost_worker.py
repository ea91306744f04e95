"""How long the survivor of a lost worker takes to exit (issue 16): two `train` workers on
127.0.0.1, one of them sent a signal `--after` seconds into its training; the time from the
signal to the other's exit, its status and its last line.

`--signal KILL` is a crash; `STOP` freezes the process (alive, connections open: only the
missing heartbeats tell). Each run trains into a temporary folder, deleted afterwards.

    python benchmarks/lost_worker.py --data ../shared/data/multi30k --src de --tgt en \\
        --victim 1 --signal KILL --after 20 --runs 3 -- --preset tiny --max-steps 100000
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def one_run(args: argparse.Namespace, folder: Path) -> str:
    """Starts both workers, signals the victim, returns a line describing the survivor."""
    addresses = [f"127.0.0.1:{port}" for port in free_ports(2)]
    training = threading.Event()
    processes, lines = [], [[], []]
    for index in range(2):
        config = {"cluster": {"worker": addresses}, "task": {"type": "worker", "index": index}}
        command = [sys.executable, "-m", "keras_transformer.train", "--data", args.data,
                   "--src", args.src, "--tgt", args.tgt, "--out", str(folder / "run"),
                   "--prepared", str(folder.parent / "prepared"), *args.train_flags]
        processes.append(subprocess.Popen(
            command, cwd=REPO, env=dict(os.environ, TF_CONFIG=json.dumps(config)),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))

        def read(stream, index=index):
            for line in stream:
                lines[index].append(line.rstrip())
                if index == args.victim and "first training step" in line:
                    training.set()

        threading.Thread(target=read, args=(processes[-1].stdout,), daemon=True).start()
    victim, survivor = processes[args.victim], processes[1 - args.victim]
    try:
        if not training.wait(timeout=900):
            return "training never started: " + " | ".join(lines[1 - args.victim][-3:])
        time.sleep(args.after)
        victim.send_signal(getattr(signal, f"SIG{args.signal}"))
        sent = time.monotonic()
        status = survivor.wait(timeout=600)
        waited = time.monotonic() - sent
        time.sleep(0.2)  # the reader thread's last lines
        return (f"survivor worker {1 - args.victim}: status {status} after {waited:.1f} s: "
                f"{lines[1 - args.victim][-1] if lines[1 - args.victim] else ''}")
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
            process.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", required=True)
    parser.add_argument("--src", required=True)
    parser.add_argument("--tgt", required=True)
    parser.add_argument("--victim", type=int, choices=(0, 1), default=1)
    parser.add_argument("--signal", choices=("KILL", "STOP", "TERM"), default="KILL")
    parser.add_argument("--after", type=float, default=20.0,
                        help="seconds after the victim's training began")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("train_flags", nargs="*", help="after --: more train flags")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="lost_worker_") as temporary:
        for run in range(args.runs):  # the data are prepared by the first run, then reused
            folder = Path(temporary) / f"run{run}"
            folder.mkdir()
            print(f"run {run + 1}, worker {args.victim} sent SIG{args.signal}: "
                  + one_run(args, folder), flush=True)


if __name__ == "__main__":
    main()
