"""Same-host fast paths (tier 3): ``ZmqConfig.same_host`` = auto (default) / shm / ipc / off."""

from __future__ import annotations

import pytest
import torch

from lowband.codecs import Int8BlockCodec
from tests.conftest import run_ranks
from transport.coordinator import Coordinator, CoordinatorConfig
from transport.launch import connect_all, local_group
from transport.zmq_comm import ZmqConfig

pytestmark = pytest.mark.timeout(60)

BASE = dict(bind_host="127.0.0.1", connections=2, chunk_bytes=64 * 1024, timeout=20.0)


def each(comms, fn):
    return run_ranks([lambda c=c: fn(c) for c in comms], timeout=40)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_shm_all_reduce_exact_bit_identical_and_reuses_its_slab(dtype):
    gen = torch.Generator().manual_seed(7)
    xs = [(torch.randn(300_001, generator=gen) * 100).to(dtype) for _ in range(3)]
    exact = sum(x.to(torch.float64) for x in xs)
    with local_group(3, ZmqConfig(**BASE)) as (_, comms):  # the default: auto
        assert comms[0].choose_algorithm(xs[0]) == "shm"
        outs = [
            each(comms, lambda c: (c.all_reduce(xs[c.rank]), c.all_reduce(xs[c.rank], "avg")))
            for _ in range(3)
        ]
        slabs = [len(c._reactor.shm_slabs()._slabs) for c in comms]
        stats = comms[0].stats()
    for s, a in outs[-1]:
        assert torch.equal(s, outs[0][0][0]) and torch.equal(a, outs[0][0][1])
    s, a = outs[0][0]
    if dtype.is_floating_point:
        tol = 1e-3 if dtype == torch.float32 else 4.0
        assert (s.to(torch.float64) - exact).abs().max() <= tol
        assert (a.to(torch.float64) - exact / 3).abs().max() <= tol
    else:
        assert torch.equal(s, exact.to(dtype))
        assert torch.equal(a, torch.div(exact.to(torch.int64), 3, rounding_mode="floor"))
    assert slabs == [1, 1, 1]  # one slab per rank, reused by every call
    assert stats.bytes_sent < 10_000  # only the tiny announcements crossed a socket


def test_shm_handles_concurrent_tagged_operations():
    with local_group(2, ZmqConfig(**BASE, same_host="shm")) as (_, comms):

        def body(c):
            a = c.all_reduce_async(torch.full((200_000,), 1.0 + c.rank), tag="a")
            b = c.all_reduce_async(torch.full((300_000,), 10.0 * (c.rank + 1)), tag="b")
            return b.wait(), a.wait()

        for b, a in each(comms, body):
            assert torch.equal(a, torch.full((200_000,), 3.0))
            assert torch.equal(b, torch.full((300_000,), 30.0))


@pytest.mark.parametrize("other", ["off", "foreign"])
def test_shm_is_used_only_when_every_member_can_use_it(other, monkeypatch):
    """A mixed group (one member with same_host="off", or one that could not open the others'
    slabs: another user or PID namespace, faked here through its key) runs on sockets."""
    import transport.zmq_comm as zc

    with Coordinator(CoordinatorConfig(bind="tcp://127.0.0.1:0")) as coord:
        comms = connect_all(coord.address, 1, ZmqConfig(**BASE))
        if other == "foreign":
            monkeypatch.setattr(zc, "shm_key", lambda: "shm:12345:999")
        comms.append(
            zc.connect(
                coord.address, ZmqConfig(**BASE, same_host="off" if other == "off" else "auto")
            )
        )
        try:
            run_ranks([lambda c=c: c.quorum() for c in comms])
            x = torch.ones(100_000)
            assert {c.choose_algorithm(x) for c in comms} == {"ring"}
            assert comms[0].choose_algorithm(x, codec=Int8BlockCodec()) == "scatter"
            outs = each(comms, lambda c: c.all_reduce(x))
            assert all(torch.equal(o, torch.full_like(x, 2.0)) for o in outs)
            assert comms[0].stats().bytes_sent >= 200_000  # half the payload crossed TCP
        finally:
            for c in comms:
                c.close()


def test_off_keeps_everything_on_tcp():
    with local_group(2, ZmqConfig(**BASE, same_host="off")) as (_, comms):
        x = torch.ones(100_000)
        assert comms[0].choose_algorithm(x) == "ring"
        assert comms[0].choose_algorithm(x, algorithm="scatter") == "scatter"
        out = comms[0]._reactor.links._out[comms[1].peer_id].sockets[0]
        assert out.last_endpoint.decode().startswith("tcp://")


@pytest.mark.parametrize("mode", ["ipc", "shm"])
def test_ipc_connects_same_host_peers_over_unix_sockets(mode):
    with local_group(2, ZmqConfig(**BASE, same_host=mode)) as (_, comms):
        out = comms[0]._reactor.links._out[comms[1].peer_id].sockets[0]
        assert out.last_endpoint.decode().startswith("ipc://")
        xs = [torch.randn(500_000) for _ in comms]
        assert comms[0].choose_algorithm(xs[0]) == ("ring" if mode == "ipc" else "shm")
        outs = each(comms, lambda c: c.all_reduce(xs[c.rank], algorithm="ring"))
        assert all(torch.equal(o, outs[0]) for o in outs)
        assert torch.allclose(outs[0], xs[0] + xs[1])
        msg = each(comms, lambda c: c.broadcast(xs[0] if c.rank == 0 else None))
        assert all(torch.equal(m, xs[0]) for m in msg)


def test_config_rejects_unknown_same_host_mode():
    from lowband.errors import ConfigError

    with pytest.raises(ConfigError, match="same_host"):
        ZmqConfig(same_host="yes")
