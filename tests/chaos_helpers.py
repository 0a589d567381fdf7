"""Helpers of the chaos tests (marked ``chaos``): real processes, real faults (SIGSTOP/SIGCONT,
kill -9), small sizes. Every child runs in its own session (process group) and is killed with its
group in teardown (the ``procs`` fixture, in tests/conftest.py)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Callable


def wait_for(pred: Callable[[], object], timeout: float, what: str, every: float = 0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


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
