"""The live status line (`logger.progress`): `always` writes it to stderr with the run's figures;
`never`, and `auto` when stderr is not a terminal, write nothing; `auto` on a terminal writes it."""

from __future__ import annotations

import io
import sys

import pytest

from hypertrain.run.progress import Progress


def shown(mode: str, done: int = 0) -> str:
    """What a 3-update run's status line writes to stderr."""
    progress = Progress(3, mode, done)
    progress.eval_loss = 2.5
    for update in range(done, 3):
        progress.update(update + 1, 2.0 - update / 10, 2)
    progress.eval_loss = 1.5
    progress.close()
    return sys.stderr.getvalue() if isinstance(sys.stderr, io.StringIO) else ""


def test_always_writes_the_line_with_losses_rate_and_eta_to_stderr(capsys):
    shown("always")
    line = capsys.readouterr().err.split("\r")[-1]  # the last state of the line
    for part in ("update 3/3", "loss 1.8000", "held-out 1.5000", "replica-steps/s", "ETA"):
        assert part in line


@pytest.mark.parametrize("mode", ["never", "auto"])
def test_never_and_auto_without_a_terminal_write_nothing(capsys, mode):
    assert not sys.stderr.isatty()
    shown(mode)
    assert capsys.readouterr().err == ""


def test_auto_on_a_terminal_writes_the_line(monkeypatch):
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.setattr(sys, "stderr", Terminal())
    assert "update 3/3" in shown("auto")


def test_a_resumed_run_counts_on_from_the_updates_it_had_done(capsys):
    shown("always", done=2)
    err = capsys.readouterr().err
    assert "update 2/3" in err and "update 3/3" in err and "update 0/3" not in err
