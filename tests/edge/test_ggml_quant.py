"""edge.quant.ggml: llama.cpp block formats kept packed (Q4_1, Q5_0, Q5_1, Q2_K..Q6_K).

* our reference decoder equals ``gguf.quants.dequantize`` (gguf-py's numpy implementation of
  ggml's ``dequantize_row_*``) bit for bit on random blocks with valid fp16 scale fields;
* the PyTorch fallback equals ``x @ dequantize(W)^T`` to fp32 rounding (1e-5 of ``|x| @ |W|^T``);
* the C++ kernel quantizes the activations to int8 per 32 values (``d = max|x|/127``, as the
  Q8/Q4 kernels do), so against the reference it is off by at most ``d/2 * |a q|`` per value
  (``act_bound``; ~0.5% of ``|y|`` for Gaussian x, asserted < 1.5e-2 in norm), and it equals an
  exact float64 emulation of its integer semantics (``emulate``) to 1e-5 of the sum of |terms|;
* ``GGMLLinear`` slices rows freely and columns on block boundaries only.

The scalar C++ path runs in ``tests/edge/test_quant.py::test_cpp_selftest_all_paths``
(``selftest.cpp`` checks the ggml kernels too, built with ``-DLOWBAND_QUANT_SCALAR``).
"""

from __future__ import annotations

from dataclasses import asdict

import gguf
import numpy as np
import pytest
import torch

from edge.quant import GroupBoundaryError, QuantShapeError, kernel
from edge.quant.ggml import GGML_TYPES, GGMLWeight, decode, dequantize_ggml, narrow_ggml
from edge.quant.linear import GGMLLinear
from tests.conftest import run_json_module

pytestmark = pytest.mark.timeout(600)  # the first test may build the extension (minutes here)

# Byte offsets of the fp16 fields of each block (d, dmin / m).
FP16_FIELDS = {
    "Q4_1": (0, 2),
    "Q5_0": (0,),
    "Q5_1": (0, 2),
    "Q2_K": (80, 82),
    "Q3_K": (108,),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208,),
}
TYPES = list(GGML_TYPES)


def random_blocks(name: str, n: int, k: int, seed: int = 0, scale: float = 1.0) -> np.ndarray:
    """Random block bytes ``uint8 [n, row_bytes]`` whose fp16 fields are finite normals."""
    t = GGML_TYPES[name]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (n, k // t.qk, t.size), dtype=np.uint8)
    for at in FP16_FIELDS[name]:
        v = (rng.standard_normal((n, k // t.qk, 1)) * scale).astype(np.float16)
        raw[:, :, at : at + 2] = v.view(np.uint8)
    return raw.reshape(n, -1)


def weight(name: str, n: int, k: int, seed: int = 0, scale: float = 1.0) -> GGMLWeight:
    data = torch.from_numpy(random_blocks(name, n, k, seed, scale))
    return GGMLWeight(GGML_TYPES[name], (n, k), data)


@pytest.fixture(params=["kernel", "fallback"])
def mode(request):
    saved = kernel.get_config()
    if request.param == "fallback":
        kernel.configure(enabled=False)
    yield request.param
    kernel.configure(**asdict(saved))


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("n,blocks", [(1, 1), (5, 3), (16, 8)])
def test_reference_matches_gguf_py(name, n, blocks) -> None:
    k = GGML_TYPES[name].qk * blocks
    raw = random_blocks(name, n, k, seed=n * 31 + blocks)
    want = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[name])
    got = dequantize_ggml(GGMLWeight(GGML_TYPES[name], (n, k), torch.from_numpy(raw)))
    assert got.shape == (n, k)
    assert np.array_equal(got.numpy(), want), np.abs(got.numpy() - want).max()


def test_sizes_match_gguf_py() -> None:
    for name, t in GGML_TYPES.items():
        qk, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name]]
        assert (t.qk, t.size, t.type_id) == (qk, size, gguf.GGMLQuantizationType[name].value)


def _bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return 1e-5 * (x.abs().double() @ w.abs().double().T) + 1e-6


def _decoded(w: GGMLWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, a, b of every 16 values: [N, K/16, 16], [N, K/16], [N, K/16]."""
    n, k = w.shape
    q, a, b = decode(w.type, w.data.reshape(-1, w.type.size))
    return q.reshape(n, k // 16, 16), a.reshape(n, k // 16), b.reshape(n, k // 16)


def _act(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's int8 activations per 32 values: (xq [M, K/32, 32], d [M, K/32]), fp32."""
    m, k = x.shape
    xb = x.float().reshape(m, k // 32, 32)
    d = xb.abs().amax(-1) / 127.0
    inv = torch.where(d != 0, 1.0 / torch.where(d != 0, d, torch.ones_like(d)), 0.0)
    return torch.round(xb * inv.unsqueeze(-1)), d  # round half to even, like cvtps2dq


def emulate(x: torch.Tensor, w: GGMLWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's semantics in float64: (y, sum of |terms|)."""
    m, k = x.shape
    q, a, b = _decoded(w)
    xq, d = _act(x)
    isum = torch.einsum("msi,nsi->mns", xq.reshape(m, k // 16, 16).double(), q.double())
    scale = a.unsqueeze(0) * d.repeat_interleave(2, dim=1).unsqueeze(1)  # fp32 a * d_x
    xs16 = x.float().reshape(m, k // 16, 16).sum(-1)  # per-16 sums of the fp32 activations
    t = scale.double() * isum
    u = b.double().unsqueeze(0) * xs16.double().unsqueeze(1)
    return (t + u).sum(-1), (t.abs() + u.abs()).sum(-1)


def act_bound(x: torch.Tensor, w: GGMLWeight) -> torch.Tensor:
    """|kernel - reference| <= sum over 32-blocks c of d_c/2 * sum_{i in c} |a q_i| (+ slack)."""
    m, k = x.shape
    q, a, _ = _decoded(w)
    aq = (a.unsqueeze(-1) * q.float()).abs().reshape(w.shape[0], k // 32, 32).sum(-1)
    _, d = _act(x)
    return (d.double() / 2) @ aq.double().T + _bound(x, dequantize_ggml(w))


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("m,n,blocks", [(1, 37, 1), (3, 64, 4), (17, 9, 9)])
def test_kernel_matches_reference(mode, name, m, n, blocks) -> None:
    k = GGML_TYPES[name].qk * blocks  # K-quants: K a multiple of 256
    w = weight(name, n, k, seed=blocks, scale=0.05)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    bias = torch.randn(n, generator=torch.Generator().manual_seed(7))
    deq = dequantize_ggml(w)
    ref = x.double() @ deq.double().T + bias.double()
    y = kernel.ggml_gemv(x, w, bias)
    fb = kernel.ggml_gemv(x, w, bias, force_fallback=True)
    assert y.shape == (m, n) and y.dtype == torch.float32
    assert bool(((fb.double() - ref).abs() <= _bound(x, deq)).all())
    assert bool(((y.double() - ref).abs() <= act_bound(x, w)).all())
    assert ((y.double() - ref).norm() / ref.norm()).item() < 1.5e-2
    if mode == "kernel":
        assert kernel.available(), kernel.unavailable_reason()
        emu, mag = emulate(x, w)
        assert bool(((y - bias).double() - emu).abs().le(1e-5 * mag + 1e-7).all())
    else:
        assert torch.equal(y, fb)


@pytest.mark.parametrize("name", TYPES)
def test_native_dequantize_matches_reference(mode, name) -> None:
    w = weight(name, 33, GGML_TYPES[name].qk * 3, seed=11)
    want = dequantize_ggml(w)
    got = kernel.ggml_dequantize(w)
    assert torch.allclose(got, want, rtol=1e-6, atol=0)  # C++ may fuse a * q + b (one FMA)
    if mode == "fallback":
        assert torch.equal(got, want)
    x = torch.randn(5, w.shape[1], generator=torch.Generator().manual_seed(1))
    y = kernel.ggml_gemv_fallback(x, w, native_dequant=True)
    assert bool(((y.double() - x.double() @ want.double().T).abs() <= _bound(x, want)).all())


def test_kernel_bigger_shape_and_threads() -> None:
    w = weight("Q4_K", 700, 2048, seed=3, scale=0.01)
    x = torch.randn(2, 2048, generator=torch.Generator().manual_seed(1))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        y1 = kernel.ggml_gemv(x, w)
        torch.set_num_threads(2)
        y2 = kernel.ggml_gemv(x, w)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(y1, y2)  # rows are independent
    deq = dequantize_ggml(w)
    assert bool(((y1.double() - x.double() @ deq.double().T).abs() <= act_bound(x, w)).all())


def test_shape_errors() -> None:
    t = GGML_TYPES["Q6_K"]
    with pytest.raises(QuantShapeError, match="multiple of 256"):
        GGMLWeight(t, (2, 128), torch.zeros(2, 105, dtype=torch.uint8))
    with pytest.raises(QuantShapeError, match="uint8"):
        GGMLWeight(t, (2, 256), torch.zeros(2, 211, dtype=torch.uint8))
    with pytest.raises(QuantShapeError):
        kernel.ggml_gemv(torch.zeros(1, 128), weight("Q6_K", 2, 256))


@pytest.mark.parametrize("name", ["Q4_K", "Q5_0"])
def test_narrow_rows_and_block_columns(name) -> None:
    qk = GGML_TYPES[name].qk
    w = weight(name, 6, 4 * qk, seed=5)
    full = dequantize_ggml(w)
    assert torch.equal(dequantize_ggml(narrow_ggml(w, 0, 2, 3)), full[2:5])
    assert torch.equal(dequantize_ggml(narrow_ggml(w, 1, qk, 2 * qk)), full[:, qk : 3 * qk])
    with pytest.raises(GroupBoundaryError, match=f"multiples of {qk}"):
        narrow_ggml(w, 1, 16, qk)
    with pytest.raises(QuantShapeError, match="out of range"):
        narrow_ggml(w, 0, 5, 2)


def test_ggml_linear_forward_and_shards(mode) -> None:
    w = weight("Q6_K", 24, 512, seed=9, scale=0.02)
    bias = torch.randn(24, generator=torch.Generator().manual_seed(2))
    lin = GGMLLinear(w, bias)
    ref = torch.nn.Linear(512, 24)
    with torch.no_grad():
        ref.weight.copy_(lin.dequantize_weight())
        ref.bias.copy_(bias)
    x = torch.randn(2, 3, 512, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want, got = ref(x), lin(x)
        assert ((got - want).norm() / want.norm()).item() < 1.5e-2
        long = GGMLLinear(w, bias, max_kernel_rows=2)  # 6 rows > 2: the dequantize path
        assert torch.allclose(long(x), want, rtol=1e-5, atol=1e-5)
        rows = lin.narrow_out(8, 8)
        assert torch.allclose(rows(x), got[..., 8:16], rtol=1e-5, atol=1e-5)
        a, b = lin.narrow_in(0, 256, keep_bias=True), lin.narrow_in(256, 256)
        assert b.bias is None  # column halves: the same 32-value activation blocks
        assert torch.allclose(a(x[..., :256]) + b(x[..., 256:]), got, rtol=1e-5, atol=1e-5)
    with pytest.raises(GroupBoundaryError):
        lin.narrow_in(0, 128)
    sd = lin.state_dict()
    assert sd["blocks"].dtype == torch.uint8 and torch.equal(sd["blocks"], w.data)
    assert "type=Q6_K" in repr(lin)


def test_benchmark_ggml_tiny_smoke() -> None:
    report = run_json_module("benchmarks.quant_gemv", "--ggml", "--tiny", "--json", timeout=240)
    assert report["bench"] == "quant_gemv" and report["threads"] == 1
    for shape, res in report["results"].items():
        assert {"fp32", "q4g32", *GGML_TYPES} == set(res), shape
        for stats in res.values():
            assert 0 < stats["min_us"] <= stats["median_us"] <= stats["max_us"]
