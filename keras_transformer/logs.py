"""What the command-line tools print: the project's own lines, not TensorFlow's C++ noise.

TensorFlow, XLA, oneDNN and SentencePiece log from C++ straight to file descriptor 2, before
and regardless of Python's logging: "All log messages before absl::InitializeLog()", "Could
not find cuda drivers", "failed call to cuInit" on a CPU machine, "oneDNN supports DT_INT64
only on platforms with AVX-512" on one that has it, SentencePiece's `LOG(INFO)`. Setting
`TF_CPP_MIN_LOG_LEVEL` does not silence the ones written before absl is initialized, so
`start_cli_logging` puts a filter on descriptor 2 itself: a pipe whose reader thread passes
every line on to the real stderr except those C++ log lines (Python warnings, tracebacks and
fatal C++ errors pass). `--verbose`, or a `TF_CPP_MIN_LOG_LEVEL` of the user's own, turns the
filter off.

The project's own progress lines (loggers "keras_transformer" and "pipelines") go to stdout,
or to stderr for the commands whose stdout is their result (`translate`, `evaluate`,
`force_decode`, `export`: `show_project_logs(to_stderr=True)`), so that it stays clean.
"""

from __future__ import annotations

import atexit
import logging
import os
import re
import sys
import threading
from collections.abc import Sequence

# A glog/absl line below FATAL ("I0000 00:00:1795494401.635544   14486 port.cc:153] ..."), its
# known continuation, absl's pre-initialization notice, and SentencePiece's LOG(INFO/WARNING).
_NATIVE_LOG = re.compile(
    rb"^(?:[IWE]\d{4} [\d:.]+\s+\d+ [\w./-]+:\d+\]"
    rb"|WARNING: All log messages before absl::InitializeLog\(\)"
    rb"|To enable the following instructions: .* rebuild TensorFlow"
    rb"|\w+\.cc\(\d+\) LOG\((?:INFO|WARNING)\))")
# The same glog/absl prefix in the middle of a line (after a progress bar's "\r...").
_NATIVE_LOG_INSIDE = re.compile(rb"[IWE]\d{4} [\d:.]+\s+\d+ [\w./-]+:\d+\] ")
LOGGERS = ("keras_transformer", "pipelines")


class _ConsoleHandler(logging.StreamHandler):
    """Writes to whatever `sys.stdout` (or `sys.stderr`, `to_stderr`) is when a record comes
    (either may be replaced later)."""

    to_stderr = False

    @property
    def stream(self):
        return sys.stderr if self.to_stderr else sys.stdout

    @stream.setter
    def stream(self, value) -> None:
        del value


def show_project_logs(to_stderr: bool = False) -> None:
    """Shows the INFO lines of the project's loggers ("keras_transformer", "pipelines": pairs
    dropped as too long, tokenizer trained or reused, shards written, ...) on stdout, or on
    stderr for a command whose stdout is its result (translations, scores, JSON, a path)."""
    for name in LOGGERS:
        logger = logging.getLogger(name)
        handlers = [handler for handler in logger.handlers
                    if isinstance(handler, _ConsoleHandler)]
        if not handlers:
            handlers = [_ConsoleHandler()]
            handlers[0].setFormatter(logging.Formatter("%(message)s"))
            logger.addHandler(handlers[0])
            logger.setLevel(logging.INFO)
            logger.propagate = False
        for handler in handlers:
            handler.to_stderr = to_stderr


def is_native_log_line(line: bytes) -> bool:
    """True for a C++ log line that `start_cli_logging` hides (see the module docstring)."""
    return _NATIVE_LOG.match(line) is not None


def filter_native_logs(line: bytes) -> bytes | None:
    """`line` without C++ log output (None: nothing left worth a line)."""
    if is_native_log_line(line):
        return None
    inside = _NATIVE_LOG_INSIDE.search(line)
    if inside is not None:  # e.g. a progress bar, then a C++ line without a newline between
        line = line[:inside.start()].rstrip()
        return line or None
    return line


class _NativeLogFilter:
    """Descriptor 2 replaced by a pipe; a thread forwards all but C++ log lines."""

    def __init__(self):
        self.real_stderr = os.dup(2)
        read_end, write_end = os.pipe()
        sys.stderr.flush()
        os.dup2(write_end, 2)
        os.close(write_end)
        self.reader = threading.Thread(target=self._forward, args=(read_end,), daemon=True,
                                       name="native-log-filter")
        self.reader.start()

    def _forward(self, read_end: int) -> None:
        with os.fdopen(read_end, "rb", buffering=0) as pipe:
            pending = b""
            while chunk := pipe.read(65536):
                pending += chunk
                *lines, pending = pending.split(b"\n")
                kept = (filter_native_logs(line) for line in lines)
                self._write(b"".join(line + b"\n" for line in kept if line is not None))
            if pending and (last := filter_native_logs(pending)) is not None:
                self._write(last)

    def _write(self, data: bytes) -> None:
        while data:
            data = data[os.write(self.real_stderr, data):]

    def stop(self) -> None:
        """Puts the real stderr back and forwards what is still in the pipe."""
        try:
            sys.stderr.flush()
        except (OSError, ValueError):
            pass
        os.dup2(self.real_stderr, 2)  # closes our write end: the reader sees the end
        self.reader.join(timeout=5)


_active: list[_NativeLogFilter] = []


def start_cli_logging(argv: Sequence[str] | None = None) -> None:
    """Sets up a command's output; call it first, before TensorFlow loads.

    Args:
        argv: the command's arguments; `--verbose` among them keeps TensorFlow's C++ logs.
    """
    show_project_logs()
    argv = sys.argv[1:] if argv is None else argv
    if _active or "--verbose" in argv or "TF_CPP_MIN_LOG_LEVEL" in os.environ:
        return
    _active.append(_NativeLogFilter())
    atexit.register(stop_cli_logging)
    # And at the source, for what TensorFlow logs once absl is initialized: some errors span
    # several lines (a cluster's barrier timeout lists every task), only the first prefixed.
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"


def stop_cli_logging() -> None:
    """Removes the filter of `start_cli_logging` (before `os._exit`, which skips atexit)."""
    while _active:
        _active.pop().stop()
