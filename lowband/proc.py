"""Child processes that do not outlive the launcher that started them."""

from __future__ import annotations

import ctypes
import signal
import sys

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """``preexec_fn`` for launchers: the child gets SIGTERM when the thread that started it
    dies, even if the launcher was SIGKILLed and had no chance to stop it (Linux; elsewhere a
    no-op). Children run in their own session so a terminal's Ctrl-C reaches the launcher
    only, which then stops them in order; this covers the case where it cannot."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
