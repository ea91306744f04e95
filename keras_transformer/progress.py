"""A progress bar for the command-line tools."""

from __future__ import annotations

import sys


class ProgressBar:
    """A one-line progress bar on stderr (nothing when `total` is 0 or `enabled` is False)."""

    def __init__(self, total: int, enabled: bool = True, width: int = 30):
        self.total, self.enabled, self.width = total, enabled and total > 0, width

    def update(self, done: int) -> None:
        if self.enabled:
            filled = self.width * done // self.total
            sys.stderr.write(f"\r[{'#' * filled}{'.' * (self.width - filled)}] "
                             f"{done}/{self.total} sentences")
            sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")
            sys.stderr.flush()
