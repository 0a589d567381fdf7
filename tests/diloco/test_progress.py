"""Training progress: a bar on a terminal, a line every tenth of the run in a log."""

from __future__ import annotations

import io

from diloco.metrics import Progress


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_log_gets_one_line_per_tenth_of_the_run() -> None:
    log = io.StringIO()
    bar = Progress(3200, enabled=True, stream=log)
    for step in range(1, 3201):
        bar.update(step, loss=f"{1.0 / step:.3f}")
    bar.close()
    lines = log.getvalue().splitlines()
    assert [ln.split(" (")[0] for ln in lines] == [
        f"train: step {s}/3200" for s in range(320, 3201, 320)
    ]
    assert lines[-1] == "train: step 3200/3200 (100%) loss=0.000"
    assert "\r" not in log.getvalue()


def test_a_resumed_run_counts_from_where_it_starts() -> None:
    log = io.StringIO()
    bar = Progress(100, enabled=True, desc="ddp", initial=45, stream=log)
    for step in range(46, 101):
        bar.update(step)
    assert log.getvalue().splitlines() == [
        f"ddp: step {s}/100 ({s}%)" for s in (50, 60, 70, 80, 90, 100)
    ]


def test_a_terminal_gets_the_bar_and_disabled_gets_nothing() -> None:
    tty = _Terminal()
    bar = Progress(10, enabled=True, stream=tty)
    for step in range(1, 11):
        bar.update(step)
    bar.close()
    assert "\r" in tty.getvalue() and "10/10" in tty.getvalue()
    quiet = io.StringIO()
    off = Progress(10, enabled=False, stream=quiet)
    off.update(10)
    off.close()
    assert quiet.getvalue() == ""
