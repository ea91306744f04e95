"""A progress bar for the command-line tools."""

from __future__ import annotations

import sys


class ProgressBar:
    """A one-line progress bar on stderr (nothing when `total` is 0 or `enabled` is False).

    On a terminal the line is redrawn in place; when stderr is a file or a pipe (a log of a
    background run) a line is written at each tenth of the way instead, so that the log holds
    ten lines rather than one line of every redraw."""

    def __init__(self, total: int, enabled: bool = True, width: int = 30):
        self.total, self.enabled, self.width = total, enabled and total > 0, width
        # (no stderr at all under pythonw, or one without isatty: not a terminal)
        self.interactive = self.enabled and getattr(sys.stderr, "isatty", lambda: False)()
        self._tenths_written = 0

    def update(self, done: int) -> None:
        if not self.enabled:
            return
        filled = self.width * done // self.total
        line = f"[{'#' * filled}{'.' * (self.width - filled)}] {done}/{self.total} sentences"
        if self.interactive:
            sys.stderr.write(f"\r{line}")
        else:
            tenths = 10 * done // self.total
            if tenths <= self._tenths_written:
                return
            self._tenths_written = tenths
            sys.stderr.write(f"{line}\n")
        sys.stderr.flush()

    def close(self) -> None:
        if self.enabled and self.interactive:
            sys.stderr.write("\n")
            sys.stderr.flush()
