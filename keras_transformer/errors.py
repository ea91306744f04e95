"""The one error a user fixes by changing what they asked for.

`UsageError` is raised by the library for a bad setting, corpus, run directory or input file,
with a message that says what and where, and how to fix it. The command lines print it as one
line (`error: ...`), never as a traceback, and exit with a status of their own (2 for
`train` and `prepare`, 1 for `translate`, `evaluate` and `export`).
"""

from __future__ import annotations


class UsageError(ValueError):
    """A bad setting, corpus, run directory or input: one line saying what to change."""
