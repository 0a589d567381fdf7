"""``edge.quant.embedding``: a packed token table gives the dequantized rows of the ids it is
asked for (kernel and PyTorch decoders alike), follows model-wide dtype casts without touching
its bytes, refuses ids outside the vocabulary, and its tied head is a view of its rows."""

from __future__ import annotations

import pytest
import torch

from edge.quant import QuantShapeError, kernel, quantize
from edge.quant.embedding import GGMLEmbedding, QuantEmbedding
from edge.quant.ggml import dequantize_ggml
from tests.edge.test_ggml_quant import weight

pytestmark = pytest.mark.timeout(600)  # may build the C++ extension first

IDS = torch.tensor([[3, 0, 17, 3], [39, 8, 8, 1]])


def _tables() -> list[tuple[GGMLEmbedding | QuantEmbedding, torch.Tensor]]:
    g = weight("Q6_K", 40, 512, seed=1, scale=1e-4)
    q = quantize(torch.randn(40, 64, generator=torch.Generator().manual_seed(0)), 4, 32)
    return [
        (GGMLEmbedding(g), dequantize_ggml(g)),
        (QuantEmbedding(q), QuantEmbedding(q).dequantize_weight()),
    ]


@pytest.mark.parametrize("native", [True, False])
def test_lookup_is_the_dequantized_rows(native) -> None:
    saved = kernel.get_config()
    kernel.configure(enabled=native)
    try:
        for emb, full in _tables():
            got = emb(IDS)
            assert got.shape == (2, 4, full.shape[1]) and got.dtype == torch.float32
            torch.testing.assert_close(got, full[IDS], rtol=1e-6, atol=0)
    finally:
        kernel.configure(enabled=saved.enabled)


def test_dtype_casts_and_bounds() -> None:
    for emb, full in _tables():
        raw = [b.clone() for b in emb.buffers() if b.numel()]
        emb.to(torch.bfloat16)
        assert emb(IDS).dtype == torch.bfloat16
        assert all(torch.equal(a, b) for a, b in zip(raw, [b for b in emb.buffers() if b.numel()]))
        assert "dtype_ref" not in emb.state_dict()
        for bad in (torch.tensor([40]), torch.tensor([-1])):
            with pytest.raises(IndexError, match="out of range"):
                emb(bad)


def test_tied_head_is_a_view_of_the_rows() -> None:
    for emb, full in _tables():
        head = emb.tied_head(8, 16)
        assert (head.out_features, head.in_features) == (16, full.shape[1])
        name = "blocks" if isinstance(emb, GGMLEmbedding) else "qweight"
        buf, hbuf = getattr(emb, name), getattr(head, name)
        assert hbuf.data_ptr() == buf[8].data_ptr()
        torch.testing.assert_close(head.dequantize_weight(), full[8:24])
        assert emb.tied_head().out_features == 40
        with pytest.raises(QuantShapeError, match="out of range"):
            emb.tied_head(30, 16)
