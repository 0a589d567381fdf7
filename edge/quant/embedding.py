"""Token embeddings kept in their quantized form: a lookup dequantizes only the rows it reads.

A GGUF file stores ``token_embd`` quantized (Q6_K, Q4_K, Q8_0, ...). Dequantized once to float32
it costs 4 bytes per value (Llama 3.2 1B's 128256 x 2048 table: 1 GiB), and when the head is
tied to it (Llama 3.2, Qwen2.5: no ``output.weight``) it becomes a float32 LM head that reads all
of that every decode step, more than every quantized layer together. llama.cpp keeps the table
in the file's type for both uses; so do these modules:

* ``GGMLEmbedding`` (ggml blocks, ``edge.quant.ggml``) and ``QuantEmbedding`` (Q8_0 / Q4_0 as
  ``edge.quant.formats`` packs them) hold the file's bytes; ``forward(ids)`` gathers the rows of
  ``ids`` and dequantizes those alone (one row per decoded token);
* :meth:`tied_head` gives the LM head, or a tensor-parallel rank's rows of it, as a
  ``GGMLLinear`` / ``QuantLinear`` over a view of the same rows: the weights are in memory once
  and the head is the quantized matmul.

The output dtype follows the model's (``model.to(dtype)`` / ``.half()`` move the empty
``dtype_ref`` buffer; the packed bytes never change).
"""

from __future__ import annotations

import torch
from torch import nn

from . import kernel
from .formats import PackedWeight, QuantShapeError, QuantSpec, dequantize
from .ggml import GGMLWeight, dequantize_ggml
from .linear import GGMLLinear, QuantLinear, keep_fp16_scales

__all__ = ["GGMLEmbedding", "QuantEmbedding", "PackedEmbedding", "packed_embedding"]


class _RowsEmbedding(nn.Module):
    """What both packed tables share: ids -> rows, output dtype, the tied head's row range."""

    dtype_ref: torch.Tensor

    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_embeddings = int(num_embeddings)
        self.embedding_dim = int(embedding_dim)
        # Empty: only its dtype matters, which model-wide casts update like any float buffer.
        self.register_buffer("dtype_ref", torch.empty(0, dtype=dtype), persistent=False)

    def _rows(self, ids: torch.Tensor) -> torch.Tensor:
        """fp32 ``[len(ids), embedding_dim]`` for in-range int64 ``ids``."""
        raise NotImplementedError

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids: (...) token ids -> (..., embedding_dim) in the model's dtype."""
        ids = input_ids.reshape(-1).to(torch.int64)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.num_embeddings):
            raise IndexError(
                f"token id out of range [0, {self.num_embeddings}): "
                f"{int(ids.min())}..{int(ids.max())}"
            )
        x = self._rows(ids).to(self.dtype_ref.dtype)
        return x.view(*input_ids.shape, self.embedding_dim)

    def _head_range(self, start: int, length: int | None) -> tuple[int, int]:
        n = self.num_embeddings - start if length is None else length
        if start < 0 or n < 0 or start + n > self.num_embeddings:
            raise QuantShapeError(
                f"head rows [{start}, {start + n}) out of range for {self.num_embeddings} tokens"
            )
        return start, n


class GGMLEmbedding(_RowsEmbedding):
    """A ``[V, H]`` table of ggml blocks (``blocks``: ``uint8 [V, H / qk * size]``, the file's
    bytes), dequantized row by row on lookup (the C++ decoders when the kernel is loaded)."""

    blocks: torch.Tensor

    def __init__(
        self, weight: GGMLWeight, dtype: torch.dtype = torch.float32, *, use_kernel: bool = True
    ) -> None:
        super().__init__(*weight.shape, dtype)
        self.qtype = weight.type  # not "type": that is nn.Module.type()
        self.use_kernel = bool(use_kernel)
        self.register_buffer("blocks", weight.data.contiguous())

    @property
    def weight_blocks(self) -> GGMLWeight:
        return GGMLWeight(self.qtype, (self.num_embeddings, self.embedding_dim), self.blocks)

    def dequantize_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_ggml(self.weight_blocks, dtype)

    def _rows(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.blocks.index_select(0, ids.to(self.blocks.device))
        w = GGMLWeight(self.qtype, (ids.numel(), self.embedding_dim), rows)
        return kernel.ggml_dequantize(w, force_fallback=not self.use_kernel)

    def tied_head(self, start: int = 0, length: int | None = None) -> GGMLLinear:
        """The LM head's rows ``start:start+length`` (default: all) over these blocks (a view)."""
        a, n = self._head_range(start, length)
        return GGMLLinear(
            GGMLWeight(self.qtype, (n, self.embedding_dim), self.blocks[a : a + n]),
            use_kernel=self.use_kernel,
        )

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, type={self.qtype.name}"


class QuantEmbedding(_RowsEmbedding):
    """A ``[V, H]`` table as Q8 / Q4 groups (``qweight``, fp16 ``scales``; see ``formats``)."""

    qweight: torch.Tensor
    scales: torch.Tensor

    def __init__(self, packed: PackedWeight, dtype: torch.dtype = torch.float32) -> None:
        super().__init__(*packed.spec.shape, dtype)
        self.bits, self.group = packed.spec.bits, packed.spec.group
        self.register_buffer("qweight", packed.qweight.contiguous())
        self.register_buffer("scales", packed.scales.contiguous())

    @property
    def packed(self) -> PackedWeight:
        spec = QuantSpec(self.bits, self.group, (self.num_embeddings, self.embedding_dim))
        return PackedWeight(spec, self.qweight, self.scales)

    def dequantize_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize(self.packed, dtype=dtype)

    def _rows(self, ids: torch.Tensor) -> torch.Tensor:
        ids = ids.to(self.qweight.device)
        spec = QuantSpec(self.bits, self.group, (ids.numel(), self.embedding_dim))
        return dequantize(spec, self.qweight.index_select(0, ids), self.scales.index_select(0, ids))

    def tied_head(self, start: int = 0, length: int | None = None) -> QuantLinear:
        """The LM head's rows ``start:start+length`` (default: all) over these groups (a view)."""
        a, n = self._head_range(start, length)
        spec = QuantSpec(self.bits, self.group, (n, self.embedding_dim))
        return QuantLinear.from_packed(
            PackedWeight(spec, self.qweight[a : a + n], self.scales[a : a + n])
        )

    def _apply(self, fn, recurse: bool = True):
        return keep_fp16_scales(self, lambda: super(QuantEmbedding, self)._apply(fn, recurse))

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, bits={self.bits}, group={self.group}"


PackedEmbedding = GGMLEmbedding | QuantEmbedding


def packed_embedding(w: GGMLWeight | PackedWeight, dtype: torch.dtype) -> PackedEmbedding:
    """The embedding module for a quantized table as read from a file."""
    return GGMLEmbedding(w, dtype) if isinstance(w, GGMLWeight) else QuantEmbedding(w, dtype)
