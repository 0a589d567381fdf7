"""Issue 10, training: a worker paused past the deadline rejoins with bit-identical state."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from tests.chaos_helpers import last_step, train_tiny, wait_for, worker_pids

pytestmark = [pytest.mark.chaos, pytest.mark.slow, pytest.mark.timeout(240)]


def test_sigstopped_worker_rejoins_and_finishes_consistent(tmp_path, procs):
    """kill -STOP one worker for longer than the deadline (2 × the 2 s heartbeat), then
    kill -CONT: it is declared lost, re-registers by itself, gets the survivor's state and
    both finish bit-identical; the summary says who was out and for how long."""
    out = tmp_path / "run"
    with open(tmp_path / "train.log", "w") as log:
        p = train_tiny(out, log, 500)
        procs.append(p)
        victim = worker_pids(out)["1"]
        wait_for(lambda: last_step(out / "metrics-worker1.jsonl") >= 40, 90, "step 40")
        os.kill(victim, signal.SIGSTOP)
        try:
            time.sleep(6.5)  # > dead_after (4 s) and the ZMTP heartbeat timeout
        finally:
            os.kill(victim, signal.SIGCONT)
        assert p.wait(180) == 0, (tmp_path / "train.log").read_text()[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["exit_codes"] == {"0": 0, "1": 0}
    assert summary["finished_together"] == ["worker0", "worker1"]
    assert summary["consistent"] is True
    out_of = {r["worker"]: r for r in summary["rejoined"]}
    assert "worker1" in out_of and out_of["worker1"]["out_s"] > 0
    assert summary["transfers"]["worker1"] >= 1
    w1 = (out / "worker1.log").read_text()
    assert "Traceback" not in w1 and "rejoined" in w1
