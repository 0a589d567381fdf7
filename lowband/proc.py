"""Process helpers for launchers, benchmarks and tests: children that do not outlive the
launcher that started them, free TCP ports to hand to them, and whether an address is
loopback."""

from __future__ import annotations

import ctypes
import ipaddress
import signal
import socket
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


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that was free a moment ago (bind to port 0, read it back).

    Another process may take it before the caller binds it; the caller's bind then fails
    loudly, which is the intended outcome for launchers and tests on one machine."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def is_loopback(host: str) -> bool:
    """True for an address only this machine can reach: 127.0.0.0/8, ::1, ``localhost``.
    A wildcard (``0.0.0.0``, ``*``, ``::``, empty) or any other name is not loopback: a name
    can resolve anywhere."""
    host = host.strip("[]").lower()
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
