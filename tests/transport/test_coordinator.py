"""Coordinator: pure quorum bookkeeping (tier 1) and membership over real sockets (tier 3)."""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest
import torch

from lowband.errors import PeerLost, TransportTimeout
from tests.conftest import run_ranks
from transport.coordinator import Coordinator, CoordinatorConfig, MembershipBook
from transport.launch import connect_all
from transport.zmq_comm import ZmqConfig, connect

pytestmark = pytest.mark.timeout(60)

CFG = ZmqConfig(
    bind_host="127.0.0.1", connections=2, chunk_bytes=16 * 1024, timeout=20.0, same_host="off"
)


# ---- tier 1: MembershipBook ----------------------------------------------------------------------
def test_book_founding_members_wait_for_min_world():
    book = MembershipBook()
    for p in "abc":
        book.register(p)
    book.arrive("a", 3)
    book.arrive("b", 3)
    assert book.try_complete() is None  # c registered but has not arrived
    book.arrive("c", 1)
    views = book.try_complete()
    assert views is not None and book.epoch == 0
    assert [views[p].rank for p in "abc"] == [0, 1, 2]
    assert all(v.joined == () and v.left == () for v in views.values())


def test_book_min_world_blocks_until_enough_peers_registered():
    book = MembershipBook()
    book.register("a")
    book.arrive("a", 2)
    assert book.try_complete() is None
    book.register("b")
    assert book.try_complete() is None  # b registered: it must arrive too
    book.arrive("b", 1)
    assert book.try_complete()["b"].peers == ("a", "b")


def test_book_epochs_change_only_with_the_view_and_report_joined_left():
    book = MembershipBook()
    for p in "ab":
        book.register(p)
        book.arrive(p, 1)
    assert book.try_complete() is not None and book.epoch == 0
    for p in "ab":
        book.arrive(p, 1)
    assert book.try_complete() is not None and book.epoch == 0  # same view, same epoch
    book.register("c")
    book.remove("a")
    book.arrive("b", 1)
    assert book.try_complete() is None  # newcomer c must be admitted in this round
    book.arrive("c", 1)
    views = book.try_complete()
    assert book.epoch == 1
    assert views["b"].peers == ("b", "c") and views["b"].rank == 0
    assert views["b"].joined == ("c",) and views["b"].left == ("a",)
    assert views["c"].joined == () and views["c"].left == ()  # first epoch of c


def test_book_dead_peer_unblocks_a_waiting_round():
    book = MembershipBook()
    for p in "abc":
        book.register(p)
        book.arrive(p, 1)
    book.try_complete()
    book.arrive("a", 1)
    book.arrive("b", 1)
    assert book.try_complete() is None
    book.remove("c")
    assert book.try_complete()["a"].peers == ("a", "b")


# ---- tier 3: real sockets ------------------------------------------------------------------------
def test_join_leave_and_retry_in_the_next_epoch():
    with Coordinator(CoordinatorConfig(bind="tcp://127.0.0.1:0", heartbeat_interval=0.3)) as coord:
        a, b = connect_all(coord.address, 2, CFG)
        try:
            assert a.membership.epoch == 0
            # A newcomer registers; the members' next quorum admits it.
            c = connect(coord.address, CFG)
            ms = run_ranks([lambda p=p: p.quorum() for p in (a, b, c)])
            assert [m.epoch for m in ms] == [1, 1, 1]
            assert ms[0].joined == (c.peer_id,) and ms[2].joined == ()
            assert [m.rank for m in ms] == [0, 1, 2]
            out = run_ranks([lambda p=p: p.all_reduce(torch.ones(4)) for p in (a, b, c)])
            assert all(torch.equal(o, torch.full((4,), 3.0)) for o in out)

            # a leaves: a pending collective on the others fails with PeerLost, not a hang.
            pending = b.all_reduce_async(torch.ones(4), tag="x")
            a.close()
            with pytest.raises(PeerLost):
                pending.wait(10)
            with pytest.raises(PeerLost):  # and so does any later call in that epoch
                c.all_reduce(torch.ones(4), tag="y", timeout=10)
            ms = run_ranks([lambda p=p: p.quorum() for p in (b, c)])
            assert [m.epoch for m in ms] == [2, 2] and ms[0].left == (a.peer_id,)
            assert [m.rank for m in ms] == [0, 1]
            out = run_ranks([lambda p=p: p.all_reduce(torch.ones(4), tag="x") for p in (b, c)])
            assert all(torch.equal(o, torch.full((4,), 2.0)) for o in out)
        finally:
            for p in (a, b, c):
                p.close()
        assert coord.counters["left"] >= 1


def test_quorum_times_out_when_a_member_does_not_come():
    with Coordinator(CoordinatorConfig(bind="tcp://127.0.0.1:0", heartbeat_interval=0.3)) as coord:
        a, b = connect_all(coord.address, 2, CFG)
        try:
            with pytest.raises(TransportTimeout, match="quorum"):
                a.quorum(timeout=0.5)
            # The cancelled arrival does not count: b alone cannot complete a round.
            with pytest.raises(TransportTimeout):
                b.quorum(timeout=0.5)
            ms = run_ranks([lambda p=p: p.quorum(timeout=10) for p in (a, b)])
            assert [m.epoch for m in ms] == [0, 0]
        finally:
            a.close()
            b.close()


def test_silent_but_connected_peer_is_kept():
    """A peer whose Python threads are starved (here: its reactor thread is blocked) still
    answers ZMTP pings from libzmq's I/O thread, so it stays a member and its collective
    completes once it runs again (the 3 MB prompt case of issue 10)."""
    interval = 0.3
    with Coordinator(
        CoordinatorConfig(bind="tcp://127.0.0.1:0", heartbeat_interval=interval)
    ) as coord:
        a, b = connect_all(coord.address, 2, CFG)
        try:
            pending = a.all_reduce_async(torch.ones(2), tag="z")
            stall = threading.Event()
            b._reactor.call(lambda: stall.wait(30))
            time.sleep(6 * interval)  # three deadlines of silence
            assert set(coord.alive) == {a.peer_id, b.peer_id}
            stall.set()
            other = b.all_reduce_async(torch.ones(2), tag="z")
            assert pending.wait(10).tolist() == [2.0, 2.0]
            assert other.wait(10).tolist() == [2.0, 2.0]
        finally:
            a.close()
            b.close()


def test_hung_peer_is_declared_lost_then_rejoins_by_itself():
    interval = 0.3
    cfg = CoordinatorConfig(
        bind="tcp://127.0.0.1:0", heartbeat_interval=interval, unresponsive_after=3 * interval
    )
    with Coordinator(cfg) as coord:
        a, b = connect_all(coord.address, 2, CFG)
        try:
            pending = a.all_reduce_async(torch.ones(2), tag="z")
            stall = threading.Event()
            b._reactor.call(lambda: stall.wait(30))
            # PeerLost within the wait's 12 s (wait raises TransportTimeout after it), where
            # the 0.9 s unresponsive_after set here should take ~1 s; a hung peer kept alive by
            # its ZMTP pings would instead be declared only after the default 60 s or never,
            # and the op would fail by its own 20 s timeout (CFG.timeout), not PeerLost.
            with pytest.raises(PeerLost) as info:
                pending.wait(12)
            assert b.peer_id in info.value.peers
            assert coord.alive == (a.peer_id,)
            stall.set()
            deadline = time.monotonic() + 10
            while b.peer_id not in coord.alive and time.monotonic() < deadline:
                time.sleep(0.02)  # b heartbeats, is refused, registers again by itself
            assert b.peer_id in coord.alive
            # b learns it was expelled at its next heartbeat, registers again and is admitted
            # as a newcomer; the survivor forgets it was lost.
            mb: list = []

            def join_b():
                try:
                    mb.append(b.quorum(timeout=10))
                except Exception as exc:  # noqa: BLE001 - shown by the assertion
                    mb.append(exc)

            t = threading.Thread(target=join_b)
            t.start()
            ma = a.quorum(timeout=10)
            t.join(15)
            assert mb and mb[0].epoch == ma.epoch == 1 and ma.world_size == 2
            assert ma.joined == (b.peer_id,) and ma.left == (b.peer_id,)
            out = [
                a.all_reduce_async(torch.ones(2), tag="y"),
                b.all_reduce_async(torch.ones(2), tag="y"),
            ]
            assert [w.wait(10).tolist() for w in out] == [[2.0, 2.0]] * 2
            assert b._reactor.members.rejoins == 1
        finally:
            a.close()
            b.close()


def test_pending_quorum_completes_without_a_peer_that_dies_meanwhile():
    with Coordinator(CoordinatorConfig(bind="tcp://127.0.0.1:0", heartbeat_interval=0.3)) as coord:
        a, b, c = connect_all(coord.address, 3, CFG)
        try:
            results = []
            waiting = []
            for p in (a, b):
                t = threading.Thread(target=lambda p=p: results.append(p.quorum(timeout=10)))
                t.start()
                waiting.append(t)
            time.sleep(0.2)  # both are inside quorum(), waiting for c
            c.close()
            for t in waiting:
                t.join(15)
            assert sorted((m.epoch, m.world_size) for m in results) == [(1, 2), (1, 2)]
        finally:
            for p in (a, b, c):
                p.close()


def test_collectives_survive_a_dead_coordinator_and_quorum_says_so():
    coord = Coordinator(CoordinatorConfig(bind="tcp://127.0.0.1:0", heartbeat_interval=0.3)).start()
    # A short grace: the quorum gives up on the stopped coordinator within the test's wait.
    a, b = connect_all(coord.address, 2, dataclasses.replace(CFG, coordinator_grace=3.0))
    try:
        coord.stop()
        outs = run_ranks([lambda p=p: p.all_reduce(torch.ones(3)) for p in (a, b)])
        assert all(torch.equal(o, torch.full((3,), 2.0)) for o in outs)
        with pytest.raises(PeerLost, match="coordinator"):
            a.quorum(timeout=15)
    finally:
        a.close()
        b.close()
