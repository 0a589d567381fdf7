"""ZeroMQ communicator over real sockets on 127.0.0.1 (tier 3), peers as threads of this process."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lowband.codecs import FourBitCodec, Int8BlockCodec
from lowband.comm import Communicator, ring_bytes
from lowband.errors import CommClosed, ConfigError, IncompatiblePeer, PeerLost, TransportTimeout
from tests.conftest import run_ranks
from transport.coordinator import Coordinator, CoordinatorConfig
from transport.launch import local_group
from transport.zmq_comm import ZmqConfig, connect

pytestmark = pytest.mark.timeout(60)

SMALL = ZmqConfig(
    bind_host="127.0.0.1", connections=3, chunk_bytes=16 * 1024, timeout=20.0, same_host="off"
)  # these test the socket paths


def each(comms, fn):
    return run_ranks([lambda c=c: fn(c) for c in comms], timeout=40)


def test_satisfies_protocol_and_starts_outside_any_epoch():
    with Coordinator(CoordinatorConfig(bind="tcp://127.0.0.1:0")) as coord:
        comm = connect(coord.address, SMALL)
        try:
            assert isinstance(comm, Communicator)
            assert comm.membership.epoch == -1
            with pytest.raises(PeerLost, match="quorum"):
                comm.all_reduce(torch.ones(2))
            m = comm.quorum()
            assert (m.epoch, m.rank, m.world_size) == (0, 0, 1)
            assert torch.equal(comm.all_reduce(torch.ones(3), "avg"), torch.ones(3))
        finally:
            comm.close()
        with pytest.raises(CommClosed):
            comm.all_reduce(torch.ones(2))


@pytest.mark.parametrize("algorithm", ["ring", "scatter", "star"])
@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float64, torch.bfloat16, torch.int64, torch.int32]
)
def test_all_reduce_exact_and_bit_identical(algorithm, dtype):
    n = 3
    with local_group(n, SMALL) as (_, comms):
        gen = torch.Generator().manual_seed(1)
        # 50_001 elements: segments and chunks of unequal length, several chunks per segment.
        xs = [(torch.randn(50_001, generator=gen) * 100).to(dtype) for _ in range(n)]
        outs = each(
            comms,
            lambda c: (
                c.all_reduce(xs[c.rank], "sum", algorithm=algorithm),
                c.all_reduce(xs[c.rank], "avg", algorithm=algorithm),
            ),
        )
    exact = sum(x.to(torch.float64) for x in xs)
    for s, a in outs:
        assert s.dtype == dtype and s.shape == xs[0].shape
        assert torch.equal(s, outs[0][0]) and torch.equal(a, outs[0][1])  # bit-identical
    s = outs[0][0].to(torch.float64)
    if dtype in (torch.int64, torch.int32):
        assert torch.equal(s, exact)
        assert torch.equal(
            outs[0][1], torch.div(exact.to(torch.int64), n, rounding_mode="floor").to(dtype)
        )
    else:
        tol = {torch.float64: 1e-9, torch.float32: 1e-3, torch.bfloat16: 4.0}[dtype]
        assert (s - exact).abs().max() <= tol
        assert (outs[0][1].to(torch.float64) - exact / n).abs().max() <= tol


@pytest.mark.parametrize("codec", [Int8BlockCodec(256), FourBitCodec("e2m1", 128)])
def test_codec_all_reduce_identical_and_error_does_not_grow(codec):
    torch.manual_seed(0)
    errs = {}
    for n in (2, 4):
        xs = [torch.randn(40_000) for _ in range(n)]
        with local_group(n, SMALL) as (_, comms):
            outs = each(
                comms, lambda c: c.all_reduce(xs[c.rank], "avg", codec=codec, algorithm="ring")
            )
            sent = comms[1].stats().bytes_sent
        exact = sum(xs) / n
        assert all(torch.equal(o, outs[0]) for o in outs)
        errs[n] = ((outs[0] - exact).norm() / exact.norm()).item()
        # One quantization per contribution plus one of the result, averaged: the error is
        # about the codec's single-pass error, not n times it.
        single = ((codec.decode(codec.encode(xs[0])) - xs[0]).norm() / xs[0].norm()).item()
        assert errs[n] < 2.5 * single
        payload = codec.encode(xs[0]).nbytes
        assert abs(sent - ring_bytes(payload, n)) <= 0.02 * payload + 1024
    assert errs[4] < 2 * errs[2]


@pytest.mark.parametrize("scatter_max_world", [0, 3, 8])
def test_stats_report_ring_bytes(scatter_max_world):
    n = 4
    x = torch.ones(1 << 18)  # 1 MiB, above the star threshold
    config = dataclasses.replace(SMALL, scatter_max_world=scatter_max_world)
    with local_group(n, config) as (_, comms):
        # auto: scatter up to scatter_max_world ranks, ring above; the same bytes either way
        assert comms[0].choose_algorithm(x) == ("scatter" if scatter_max_world >= n else "ring")
        assert comms[0].choose_algorithm(x[:1000]) == "star"
        works = each(comms, lambda c: c.all_reduce_async(x))
        for w in works:
            assert torch.equal(w.wait(), torch.full_like(x, 4.0))
            assert w.stats.bytes_sent == ring_bytes(x.numel() * 4, n)
            assert w.stats.bytes_received == ring_bytes(x.numel() * 4, n)
        assert comms[2].stats().bytes_sent == ring_bytes(x.numel() * 4, n)


def test_input_is_not_modified_and_can_be_reused_at_once():
    with local_group(2, SMALL) as (_, comms):

        def body(c):
            x = torch.full((100_000,), float(c.rank + 1))
            keep = x.clone()
            outs = []
            for _ in range(3):
                outs.append(c.all_reduce(x, algorithm="ring"))
                assert torch.equal(x, keep)
                outs[-1].add_(1000)  # mutate the result at once: peers must be unaffected
            return outs

        for outs in each(comms, body):
            assert all(torch.equal(o, torch.full((100_000,), 1003.0)) for o in outs)


DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.int64,
    torch.float64,
]


@pytest.mark.parametrize("shape", [(), (0,), (3, 0, 2), (7, 5), (40_000,)])
def test_broadcast_and_gather_every_dtype_and_shape(shape):
    gen = torch.Generator().manual_seed(3)

    def make(dtype):
        raw = torch.randint(0, 255, shape, generator=gen, dtype=torch.int64)
        return raw.to(dtype) if dtype != torch.bool else raw % 2 == 0

    tensors = [make(d) for d in DTYPES]
    with local_group(3, SMALL) as (_, comms):

        def body(c):
            ts, meta = c.broadcast_message(
                tensors if c.rank == 2 else None,
                {"names": [str(d) for d in DTYPES]} if c.rank == 2 else None,
                root=2,
            )
            single = c.broadcast(tensors[2] if c.rank == 0 else None, root=0)
            gathered = c.all_gather(tensors[c.rank])
            return ts, meta, single, gathered

        for ts, meta, single, gathered in each(comms, body):
            assert meta == {"names": [str(d) for d in DTYPES]}
            for got, want in zip(ts, tensors):
                assert (
                    got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)
                )
            assert torch.equal(single, tensors[2])
            for r, g in enumerate(gathered):
                assert g.dtype == tensors[r].dtype and torch.equal(g, tensors[r])


def test_async_tags_complete_out_of_order_and_tags_can_be_reused():
    with local_group(2, SMALL) as (_, comms):
        c0, c1 = comms
        a0 = c0.all_reduce_async(torch.ones(3), tag="a")
        b0 = c0.all_reduce_async(torch.ones(3) * 2, tag="b")
        b1 = c1.all_reduce_async(torch.ones(3) * 2, tag="b")
        assert torch.equal(b1.wait(10), torch.full((3,), 4.0))
        assert torch.equal(b0.wait(10), torch.full((3,), 4.0))
        assert not a0.done()
        a1 = c1.all_reduce_async(torch.ones(3), tag="a")
        assert torch.equal(a0.wait(10), torch.full((3,), 2.0)) and torch.equal(
            a1.wait(10), a0.wait()
        )

        # The same tag in a loop: each use is a distinct operation even if one rank runs ahead.
        def loop(c):
            works = [c.all_reduce_async(torch.full((5,), float(i)), tag="grad") for i in range(20)]
            return [w.wait(10)[0].item() for w in works]

        for vals in each(comms, loop):
            assert vals == [2.0 * i for i in range(20)]


def test_send_recv_queue_and_large_messages():
    big = torch.randn(300_000)
    with local_group(3, SMALL) as (_, comms):

        def body(c):
            if c.rank == 0:
                c.send(2, [big, torch.arange(3)], {"step": 1}, tag="x")
                c.send(2, [torch.ones(1)], {"step": 2}, tag="x")
            if c.rank == 2:
                first = c.recv(0, tag="x")
                second = c.recv(0, tag="x")
                return first, second
            return None

        out = each(comms, body)[2]
    (ts1, m1), (ts2, m2) = out
    assert m1 == {"step": 1} and m2 == {"step": 2}
    assert torch.equal(ts1[0], big) and torch.equal(ts1[1], torch.arange(3))
    assert torch.equal(ts2[0], torch.ones(1))


def test_barrier_and_timeouts():
    with local_group(2, SMALL) as (_, comms):
        each(comms, lambda c: c.barrier())
        with pytest.raises(TransportTimeout):
            comms[0].all_reduce(torch.ones(2), tag="lonely", timeout=0.3)
        with pytest.raises(TransportTimeout):
            comms[0].recv(1, tag="never", timeout=0.3)
        # The group still works afterwards.
        out = each(comms, lambda c: c.all_reduce(torch.ones(2), tag="after"))
        assert all(torch.equal(o, torch.full((2,), 2.0)) for o in out)


def test_mismatched_shapes_fail_clearly_on_every_rank():
    with local_group(2, SMALL) as (_, comms):

        def body(c):
            with pytest.raises(Exception, match="disagree"):
                c.all_reduce(torch.ones(10 + c.rank), algorithm="star", timeout=5)
            return True

        each(comms, body)


def test_incompatible_signature_is_refused():
    with Coordinator(CoordinatorConfig(bind="tcp://127.0.0.1:0")) as coord:
        first = connect(coord.address, SMALL, signature="llama-124M")
        try:
            with pytest.raises(IncompatiblePeer, match="signature"):
                connect(coord.address, SMALL, signature="llama-7B")
            assert coord.counters["refused"] == 1
            with pytest.raises(IncompatiblePeer, match="chunk_bytes"):
                connect(
                    coord.address,
                    ZmqConfig(bind_host="127.0.0.1", chunk_bytes=1 << 20),
                    signature="llama-124M",
                )
        finally:
            first.close()


def test_config_is_validated():
    with pytest.raises(ConfigError, match="connections"):
        ZmqConfig(connections=0)
    with pytest.raises(ConfigError, match="max_message_bytes"):
        ZmqConfig(chunk_bytes=8 << 20, max_message_bytes=8 << 20)
    with pytest.raises(ConfigError, match="bind"):
        CoordinatorConfig(bind="localhost:1234")


@pytest.mark.parametrize("algorithm", ["ring", "scatter", "star"])
def test_all_reduce_of_empty_and_zero_dim_tensors(algorithm):
    with local_group(3, SMALL) as (_, comms):

        def body(c):
            e = c.all_reduce(torch.empty(0, 4), algorithm=algorithm)
            s = c.all_reduce(torch.tensor(float(c.rank)), "avg", algorithm=algorithm)
            t = c.all_reduce(torch.arange(2.0), algorithm=algorithm)  # fewer elements than ranks
            return e, s, t

        for e, s, t in each(comms, body):
            assert e.shape == (0, 4)
            assert s.shape == () and s.item() == 1.0
            assert torch.equal(t, torch.tensor([0.0, 3.0]))


@pytest.mark.parametrize("numel", [24_578, 8_191])  # segments of 2, 3, 3 chunks / all one chunk
def test_ring_with_unequal_chunk_counts_per_segment(numel):
    xs = [torch.randn(numel) for _ in range(3)]
    with local_group(3, SMALL) as (_, comms):  # 16 KiB chunks: 4096 float32 per chunk
        outs = each(comms, lambda c: c.all_reduce(xs[c.rank], algorithm="ring"))
    assert all(torch.equal(o, outs[0]) for o in outs)
    assert torch.allclose(outs[0], xs[0] + xs[1] + xs[2], atol=1e-5)


@pytest.mark.parametrize("world", [2, 4])
def test_random_shapes_algorithms_and_codecs_against_exact_sums(world):
    import random

    from lowband.codecs import Fp16Codec

    rng = random.Random(world)
    cases = [
        (
            rng.choice([0, 1, 3, 4095, 4097, 9000, 33_333]),
            rng.choice(["ring", "scatter", "star"]),
            rng.choice([None, Fp16Codec()]),
        )
        for _ in range(8)
    ]
    with local_group(world, SMALL) as (_, comms):
        for numel, algorithm, codec in cases:
            xs = [torch.randn(numel) for _ in range(world)]
            outs = each(
                comms, lambda c: c.all_reduce(xs[c.rank], "avg", algorithm=algorithm, codec=codec)
            )
            assert all(torch.equal(o, outs[0]) for o in outs), (numel, algorithm, codec)
            tol = 1e-5 if codec is None else 2e-2
            assert torch.allclose(outs[0], sum(xs) / world, atol=tol), (numel, algorithm, codec)
