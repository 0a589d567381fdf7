"""Nested (matryoshka) quantization: exact round trips, the prefix property, quality vs native
b-bit quantization, the file format's checks and the checkpoint converter."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from edge.moe.checkpoint import (
    NestedCheckpoint,
    load_backbone,
    load_dense,
    quantize_nested_checkpoint,
)
from edge.moe.planes import ExpertFile, planes_to_codes, to_planes, write_expert_file
from edge.moe.quant import (
    WIDTHS,
    NestedQuantConfig,
    dequantize_nested,
    quantize_independent,
    quantize_int8,
    slice_codes,
)
from lowband.errors import ConfigError, CorruptWeights
from lowband.models.config import ModelConfig
from lowband.models.llama import LlamaForCausalLM, init_weights
from lowband.models.tokenizer import ByteTokenizer
from lowband.models.weights import save_pretrained
from tests.conftest import tiny_llama

pytestmark = pytest.mark.timeout(120)


def rel_err(w: torch.Tensor, w_hat: torch.Tensor) -> float:
    return float((w - w_hat).norm() / w.norm())


def tiny_moe_config(**kw) -> ModelConfig:
    """The tests' tiny Llama as a Mixtral with 4 experts, 2 per token, and ModelConfig's
    default 2048 positions."""
    moe = dict(
        model_type="mixtral",
        max_position_embeddings=2048,
        num_local_experts=4,
        num_experts_per_tok=2,
    )
    return tiny_llama(**{**moe, **kw})


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A random tiny MoE checkpoint and its nested conversion."""
    root = tmp_path_factory.mktemp("nested")
    model = LlamaForCausalLM(tiny_moe_config())
    init_weights(model, seed=3)
    src = save_pretrained(model, root / "src")
    ByteTokenizer().save(src)
    out = quantize_nested_checkpoint(src, root / "nested", NestedQuantConfig(group_size=32))
    return src, out


# ---- quantization math ---------------------------------------------------------------------------
def test_int8_codes_reconstruct_within_half_a_step() -> None:
    torch.manual_seed(0)
    w = torch.randn(48, 128) * 0.05
    q = quantize_int8(w, 64)
    assert q.codes.dtype == torch.uint8 and q.lo.dtype == torch.float16 and q.lo.shape == (48, 2)
    w8 = dequantize_nested(q.codes, q.lo, q.step, 8)
    step = q.step.float().repeat_interleave(64, dim=1)
    assert torch.all((w8 - w).abs() <= step * 0.5 + 1e-7)


@pytest.mark.parametrize("bits", WIDTHS)
def test_sliced_error_bound_is_half_a_b_bit_step(bits: int) -> None:
    torch.manual_seed(1)
    w = torch.randn(32, 64)
    q = quantize_int8(w, 32)
    wb = dequantize_nested(slice_codes(q.codes, bits), q.lo, q.step, bits)
    k = 2 ** (8 - bits)
    step = q.step.float().repeat_interleave(32, dim=1)
    # int8 rounding (half a step) plus the mid-range reconstruction of the dropped bits.
    assert torch.all((wb - w).abs() <= step * (0.5 + (k - 1) / 2) + 1e-6)


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_range_extension_makes_the_slice_the_native_quantizer(bits: int) -> None:
    """With e = 2^b / (2^b - 1) the b-bit slice has the native min/max quantizer's bins and
    levels: the same reconstruction except where float16 rounding moves a bin edge."""
    torch.manual_seed(2)
    w = torch.randn(128, 256) * 0.02
    ext = 2**bits / (2**bits - 1)
    q = quantize_int8(w, 64, range_ext=ext)
    nested = dequantize_nested(slice_codes(q.codes, bits), q.lo, q.step, bits)
    native = quantize_independent(w, bits, 64)
    step = (w.view(128, 4, 64).amax(-1) - w.view(128, 4, 64).amin(-1)) / (2**bits - 1)
    close = (nested - native).abs() <= step.repeat_interleave(64, dim=1) * 0.05
    assert close.float().mean() > 0.99
    assert abs(rel_err(w, nested) - rel_err(w, native)) < 0.01 * rel_err(w, native)


def test_default_grid_is_close_to_native_at_every_width() -> None:
    torch.manual_seed(2)
    # Bell-shaped weights with a few outliers, like trained matrices.
    w = torch.randn(256, 256) * 0.02
    w[torch.rand_like(w) < 0.001] *= 8
    q = quantize_int8(w, 64)
    errs = {
        b: rel_err(w, dequantize_nested(slice_codes(q.codes, b), q.lo, q.step, b)) for b in WIDTHS
    }
    for bits in (2, 3, 4):
        native = rel_err(w, quantize_independent(w, bits, 64))
        assert errs[bits] <= native * 1.15, (bits, errs[bits], native)
    assert errs[8] < 0.01  # the 8/7 wider grid costs 14% at 8 bits, where it does not matter
    # Each extra bit helps (the slices are real precisions, not copies of one another).
    assert errs[2] > errs[3] > errs[4] > errs[8] and errs[2] > 3 * errs[4]


def test_constant_group_is_exact() -> None:
    w = torch.full((4, 64), 0.125)
    q = quantize_int8(w, 64)
    for bits in WIDTHS:
        assert torch.allclose(
            dequantize_nested(slice_codes(q.codes, bits), q.lo, q.step, bits), w, atol=2**-24 * 256
        )


def test_group_size_must_divide_and_be_a_multiple_of_8() -> None:
    with pytest.raises(ConfigError):
        NestedQuantConfig(group_size=12)
    with pytest.raises(ConfigError):
        quantize_int8(torch.randn(4, 40), 32)


# ---- bit-planes ----------------------------------------------------------------------------------
def test_planes_round_trip_and_prefix_property() -> None:
    g = torch.Generator().manual_seed(3)
    codes = torch.randint(0, 256, (4096,), dtype=torch.uint8, generator=g)
    planes = to_planes(codes)
    assert planes.shape == (8, 512)
    assert torch.equal(planes_to_codes(planes), codes)  # 8 planes: bit-exact
    for bits in range(1, 9):
        assert torch.equal(planes_to_codes(planes[:bits]), codes >> (8 - bits)), bits
    # MSB first: plane 0 is the top bit, and weight 8i+t lives in bit t of byte i.
    assert int(planes[0][0]) == sum(int(codes[t] >> 7) << t for t in range(8))


# ---- file format ---------------------------------------------------------------------------------
def write_one(path: Path, seed: int = 0) -> dict:
    torch.manual_seed(seed)
    qs = {
        "w1": quantize_int8(torch.randn(64, 32), 32),
        "w2": quantize_int8(torch.randn(32, 64), 32),
        "w3": quantize_int8(torch.randn(64, 32), 32),
    }
    write_expert_file(path, layer=1, expert=5, tensors=qs)
    return qs


def test_expert_file_round_trip_bit_exact(tmp_path: Path) -> None:
    qs = write_one(tmp_path / "e.lbn")
    with ExpertFile(tmp_path / "e.lbn") as f:
        assert (f.layer, f.expert, f.group_size) == (1, 5, 32)
        scales = f.read_scales()
        planes = f.read_planes(0, 8)
        assert planes.shape == (8, f.plane_bytes)
        codes = f.split(planes_to_codes(planes))
        for name, q in qs.items():
            assert torch.equal(scales[name][0], q.lo) and torch.equal(scales[name][1], q.step)
            assert torch.equal(codes[name], q.codes)
        # The b-bit read is a prefix, and an upgrade read of the remaining planes completes it.
        top3, rest = f.read_planes(0, 3), f.read_planes(3, 8)
        sliced = f.split(planes_to_codes(top3))
        full = f.split(planes_to_codes(torch.cat([top3, rest])))
        for name, q in qs.items():
            assert torch.equal(sliced[name], slice_codes(q.codes, 3))
            assert torch.equal(full[name], q.codes)
        # One plane is the concatenation of the tensors' planes.
        assert torch.equal(planes[1], torch.cat([to_planes(q.codes)[1] for q in qs.values()]))
        assert f.nbytes(4) - f.nbytes(3) == f.plane_bytes == (3 * 64 * 32) // 8
        f.verify()


def flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x5A
    path.write_bytes(bytes(data))


def test_corrupt_plane_is_rejected_only_where_it_is_read(tmp_path: Path) -> None:
    write_one(tmp_path / "e.lbn")
    with ExpertFile(tmp_path / "e.lbn") as f:
        plane3 = f._planes[3][0]
    flip_byte(tmp_path / "e.lbn", plane3 + 7)
    with ExpertFile(tmp_path / "e.lbn") as f:
        f.read_planes(0, 3)  # planes 0..2 are intact
        with pytest.raises(CorruptWeights, match="bit-plane 3"):
            f.read_planes(0, 4)
        with pytest.raises(CorruptWeights):
            f.verify()


@pytest.mark.parametrize("damage", ["truncate", "magic", "meta", "scales", "pad"])
def test_damaged_files_raise_corrupt_weights(tmp_path: Path, damage: str) -> None:
    p = tmp_path / "e.lbn"
    write_one(p)
    with ExpertFile(p) as f:
        scales_off = f._scales[0]
    data = p.read_bytes()
    if damage == "truncate":
        p.write_bytes(data[:-100])
    elif damage == "magic":
        p.write_bytes(b"XXXX" + data[4:])
    elif damage == "meta":
        flip_byte(p, 20)
    elif damage == "scales":
        flip_byte(p, scales_off + 3)
    else:
        p.write_bytes(data + b"\0" * 64)
    with pytest.raises(CorruptWeights):
        with ExpertFile(p) as f:
            f.verify()


def test_missing_or_empty_file(tmp_path: Path) -> None:
    with pytest.raises(CorruptWeights, match="missing"):
        ExpertFile(tmp_path / "none.lbn")
    (tmp_path / "empty.lbn").write_bytes(b"")
    with pytest.raises(CorruptWeights, match="truncated"):
        ExpertFile(tmp_path / "empty.lbn")


# ---- checkpoint conversion -----------------------------------------------------------------------
def test_converter_layout_and_copies(tiny_ckpt: tuple[Path, Path]) -> None:
    src, out = tiny_ckpt
    manifest = json.loads((out / "nested.json").read_text())
    assert manifest["group_size"] == 32 and len(manifest["experts"]) == 2 * 4
    assert (out / "lowband_tokenizer.json").exists()
    assert json.loads((out / "config.json").read_text()) == json.loads(
        (src / "config.json").read_text()
    )
    from safetensors import safe_open

    with (
        safe_open(str(out / "model.safetensors"), "pt") as a,
        safe_open(str(src / "model.safetensors"), "pt") as b,
    ):
        assert not any("experts" in k for k in a.keys())
        for k in a.keys():  # non-expert weights copied as is
            assert torch.equal(a.get_tensor(k), b.get_tensor(k))
    e = manifest["experts"][0]
    assert e["bytes"]["8"] > e["bytes"]["4"] > e["bytes"]["3"] > e["bytes"]["2"]
    for b in ("2", "3", "4"):
        # squared errors, small random groups: the 8/7 grid trades some MSE for perplexity
        assert e["err2"]["nested"][b] <= e["err2"]["independent"][b] * 1.5


def test_dense_8_bit_model_matches_the_original(tiny_ckpt: tuple[Path, Path]) -> None:
    src, out = tiny_ckpt
    from lowband.models.weights import load_pretrained

    ref = load_pretrained(src)
    ids = torch.tensor([list(b"to be or not to be")])
    with torch.no_grad():
        want = ref(ids)
        got8 = load_dense(out, 8)(ids)
        got2 = load_dense(out, 2)(ids)
    assert rel_err(want, got8) < 0.02
    assert rel_err(want, got2) > rel_err(want, got8)
    # The backbone leaves experts on the meta device: nothing of them is in memory.
    bb = load_backbone(out)
    assert bb.model.layers[0].block_sparse_moe.experts[0].w1.weight.is_meta
    assert not bb.model.layers[0].self_attn.q_proj.weight.is_meta


def test_mismatched_config_is_rejected(tiny_ckpt: tuple[Path, Path], tmp_path: Path) -> None:
    _, out = tiny_ckpt
    bad = tmp_path / "bad"
    shutil.copytree(out, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["intermediate_size"] = 96
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CorruptWeights, match="does not match"):
        NestedCheckpoint(bad)
    # Planes of another expert under this expert's name.
    bad2 = tmp_path / "bad2"
    shutil.copytree(out, bad2)
    shutil.copyfile(bad2 / "experts" / "L000_E001.lbn", bad2 / "experts" / "L000_E000.lbn")
    with pytest.raises(CorruptWeights, match="expects"):
        NestedCheckpoint(bad2)
    (bad2 / "experts" / "L001_E002.lbn").unlink()
    with pytest.raises(CorruptWeights):
        NestedCheckpoint(bad2, experts=[(1, 2)])


def test_subset_of_experts_opens_only_those(tiny_ckpt: tuple[Path, Path]) -> None:
    _, out = tiny_ckpt
    ck = NestedCheckpoint(out, experts=[(1, 3), (0, 0)])
    try:
        assert ck.keys == [(1, 3), (0, 0)]
        with pytest.raises(ConfigError):
            NestedCheckpoint(out, experts=[(5, 0)])
    finally:
        ck.close()


def test_converter_refuses_dense_models(tmp_path: Path) -> None:
    model = LlamaForCausalLM(tiny_moe_config(model_type="llama", num_local_experts=0))
    src = save_pretrained(model, tmp_path / "dense")
    with pytest.raises(ConfigError, match="not a mixture-of-experts"):
        quantize_nested_checkpoint(src, tmp_path / "out")


def test_bytes_layout_holds_the_same_int8_codes(tmp_path: Path) -> None:
    torch.manual_seed(4)
    qs = {
        "w1": quantize_int8(torch.randn(64, 32), 32),
        "w2": quantize_int8(torch.randn(32, 64), 32),
        "w3": quantize_int8(torch.randn(64, 32), 32),
    }
    write_expert_file(tmp_path / "p.lbn", layer=0, expert=0, tensors=qs)
    write_expert_file(tmp_path / "b.lbn", layer=0, expert=0, tensors=qs, layout="bytes")
    with ExpertFile(tmp_path / "p.lbn") as p, ExpertFile(tmp_path / "b.lbn") as b:
        assert b.layout == "bytes" and b.widths == (8,) and p.widths == WIDTHS
        assert b.nbytes(8) == p.nbytes(8)
        codes = b.split(b.read_codes())
        for name, q in qs.items():
            assert torch.equal(codes[name], q.codes)
        with pytest.raises(ConfigError):
            b.nbytes(4)
        with pytest.raises(ConfigError):
            b.read_planes(0, 2)
        b.verify()
    flip_byte(tmp_path / "b.lbn", (tmp_path / "b.lbn").stat().st_size - 1)
    with ExpertFile(tmp_path / "b.lbn") as b:
        with pytest.raises(CorruptWeights, match="int8 codes"):
            b.read_codes()


def test_metadata_ending_in_a_zero_byte_parses(tmp_path: Path) -> None:
    """Regression: trailing zero bytes of the msgpack metadata are data, not padding."""
    import zlib

    for seed in range(5000):
        g = torch.Generator().manual_seed(seed)
        qs = {n: quantize_int8(torch.randn(8, 8, generator=g), 8) for n in ("w1", "w2", "w3")}
        codes = b"".join(q.codes.numpy().tobytes() for q in qs.values())
        if zlib.crc32(codes) & 0xFF == 0:  # the last byte of the metadata is this crc's
            break
    write_expert_file(tmp_path / "z.lbn", layer=0, expert=0, tensors=qs, layout="bytes")
    with ExpertFile(tmp_path / "z.lbn") as f:
        f.verify()
        assert torch.equal(f.split(f.read_codes())["w3"], qs["w3"].codes)


def test_older_format_version_is_refused(tmp_path: Path) -> None:
    import struct

    write_one(tmp_path / "e.lbn")
    data = bytearray((tmp_path / "e.lbn").read_bytes())
    magic, version, flags, meta_len, crc = struct.unpack_from("<4sHHII", data, 0)
    struct.pack_into("<4sHHII", data, 0, magic, version - 1, flags, meta_len, crc)
    (tmp_path / "e.lbn").write_bytes(bytes(data))
    with pytest.raises(CorruptWeights, match="format version"):
        ExpertFile(tmp_path / "e.lbn")
