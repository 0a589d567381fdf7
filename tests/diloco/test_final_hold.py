"""The end of a run is a sync point that waits for a worker lost near the end (issue 26).

On the loopback group: a worker lost in the last sync period leaves the survivors finishing with
fewer than ``workers``; they hold for ``final_grace`` and a worker that (re)joins then receives
the final state. The real-process SIGSTOP case is tests/diloco/test_last_period_pause.py.
"""

from __future__ import annotations

import threading
import time

import pytest

from diloco.config import DilocoConfig
from diloco.metrics import MetricsLog, RunSummary, read_jsonl
from diloco.reconcile import ReconcileConfig
from diloco.task import lm_task
from diloco.trainer import DilocoWorker
from lowband.errors import ConfigError
from tests.chaos_helpers import wait_for
from tests.diloco.configs import small_lm
from transport.loopback import LoopbackGroup

pytestmark = pytest.mark.timeout(120)

STEPS = 24
MODE = DilocoConfig(inner_steps=6, n_fragments=2, tau=1, alpha=0.5)


class _Killed(Exception):
    pass


def _holds(path) -> list[dict]:
    return [r for r in read_jsonl(path) if r["event"] == "hold"] if path.exists() else []


def _run(worker: DilocoWorker, out: dict, key: str) -> threading.Thread:
    def body() -> None:
        try:
            out[key] = worker.run()
        except BaseException as exc:  # noqa: BLE001 - the test reads it
            out[key] = exc
        finally:
            worker.log.close()

    t = threading.Thread(target=body, name=key, daemon=True)
    t.start()
    return t


def test_a_worker_back_within_the_grace_receives_the_final_state(tmp_path):
    """Worker 1 dies in the last sync period; worker 0 finishes the run alone and holds; a worker
    that joins during the hold receives the final state: both end bit-identical at step T."""
    cfg = small_lm(steps=STEPS, mode=MODE, final_grace=60.0)
    task = lm_task(cfg)
    group = LoopbackGroup(2, timeout=30)
    comms = group.comms()

    def die(step: int) -> None:
        if step == STEPS - 2:  # after the last sync point but one: the last sync goes on alone
            group.kill(comms[1])
            raise _Killed

    log0 = tmp_path / "w0.jsonl"
    survivor = DilocoWorker(cfg, comms[0], task, log=MetricsLog(log0))
    victim = DilocoWorker(cfg, comms[1], task, on_step=die)
    out: dict = {}
    threads = [_run(survivor, out, "survivor"), _run(victim, out, "victim")]
    wait_for(lambda: _holds(log0), 60, "the survivor to hold at the end", every=0.02)
    assert "survivor" not in out  # still holding: it has not finished without the late one
    late = DilocoWorker(cfg, group.join(), task)
    threads.append(_run(late, out, "late"))
    for t in threads:
        t.join(90)
        assert not t.is_alive()
    assert isinstance(out["victim"], _Killed)
    first, second = out["survivor"], out["late"]
    assert first.steps == second.steps == STEPS
    assert first.state_hash == second.state_hash
    assert second.transfers == 1 and second.start_step == STEPS  # it trained no step itself
    assert first.retries == 1  # the sync the victim took with it was redone
    assert set(first.group) == set(second.group) and len(first.group) == 2
    start, end = _holds(log0)
    assert start["waiting_for"] == [comms[1].peer_id] and start["step"] == STEPS
    assert end["world"] == 2
    run = RunSummary.from_finals(
        ["w0", "w1"],
        {"w0": first.summary(), "w1": second.summary()},
        steps=STEPS,
    )
    assert run.consistent and not run.apart


def test_without_a_return_the_hold_ends_at_the_grace_and_names_the_missing(tmp_path):
    cfg = small_lm(steps=STEPS, mode=MODE, final_grace=1.0)
    task = lm_task(cfg)
    group = LoopbackGroup(2, timeout=30)
    comms = group.comms()

    def die(step: int) -> None:
        if step == STEPS - 2:
            group.kill(comms[1])
            raise _Killed

    log0 = tmp_path / "w0.jsonl"
    survivor = DilocoWorker(cfg, comms[0], task, log=MetricsLog(log0))
    victim = DilocoWorker(cfg, comms[1], task, on_step=die)
    out: dict = {}
    for t in [_run(survivor, out, "survivor"), _run(victim, out, "victim")]:
        t.join(90)
        assert not t.is_alive()
    assert out["survivor"].steps == STEPS and out["survivor"].group == (comms[0].peer_id,)
    start, end = _holds(log0)
    assert start["waiting_for"] == end["missing"] == [comms[1].peer_id]
    assert end["world"] == 1 and 0 < end["waited_s"] < 30  # the grace, not a collective's


def test_a_peer_lost_longer_ago_than_the_grace_delays_nobody(tmp_path):
    """A worker killed early is not waited for at the end: the grace counts from the loss."""
    cfg = small_lm(steps=STEPS, mode=MODE, final_grace=0.2)
    task = lm_task(cfg)
    group = LoopbackGroup(2, timeout=30)
    comms = group.comms()

    def die(step: int) -> None:
        if step == 2:
            group.kill(comms[1])
            raise _Killed

    def slow(step: int) -> None:
        if step > 2:
            time.sleep(0.02)  # the rest of the run outlasts the grace on any machine

    log0 = tmp_path / "w0.jsonl"
    survivor = DilocoWorker(cfg, comms[0], task, log=MetricsLog(log0), on_step=slow)
    victim = DilocoWorker(cfg, comms[1], task, on_step=die)
    out: dict = {}
    for t in [_run(survivor, out, "survivor"), _run(victim, out, "victim")]:
        t.join(90)
        assert not t.is_alive()
    assert out["survivor"].steps == STEPS
    assert _holds(log0) == []


def test_final_grace_is_validated():
    with pytest.raises(ConfigError, match="final_grace"):
        small_lm(final_grace=-1.0)
    with pytest.raises(ConfigError, match="final_grace"):
        ReconcileConfig(sync_timeout=1.0, audit_every=0, stride=1, final_grace=-0.5)


# ---- the run summary names a worker that finished apart ----------------------------------------
def _final(h: int, peer: str, group: list[str], at: float) -> dict:
    return {
        "event": "final",
        "state_hash": h,
        "steps": 10,
        "peer_id": peer,
        "group": group,
        "finished_at": at,
    }


def test_a_worker_that_finished_apart_is_named_with_the_cause():
    finals = {
        "worker0": _final(7, "p0", ["p0"], 1000.0),
        "worker1": _final(9, "p1", ["p1"], 1042.0),
    }
    run = RunSummary.from_finals(["worker0", "worker1"], finals, steps=10)
    assert not run.consistent and run.differ == ("worker1",)
    assert run.to_dict()["consistent"] is False
    assert run.reason is not None
    assert run.reason.startswith(
        "final state differs: worker1 (finished in a group without worker0, 42s after they "
        "finished: it was out of the group when they finished"
    )


def test_finishing_apart_with_the_same_state_is_consistent_and_groups_are_optional():
    # Paused after its last sync: nothing to miss, the same final state, consistent.
    same = {
        "worker0": _final(7, "p0", ["p0"], 1000.0),
        "worker1": _final(7, "p1", ["p1"], 1005.0),
    }
    run = RunSummary.from_finals(["worker0", "worker1"], same, steps=10)
    assert run.consistent and run.reason is None
    assert set(run.apart) == {"worker0", "worker1"}
    # DDP and records without a group: the reason is the hashes alone.
    bare = {"a": {"state_hash": 1, "group": []}, "b": {"state_hash": 2}}
    assert RunSummary.from_finals(["a", "b"], bare).reason == "final state differs: b"
