"""Tier 2: the Reconciler (diloco.reconcile) on the loopback communicator, without a trainer.

Each rank is a small in-memory replica (one parameter vector, one "outer state" vector, step and
syncs applied) so the outcome of a reconciliation is known exactly: who sends its state, who
receives it, what a redone sync averages, and what is logged.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

import pytest
import torch

from diloco.checkpoint import State
from diloco.common import hash_state
from diloco.metrics import MetricsLog
from diloco.reconcile import (
    ReconcileConfig,
    Reconciler,
    Replica,
    StateMismatch,
)
from lowband.comm import Communicator
from lowband.errors import ConfigError, IncompatiblePeer, ProtocolError
from tests.conftest import rank_outcomes
from transport.loopback import LoopbackGroup

pytestmark = pytest.mark.timeout(60)

CFG = ReconcileConfig(sync_timeout=10.0, audit_every=2, stride=3)


class Recorder(MetricsLog):
    """A metrics log that keeps its records in memory."""

    def __init__(self) -> None:
        super().__init__(None)
        self.records: list[dict[str, Any]] = []

    def log(self, event: str, **fields: Any) -> dict[str, Any]:
        rec = super().log(event, **fields)
        self.records.append(rec)
        return rec

    def events(self, name: str) -> list[dict[str, Any]]:
        return [r for r in self.records if r["event"] == name]


class Member:
    """A replica whose whole state is θ (4 floats), an outer-state vector, step and applied."""

    def __init__(
        self,
        comm: Communicator,
        theta: list[float],
        *,
        step: int = 0,
        applied: int = 0,
        initialized: bool = True,
        signature: bytes = b"run-A",
        broken_load: bool = False,
    ) -> None:
        self.comm = comm
        self.theta = torch.tensor(theta, dtype=torch.float32)
        self.moment = self.theta * 0.5
        self.step, self.applied = step, applied
        self.initialized, self.slot, self.signature = initialized, -1, signature
        self.lost: tuple[int, int] | None = None
        self.lost_x = torch.zeros(4)
        self.broken_load = broken_load
        self.redone: list[tuple[int, int, bool, int, str]] = []

    @property
    def lost_sync(self) -> tuple[int, int] | None:
        return self.lost

    def state_hash(self) -> int:
        return hash_state([self.theta, self.moment], self.step, self.applied)

    def state(self, *, own: bool) -> State:
        meta = {"step": self.step, "applied": self.applied, "slot": self.slot if own else -1}
        return {"theta": self.theta.clone(), "moment": self.moment.clone()}, meta

    def load(self, tensors: dict[str, torch.Tensor], meta: dict, *, own: bool) -> None:
        if not self.broken_load:
            self.theta, self.moment = tensors["theta"].clone(), tensors["moment"].clone()
        self.step, self.applied = int(meta["step"]), int(meta["applied"])
        self.lost, self.initialized = None, True

    def redo(self, fragment: int, round_: int, *, leader: bool, expected: int, tag: str) -> None:
        self.redone.append((fragment, round_, leader, expected, tag))
        x = self.lost_x if leader else torch.zeros(4)
        total = self.comm.all_reduce(x, "sum", tag=tag, timeout=10.0)
        if leader:
            self.theta = self.theta + total / expected
            self.applied += 1
            self.lost = None


def run_ranks(fns: list[Callable[[], Any]], timeout: float = 30.0) -> list[BaseException | None]:
    """Each rank's error (None where it returned)."""
    return rank_outcomes(fns, timeout)[1]


def reconcilers(members: list[Member]) -> list[Reconciler]:
    return [Reconciler(CFG, m.comm, m, Recorder()) for m in members]


def test_member_satisfies_the_replica_protocol():
    def take(r: Replica) -> Replica:
        return r

    m = Member(LoopbackGroup(1).comms()[0], [0.0] * 4)
    assert take(m) is m


def test_stale_member_receives_the_source_state_and_hashes_agree():
    comms = LoopbackGroup(2).comms()
    ahead = Member(comms[0], [1.0, 2.0, 3.0, 4.0], step=6, applied=2)
    behind = Member(comms[1], [9.0, 9.0, 9.0, 9.0], step=3, applied=1)
    before = ahead.state_hash()
    recs = reconcilers([ahead, behind])
    assert run_ranks([lambda r=r: r.reconcile("start") for r in recs]) == [None, None]
    assert torch.equal(behind.theta, torch.tensor([1.0, 2.0, 3.0, 4.0]))
    assert torch.equal(behind.moment, ahead.moment)
    assert (behind.step, behind.applied) == (6, 2)
    assert ahead.state_hash() == behind.state_hash() == before
    assert [r.transfers for r in recs] == [0, 1]
    assert [(m.slot, m.initialized) for m in (ahead, behind)] == [(0, True), (1, True)]
    for r in recs:
        (audit,) = r.log.events("audit")  # type: ignore[attr-defined]
        assert audit["reason"] == "start" and audit["refreshed"] == [1]
        assert audit["state_hash"] == before and audit["world"] == 2


def test_the_majority_hash_wins_among_equals():
    comms = LoopbackGroup(3).comms()
    members = [
        Member(comms[0], [5.0, 5.0, 5.0, 5.0], step=6, applied=2),  # corrupted
        Member(comms[1], [1.0, 1.0, 1.0, 1.0], step=6, applied=2),
        Member(comms[2], [1.0, 1.0, 1.0, 1.0], step=6, applied=2),
    ]
    recs = reconcilers(members)
    assert run_ranks([lambda r=r: r.reconcile("audit") for r in recs]) == [None] * 3
    assert all(torch.equal(m.theta, torch.ones(4)) for m in members)
    assert [r.transfers for r in recs] == [1, 0, 0]
    assert len({m.state_hash() for m in members}) == 1


def test_a_fresh_run_agrees_on_the_lowest_rank_state():
    comms = LoopbackGroup(2).comms()
    members = [
        Member(comms[0], [1.0] * 4, initialized=False),
        Member(comms[1], [2.0] * 4, initialized=False),
    ]
    recs = reconcilers(members)
    assert run_ranks([lambda r=r: r.reconcile("start") for r in recs]) == [None, None]
    assert torch.equal(members[1].theta, torch.ones(4))
    assert all(m.initialized for m in members)


def test_a_member_joining_later_receives_the_state():
    group = LoopbackGroup(2)
    founders = [Member(c, [0.0] * 4) for c in group.comms()]
    recs = reconcilers(founders)
    assert run_ranks([lambda r=r: r.reconcile("start") for r in recs]) == [None, None]
    for m in founders:  # they train in lockstep: the same update on both
        m.theta, m.step, m.applied = m.theta + 0.25, 3, 1
    newcomer = Member(group.join(), [7.0] * 4, initialized=False)
    new_rec = Reconciler(CFG, newcomer.comm, newcomer, Recorder())

    def join() -> None:
        new_rec.form(2)
        new_rec.reconcile("start")

    errors = run_ranks([recs[0].sync_point, recs[1].sync_point, join])
    assert errors == [None, None, None]
    assert torch.equal(newcomer.theta, torch.full((4,), 0.25))
    assert (newcomer.step, newcomer.applied, newcomer.slot) == (3, 1, 2)
    assert newcomer.state_hash() == founders[0].state_hash() == founders[1].state_hash()
    assert new_rec.transfers == 1 and [r.transfers for r in recs] == [0, 0]
    for r in recs:
        (change,) = r.log.events("membership")  # type: ignore[attr-defined]
        assert change["world"] == 3 and change["joined"] == [newcomer.comm.membership.peer_id]
        assert change["step"] == 3
        assert [a["reason"] for a in r.log.events("audit")] == ["start", "membership"]  # type: ignore[attr-defined]
        assert r.log.events("audit")[-1]["refreshed"] == [2]  # type: ignore[attr-defined]


def test_a_sync_every_leader_lost_is_redone_before_the_transfer():
    group = LoopbackGroup(2)
    leaders = [Member(c, [1.0] * 4, step=6, applied=2) for c in group.comms()]
    for m, x in zip(leaders, (2.0, 4.0)):
        m.lost, m.lost_x = (1, 3), torch.full((4,), x)
    newcomer = Member(group.join(), [0.0] * 4, initialized=False)
    recs = reconcilers([*leaders, newcomer])

    def newcomer_start() -> None:
        recs[2].form(1)
        recs[2].reconcile("start")

    errors = run_ranks([recs[0].sync_point, recs[1].sync_point, newcomer_start])
    assert errors == [None, None, None]
    for m in (*leaders, newcomer):  # θ + (2 + 4) / 2: the newcomer is counted out
        assert torch.equal(m.theta, torch.full((4,), 4.0))
        assert (m.step, m.applied, m.lost) == (6, 3, None)
    assert [m.redone[0][2:4] for m in (*leaders, newcomer)] == [(True, 2), (True, 2), (False, 2)]
    assert len({m.redone[0][4] for m in (*leaders, newcomer)}) == 1  # one tag on every rank
    assert recs[2].transfers == 1


def test_a_different_signature_is_refused_and_the_rest_continue():
    comms = LoopbackGroup(3).comms()
    members = [
        Member(comms[0], [1.0] * 4, step=3, applied=1),
        Member(comms[1], [1.0] * 4, step=3, applied=1),
        Member(comms[2], [1.0] * 4, step=3, applied=1, signature=b"run-B"),
    ]
    recs = reconcilers(members)
    errors = run_ranks([lambda r=r: r.reconcile("start") for r in recs])
    assert errors[:2] == [None, None] and isinstance(errors[2], IncompatiblePeer)
    assert comms[0].world_size == 2
    assert [r.log.events("audit")[0]["world"] for r in recs[:2]] == [2, 2]  # type: ignore[attr-defined]


def test_a_transfer_that_does_not_take_raises_state_mismatch():
    comms = LoopbackGroup(2).comms()
    members = [
        Member(comms[0], [1.0] * 4, step=6, applied=2),
        Member(comms[1], [0.0] * 4, step=3, applied=1, broken_load=True),
    ]
    recs = reconcilers(members)
    errors = run_ranks([lambda r=r: r.reconcile("start") for r in recs])
    assert all(isinstance(e, StateMismatch) for e in errors), errors


def test_audit_schedule_and_config_validation():
    comm = LoopbackGroup(1).comms()[0]
    m = Member(comm, [0.0] * 4)
    rec = Reconciler(CFG, comm, m, Recorder())
    due = []
    for step in range(0, 19, 3):  # sync points every stride=3 steps, audit every 2nd
        m.step = step
        due.append(rec.audit_due())
    assert due == [True, False, True, False, True, False, True]
    never = Reconciler(
        ReconcileConfig(sync_timeout=1.0, audit_every=0, stride=3), comm, m, Recorder()
    )
    assert not never.audit_due()
    assert CFG.quorum_timeout == 30.0
    with pytest.raises(ConfigError, match="sync_timeout"):
        ReconcileConfig(sync_timeout=0.0, audit_every=1, stride=1)
    with pytest.raises(ConfigError, match="stride"):
        ReconcileConfig(sync_timeout=1.0, audit_every=1, stride=0)


# ---- the site's hooks (diloco.site.SiteReconciler) with the site's collectives faked ------------
class FakeSite:
    """Site collectives of a rank whose site peers are simulated: ``others(row)`` gives the rows
    the other site ranks report for this rank's ``row``; this rank is the last site rank."""

    def __init__(self, others: Callable[[list[int]], list[list[int]]], want: int = 0) -> None:
        self.others, self.want = others, want
        self.gathered: list[list[int]] = []
        self.replicated = 0

    def max(self, value: int) -> int:
        return max(value, self.want)

    def gather(self, row: list[int]) -> list[list[int]]:
        self.gathered.append(row)
        return [*self.others(row), row]

    def replicate(self) -> None:
        self.replicated += 1


def site_reconciler(cfg: ReconcileConfig, m: Member, site: FakeSite) -> Reconciler:
    from diloco.site import SiteReconciler

    return SiteReconciler(
        cfg,
        m.comm,
        m,
        Recorder(),
        site_rank=1,
        site_max=site.max,
        site_gather=site.gather,
        replicate=site.replicate,
    )


def test_site_reconcile_takes_rank0_slot_and_replicates():
    comms = LoopbackGroup(2).comms()
    members = [
        Member(c, [float(r)] * 4, step=3 * (2 - r), applied=2 - r) for r, c in enumerate(comms)
    ]
    sites = [FakeSite(lambda row: [[7, *row[1:]]]) for _ in members]
    recs = [site_reconciler(CFG, m, s) for m, s in zip(members, sites)]
    assert run_ranks([lambda r=r: r.reconcile("start") for r in recs]) == [None, None]
    assert [m.slot for m in members] == [7, 7]  # the site's rank 0 decides the data stream
    assert [s.replicated for s in sites] == [1, 1]
    assert sites[1].gathered == [[1, 6, 2]]  # asked after the transfer: slot 1, the new progress
    assert torch.equal(members[1].theta, torch.zeros(4))


def test_site_reconcile_refuses_ranks_of_different_progress():
    comm = LoopbackGroup(1).comms()[0]
    m = Member(comm, [0.0] * 4, step=6, applied=2)
    site = FakeSite(lambda row: [[0, row[1] - 3, row[2] - 1]])
    rec = site_reconciler(CFG, m, site)
    with pytest.raises(ProtocolError, match=r"different progress after reconciling \(audit\)"):
        rec.reconcile("audit")
    assert site.replicated == 0


def test_site_sync_point_reconciles_when_any_site_rank_asks():
    comm = LoopbackGroup(1).comms()[0]
    quiet = ReconcileConfig(sync_timeout=10.0, audit_every=0, stride=3)
    m = Member(comm, [0.0] * 4, step=3, applied=1)
    alone, asked = FakeSite(lambda row: [row]), FakeSite(lambda row: [row], want=1)
    rec_alone, rec_asked = site_reconciler(quiet, m, alone), site_reconciler(quiet, m, asked)
    rec_alone.sync_point()  # nothing changed, no audit, no lost sync: replicate only
    assert rec_alone.log.events("audit") == [] and alone.replicated == 1  # type: ignore[attr-defined]
    rec_asked.sync_point()  # another rank of the site lost a sync: this group reconciles too
    assert [a["reason"] for a in rec_asked.log.events("audit")] == ["audit"]  # type: ignore[attr-defined]
    assert asked.replicated == 1


def test_site_admits_a_newcomer_in_every_group_at_the_same_sync_point():
    """The site's other rank saw its group admit one newcomer; this group's newcomer registers
    only after this group's quorum, so the rank re-quorums until it is admitted here too."""
    group = LoopbackGroup(1)
    founder = Member(group.comms()[0], [0.5] * 4, step=3, applied=1)
    newcomer_done: dict[str, Any] = {}

    def newcomer() -> None:
        m = Member(group.join(), [9.0] * 4, initialized=False)
        rec = Reconciler(CFG, m.comm, m, Recorder())
        newcomer_done["member"] = m
        try:
            rec.form(1)
            rec.reconcile("start")
        except BaseException as e:  # noqa: BLE001 - reported to the test
            newcomer_done["error"] = e

    def others(row: list[int]) -> list[list[int]]:
        if "thread" not in newcomer_done:  # the first admission round: the newcomer arrives
            newcomer_done["thread"] = threading.Thread(target=newcomer, daemon=True)
            newcomer_done["thread"].start()
        return [[1, 0]] if len(row) == 2 else [[0, *row[1:]]]

    site = FakeSite(others)
    rec = site_reconciler(CFG, founder, site)
    assert run_ranks([rec.sync_point]) == [None]
    newcomer_done["thread"].join(30)
    assert "error" not in newcomer_done
    assert site.gathered[0] == [0, 0] and site.gathered[-2] == [1, 0]  # (joined, expired)
    (change,) = rec.log.events("membership")  # type: ignore[attr-defined]
    assert change["world"] == 2 and len(change["joined"]) == 1
    new = newcomer_done["member"]
    assert (
        torch.equal(new.theta, torch.full((4,), 0.5)) and new.state_hash() == founder.state_hash()
    )
