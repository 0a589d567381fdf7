"""llama.cpp's block formats kept packed as in the GGUF file (pure PyTorch maths, no I/O).

``GGMLWeight`` holds a ``[N, K]`` matrix as ``uint8 [N, K / QK * type_size]``: row ``n`` is the
row's blocks back to back, byte for byte what ``ggml`` stores. Types (``QK`` values per block,
bytes per block; every value is ``w = a * q + b`` with ``a, b`` constant over 16 values):

=======  ====  =====  ====================================================================
type     QK    bytes  block layout (fp16 ``d``/``dmin``/``m``; ``q`` the integer in ``w``)
=======  ====  =====  ====================================================================
Q4_1     32    20     d, m, qs[16] (nibbles: lo = value j, hi = j+16); w = d*q + m
Q5_0     32    22     d, qh[4] (bit j = 5th bit of value j), qs[16]; w = d*(q - 16)
Q5_1     32    24     d, m, qh[4], qs[16]; w = d*q + m
Q2_K     256   84     scales[16] (lo: sc, hi: mn), qs[64], d, dmin; w = d*sc*q - dmin*mn
Q3_K     256   110    hmask[32], qs[64], scales[12] (6-bit, -32), d; w = d*sc*(q - 4*!hbit)
Q4_K     256   144    d, dmin, scales[12] (6-bit sc/mn per 32), qs[128]; w = d*sc*q - dmin*mn
Q5_K     256   176    d, dmin, scales[12], qh[32], qs[128]; as Q4_K with a 5th bit
Q6_K     256   210    ql[128], qh[64], scales[16] (int8), d; w = d*sc*(q - 32)
=======  ====  =====  ====================================================================

Bit positions follow ``dequantize_row_*`` in ggml's ``ggml-quants.c``. :func:`decode` returns
the integers ``q`` and the per-16 ``a, b`` (the same split the C++ kernel uses,
``csrc/ggml_kernels.h``), :func:`dequantize_ggml` the fp32 matrix. Because a block never
straddles a row, slicing output rows is a plain row slice; slicing input columns must fall on
block boundaries (:func:`narrow_ggml`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .formats import GroupBoundaryError, QuantShapeError, check_slice

__all__ = ["GGML_TYPES", "GGMLType", "GGMLWeight", "decode", "dequantize_ggml", "narrow_ggml"]


@dataclass(frozen=True)
class GGMLType:
    """One block format: ``name`` (as ``gguf.GGMLQuantizationType``), ``type_id`` (its number in
    ggml, also the C++ kernel's selector), ``qk`` values per block, ``size`` bytes per block."""

    name: str
    type_id: int
    qk: int
    size: int


GGML_TYPES: dict[str, GGMLType] = {
    t.name: t
    for t in (
        GGMLType("Q4_1", 3, 32, 20),
        GGMLType("Q5_0", 6, 32, 22),
        GGMLType("Q5_1", 7, 32, 24),
        GGMLType("Q2_K", 10, 256, 84),
        GGMLType("Q3_K", 11, 256, 110),
        GGMLType("Q4_K", 12, 256, 144),
        GGMLType("Q5_K", 13, 256, 176),
        GGMLType("Q6_K", 14, 256, 210),
    )
}


def ggml_type(name: str) -> GGMLType:
    t = GGML_TYPES.get(name)
    if t is None:
        raise QuantShapeError(f"ggml type {name!r} is not one of {', '.join(GGML_TYPES)}")
    return t


@dataclass(frozen=True, eq=False)
class GGMLWeight:
    """A ``[N, K]`` weight as ggml blocks: ``data`` is ``uint8 [N, K // qk * size]``."""

    type: GGMLType
    shape: tuple[int, int]
    data: torch.Tensor

    def __post_init__(self) -> None:
        n, k = (int(s) for s in self.shape)
        object.__setattr__(self, "shape", (n, k))
        if n < 0 or k < 0 or k % self.type.qk:
            raise QuantShapeError(
                f"{self.type.name} needs in_features a multiple of {self.type.qk}, got {self.shape}"
            )
        want = (n, self.row_bytes)
        if self.data.dtype != torch.uint8 or tuple(self.data.shape) != want:
            raise QuantShapeError(
                f"{self.type.name} data must be uint8 {want} for shape {self.shape}, "
                f"got {self.data.dtype} {tuple(self.data.shape)}"
            )

    @property
    def row_bytes(self) -> int:
        return self.shape[1] // self.type.qk * self.type.size

    @property
    def bits_per_weight(self) -> float:
        return 8.0 * self.type.size / self.type.qk


def _f16(b: torch.Tensor, at: int) -> torch.Tensor:
    """fp16 field at byte ``at`` of each block ``b [nb, size]`` -> fp32 ``[nb, 1]``."""
    return b[:, at : at + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """``[nb, c, 32]`` bytes -> ``[nb, c, 64]``: 32 low nibbles then 32 high nibbles."""
    return torch.cat((qs & 0x0F, qs >> 4), dim=-1)


def _bits(h: torch.Tensor, n: int) -> torch.Tensor:
    """``[nb, L]`` bytes -> ``[nb, n, L]`` with ``[:, i, l]`` = bit ``i`` of ``h[:, l]``."""
    shifts = torch.arange(n, dtype=torch.uint8).view(1, n, 1)
    return (h.unsqueeze(1) >> shifts) & 1


def _scale_min_k4(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K ``scales[12]`` -> 8 six-bit scales and mins (``get_scale_min_k4``)."""
    s = s.to(torch.int32)
    lo, hi, mix = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = torch.cat((lo & 63, (mix & 0x0F) | ((lo >> 6) << 4)), dim=1)
    mn = torch.cat((hi & 63, (mix >> 4) | ((hi >> 6) << 4)), dim=1)
    return sc.float(), mn.float()


def _q32(b: torch.Tensor, *, five: bool, with_min: bool):
    off = 4 if with_min else 2
    qh = None
    if five:
        qh = b[:, off : off + 4].to(torch.int64)
        qh = qh[:, 0] | (qh[:, 1] << 8) | (qh[:, 2] << 16) | (qh[:, 3] << 24)
        off += 4
    q = _nibbles(b[:, off : off + 16].unsqueeze(1)).reshape(-1, 32).to(torch.int32)
    if qh is not None:
        hb = (qh.unsqueeze(1) >> torch.arange(32).unsqueeze(0)) & 1
        q = q | (hb.to(torch.int32) << 4)
    d = _f16(b, 0)
    if with_min:
        return q, d.expand(-1, 2), _f16(b, 2).expand(-1, 2)
    return q - 16 if five else q, d.expand(-1, 2), torch.zeros_like(d).expand(-1, 2)


def _q2k(b: torch.Tensor):
    sc = b[:, 0:16]
    qs = b[:, 16:80].view(-1, 2, 1, 32)  # halves of 128 values
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(1, 1, 4, 1)
    q = ((qs >> shifts) & 3).reshape(-1, 256).to(torch.int32)
    d, dmin = _f16(b, 80), _f16(b, 82)
    return q, d * (sc & 0x0F).float(), -(dmin * (sc >> 4).float())


def _q3k(b: torch.Tensor):
    hmask, qs, s = b[:, 0:32], b[:, 32:96].view(-1, 2, 1, 32), b[:, 96:108].to(torch.int32)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(1, 1, 4, 1)
    low = ((qs >> shifts) & 3).reshape(-1, 256).to(torch.int32)
    hbit = _bits(hmask, 8).reshape(-1, 256).to(torch.int32)  # value 32*i + l: bit i of hmask[l]
    q = low - 4 * (1 - hbit)
    idx = torch.arange(16)
    lo4 = torch.where(idx < 8, s[:, idx % 8] & 0x0F, s[:, idx % 8] >> 4)
    hi2 = (s[:, 8 + idx % 4] >> (2 * (idx // 4))) & 3
    scale = (lo4 | (hi2 << 4)) - 32
    return q, _f16(b, 108) * scale.float(), torch.zeros(b.shape[0], 16)


def _q45k(b: torch.Tensor, five: bool):
    sc, mn = _scale_min_k4(b[:, 4:16])
    off = 48 if five else 16
    q = _nibbles(b[:, off : off + 128].view(-1, 4, 32)).reshape(-1, 256).to(torch.int32)
    if five:
        q = q | (_bits(b[:, 16:48], 8).reshape(-1, 256).to(torch.int32) << 4)
    d, dmin = _f16(b, 0), _f16(b, 2)
    a, c = d * sc, -(dmin * mn)  # per 32 values
    return q, a.repeat_interleave(2, dim=1), c.repeat_interleave(2, dim=1)


def _q6k(b: torch.Tensor):
    ql, qh = b[:, 0:128].view(-1, 2, 2, 32), b[:, 128:192].view(-1, 2, 1, 32)
    low = torch.cat((ql & 0x0F, ql >> 4), dim=2)  # [nb, half, 4, 32]: ql[l], ql[l+32], >>4 ...
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(1, 1, 4, 1)
    high = (qh >> shifts) & 3
    q = (low.to(torch.int32) | (high.to(torch.int32) << 4)).reshape(-1, 256) - 32
    sc = b[:, 192:208].contiguous().view(torch.int8).float()
    return q, _f16(b, 208) * sc, torch.zeros(b.shape[0], 16)


def decode(t: GGMLType, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``blocks uint8 [nb, size]`` -> ``(q int32 [nb, qk], a fp32 [nb, qk/16], b fp32 [nb,
    qk/16])`` with value ``i`` of a block ``= a[i // 16] * q[i] + b[i // 16]``."""
    if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] != t.size:
        raise QuantShapeError(f"{t.name} blocks must be uint8 [nb, {t.size}]")
    b = blocks.contiguous()
    if t.name == "Q4_1":
        return _q32(b, five=False, with_min=True)
    if t.name == "Q5_0":
        return _q32(b, five=True, with_min=False)
    if t.name == "Q5_1":
        return _q32(b, five=True, with_min=True)
    if t.name == "Q2_K":
        return _q2k(b)
    if t.name == "Q3_K":
        return _q3k(b)
    if t.name in ("Q4_K", "Q5_K"):
        return _q45k(b, five=t.name == "Q5_K")
    return _q6k(b)


def dequantize_ggml(w: GGMLWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The ``[N, K]`` matrix the blocks represent (fp32 maths, as ``dequantize_row_*``)."""
    n, k = w.shape
    if n * k == 0:
        return torch.zeros(n, k, dtype=dtype)
    q, a, b = decode(w.type, w.data.reshape(-1, w.type.size))
    v = a.unsqueeze(-1) * q.float().view(q.shape[0], -1, 16) + b.unsqueeze(-1)
    return v.reshape(n, k).to(dtype)


def narrow_ggml(w: GGMLWeight, dim: int, start: int, length: int) -> GGMLWeight:
    """Rows ``start:start+length`` (``dim=0``) or columns in whole blocks (``dim=1``; else
    ``GroupBoundaryError``), without touching the blocks."""
    n, k = w.shape
    check_slice(w.shape, dim, start, length)
    if dim == 0:
        return GGMLWeight(w.type, (length, k), w.data[start : start + length].contiguous())
    qk, sz = w.type.qk, w.type.size
    if start % qk or length % qk:
        raise GroupBoundaryError(
            f"column slice [{start}, {start + length}) cuts a {w.type.name} block of {qk} "
            f"values; column splits must be multiples of {qk}"
        )
    cols = w.data[:, start // qk * sz : (start + length) // qk * sz]
    return GGMLWeight(w.type, (n, length), cols.contiguous())
