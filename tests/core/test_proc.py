"""Launchers' children do not outlive a launcher that was SIGKILLed (lowband.proc)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

LAUNCHER = """
import subprocess, sys, time
from lowband.proc import die_with_parent
kw = {"preexec_fn": die_with_parent} if sys.argv[1] == "guarded" else {}
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                         start_new_session=True, **kw)
print(child.pid, flush=True)
time.sleep(120)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux-only")
@pytest.mark.parametrize("mode", ["guarded", "plain"])
def test_child_dies_with_a_killed_launcher(spawn, mode):
    p = spawn([sys.executable, "-c", LAUNCHER, mode], stdout=subprocess.PIPE, text=True)
    child = int(p.stdout.readline())
    try:
        assert _alive(child)
        os.kill(p.pid, signal.SIGKILL)
        p.wait(timeout=10)
        deadline = time.monotonic() + 10
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        # Without the guard the child is orphaned and keeps running: the test can tell.
        assert _alive(child) == (mode == "plain")
    finally:
        try:
            os.kill(child, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads Linux's port range")
def test_free_port_is_outside_the_range_bind_zero_draws_from():
    # A port from bind(0) is what a child's next bind(0) (a ZeroMQ socket, a coordinator)
    # may be handed before the caller binds it: CI once saw an HTTP client reach a ZeroMQ
    # socket that way. free_port draws below the ephemeral range instead.
    import socket

    from lowband.proc import _ephemeral_range, free_port

    lo, hi = _ephemeral_range() or (0, 0)
    ports = {free_port() for _ in range(20)}
    if lo - 10000 >= 1000:
        assert all(10000 <= p < lo for p in ports), (ports, lo, hi)
    for p in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))
