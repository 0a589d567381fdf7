"""The fused K-quant kernels (csrc/ggml_kernels.h: Q2_K..Q6_K unpacked in registers, one row at
a time for one activation row, a weight row at a time against tiles of 8 activation rows for a
few rows; beyond that the AVX-512 build's GEMM (16 weight rows per zmm lane group, K tiles of 4
super-blocks) or, on AVX2 alone, weight x activation row blocks).

* an activation row gives the same bits whether it is alone in a call or one of many, at shapes
  that cross every route's tiles (6 rows: Q6_K's GEMM, row tiles for the others; 9 rows: row
  tiles; 19 and 131 rows: the GEMM, or on AVX2 row tiles and blocks; 70 weight rows = 4 x 16 + 6;
  K = 5 super-blocks = a K tile and a tail): the compiled step's batched == single-step
  identity rests on this;
* at those shapes the kernel still equals the float64 emulation of its integer semantics
  (``tests/edge/test_ggml_quant.emulate``) to 1e-5 of the sum of |terms|.

The AVX2-only routes an AVX-512 build does not take are checked by ``selftest.cpp`` built with
``-mavx2`` (``tests/edge/test_quant.py::test_cpp_selftest_all_paths``).
"""

from __future__ import annotations

import pytest
import torch

from edge.quant import kernel
from tests.edge.test_ggml_quant import emulate, weight

pytestmark = pytest.mark.timeout(600)  # the first test may build the extension (minutes here)

K_TYPES = ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]


@pytest.fixture(autouse=True)
def _needs_kernel():
    if not kernel.available():
        pytest.skip(f"C++ kernel unavailable: {kernel.unavailable_reason()}")


@pytest.mark.parametrize("name", K_TYPES)
@pytest.mark.parametrize("m", [6, 9, 19, 131])
def test_rows_alone_equal_rows_in_a_batch(name, m) -> None:
    n, k = 70, 1280  # 70 = 4 x 16 + 6 = 2 x 32 + 6 weight rows; 5 super-blocks
    w = weight(name, n, k, seed=4, scale=0.02)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(5))
    x[3] = 0.0  # an all-zero row (every activation scale 0)
    many = kernel.ggml_gemv(x, w)
    for i in range(m):
        alone = kernel.ggml_gemv(x[i : i + 1].contiguous(), w)
        assert torch.equal(alone[0], many[i]), (name, i)
    assert torch.equal(many[3], torch.zeros(n))
    for start, count in ((0, 2), (5, 8), (2, m - 2)):  # partial and whole tiles, other offsets
        got = kernel.ggml_gemv(x[start : start + count].contiguous(), w)
        assert torch.equal(got, many[start : start + count])


@pytest.mark.parametrize("name", K_TYPES)
@pytest.mark.parametrize("m", [1, 9, 19])
def test_tiles_match_emulation(name, m) -> None:
    w = weight(name, 45, 768, seed=6, scale=0.05)
    x = torch.randn(m, 768, generator=torch.Generator().manual_seed(m))
    y = kernel.ggml_gemv(x, w)
    emu, mag = emulate(x, w)
    assert bool((y.double() - emu).abs().le(1e-5 * mag + 1e-7).all())


@pytest.mark.parametrize("k", [640, 672])
@pytest.mark.parametrize("m", [2, 5, 8, 19])
def test_q5_0_rows_alone_equal_rows_in_a_batch(k, m) -> None:
    """Q5_0 (the 32-value blocks llama.cpp falls back to where K is not a multiple of 256):
    up to 4 activation rows at a time below 8 rows, the AVX-512 GEMM from 8; two blocks per
    zmm, so K of 20 blocks (pairs only) and 21 (an odd last block). Every row keeps the bits
    it gets alone, and the kernel equals the emulation."""
    w = weight("Q5_0", 37, k, seed=9, scale=0.05)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(10))
    x[1] = 0.0
    many = kernel.ggml_gemv(x, w)
    for i in range(m):
        alone = kernel.ggml_gemv(x[i : i + 1].contiguous(), w)
        assert torch.equal(alone[0], many[i]), (k, m, i)
    assert torch.equal(many[1], torch.zeros(37))
    emu, mag = emulate(x, w)
    assert bool((many.double() - emu).abs().le(1e-5 * mag + 1e-7).all())
