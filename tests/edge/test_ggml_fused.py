"""The fused K-quant kernels (csrc/ggml_kernels.h: Q2_K..Q6_K unpacked in registers, one row at
a time for one activation row, a weight row at a time against tiles of 8 activation rows up to
128 rows, weight x activation row blocks beyond).

* an activation row gives the same bits whether it is alone in a call or one of many, at shapes
  that cross the kernels' tiles (32 weight rows x 8 activation rows) on both many-row routes
  (19 rows: row by row; 131 rows: blocks): the compiled step's
  batched == single-step identity rests on this;
* at those shapes the kernel still equals the float64 emulation of its integer semantics
  (``tests/edge/test_ggml_quant.emulate``) to 1e-5 of the sum of |terms|.
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
@pytest.mark.parametrize("m", [19, 131])  # 2 x 8 + 3 rows (decode-batch route), 16 x 8 + 3 (blocks)
def test_rows_alone_equal_rows_in_a_batch(name, m) -> None:
    n, k = 70, 512  # 70 = 2 x 32 + 6 weight rows
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
@pytest.mark.parametrize("m", [1, 9])
def test_tiles_match_emulation(name, m) -> None:
    w = weight(name, 45, 768, seed=6, scale=0.05)
    x = torch.randn(m, 768, generator=torch.Generator().manual_seed(m))
    y = kernel.ggml_gemv(x, w)
    emu, mag = emulate(x, w)
    assert bool((y.double() - emu).abs().le(1e-5 * mag + 1e-7).all())
