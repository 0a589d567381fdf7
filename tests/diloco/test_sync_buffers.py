"""A fragment sync's buffers: the sum Σ_m x_m is written into x's own buffer (``out=``), so a
worker holds one float32 buffer per fragment sync, not two (its 24 B/param: θ_m, gradient,
AdamW's moments, θ_g, outer momentum; ``benchmarks.diloco_memory`` measures the bytes)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from diloco.config import DilocoConfig
from diloco.task import lm_task
from diloco.trainer import DilocoWorker
from tests.conftest import rank_outcomes
from tests.diloco.configs import small_lm
from transport.loopback import LoopbackGroup

pytestmark = pytest.mark.timeout(120)


class _Recording:
    """A communicator that records every fragment sum: (input, out, result) storage pointers."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.sums: list[tuple[int, int | None, int]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def all_reduce_async(self, tensor: torch.Tensor, op: Any = "sum", **kw: Any) -> Any:
        work = self._inner.all_reduce_async(tensor, op, **kw)
        if str(kw.get("tag", "")).endswith("/sum"):
            out = kw.get("out")
            self.sums.append(
                (tensor.data_ptr(), None if out is None else out.data_ptr(), work.wait().data_ptr())
            )
        return work


@pytest.mark.parametrize("codec", ["int8", "fp32"])
def test_each_fragment_sum_lands_in_its_contribution_buffer(codec):
    mode = DilocoConfig(inner_steps=4, n_fragments=2, tau=1, codec=codec)
    cfg = small_lm(mode=mode, workers=2, steps=8)
    task = lm_task(cfg)
    comms = [_Recording(c) for c in LoopbackGroup(2, timeout=30).comms()]
    workers = [DilocoWorker(cfg, c, task) for c in comms]  # type: ignore[arg-type]
    results, errors = rank_outcomes([w.run for w in workers], 100.0)
    assert errors == [None, None]
    assert results[0].state_hash == results[1].state_hash
    for c in comms:
        assert len(c.sums) == 4  # 8 steps, H = 4, P = 2: two syncs per fragment
        for x, out, result in c.sums:
            assert out == x and result == x
