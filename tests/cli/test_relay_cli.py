"""`lowband coordinator --relay-bind` and `lowband worker --reachable no`: a worker that says it
cannot be dialled trains with the others through the coordinator's relay (the NAT case's CLI;
the namespaces-behind-MASQUERADE tests are in tests/transport/test_nat_relay.py)."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import time

import pytest

from lowband.proc import free_port
from tests.conftest import PY

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def _line(proc: subprocess.Popen, pattern: str, timeout: float) -> re.Match:
    deadline = time.monotonic() + timeout
    seen = []
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        seen.append(line)
        if m := re.search(pattern, line):
            return m
    raise AssertionError(f"no line matching {pattern!r} in {seen}")


def test_a_worker_that_cannot_be_dialled_trains_through_the_relay(tmp_path, spawn):
    relay_port = free_port()
    args = f"-v coordinator --bind tcp://127.0.0.1:0 --relay-bind tcp://127.0.0.1:{relay_port}"
    coord = spawn(
        [PY, "-m", "cli", *args.split()],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    address = _line(coord, r"listening on (tcp://\S+)", 60).group(1)
    assert (
        _line(coord, r"relay for peers behind NAT on (\S+)", 30).group(1).endswith(f":{relay_port}")
    )

    def worker(i: int, *extra: str) -> subprocess.Popen:
        args = (
            f"worker --coordinator {address} --preset tiny --workers 2 --steps 24 -H 8 -P 2 "
            f"--id {i} --out {tmp_path / f'w{i}'} --threads 1 --bind-host 127.0.0.1"
        )
        return spawn(
            [PY, "-m", "cli", *args.split(), *extra],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )

    procs = [worker(0, "--reachable", "no"), worker(1)]
    outs = [p.communicate(timeout=180)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [o[-2000:] for o in outs]
    finals = [json.loads(o.strip().splitlines()[-1]) for o in outs]
    assert finals[0]["state_hash"] == finals[1]["state_hash"]
    coord.send_signal(signal.SIGTERM)
    rest = coord.communicate(timeout=30)[0]
    assert coord.returncode == 0, rest[-2000:]
    forwarded = re.search(r"relay: forwarded (\d+) messages", rest)
    assert forwarded and int(forwarded.group(1)) > 0, rest[-2000:]


def test_relay_flags_are_checked_before_anything_listens():
    for args, needle in (
        ("coordinator --bind tcp://127.0.0.1:0 --relay-bind 127.0.0.1:1", "relay_bind"),
        ("worker --coordinator tcp://127.0.0.1:1 --relay x", "--relay"),
        ("worker --coordinator tcp://127.0.0.1:1 --reachable maybe", "--reachable"),
        ("worker --coordinator tcp://127.0.0.1:1 --connections 0", "--connections"),
        ("worker --coordinator tcp://127.0.0.1:1 --connections 65", "--connections"),
    ):
        bad = subprocess.run(
            [PY, "-m", "cli", *args.split()], capture_output=True, text=True, timeout=60
        )
        assert bad.returncode == 2 and needle in bad.stderr, (args, bad.stderr)
