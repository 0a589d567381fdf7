"""Codec decode checks the peer's metadata against the frames before it allocates (issue 25).

Before the check, a 20 KB int8 or 4-bit payload whose metadata claimed a large block decoded
into ~64 MiB (the block broadcast against the scales), and larger claims were an OOM kill.
"""

from __future__ import annotations

import resource

import pytest
import torch

from lowband.codecs import FourBitCodec, Int8BlockCodec
from lowband.comm import Encoded
from lowband.errors import ProtocolError

pytestmark = [pytest.mark.security, pytest.mark.timeout(60)]

CODECS = [Int8BlockCodec(), FourBitCodec("nf4"), FourBitCodec("e2m1")]


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@pytest.mark.parametrize("codec", CODECS, ids=lambda c: c.name)
def test_honest_payload_round_trips(codec):
    x = torch.randn(3, 1000, generator=torch.Generator().manual_seed(0))
    y = codec.decode(codec.encode(x))
    # the coarsest grid (e2m1) has a step of 1/3 of the block's absmax near the top
    assert y.shape == x.shape and (y - x).abs().max() <= x.abs().max() / 6 + 1e-6


@pytest.mark.parametrize("codec", CODECS, ids=lambda c: c.name)
@pytest.mark.parametrize(
    "forge",
    [
        lambda m: {**m, "block": 1 << 22},  # a huge block: the old decode broadcast it
        lambda m: {**m, "block": 0},
        lambda m: {**m, "block": "256"},
        lambda m: {**m, "shape": [1 << 30]},  # more elements than the frames carry
        lambda m: {**m, "shape": [-1, 4]},
        lambda m: {**m, "shape": [2.5]},
        lambda m: {**m, "shape": "big"},
        lambda m: {k: v for k, v in m.items() if k != "shape"},
        lambda m: {**m, "shape": [1 << 40, 1 << 40]},  # overflows any allocation
    ],
)
def test_forged_metadata_is_refused_before_allocation(codec, forge):
    enc = codec.encode(torch.randn(20_000))
    before = _rss_mib()
    with pytest.raises(ProtocolError):
        codec.decode(Encoded(frames=enc.frames, meta=forge(dict(enc.meta))))
    assert _rss_mib() - before < 32  # the peak RSS did not grow by what the claim asks for


@pytest.mark.parametrize("codec", CODECS, ids=lambda c: c.name)
def test_frames_that_do_not_match_the_shape_are_refused(codec):
    enc = codec.encode(torch.randn(4096))
    codes, scale = enc.frames
    for frames in [(codes[:-1], scale), (codes, scale[:-1]), (codes,), (codes, scale, scale)]:
        with pytest.raises(ProtocolError):
            codec.decode(Encoded(frames=frames, meta=enc.meta))


def test_a_four_bit_payload_of_another_kind_is_refused():
    enc = FourBitCodec("e2m1").encode(torch.randn(256))
    with pytest.raises(ProtocolError, match="kind"):
        FourBitCodec("nf4").decode(enc)
