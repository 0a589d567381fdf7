"""``all_reduce(..., out=)``: the result written into the caller's buffer (the input's own, for a
DiLoCo fragment sync), bit-identical to the ordinary call, and only on success (a failed
operation leaves ``out`` as it was, so the caller can retry from its input)."""

from __future__ import annotations

import pytest
import torch

from lowband.codecs import FourBitCodec, Int8BlockCodec
from lowband.errors import ConfigError, PeerLost
from tests.conftest import run_ranks
from transport.launch import local_group
from transport.loopback import LoopbackGroup
from transport.zmq_comm import ZmqConfig

pytestmark = pytest.mark.timeout(60)

SMALL = ZmqConfig(
    bind_host="127.0.0.1", connections=2, chunk_bytes=16 * 1024, timeout=20.0, same_host="off"
)
CODECS = [None, Int8BlockCodec(256), FourBitCodec("e2m1", 128)]


def _inputs(world: int, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return [(torch.randn(5_003, generator=gen) * 10).to(dtype) for _ in range(world)]


def _reduce_both_ways(comms, xs, op, codec, algorithm="auto", which=None):
    """Each rank reduces a copy of its input twice: plainly, then in place (``out=`` its
    input) where ``which(rank)`` says so. Returns (plain, in_place, buffer) per rank."""
    which = which or (lambda r: True)

    def rank(c):
        kw = dict(codec=codec, algorithm=algorithm)
        plain = c.all_reduce(xs[c.rank].clone(), op, tag="plain", **kw)
        buf = xs[c.rank].clone()
        out = buf if which(c.rank) else None
        return plain, c.all_reduce(buf, op, tag="inplace", out=out, **kw), buf

    return run_ranks([lambda c=c: rank(c) for c in comms], timeout=40)


@pytest.mark.parametrize("codec", CODECS, ids=lambda c: "fp32" if c is None else c.name)
@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("op", ["sum", "avg"])
def test_loopback_out_is_the_input_and_bit_identical(codec, world, op):
    xs = _inputs(world)
    res = _reduce_both_ways(LoopbackGroup(world).comms(), xs, op, codec)
    for plain, inplace, buf in res:
        assert inplace.data_ptr() == buf.data_ptr()  # the sum lives in the input's buffer
        assert torch.equal(inplace, plain) and torch.equal(plain, res[0][0])


@pytest.mark.parametrize("codec", CODECS[:2], ids=["fp32", "int8"])
def test_loopback_some_ranks_in_place_others_not(codec):
    """Whichever rank's ``out`` holds the accumulator, every rank gets the same bits."""
    xs = _inputs(3)
    for which in (lambda r: r == 0, lambda r: r == 2, lambda r: r == 1):
        res = _reduce_both_ways(LoopbackGroup(3).comms(), xs, "sum", codec, which=which)
        for r, (plain, inplace, buf) in enumerate(res):
            assert torch.equal(inplace, res[0][0]) and torch.equal(plain, res[0][0])
            assert (inplace.data_ptr() == buf.data_ptr()) == which(r)
            if not which(r):
                assert torch.equal(buf, xs[r])  # an input without ``out=`` is untouched


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.int64])
def test_loopback_out_of_other_dtypes(dtype):
    xs = _inputs(2, dtype)
    for codec in (None, Int8BlockCodec(64)) if dtype.is_floating_point else (None,):
        res = _reduce_both_ways(LoopbackGroup(2).comms(), xs, "avg", codec)
        for plain, inplace, buf in res:
            assert inplace.dtype == dtype and inplace.data_ptr() == buf.data_ptr()
            assert torch.equal(inplace, plain)


def test_loopback_failed_reduce_leaves_out_as_it_was():
    group = LoopbackGroup(2)
    c0, _ = group.comms()
    x = torch.randn(1000)
    before = x.clone()
    work = c0.all_reduce_async(x, codec=Int8BlockCodec(), tag="t", out=x)
    group.kill(1)
    with pytest.raises(PeerLost):
        work.wait(5.0)
    assert torch.equal(x, before)


@pytest.mark.parametrize(
    "out", [torch.zeros(7), torch.zeros(8, dtype=torch.float64), torch.zeros(16)[::2]]
)
def test_an_unfit_out_is_refused_before_anything_is_sent(out):
    c0, c1 = LoopbackGroup(2).comms()
    with pytest.raises(ConfigError, match="out"):
        c0.all_reduce_async(torch.ones(8), tag="t", out=out)
    # Nothing was contributed: the same tag still reduces normally.
    res = run_ranks([lambda c=c: c.all_reduce(torch.ones(8), tag="t") for c in (c0, c1)])
    assert all(torch.equal(r, torch.full((8,), 2.0)) for r in res)


@pytest.mark.parametrize(
    ("algorithm", "codec"),
    [("ring", None), ("scatter", None), ("star", None), ("scatter", Int8BlockCodec(256))],
    ids=["ring", "scatter", "star", "scatter-int8"],
)
def test_zmq_out_is_the_input_and_bit_identical(algorithm, codec):
    # Two ranks: the owner schedules sum in arrival order, which only two terms make the same
    # bits on every call (a + b == b + a), so the plain call is the reference.
    xs = _inputs(2)
    with local_group(2, SMALL) as (_, comms):
        res = _reduce_both_ways(comms, xs, "avg", codec, algorithm=algorithm)
    for plain, inplace, buf in res:
        assert inplace.data_ptr() == buf.data_ptr()
        assert torch.equal(inplace, plain) and torch.equal(plain, res[0][0])


def test_zmq_unfit_out_is_refused():
    with local_group(1, SMALL) as (_, comms):
        with pytest.raises(ConfigError, match="out"):
            comms[0].all_reduce(torch.ones(4), out=torch.ones(5))


@pytest.mark.parametrize("numel", [1, 255, 256, 70_001])
def test_int8_decode_into_equals_decode(numel):
    codec = Int8BlockCodec(256)
    x = torch.randn(numel) * 3
    enc = codec.encode(x)
    out = torch.full((numel,), float("nan"))
    codec.decode_into(enc, out)
    assert torch.equal(out, codec.decode(enc))
