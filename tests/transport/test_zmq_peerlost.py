"""PeerLost reaches EVERY survivor, never a deadline (tier 3: real sockets, a real SIGKILL).

The victim is a child process in its own process group that SIGKILLs itself at a chosen point
inside a collective (mid-ring, before finalizing its scatter segment, before contributing to a
star, half-way through sending a broadcast, before sending its all-gather share). Survivors use an
op timeout of 120 s and wait at most 60 s, so a survivor that only escapes by its deadline
fails the test with TransportTimeout instead of PeerLost.
"""

from __future__ import annotations

import subprocess
import threading
import time
from dataclasses import replace

import pytest
import torch

from lowband.codecs import Int8BlockCodec
from lowband.errors import PeerLost, TransportTimeout
from tests.conftest import PY, run_ranks
from transport.coordinator import Coordinator, CoordinatorConfig
from transport.launch import local_group
from transport.zmq_comm import ZmqConfig, connect

pytestmark = pytest.mark.timeout(90)

CFG = ZmqConfig(
    bind_host="127.0.0.1", connections=2, chunk_bytes=64 * 1024, timeout=120.0, same_host="off"
)
WAIT = 60.0  # well under the op timeout: PeerLost must come from the failure, not the deadline
N_RING = 200_000  # 800 KB: four segments of several 64 KiB chunks

CHILD = """
import os, signal, sys, torch
from lowband.codecs import Int8BlockCodec
from transport import allreduce, messages
from transport.zmq_comm import ZmqConfig, connect

kind = sys.argv[2]
def die(*args, **kw):
    os.kill(os.getpid(), signal.SIGKILL)
if kind == "ring":
    seen = [0]
    on_message = allreduce.RingAllReduce.on_message
    def patched(self, eng, src, msg):
        seen[0] += 1
        if seen[0] == 3:  # in the middle of the reduce-scatter
            die()
        return on_message(self, eng, src, msg)
    allreduce.RingAllReduce.on_message = patched
elif kind == "scatter":
    allreduce.OwnerAllReduce._finalize = die  # contributed, but never sends its segment
elif kind == "star":
    allreduce.OwnerAllReduce.start = die  # a non-root that never contributes
elif kind == "broadcast":  # the root dies half-way through its message to the first peer
    sends = [0]
    send = messages.BroadcastOp.send
    def patched(self, *args, **kw):
        sends[0] += 1
        if sends[0] == 20:
            die()
        return send(self, *args, **kw)
    messages.BroadcastOp.send = patched
elif kind == "all_gather":
    messages.AllGatherOp.start = die
comm = connect(sys.argv[1], ZmqConfig(bind_host="127.0.0.1", connections=2,
                                      chunk_bytes=64 * 1024, timeout=120.0))
comm.quorum(min_world=int(sys.argv[3]), timeout=60)
print("READY", comm.rank, flush=True)
sys.stdin.readline()
x = torch.ones(200_000)
if kind == "ring":
    comm.all_reduce(x, algorithm="ring")
elif kind == "scatter":
    comm.all_reduce(x, algorithm="ring", codec=Int8BlockCodec())
elif kind == "star":
    comm.all_reduce(x[:100], algorithm="star")
elif kind == "broadcast":
    comm.broadcast(torch.ones(2_000_000), root=comm.rank)
elif kind == "all_gather":
    comm.all_gather(x)
elif kind == "idle":
    sys.stdin.readline()
"""


def _collective(kind: str, c, world: int, victim_root: int | None = None):
    """Start ``kind`` on communicator ``c`` (async where the API allows); returns a waiter."""
    x = torch.full((N_RING,), float(c.rank + 1))
    if kind == "ring":
        w = c.all_reduce_async(x, algorithm="ring")
    elif kind == "scatter":
        w = c.all_reduce_async(x, algorithm="ring", codec=Int8BlockCodec())
    elif kind == "star":
        w = c.all_reduce_async(x[:100], algorithm="star")
    elif kind == "broadcast":
        root = victim_root if victim_root is not None else 0
        w = c.broadcast_async(x if c.rank == root else None, root=root)
    else:
        w = c.all_gather_async(x)
    return w


def _expected(kind: str, out, world: int) -> bool:
    total = world * (world + 1) / 2
    if kind in ("ring", "star"):
        return torch.equal(out, torch.full_like(out, total))
    if kind == "scatter":
        return torch.allclose(out, torch.full_like(out, total), rtol=0.02)
    if kind == "broadcast":
        return torch.equal(out, torch.full((N_RING,), 1.0))
    return all(torch.equal(o, torch.full((N_RING,), float(r + 1))) for r, o in enumerate(out))


def _form(coord, spawn, kind: str):
    """Three survivors in this process (ranks 0-2) plus the victim child (rank 3)."""
    survivors = [connect(coord.address, CFG) for _ in range(3)]
    child = spawn(
        [PY, "-c", CHILD, coord.address, kind, "4"], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    ms = run_ranks([lambda c=c: c.quorum(min_world=4, timeout=60) for c in survivors], timeout=70)
    assert all(m.world_size == 4 for m in ms)
    assert child.stdout.readline().split() == [b"READY", b"3"]
    return sorted(survivors, key=lambda c: c.rank), child


@pytest.mark.parametrize("kind", ["ring", "scatter", "star", "broadcast", "all_gather"])
def test_sigkill_mid_collective_raises_peer_lost_on_every_survivor_then_retry_works(spawn, kind):
    coordinator = CoordinatorConfig(bind="tcp://127.0.0.1:0", heartbeat_interval=0.5)
    with Coordinator(coordinator) as coord:
        survivors, child = _form(coord, spawn, kind)
        victim = survivors[0].membership.peers[3]
        try:
            works = [_collective(kind, c, 4, victim_root=3) for c in survivors]
            child.stdin.write(b"GO\n")
            child.stdin.flush()
            assert child.wait(timeout=60) == -9  # it really died by SIGKILL, mid-op

            errors = []
            for w in works:
                try:
                    w.wait(WAIT)
                    errors.append(None)
                except (PeerLost, TransportTimeout) as exc:
                    errors.append(exc)
            assert all(isinstance(e, PeerLost) for e in errors), errors
            assert all(e.peers == (victim,) for e in errors), [e.peers for e in errors]

            ms = run_ranks([lambda c=c: c.quorum(timeout=30) for c in survivors], timeout=40)
            assert [(m.epoch, m.world_size, len(m.left)) for m in ms] == [(1, 3, 1)] * 3
            outs = run_ranks([lambda c=c: _collective(kind, c, 3).wait(30) for c in survivors])
            assert all(_expected(kind, o, 3) for o in outs), kind
        finally:
            for c in survivors:
                c.close()


def test_sigkill_mid_scatter_leaves_every_survivors_out_as_it_was(spawn):
    """``all_reduce(x, out=x)`` with int8 (the owners' final encodings held until all arrived):
    the victim contributed but never sends its segment's final value, so every survivor has
    some of the result and not all; each still holds its input (a DiLoCo worker redoes the
    sync from it), then a retry from that input sums it."""
    codec = Int8BlockCodec()
    coordinator = CoordinatorConfig(bind="tcp://127.0.0.1:0", heartbeat_interval=0.5)
    with Coordinator(coordinator) as coord:
        survivors, child = _form(coord, spawn, "scatter")
        try:
            xs = [torch.full((N_RING,), float(c.rank + 1)) for c in survivors]
            works = [
                c.all_reduce_async(x, algorithm="scatter", codec=codec, out=x)
                for c, x in zip(survivors, xs)
            ]
            child.stdin.write(b"GO\n")
            child.stdin.flush()
            assert child.wait(timeout=60) == -9
            for w in works:
                with pytest.raises(PeerLost):
                    w.wait(WAIT)
            for c, x in zip(survivors, xs):
                assert torch.equal(x, torch.full((N_RING,), float(c.rank + 1)))
            run_ranks([lambda c=c: c.quorum(timeout=30) for c in survivors], timeout=40)
            outs = run_ranks(
                [
                    lambda c=c, x=x: c.all_reduce(x, algorithm="scatter", codec=codec, out=x)
                    for c, x in zip(survivors, xs)
                ]
            )
            for o, x in zip(outs, xs):
                assert o.data_ptr() == x.data_ptr() and torch.allclose(o, torch.full_like(o, 6.0))
        finally:
            for c in survivors:
                c.close()


def test_sigkill_while_survivors_wait_in_quorum_does_not_fail_the_quorum(spawn):
    """Commit 404f99c: a peer-lost notice never fails a pending quorum; the round completes
    with the survivors."""
    coordinator = CoordinatorConfig(bind="tcp://127.0.0.1:0", heartbeat_interval=0.5)
    with Coordinator(coordinator) as coord:
        survivors = [connect(coord.address, CFG) for _ in range(2)]
        child = spawn(
            [PY, "-c", CHILD, coord.address, "idle", "3"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        try:
            run_ranks(
                [lambda c=c: c.quorum(min_world=3, timeout=60) for c in survivors], timeout=70
            )
            assert child.stdout.readline().split()[0] == b"READY"
            results: list = [None, None]

            def enter(i: int) -> None:
                try:
                    results[i] = survivors[i].quorum(timeout=30)  # the child never arrives
                except Exception as exc:  # noqa: BLE001 - asserted below
                    results[i] = exc

            threads = [threading.Thread(target=enter, args=(i,)) for i in range(2)]
            for t in threads:
                t.start()
            # Both are inside quorum() once the coordinator counts them as arrived.
            _until(lambda: len(coord._book.arrived) == 2, 20)
            child.kill()
            for t in threads:
                t.join(40)
            assert [(m.epoch, m.world_size) for m in results] == [(1, 2), (1, 2)], results
        finally:
            for c in survivors:
                c.close()


def _until(cond, timeout: float) -> None:
    done = threading.Event()
    for _ in range(int(timeout / 0.01)):
        if cond():
            return
        done.wait(0.01)
    raise AssertionError("condition not reached")


# ---- graceful departures, the ABORT path (threads of this process) ---------------------------
SMALL = ZmqConfig(
    bind_host="127.0.0.1", connections=2, chunk_bytes=16 * 1024, timeout=120.0, same_host="off"
)


def test_a_peer_leaving_before_a_star_fails_every_survivor_through_abort():
    """Rank 2 leaves gracefully without contributing. Only the root needs it directly; rank 1
    waits only on the root, which now tells it (ABORT with the lost peer) instead of letting it
    sit until its deadline. A survivor that starts the op later fails at once too."""
    with local_group(4, SMALL) as (_, comms):
        c0, c1, c2, c3 = comms
        w0 = c0.all_reduce_async(torch.ones(10), algorithm="star", tag="s")
        w1 = c1.all_reduce_async(torch.ones(10), algorithm="star", tag="s")
        c2.close()
        for w in (w0, w1):
            with pytest.raises(PeerLost) as info:
                w.wait(WAIT)
            assert c2.peer_id in info.value.peers
        # c3 had not started it: the ABORT waits for it, so it fails at once, not at 120 s.
        with pytest.raises(PeerLost):
            c3.all_reduce(torch.ones(10), algorithm="star", tag="s", timeout=WAIT)
        ms = run_ranks([lambda c=c: c.quorum(timeout=20) for c in (c0, c1, c3)])
        assert [m.world_size for m in ms] == [3, 3, 3]
        outs = run_ranks(
            [
                lambda c=c: c.all_reduce(torch.ones(10), algorithm="star", tag="s")
                for c in (c0, c1, c3)
            ]
        )
        assert all(torch.equal(o, torch.full((10,), 3.0)) for o in outs)


@pytest.mark.parametrize("kind", ["star", "all_gather"])
def test_a_peer_that_contributed_then_left_does_not_fail_the_others(kind):
    """The graceful leave after contributing: its data precedes its BYEs, so what it
    completed its part of finishes on everyone else."""
    with local_group(3, SMALL) as (_, comms):
        c0, c1, c2 = comms

        def start(c):
            x = torch.full((5_000,), float(c.rank + 1))
            if kind == "star":
                return c.all_reduce_async(x, algorithm="star", tag="t")
            return c.all_gather_async(x, tag="t")

        w2 = start(c2)  # rank 2 contributes (never the star's root) ...
        c2.close()  # ... and leaves at once, before the others even start
        w0, w1 = start(c0), start(c1)
        outs = [w0.wait(WAIT), w1.wait(WAIT)]
        assert w2.done()
        if kind == "star":
            assert all(torch.equal(o, torch.full((5_000,), 6.0)) for o in outs)
        else:
            for out in outs:
                assert [o[0].item() for o in out] == [1.0, 2.0, 3.0]


# ---- receive pairing ----------------------------------------------------------------------------
@pytest.mark.slow
def test_ranks_that_finish_may_close_at_once_while_a_slow_rank_still_receives():
    """Rank 2 handles its messages late (a slow link or a busy core): the others finish first
    and close on return, with their last pieces for rank 2 still unread, which then takes
    0.1 s each (a 1 MB segment in 16 KiB chunks: longer than the 2 s a departed peer's BYEs
    get). The ring is the case: a rank there needs only its predecessor, and gets everything
    the others send through it (scatter's ``needs`` has always looked at the owners).
    Their last sends were with the kernel before they completed, their BYEs follow them, and
    rank 2 keeps waiting while their data comes in: it completes with the right sum."""
    with local_group(3, replace(SMALL, chunk_bytes=16 * 1024)) as (_, comms):
        slow = comms[2]._reactor.routing
        route = slow.route
        closed = threading.Event()

        def late(*args, **kw):
            time.sleep(0.1 if closed.is_set() else 0.02)
            return route(*args, **kw)

        slow.route = late  # type: ignore[method-assign]
        xs = [torch.full((786_432,), float(c.rank + 1)) for c in comms]  # 1 MB segments
        works = [c.all_reduce_async(xs[c.rank], algorithm="ring", tag="a") for c in comms]
        for c, w in zip(comms[:2], works[:2]):
            assert torch.equal(w.wait(WAIT), torch.full((786_432,), 6.0))
            c.close()
        closed.set()
        assert not works[2].done()  # the test's premise: rank 2 is still receiving
        assert torch.equal(works[2].wait(WAIT), torch.full((786_432,), 6.0))


def test_an_abandoned_recv_does_not_shift_later_pairings():
    with local_group(2, SMALL) as (_, (c0, c1)):
        with pytest.raises(TransportTimeout):
            c1.recv(0, tag="x", timeout=0.2)
        # The message the abandoned receive waited for comes late: the next receive gets it.
        c0.send(1, [torch.tensor([1.0])], {"n": 1}, tag="x")
        c0.send(1, [torch.tensor([2.0])], {"n": 2}, tag="x")
        assert c1.recv(0, tag="x", timeout=10)[1] == {"n": 1}
        assert c1.recv(0, tag="x", timeout=10)[1] == {"n": 2}
        with pytest.raises(TransportTimeout):
            c1.recv(0, tag="x", timeout=0.2)
        c0.send(1, [], {"n": 3}, tag="x")
        assert c1.recv(0, tag="x", timeout=10)[1] == {"n": 3}


def test_a_recv_that_times_out_behind_another_hands_its_place_on():
    """Two receives of one tag in flight (two threads); the first times out: the second moves
    up and gets the first message instead of waiting for a second one that never comes."""
    with local_group(2, SMALL) as (_, (c0, c1)):
        results: dict[str, object] = {}

        def recv(name: str, timeout: float) -> None:
            try:
                results[name] = c1.recv(0, tag="y", timeout=timeout)[1]
            except TransportTimeout as exc:
                results[name] = exc

        first = threading.Thread(target=recv, args=("first", 0.3))
        first.start()
        _until(lambda: sum(len(q) for q in c1._reactor.routing._recvs.values()) == 1, 10)
        second = threading.Thread(target=recv, args=("second", 20.0))
        second.start()
        _until(lambda: sum(len(q) for q in c1._reactor.routing._recvs.values()) == 2, 10)
        first.join(10)
        assert isinstance(results["first"], TransportTimeout)
        c0.send(1, [], {"only": True}, tag="y")
        second.join(20)
        assert results["second"] == {"only": True}
