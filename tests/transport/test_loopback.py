"""Multi-rank tests of the in-process loopback communicator (tier 2: no sockets)."""

import threading

import pytest
import torch

from lowband.codecs import Int8BlockCodec
from lowband.comm import Communicator, ring_bytes
from lowband.errors import PeerLost, ProtocolError, TransportTimeout
from tests.conftest import run_ranks
from transport.loopback import LoopbackGroup


def test_satisfies_protocol():
    assert isinstance(LoopbackGroup(2).comms()[0], Communicator)


@pytest.mark.parametrize("world", [1, 2, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_all_reduce_sum_avg(world, dtype):
    comms = LoopbackGroup(world).comms()
    xs = [torch.arange(10).to(dtype) * (r + 1) for r in range(world)]
    total = sum(x.to(torch.float64) for x in xs)

    out = run_ranks(
        [lambda c=c, x=x: (c.all_reduce(x), c.all_reduce(x, "avg")) for c, x in zip(comms, xs)]
    )
    for s, a in out:
        assert s.dtype == dtype and torch.equal(s.to(torch.float64), total)
        if dtype.is_floating_point:
            assert torch.allclose(a.to(torch.float64), total / world, rtol=1e-2)
    assert all(torch.equal(o[0], out[0][0]) for o in out)


def test_codec_results_identical_on_all_ranks_and_bytes_modelled():
    comms = LoopbackGroup(4).comms()
    torch.manual_seed(0)
    xs = [torch.randn(100_000) for _ in range(4)]
    codec = Int8BlockCodec(256)
    outs = run_ranks(
        [
            lambda c=c, x=x: c.all_reduce(x, "avg", codec=codec, algorithm="ring")
            for c, x in zip(comms, xs)
        ]
    )
    exact = sum(xs) / 4
    for o in outs:
        assert torch.equal(o, outs[0])
    assert (outs[0] - exact).abs().max() < 0.05
    payload = codec.encode(xs[0]).nbytes
    assert comms[1].stats().bytes_sent == ring_bytes(payload, 4)


def test_async_tags_can_complete_out_of_order():
    c0, c1 = LoopbackGroup(2).comms()
    a0 = c0.all_reduce_async(torch.ones(3), tag="a")
    b0 = c0.all_reduce_async(torch.ones(3) * 2, tag="b")
    b1 = c1.all_reduce_async(torch.ones(3) * 2, tag="b")
    assert b0.done() and b1.done() and not a0.done()
    a1 = c1.all_reduce_async(torch.ones(3), tag="a")
    assert torch.equal(a0.wait(1), torch.full((3,), 2.0)) and a1.done()
    assert torch.equal(b1.wait(1), torch.full((3,), 4.0))


def test_broadcast_gather_barrier_p2p():
    comms = LoopbackGroup(3).comms()

    def body(c):
        b = c.broadcast(torch.arange(4.0) if c.rank == 1 else None, root=1)
        g = c.all_gather(torch.full((c.rank + 1,), float(c.rank)))
        ts, meta = c.broadcast_message(
            [torch.ones(2)] if c.rank == 0 else None, {"step": 7} if c.rank == 0 else None, root=0
        )
        c.barrier()
        if c.rank == 0:
            c.send(2, [torch.tensor([42])], {"k": "v"}, tag="x")
            return b, g, ts, meta, None
        if c.rank == 2:
            return b, g, ts, meta, c.recv(0, tag="x")
        return b, g, ts, meta, None

    for r, (b, g, ts, meta, p2p) in enumerate(run_ranks([lambda c=c: body(c) for c in comms])):
        assert torch.equal(b, torch.arange(4.0))
        assert [t.tolist() for t in g] == [[0.0], [1.0, 1.0], [2.0, 2.0, 2.0]]
        assert meta == {"step": 7} and torch.equal(ts[0], torch.ones(2))
        if r == 2:
            assert p2p[0][0].item() == 42 and p2p[1] == {"k": "v"}


def test_kill_raises_peer_lost_everywhere_then_quorum_shrinks():
    group = LoopbackGroup(3, timeout=5)
    c0, c1, c2 = group.comms()
    w0 = c0.all_reduce_async(torch.ones(2), tag="t")
    group.kill(2)
    with pytest.raises(PeerLost):
        w0.wait()
    with pytest.raises(PeerLost):
        c1.all_reduce(torch.ones(2), tag="t")
    m0, m1 = run_ranks([c0.quorum, c1.quorum])
    assert m0.epoch == m1.epoch == 1 and m0.world_size == 2 and m0.left == (c2.peer_id,)
    outs = run_ranks([lambda: c0.all_reduce(torch.ones(2)), lambda: c1.all_reduce(torch.ones(2))])
    assert torch.equal(outs[0], torch.full((2,), 2.0))
    with pytest.raises(PeerLost):
        c2.all_reduce(torch.ones(2))


def test_join_admitted_at_next_quorum():
    group = LoopbackGroup(2, timeout=5)
    c0, c1 = group.comms()
    new = group.join()
    with pytest.raises(PeerLost, match="quorum"):
        new.all_reduce(torch.ones(1))
    ms = run_ranks([c0.quorum, c1.quorum, new.quorum])
    assert [m.rank for m in ms] == [0, 1, 2] and {m.epoch for m in ms} == {1}
    assert ms[0].joined == (new.peer_id,) and ms[2].joined == ()
    outs = run_ranks([lambda c=c: c.all_reduce(torch.ones(1)) for c in (c0, c1, new)])
    assert all(o.item() == 3.0 for o in outs)
    # nothing changed: same epoch
    ms2 = run_ranks([c0.quorum, c1.quorum, new.quorum])
    assert {m.epoch for m in ms2} == {1}


def test_mismatch_and_timeout_are_errors():
    c0, c1 = LoopbackGroup(2, timeout=0.2).comms()
    w = c0.all_reduce_async(torch.ones(2), tag="m")
    with pytest.raises(ProtocolError):
        c1.all_reduce(torch.ones(3), tag="m")
    with pytest.raises(ProtocolError):
        w.wait()
    with pytest.raises(TransportTimeout):
        c0.barrier(tag="lonely")
    with pytest.raises(TransportTimeout):
        c0.quorum()


def test_many_threads_stress():
    world = 6
    comms = LoopbackGroup(world).comms()

    def body(c):
        acc = torch.zeros(16)
        works = [c.all_reduce_async(torch.full((16,), float(i)), tag=f"s{i}") for i in range(50)]
        for w in reversed(works):
            acc += w.wait()
        return acc

    outs = run_ranks([lambda c=c: body(c) for c in comms])
    assert torch.equal(outs[0], torch.full((16,), float(world * sum(range(50)))))


def test_quorum_min_world_waits_for_newcomer():
    group = LoopbackGroup(1, timeout=5)
    (c0,) = group.comms()
    results = {}
    t = threading.Thread(target=lambda: results.setdefault("m", c0.quorum(min_world=2)))
    t.start()
    t.join(0.2)
    assert t.is_alive()  # alone: waits for a second peer
    new = group.join()
    m_new = new.quorum()
    t.join(5)
    assert results["m"].world_size == 2 and m_new.rank == 1
    with pytest.raises(TransportTimeout):
        LoopbackGroup(1, timeout=0.2).comms()[0].quorum(min_world=2)
