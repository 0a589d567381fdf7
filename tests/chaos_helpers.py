"""Helpers of the chaos tests (marked ``chaos``): real processes, real faults (SIGSTOP/SIGCONT,
kill -9), small sizes. Every child runs in its own session (process group) and is killed with its
group in teardown (the ``procs`` fixture, in tests/conftest.py)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Callable


def wait_for(pred: Callable[[], object], timeout: float, what: str, every: float = 0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


def events(path: Path, event: str) -> list[dict]:
    """The records of a metrics log (JSON lines) whose ``event`` is ``event`` (none before the
    file exists; a line being written is skipped)."""
    out = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line being written
        if rec.get("event") == event:
            out.append(rec)
    return out


def last_step(path: Path) -> int:
    """The last step a worker logged to its metrics file (0 before the first)."""
    if not path.exists():
        return 0
    step = 0
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line being written
        if rec.get("event") == "step":
            step = rec["step"]
    return step


def train_tiny(out: Path, log: IO[str], steps: int, *extra: str) -> subprocess.Popen:
    """``lowband train --preset tiny`` with two workers and no evaluation into ``out``, in its
    own session (kill its group in teardown: the ``procs`` fixture), output to ``log``."""
    args = [
        sys.executable,
        "-m",
        "cli",
        "train",
        "--preset",
        "tiny",
        "--workers",
        "2",
        "--steps",
        str(steps),
        "--eval-every",
        "0",
        "--no-progress",
        "--out",
        str(out),
        *extra,
    ]
    return subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def worker_pids(out: Path, timeout: float = 60) -> dict[str, int]:
    """The pid of each worker of a ``lowband train`` run into ``out``, by rank (as a string),
    once the launcher wrote them."""
    pids = wait_for(
        lambda: (
            (out / "workers.json").exists()
            and json.loads((out / "workers.json").read_text())["pids"]
        ),
        timeout,
        "workers",
    )
    return {rank: int(pid) for rank, pid in pids.items()}
