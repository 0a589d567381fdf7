"""``lowband train`` keeps every socket on loopback end to end (issue 25: local one-machine runs
bind loopback): its coordinator and every worker's data socket, sampled while the run lasts."""

from __future__ import annotations

import ipaddress
import time

import psutil
import pytest

from tests.conftest import PY

pytestmark = [pytest.mark.security, pytest.mark.timeout(300)]


def _listening(root: psutil.Process) -> set[tuple[int, str, int]]:
    seen = set()
    try:
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return seen
    for p in procs:
        try:
            conns = p.net_connections(kind="inet")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        seen |= {(p.pid, c.laddr.ip, c.laddr.port) for c in conns if c.status == psutil.CONN_LISTEN}
    return seen


def test_lowband_train_listens_only_on_loopback(tmp_path, spawn) -> None:
    run = spawn(
        [PY, "-m", "cli", "train", "--workers", "2", "--preset", "tiny", "--steps", "150"]
        + ["--out", str(tmp_path / "run")],
        env={"LOWBAND_TOKEN": ""},
    )
    root = psutil.Process(run.pid)
    seen: set[tuple[int, str, int]] = set()
    deadline = time.monotonic() + 240
    while run.poll() is None and time.monotonic() < deadline:
        seen |= _listening(root)
        time.sleep(0.1)
    assert run.wait(timeout=30) == 0
    # the coordinator and the two workers' data sockets, at least
    assert len({port for _, _, port in seen}) >= 3, seen
    exposed = [x for x in seen if not ipaddress.ip_address(x[1]).is_loopback]
    assert not exposed, f"listening beyond loopback: {exposed} of {seen}"
