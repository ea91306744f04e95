"""The errors a user fixes by changing what they asked for, or the storage they gave.

`UsageError` is raised by the library for a bad setting, corpus, run directory or input file,
with a message that says what and where, and how to fix it. `StorageError`
(`pipelines.storage`) is raised when a write fails because the disk is full, over quota,
read-only or failing: it names the path and the bytes needed, and nothing was half-written.
The command lines print either as one line (`error: ...`), never as a traceback, and exit
with a status of their own: 2 for a usage error of `train` and `prepare` (1 for
`translate`, `evaluate` and `export`), and `EXIT_STORAGE` (4) for the storage, everywhere.
"""

from __future__ import annotations

from pipelines.storage import StorageError

__all__ = ["EXIT_STORAGE", "StorageError", "TrainingDiverged", "UsageError"]

# The exit status of every command when the storage failed: free space, run it again.
EXIT_STORAGE = 4


class UsageError(ValueError):
    """A bad setting, corpus, run directory or input: one line saying what to change."""


class TrainingDiverged(RuntimeError):
    """The loss became NaN; the run's earlier checkpoints are kept."""
