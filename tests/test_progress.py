"""The command-line progress bar: redrawn on a terminal, ten lines in a log."""

from __future__ import annotations

import io

from keras_transformer.progress import ProgressBar


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_log_gets_a_line_at_each_tenth_a_terminal_one_redrawn_line(monkeypatch):
    log = io.StringIO()
    monkeypatch.setattr("sys.stderr", log)
    bar = ProgressBar(1000)
    for done in range(0, 1001, 7):
        bar.update(done)
    bar.update(1000)
    bar.close()
    lines = log.getvalue().splitlines()
    assert [line.split()[-2] for line in lines] == [
        "105/1000", "203/1000", "301/1000", "406/1000", "504/1000", "602/1000", "700/1000",
        "805/1000", "903/1000", "1000/1000"]
    assert "\r" not in log.getvalue() and lines[-1].startswith("[" + "#" * 30 + "]")

    terminal = _Terminal()
    monkeypatch.setattr("sys.stderr", terminal)
    bar = ProgressBar(4)
    for done in (2, 4):
        bar.update(done)
    bar.close()
    assert terminal.getvalue() == ("\r[###############...............] 2/4 sentences"
                                   "\r[##############################] 4/4 sentences\n")
    empty = io.StringIO()
    monkeypatch.setattr("sys.stderr", empty)
    ProgressBar(0).update(0)
    ProgressBar(5, enabled=False).update(3)
    assert empty.getvalue() == ""
