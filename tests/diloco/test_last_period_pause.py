"""Issue 26, training: a worker paused (SIGSTOP) during the last sync period of a run.

The survivor finishes the run while the worker is out. Back within the survivor's
``final_grace``, the late worker receives the final state and the run is consistent; back
after it, the late worker finishes apart and the summary says so, naming it and why (never
``consistent`` with differing hashes).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

from tests.chaos_helpers import events, last_step, train_tiny, wait_for, worker_pids

pytestmark = [pytest.mark.chaos, pytest.mark.slow, pytest.mark.timeout(420)]

STEPS = 60
H = 20  # the last sync period is steps 41..60; the pause starts at step 40 (+ a few)


def _train(out: Path, log, *extra: str) -> subprocess.Popen:
    # a batch of 32: slow enough that the pause lands well before worker 1's end
    return train_tiny(out, log, STEPS, "-H", str(H), "-P", "2", "--batch-size", "32", *extra)


def _pause_in_last_period(out: Path) -> int:
    """SIGSTOP worker 1 once it logged step STEPS - H; its pid."""
    victim = worker_pids(out)["1"]
    wait_for(
        lambda: last_step(out / "metrics-worker1.jsonl") >= STEPS - H,
        180,
        f"worker 1 at step {STEPS - H}",
        every=0.02,
    )
    os.kill(victim, signal.SIGSTOP)
    assert last_step(out / "metrics-worker1.jsonl") < STEPS  # the pause is inside the run
    return victim


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_paused_in_the_last_period_and_back_within_the_grace_gets_the_final_state(tmp_path, procs):
    out = tmp_path / "run"
    with open(tmp_path / "train.log", "w") as log:
        p = _train(out, log, "--final-grace", "120")
        procs.append(p)
        victim = _pause_in_last_period(out)
        try:
            # Worker 0 trains to the end without it, then holds for it.
            wait_for(lambda: events(out / "metrics-worker0.jsonl", "hold"), 120, "the hold")
        finally:
            os.kill(victim, signal.SIGCONT)
        assert p.wait(240) == 0, (tmp_path / "train.log").read_text()[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["exit_codes"] == {"0": 0, "1": 0}
    assert summary["consistent"] is True and summary["inconsistency"] is None, summary
    assert summary["transfers"]["worker1"] == 1  # the final state, from worker 0
    f0, f1 = (events(out / f"metrics-worker{i}.jsonl", "final")[-1] for i in (0, 1))
    assert f0["state_hash"] == f1["state_hash"] and f0["steps"] == f1["steps"] == STEPS
    assert sorted(f0["group"]) == sorted(f1["group"]) == sorted([f0["peer_id"], f1["peer_id"]])
    held = events(out / "metrics-worker0.jsonl", "hold")
    assert held[0]["step"] == STEPS and held[-1]["world"] == 2 and held[-1]["missing"] == []


def test_paused_past_the_grace_finishes_apart_and_the_summary_names_it(tmp_path, procs):
    """--final-grace 0: worker 0 does not wait; worker 1 comes back after it exited."""
    out = tmp_path / "run"
    with open(tmp_path / "train.log", "w") as log:
        p = _train(out, log, "--final-grace", "0")
        procs.append(p)
        victim = _pause_in_last_period(out)
        pid0 = worker_pids(out)["0"]
        try:
            wait_for(lambda: _gone(pid0), 180, "worker 0 to finish and exit")
        finally:
            os.kill(victim, signal.SIGCONT)
        assert p.wait(240) == 0, (tmp_path / "train.log").read_text()[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    f0, f1 = (events(out / f"metrics-worker{i}.jsonl", "final")[-1] for i in (0, 1))
    assert f0["group"] == [f0["peer_id"]] and f1["group"] == [f1["peer_id"]]
    # Worker 1 missed at least the sync worker 0 redid alone: its state is its own.
    assert f0["state_hash"] != f1["state_hash"]
    assert summary["consistent"] is False
    assert summary["differ"] == ["worker1"]
    assert summary["inconsistency"].startswith(
        "final state differs: worker1 (finished in a group without worker0, "
    ), summary["inconsistency"]
    assert "out of the group when they finished" in summary["inconsistency"]
    assert events(out / "metrics-worker0.jsonl", "hold") == []
