"""Issue 10: kill -9 of the coordinator and its restart at the same address. The workers
re-register by themselves (ZmqConfig.rejoin), the restarted coordinator resumes above the
epochs they report, and training goes on to the end with equal state hashes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from lowband.proc import free_port
from tests.chaos_helpers import last_step, wait_for

pytestmark = [pytest.mark.chaos, pytest.mark.slow, pytest.mark.timeout(240)]


def _coordinator(port: int, log) -> subprocess.Popen:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "cli",
            "coordinator",
            "--bind",
            f"tcp://127.0.0.1:{port}",
            "--heartbeat",
            "1",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def _final(path) -> dict | None:
    if not path.exists():
        return None
    done = [json.loads(x) for x in path.read_text().splitlines() if '"final"' in x]
    return done[-1] if done else None


def test_coordinator_kill_9_and_restart_training_goes_on(tmp_path, procs):
    port = free_port()
    clog = open(tmp_path / "coord.log", "w")
    procs.append(_coordinator(port, clog))
    workers = []
    for i in range(2):
        log = open(tmp_path / f"w{i}.log", "w")
        w = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "cli",
                "worker",
                "--coordinator",
                f"tcp://127.0.0.1:{port}",
                "--preset",
                "tiny",
                "--workers",
                "2",
                "--steps",
                "300",
                "--eval-every",
                "0",
                "--id",
                str(i),
                "--out",
                str(tmp_path),
                "--bind-host",
                "127.0.0.1",
                "--threads",
                "1",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        procs.append(w)
        workers.append(w)
    wait_for(lambda: last_step(tmp_path / "metrics-worker1.jsonl") >= 30, 120, "step 30")
    os.kill(procs[0].pid, signal.SIGKILL)
    procs[0].wait(10)
    time.sleep(3.0)  # > the peers' coordinator silence limit: they notice it is gone
    procs.append(_coordinator(port, clog))  # a supervisor restarts it at the same address
    for i, w in enumerate(workers):
        assert w.wait(180) == 0, (tmp_path / f"w{i}.log").read_text()[-3000:]
    finals = [_final(tmp_path / f"metrics-worker{i}.jsonl") for i in range(2)]
    assert all(f is not None and f["steps"] == 300 for f in finals), finals
    assert finals[0]["state_hash"] == finals[1]["state_hash"]
    for i in range(2):
        text = (tmp_path / f"w{i}.log").read_text()
        assert "Traceback" not in text and "rejoined" in text, text[-3000:]
