"""The TP star link on real sockets (127.0.0.1): sums, codecs, failure and resync."""

from __future__ import annotations

import pytest
import torch

from lowband.codecs import Int8BlockCodec
from lowband.errors import PeerLost, ProtocolError
from tests.conftest import run_ranks
from transport.starlink import StarHub, StarSpoke


def _group(n: int, spin_s: float = 0.0):
    hub = StarHub("127.0.0.1", spin_s=spin_s)
    spokes = [
        StarSpoke("127.0.0.1", hub.port, s, timeout=10, secret=hub.secret, spin_s=spin_s)
        for s in range(1, n)
    ]
    for s in range(1, n):
        hub.accept(s, timeout=10)
    return hub, spokes


@pytest.mark.parametrize("spin_s", [0.0, 0.002])
@pytest.mark.parametrize("codec", [None, Int8BlockCodec(block=64)])
def test_sum_is_bit_identical_everywhere(codec, spin_s) -> None:
    hub, spokes = _group(3, spin_s)
    xs = [torch.randn(1, 3, 100, generator=torch.Generator().manual_seed(r)) for r in range(3)]
    nets = [hub, *spokes]
    try:
        outs = run_ranks(
            [
                lambda r=r: [
                    nets[r].all_reduce(xs[r] * (k + 1), codec=codec, timeout=10) for k in range(4)
                ]
                for r in range(3)
            ]
        )
    finally:
        for s in spokes:
            s.close()
        hub.close()
    for k in range(4):
        ref = sum(x * (k + 1) for x in xs)
        assert torch.equal(outs[0][k], outs[1][k]) and torch.equal(outs[0][k], outs[2][k])
        tol = 1e-6 if codec is None else 0.05 * ref.abs().max().item()
        assert (outs[0][k] - ref).abs().max().item() <= tol
    payload = 3 * 100 * 4
    if codec is None:
        assert spokes[0].stats().bytes_sent == 4 * payload
        assert hub.stats().bytes_received == 2 * 4 * payload


@pytest.mark.parametrize("spin_s", [0.0, 0.002])
def test_dead_worker_abort_and_resync(spin_s) -> None:
    hub, (a, b) = _group(3, spin_s)
    x = torch.ones(4)
    try:
        b.close()  # a device dies

        def master():
            with pytest.raises(PeerLost):
                hub.all_reduce(x, timeout=10)
            hub.abort()
            hub.drop(2)
            b2 = StarSpoke("127.0.0.1", hub.port, 2, timeout=10, secret=hub.secret)  # it comes back
            hub.accept(2, timeout=10)
            hub.sync_send(timeout=10)
            return b2

        def survivor():
            with pytest.raises(PeerLost, match="aborted"):
                a.all_reduce(x, timeout=10)

        b2, _ = run_ranks([master, survivor])

        def resynced(net, sync=None):
            def run():
                if sync is not None:
                    sync()
                return net.all_reduce(x * 2, timeout=10)

            return run

        out = run_ranks(
            [
                lambda: (hub.sync_wait(timeout=10), hub.all_reduce(x, timeout=10))[1],
                resynced(a, lambda: a.resync(timeout=10)),
                resynced(b2, lambda: b2.resync(timeout=10)),
            ]
        )
        assert torch.equal(out[0], torch.full((4,), 5.0)) and torch.equal(out[1], out[0])
    finally:
        for s in (a, b):
            s.close()
        hub.close()


def test_out_of_step_is_a_protocol_error() -> None:
    hub, (a,) = _group(2)
    try:
        a._seq = 7  # a desynchronised worker

        def worker():
            with pytest.raises((ProtocolError, PeerLost)):
                a.all_reduce(torch.ones(2), timeout=5)

        def master():
            with pytest.raises(ProtocolError, match="out of step"):
                hub.all_reduce(torch.ones(2), timeout=5)
            hub.close()

        run_ranks([master, worker])
    finally:
        a.close()


def test_link_refuses_a_stranger() -> None:
    hub = StarHub("127.0.0.1")
    stranger = StarSpoke("127.0.0.1", hub.port, 1, timeout=5, secret="guess")
    friend = StarSpoke("127.0.0.1", hub.port, 1, timeout=5, secret=hub.secret)
    try:
        hub.accept(1, timeout=10)  # skips the stranger, takes the friend
        out = run_ranks(
            [
                lambda: hub.all_reduce(torch.ones(3), timeout=5),
                lambda: friend.all_reduce(torch.ones(3), timeout=5),
            ]
        )
        assert torch.equal(out[0], torch.full((3,), 2.0))
        with pytest.raises(PeerLost):
            stranger.all_reduce(torch.ones(3), timeout=5)
    finally:
        for s in (stranger, friend):
            s.close()
        hub.close()


def test_polling_receive_still_honours_the_timeout() -> None:
    """A spinning receive that gets nothing falls back to the blocking read and its deadline."""
    from lowband.errors import TransportTimeout

    hub, (a,) = _group(2, spin_s=0.01)
    try:
        with pytest.raises(TransportTimeout):
            hub.all_reduce(torch.ones(3), timeout=0.3)  # the worker never sends its part
    finally:
        a.close()
        hub.close()


def test_commands_between_all_reduces_keep_their_order() -> None:
    """A command (the next token's forward) travels on the link between all-reduces, arrives
    with its tensor shapes, and an ABORT in its place is a PeerLost; a command where an
    all-reduce answer is expected is a protocol error, never mixed into a sum."""
    hub, (a, b) = _group(3)
    try:
        x = torch.arange(6, dtype=torch.float32).view(1, 2, 3)

        def worker(spoke, slot):
            def go():
                frames, meta = spoke.next_command(timeout=5)
                assert meta == {"op": "forward", "fid": 1} and torch.equal(frames[0], x)
                assert frames[0].shape == (1, 2, 3)
                out = spoke.all_reduce(torch.full((2,), float(slot)), timeout=5)
                frames, meta = spoke.next_command(timeout=5)
                assert meta == {"op": "yield"} and frames == []
                return out

            return go

        def master():
            for slot in (1, 2):
                hub.command(slot, {"op": "forward", "fid": 1}, [x], timeout=5)
            out = hub.all_reduce(torch.zeros(2), timeout=5)
            for slot in (1, 2):
                hub.command(slot, {"op": "yield"}, timeout=5)
            return out

        res = run_ranks([master, worker(a, 1), worker(b, 2)])
        assert all(torch.equal(r, torch.full((2,), 3.0)) for r in res)
        hub.abort()
        with pytest.raises(PeerLost, match="aborted"):
            a.next_command(timeout=5)
        with pytest.raises(PeerLost, match="no link"):
            hub.command(9, {"op": "yield"})
        for dtype in (torch.bfloat16, torch.float16):  # a half-precision model's activations
            h = torch.randn(1, 2, 3).to(dtype)
            hub.command(1, {"op": "forward"}, [h], timeout=5)
            frames, _ = a.next_command(timeout=5)
            assert frames[0].dtype == dtype and torch.equal(frames[0], h)
        hub.command(2, {"op": "forward"}, [x])  # a worker expecting a sum gets a command
        b._conn.recv(timeout=5)  # (the ABORT above)
        with pytest.raises(ProtocolError, match="expected result"):
            b.all_reduce(torch.ones(2), timeout=0.5)
    finally:
        hub.close()
        a.close()
        b.close()


def test_both_ends_lower_the_retransmission_floor() -> None:
    """Hub and spoke sockets carry the link's RTO floor (kernel's default 200 ms) where the
    kernel has TCP_RTO_MIN_US; elsewhere the option is skipped, visibly."""
    import socket

    from transport.starlink import RTO_MIN_US, TCP_RTO_MIN_US, low_rto

    probe = socket.socket()
    try:
        if not low_rto(probe):
            pytest.skip("this kernel has no TCP_RTO_MIN_US (Linux < 6.15)")
    finally:
        probe.close()
    hub, (spoke,) = _group(2)
    try:
        socks = [hub._conns[1].sock, spoke._conn.sock]
        for s in socks:
            floor = s.getsockopt(socket.IPPROTO_TCP, TCP_RTO_MIN_US)
            # (rounded up to the kernel's tick: 4 ms at HZ=250, 10 at HZ=100)
            assert RTO_MIN_US <= floor <= RTO_MIN_US + 10_000
    finally:
        spoke.close()
        hub.close()
