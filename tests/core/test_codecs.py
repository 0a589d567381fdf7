import pytest
import torch

from lowband.codecs import CODEBOOKS, FourBitCodec, Int8BlockCodec, codec_names, get_codec
from lowband.errors import ConfigError, ProtocolError


@pytest.mark.parametrize("name", codec_names())
@pytest.mark.parametrize("shape", [(1,), (7, 13), (3, 1000), (4096,)])
def test_round_trip_shape_and_error(name, shape):
    torch.manual_seed(0)
    x = torch.randn(shape)
    codec = get_codec(name)
    enc = codec.encode(x)
    y = codec.decode(enc)
    assert y.shape == x.shape and y.dtype == torch.float32
    rel = (y - x).norm() / x.norm()
    bound = {
        "fp32": 0.0,
        "fp16": 1e-3,
        "bf16": 1e-2,
        "int8": 0.02,
        "fp4": 0.2,
        "nf4": 0.15,
        "e3m0": 0.35,
    }[name]
    assert rel <= bound, (name, float(rel))


def test_wire_sizes():
    x = torch.randn(1 << 16)
    assert Int8BlockCodec(256).encode(x).nbytes == (1 << 16) + 4 * (1 << 16) // 256
    assert FourBitCodec("nf4", 128).encode(x).nbytes == (1 << 15) + 4 * (1 << 16) // 128


def test_deterministic_and_zero_blocks():
    x = torch.zeros(1000)
    x[500:] = torch.randn(500)
    for name in codec_names():
        c = get_codec(name)
        a, b = c.encode(x), c.encode(x.clone())
        assert all(torch.equal(f, g) for f, g in zip(a.frames, b.frames))
        y = c.decode(a)
        assert torch.all(y[:256] == 0)


def test_codebooks_have_at_most_16_codes():
    for book in CODEBOOKS.values():
        assert len(book) <= 16 and book == sorted(book) and max(map(abs, book)) == 1.0


def test_bad_config():
    with pytest.raises(ConfigError, match="codec"):
        get_codec("int3")
    with pytest.raises(ConfigError, match="block"):
        FourBitCodec("nf4", 3)
    with pytest.raises(ConfigError, match="kind"):
        FourBitCodec("e5m2")


@pytest.mark.parametrize("numel", [1, 300, (1 << 20) + 777])
def test_int8_decode_add_is_the_unchunked_sum_bit_for_bit(numel: int) -> None:
    """The loopback sums contributions with ``decode_add_``: the same bits as ``acc += decode``,
    across chunk boundaries and a padded tail block."""

    g = torch.Generator().manual_seed(numel)
    codec = Int8BlockCodec()
    a, b = torch.randn(numel, generator=g), torch.randn(numel, generator=g) * 3
    want = codec.decode(codec.encode(a)) + codec.decode(codec.encode(b))
    got = codec.decode(codec.encode(a))
    codec.decode_add_(codec.encode(b), got)
    assert torch.equal(got, want)
    with pytest.raises(ProtocolError):
        codec.decode_add_(codec.encode(b), torch.zeros(numel + 1))
