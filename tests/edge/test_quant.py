"""edge.quant: Q8/Q4 formats, the C++ GEMV kernel vs its PyTorch fallback, QuantLinear.

Tolerances (kernel vs the fp32 dequantized reference ``F.linear(x, dequantize(W))``):
the kernel quantizes each activation block of G values to int8 with d_x = max|x_b|/127, so each
activation is off by at most d_x/2 and, per output element,

    |y_kernel - y_ref| <= sum_b (d_x,b / 2) * sum_{j in b} |W'_nj|   (+ fp32 rounding)

which is the bound asserted (``act_quant_bound``).  For Gaussian activations that is ~0.5% of
|y| in norm (uniform error d_x/sqrt(12) with max|x| ~ 2-2.5 sigma per block of 32), so a flat
"1e-3 relative" tolerance would be wrong; we also assert a <1.5e-2 relative Frobenius error.
Against an exact emulation of its own integer semantics (``emulate``) the kernel must agree to
1e-5 of sum |terms| (only the fp32 summation order differs).  The fallback is compared with the
reference at 1e-5 relative.

Every test runs with the kernel (if it builds here) and with the kernel disabled.
"""

from __future__ import annotations

import platform
import shutil
import subprocess
import sys
import threading
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from edge.quant import (
    GroupBoundaryError,
    PackedWeight,
    QuantLinear,
    QuantShapeError,
    QuantSpec,
    UnsupportedBitsError,
    UnsupportedGroupError,
    dequantize,
    kernel,
    narrow,
    quantize,
    quantize_modules,
    quantize_q4,
    quantize_q8,
)
from edge.quant.formats import unpack_q4
from lowband.errors import LowbandError
from tests.conftest import run_json_module

REPO = Path(__file__).resolve().parents[2]
CSRC = REPO / "edge" / "quant" / "csrc"
FORMATS = [(8, 32), (8, 64), (4, 32), (4, 64), (4, 128)]


@pytest.fixture
def restore_config():
    saved = kernel.get_config()
    yield
    kernel.configure(**asdict(saved))


@pytest.fixture(params=["kernel", "fallback"])
def mode(request, restore_config):
    if request.param == "fallback":
        kernel.configure(enabled=False)
        assert not kernel.available()
        assert "disabled" in kernel.unavailable_reason()
    return request.param


def rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def emulate(x: torch.Tensor, p: PackedWeight):
    """The kernel's integer semantics in float64: (y, sum of |group terms|)."""
    n, k = p.spec.shape
    G, nb, m = p.spec.group, k // p.spec.group, x.shape[0]
    xb = x.float().reshape(m, nb, G)
    d = xb.abs().amax(-1) / 127.0
    inv = torch.where(d != 0, 1.0 / torch.where(d != 0, d, torch.ones_like(d)), torch.zeros_like(d))
    xq = torch.round(xb * inv.unsqueeze(-1))  # round half to even, like cvtps2dq / nearbyint
    wq = (
        p.qweight.to(torch.float64)
        if p.spec.bits == 8
        else unpack_q4(p.qweight, G).to(torch.float64) - 8
    )
    isum = torch.einsum("mbg,nbg->mnb", xq.double(), wq.reshape(n, nb, G))
    scale = (p.scales.float().unsqueeze(0) * d.unsqueeze(1)).double()  # fp32 product, as in C++
    terms = scale * isum
    return terms.sum(-1), terms.abs().sum(-1)


def act_quant_bound(x: torch.Tensor, p: PackedWeight) -> torch.Tensor:
    n, k = p.spec.shape
    G, nb = p.spec.group, k // p.spec.group
    wabs = dequantize(p).abs().reshape(n, nb, G).sum(-1)  # [N, nb]
    half_dx = x.abs().reshape(x.shape[0], nb, G).amax(-1) / 127.0 / 2  # [M, nb]
    slack = 1e-5 * (x.abs() @ dequantize(p).abs().T) + 1e-6
    return half_dx @ wabs.T + slack


# ---------------------------------------------------------------------------------- formats
def test_q4_0_hand_example():
    # Row 0: max-by-abs is -8.0 -> d = 1, q = floor(x + 8.5) clamped to 15.
    row0 = torch.zeros(32)
    vals = {
        0: -8.0,
        1: 7.9,
        2: 0.49,
        3: 0.51,
        4: -0.49,
        5: -0.51,
        6: 3.2,
        7: -3.7,
        16: 6.5,
        17: 7.5,
        18: 1.5,
        19: -2.5,
    }
    for j, v in vals.items():
        row0[j] = v
    # Row 1: +4 and -4 tie; the first (+4) wins -> d = -0.5, q = floor(-2x + 8.5).
    row1 = torch.zeros(32)
    row1[0], row1[1], row1[16] = 4.0, -4.0, 1.0
    row2 = torch.zeros(32)  # d = 0 -> every q = 8
    p = quantize_q4(torch.stack([row0, row1, row2]), 32)

    q0 = [8] * 32
    for j, q in {
        0: 0,
        1: 15,
        2: 8,
        3: 9,
        4: 8,
        5: 7,
        6: 11,
        7: 4,
        16: 15,
        17: 15,
        18: 10,
        19: 6,
    }.items():
        q0[j] = q
    q1 = [8] * 32
    q1[0], q1[1], q1[16] = 0, 15, 6  # -2*4+8.5 -> 0; -2*-4+8.5=16.5 -> 15; -2+8.5 -> 6
    for r, q in enumerate([q0, q1, [8] * 32]):
        expect = [q[j] | (q[j + 16] << 4) for j in range(16)]  # block_q4_0.qs byte order
        assert p.qweight[r].tolist() == expect, r
    assert p.scales[:, 0].tolist() == [1.0, -0.5, 0.0]  # the zero group gets -0.0, as llama.cpp
    deq = dequantize(p)
    assert deq[0, 1].item() == 7.0 and deq[0, 17].item() == 7.0  # clamped at q=15
    assert deq[0, 3].item() == 1.0 and deq[0, 5].item() == -1.0
    assert deq[1, 0].item() == 4.0 and deq[1, 1].item() == -3.5  # asymmetric range of Q4_0
    assert deq[2].abs().sum().item() == 0.0


def test_q8_0_hand_example():
    row = torch.zeros(32)
    row[0], row[1], row[2], row[3], row[4], row[5] = 127.0, 2.5, -2.5, 0.5, 1.49, -126.6
    p = quantize_q8(row[None])
    assert p.scales.item() == 1.0
    # roundf: halves away from zero (torch.round would give 2, -2, 0)
    assert p.qweight[0, :6].tolist() == [127, 3, -3, 1, 1, -127]
    assert dequantize(p)[0, :6].tolist() == [127.0, 3.0, -3.0, 1.0, 1.0, -127.0]


@pytest.mark.parametrize("bits,group", FORMATS)
def test_round_trip_error_bounds(bits, group):
    w = rand(64, 512, seed=1) * 0.05
    w[3, 7] = 1.0  # an outlier only affects its own group
    p = quantize(w, bits, group)
    assert p.qweight.dtype == (torch.int8 if bits == 8 else torch.uint8)
    assert tuple(p.qweight.shape) == ((64, 512) if bits == 8 else (64, 256))
    assert p.scales.dtype == torch.float16 and tuple(p.scales.shape) == (64, 512 // group)
    err = (dequantize(p) - w).abs().reshape(64, -1, group)
    amax = w.abs().reshape(64, -1, group).amax(-1)
    # Q8: |e| <= d/2 with d = amax/127, plus the fp16 rounding of d (127 * d * 2^-11).
    # Q4: |e| <= |d| = amax/8 (values near +8|d| clamp to 7|d|), plus fp16 rounding.
    step = amax / 127 if bits == 8 else amax / 8
    limit = step * (0.5 if bits == 8 else 1.0) + step * (127 if bits == 8 else 8) * 2**-11 + 1e-9
    assert bool((err.amax(-1) <= limit).all())
    rel = ((dequantize(p) - w).norm() / w.norm()).item()
    assert rel < (0.01 if bits == 8 else 0.15), rel


def test_q4_zero_and_constant_groups():
    w = torch.zeros(2, 64)
    w[1] = 0.3
    p = quantize_q4(w, 32)
    assert dequantize(p)[0].abs().sum() == 0
    assert torch.allclose(dequantize(p)[1], torch.full((64,), 0.3), atol=1e-3)  # q = 0 -> -8*d


def test_bad_inputs_raise():
    with pytest.raises(QuantShapeError):
        quantize(torch.randn(4, 100), 8, 32)  # K not a multiple of G
    with pytest.raises(UnsupportedBitsError):
        quantize(torch.randn(4, 64), 3, 32)
    with pytest.raises(UnsupportedGroupError):
        quantize(torch.randn(4, 64), 4, 16)
    with pytest.raises(QuantShapeError):
        quantize(torch.randn(64), 8, 32)
    with pytest.raises(QuantShapeError):
        quantize(torch.zeros(4, 64, dtype=torch.int32), 8, 32)
    bad = torch.randn(4, 64)
    bad[1, 2] = float("nan")
    with pytest.raises(ValueError):
        quantize(bad, 4, 32)
    with pytest.raises(QuantShapeError):
        QuantSpec(4, 32, (8, 48))
    p = quantize(torch.randn(4, 64), 4, 32)
    with pytest.raises(QuantShapeError):
        PackedWeight(p.spec, p.qweight.to(torch.int8), p.scales)
    with pytest.raises(QuantShapeError):
        PackedWeight(p.spec, p.qweight, p.scales.float())
    with pytest.raises(QuantShapeError):
        narrow(p, 0, 2, 5)
    with pytest.raises(GroupBoundaryError):
        narrow(p, 1, 16, 32)
    with pytest.raises(QuantShapeError):
        kernel.gemv(torch.randn(2, 32), p.qweight, p.scales, 4, 32)
    with pytest.raises(UnsupportedBitsError):
        QuantLinear(64, 8, bits=2)
    ql = QuantLinear.from_packed(p)
    with pytest.raises(QuantShapeError):
        ql(torch.randn(3, 65))
    assert issubclass(QuantShapeError, ValueError) and issubclass(
        GroupBoundaryError, QuantShapeError
    )
    # One hierarchy: ``except LowbandError`` catches a bad quantization as any other lowband error.
    with pytest.raises(LowbandError, match="bits must be one of"):
        QuantLinear(64, 8, bits=2)


# ----------------------------------------------------------------------------------- kernel
@pytest.mark.parametrize("bits,group", FORMATS)
@pytest.mark.parametrize("m,nb", [(1, 3), (3, 11), (17, 9), (2, 17)])
def test_kernel_fallback_reference_agree(mode, bits, group, m, nb):
    # K = nb * G: never a multiple of 256 here; 3 groups = tail only, 11/9/17 = chunks of 8 + tail
    n, k = 37, nb * group
    w = rand(n, k, seed=2) / k**0.5
    x = rand(m, k, seed=3)
    x[0, :group] = 0.0  # an all-zero activation block
    bias = rand(n, seed=4)
    p = quantize(w, bits, group)
    ref = F.linear(x, dequantize(p), bias)
    y = kernel.gemv(x, p.qweight, p.scales, bits, group, bias)
    fb = kernel.gemv(x, p.qweight, p.scales, bits, group, bias, force_fallback=True)
    assert y.shape == (m, n) and y.dtype == torch.float32
    assert torch.allclose(fb, ref, rtol=1e-5, atol=1e-5)
    assert bool(((y - ref).abs() <= act_quant_bound(x, p)).all())
    assert ((y - ref).norm() / ref.norm()).item() < 1.5e-2
    if mode == "kernel" and kernel.available():
        emu, mag = emulate(x, p)
        assert bool(((y - bias).double() - emu).abs().le(1e-5 * mag + 1e-7).all())
    else:
        assert torch.equal(y, fb)


@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("m", [2, 5, 8, 9, 20])
def test_q8_rows_alone_equal_rows_in_a_batch(group, m):
    """The AVX-512 build computes Q8 through its GEMM (16 weight rows per zmm) from 8 activation
    rows, and G = 32 below that 4 rows at a time on zmm (one row: decode): every row must keep
    the bits it gets alone, the compiled step's batched == single-step identity rests on this.
    37 weight rows = 2 x 16 + 5; K of 11 groups = a chunk of 8 and a tail of 3; row 3 (or the
    last) all zeros."""
    if not kernel.available():
        pytest.skip(f"C++ kernel unavailable: {kernel.unavailable_reason()}")
    n, k = 37, 11 * group
    p = quantize(rand(n, k, seed=7) / k**0.5, 8, group)
    x = rand(m, k, seed=8)
    zero = min(3, m - 1)
    x[zero] = 0.0
    many = kernel.gemv(x, p.qweight, p.scales, 8, group)
    for i in range(m):
        alone = kernel.gemv(x[i : i + 1].contiguous(), p.qweight, p.scales, 8, group)
        assert torch.equal(alone[0], many[i]), (group, m, i)
    assert torch.equal(many[zero], torch.zeros(n))
    emu, mag = emulate(x, p)
    assert bool((many.double() - emu).abs().le(1e-5 * mag + 1e-7).all())


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_kernel_pool_runs_on_the_torch_thread_count(threads: int) -> None:
    """The kernels' persistent pool runs a job on as many threads as torch's thread count
    (``--threads``): at::parallel_for ran serially in this extension (no -fopenmp)."""
    mod = kernel.load()
    if mod is None:
        pytest.skip(f"C++ kernel unavailable: {kernel.unavailable_reason()}")
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        assert mod.pool_threads(64) == threads
        assert mod.pool_threads(1) == 1  # one item: no worker is woken
        for _ in range(200):  # back-to-back jobs (workers spinning) and a job after a nap
            assert mod.pool_threads(8) == threads
        with kernel.serial():  # this thread's jobs on it alone (a small draft model's)
            assert mod.pool_threads(64) == 1
            seen: list[int] = []  # another thread meanwhile still uses the pool

            def other() -> None:
                torch.set_num_threads(2)
                seen.append(mod.pool_threads(64))

            t = threading.Thread(target=other)
            t.start()
            t.join(timeout=30)
            assert seen == [2]
            torch.set_num_threads(threads)
        assert mod.pool_threads(64) == threads  # restored on leaving the block
    finally:
        torch.set_num_threads(before)


def test_kernel_threads_and_bigger_shape(mode):
    w = rand(1000, 2048, seed=5) / 45
    x = rand(1, 2048, seed=6)
    p = quantize(w, 4, 32)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        y1 = kernel.gemv(x, p.qweight, p.scales, 4, 32)
        torch.set_num_threads(2)
        y2 = kernel.gemv(x, p.qweight, p.scales, 4, 32)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(y1, y2)  # rows are independent: threading changes nothing
    ref = F.linear(x, dequantize(p))
    assert bool(((y1 - ref).abs() <= act_quant_bound(x, p)).all())


def test_build_failure_falls_back_and_logs(tmp_path, restore_config, caplog):
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("")
    kernel.configure(build_root=blocker)  # mkdir of <file>/<hash> fails like a broken build would
    with caplog.at_level("WARNING", logger="edge.quant.kernel"):
        assert not kernel.available()
        assert kernel.available() is False  # tried once, logged once
    assert kernel.unavailable_reason()
    assert sum("unavailable" in r.message for r in caplog.records) == 1
    p = quantize(rand(8, 64), 8, 32)
    x = rand(2, 64, seed=1)
    assert torch.allclose(
        kernel.gemv(x, p.qweight, p.scales, 8, 32), F.linear(x, dequantize(p)), atol=1e-5
    )


@pytest.mark.skipif(shutil.which("g++") is None, reason="no C++ compiler")
def test_cpp_selftest_all_paths(tmp_path):
    """gemv_kernels.h without torch: native SIMD and scalar paths (NEON under qemu if present)."""
    builds = [
        ("g++", ["-march=native"] if sys.platform == "linux" else [], None),
        ("g++", ["-DLOWBAND_QUANT_SCALAR"], None),
    ]
    if platform.machine() in ("x86_64", "AMD64"):  # the AVX2 routes an AVX-512 build skips
        builds.append(("g++", ["-mavx2", "-mfma", "-mf16c"], None))
    if shutil.which("aarch64-linux-gnu-g++") and shutil.which("qemu-aarch64"):
        builds.append(
            ("aarch64-linux-gnu-g++", ["-static", "-march=armv8.2-a+dotprod"], "qemu-aarch64")
        )
    for i, (cxx, flags, runner) in enumerate(builds):
        exe = tmp_path / f"selftest{i}"
        subprocess.run(
            [cxx, "-std=c++17", "-O1", *flags, str(CSRC / "selftest.cpp"), "-o", str(exe)],
            check=True,
            capture_output=True,
            timeout=120,
        )
        out = subprocess.run(
            [runner, str(exe)] if runner else [str(exe)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 0, out.stdout + out.stderr
        assert "fails=0" in out.stdout


# ------------------------------------------------------------------------------ QuantLinear
@pytest.mark.parametrize("bits,group", [(8, 32), (4, 32), (4, 64)])
def test_quant_linear_forward_shapes(mode, bits, group):
    lin = nn.Linear(320 if group == 64 else 352, 45)
    with torch.no_grad():
        lin.weight.copy_(rand(45, lin.in_features, seed=7) * 0.05)
    ql = QuantLinear.from_linear(lin, bits, group)
    ref_w = ql.dequantize_weight()
    for shape in [
        (lin.in_features,),
        (1, lin.in_features),
        (2, 3, lin.in_features),
        (17, lin.in_features),
    ]:
        x = rand(*shape, seed=8)
        y = ql(x)
        assert y.shape == shape[:-1] + (45,)
        ref = F.linear(x, ref_w, lin.bias.detach())
        assert ((y - ref).norm() / ref.norm()).item() < 1.5e-2
    # many rows take the dequantize + matmul path: same as the fallback
    ql.max_kernel_rows = 4
    x = rand(9, lin.in_features, seed=9)
    assert torch.allclose(ql(x), F.linear(x, ref_w, lin.bias.detach()), rtol=1e-5, atol=1e-5)
    xb = x.to(torch.bfloat16)
    assert ql(xb).dtype == torch.bfloat16


@pytest.mark.parametrize("bits,group", [(8, 32), (4, 32), (4, 128)])
def test_narrow_out_and_in(mode, bits, group):
    n, k = 40, 512
    w = rand(n, k, seed=10)
    lin = nn.Linear(k, n)
    with torch.no_grad():
        lin.weight.copy_(w)
    ql = QuantLinear.from_linear(lin, bits, group)
    x = rand(3, k, seed=11)
    full = ql(x)
    # rows: exactly the same computation per output row
    part = ql.narrow_out(8, 20)
    assert part.out_features == 20 and torch.equal(part(x), full[:, 8:28])
    # quantization is group-local, so slicing packed data == quantizing the slice
    assert torch.equal(part.qweight, quantize(w[8:28], bits, group).qweight)
    cols = ql.narrow_in(group, k - 2 * group)
    q_cols = quantize(w[:, group : k - group], bits, group)
    assert torch.equal(cols.qweight, q_cols.qweight) and torch.equal(cols.scales, q_cols.scales)
    assert cols.bias is None and ql.narrow_in(0, group, keep_bias=True).bias is not None
    # row-parallel shards sum to the full output (+ bias once)
    shards = [ql.narrow_in(s, 128) for s in range(0, k, 128)]
    total = sum(sh(x[:, i * 128 : (i + 1) * 128]) for i, sh in enumerate(shards)) + ql.bias
    assert torch.allclose(total, full, rtol=1e-4, atol=1e-4)
    with pytest.raises(GroupBoundaryError, match="multiples of its group size"):
        ql.narrow_in(group // 2, group)
    with pytest.raises(GroupBoundaryError):
        ql.narrow_in(0, group + 1)


def test_state_dict_and_safetensors_round_trip(tmp_path, mode):
    from safetensors.torch import load_file, save_file

    lin = nn.Linear(256, 24)
    ql = QuantLinear.from_linear(lin, 4, 64)
    sd = ql.state_dict()
    assert set(sd) == {"qweight", "scales", "bias"}
    assert sd["qweight"].dtype == torch.uint8 and sd["scales"].dtype == torch.float16
    save_file(sd, str(tmp_path / "q.safetensors"))
    fresh = QuantLinear(256, 24, bias=True, bits=4, group=64)
    fresh.load_state_dict(load_file(str(tmp_path / "q.safetensors")))
    x = rand(2, 256, seed=12)
    assert torch.equal(fresh(x), ql(x))
    # a model-wide dtype cast keeps the packed format intact
    scales = ql.scales.clone()
    ql.to(torch.bfloat16)
    assert ql.scales.dtype == torch.float16 and torch.equal(ql.scales, scales)
    assert ql.qweight.dtype == torch.uint8


def test_quantize_modules(mode):
    torch.manual_seed(0)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.up = nn.Linear(64, 128)
            self.down = nn.Linear(128, 64, bias=False)

        def forward(self, x):
            return self.down(F.silu(self.up(x)))

    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([Block(), Block()])
            self.norm = nn.LayerNorm(64)
            self.lm_head = nn.Linear(64, 100, bias=False)

        def forward(self, x):
            for layer in self.layers:
                x = x + layer(x)
            return self.lm_head(self.norm(x))

    model = Tiny().eval()
    x = torch.randn(2, 5, 64)
    with torch.no_grad():
        ref = model(x)
    out = quantize_modules(model, bits=8, group=32, skip=("lm_head",))
    assert out is model
    assert isinstance(model.layers[1].down, QuantLinear) and isinstance(model.lm_head, nn.Linear)
    with torch.no_grad():
        y = model(x)
    assert ((y - ref).norm() / ref.norm()).item() < 0.03
    with pytest.raises(QuantShapeError):
        quantize_modules(nn.Sequential(nn.Linear(48, 8)), bits=4, group=32)
    shared = nn.Linear(64, 64)
    seq = quantize_modules(nn.Sequential(shared, nn.ReLU(), shared), bits=4, group=64)
    assert seq[0] is seq[2] and isinstance(seq[0], QuantLinear)


# -------------------------------------------------------------------------------- benchmark
def test_benchmark_tiny_smoke():
    report = run_json_module("benchmarks.quant_gemv", "--tiny", "--json", timeout=240)
    assert report["bench"] == "quant_gemv" and report["threads"] == 1
    assert {"isa", "kernel_available", "results"} <= set(report)
    for shape, res in report["results"].items():
        assert {"fp32", "q8", "q4g32", "q4g64", "fallback_q4g32"} <= set(res), shape
        for stats in res.values():
            assert {"median_us", "min_us", "max_us", "runs_us"} <= set(stats)
            assert stats["min_us"] <= stats["median_us"] <= stats["max_us"]
        assert "speedup" in res["q8"]
