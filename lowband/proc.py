"""Process helpers for launchers, benchmarks and tests: children that do not outlive the
launcher that started them, free TCP ports to hand to them, and whether an address is
loopback."""

from __future__ import annotations

import ctypes
import ipaddress
import random
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


def _ephemeral_range() -> tuple[int, int] | None:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(x) for x in f.read().split())
        return lo, hi
    except (OSError, ValueError):
        return None


_SPARE_FLOOR = 10000  # below it live the well-known and registered services


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that was free a moment ago.

    On Linux the port is drawn from below the kernel's ephemeral range, so that no ``bind``
    to port 0 (a ZeroMQ socket, a coordinator, an outgoing connection) can take it between
    this call and the caller's own bind: a port read back from ``bind(0)`` is exactly what
    the next ``bind(0)`` in a child process may be handed. Another caller of this function
    may still draw the same port; the caller's bind then fails loudly, which is the intended
    outcome for launchers and tests on one machine."""
    span = _ephemeral_range()
    if span is not None and span[0] - _SPARE_FLOOR >= 1000:
        rng = random.SystemRandom()
        for _ in range(64):
            port = rng.randrange(_SPARE_FLOOR, span[0])
            with socket.socket() as s:
                try:
                    s.bind((host, port))
                except OSError:
                    continue
                return port
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
