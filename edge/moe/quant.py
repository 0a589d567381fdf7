"""Bit-nested ("matryoshka") int8 expert weights, stored as bit-planes most significant first.

Quantization (MWQ, D²MoE §4; MatQuant, Nair et al. 2025)
---------------------------------------------------------
Each expert matrix W (out, in) is quantized asymmetrically per group of ``g`` consecutive input
weights: ``W ≈ lo + step * q`` with ``q ∈ [0, 255]``. A b-bit model is the top b bits of the
same codes, ``q_b = q >> (8 - b)``: lower precisions are nested inside the higher ones and a
b-bit slice is a prefix of the 8 bit-planes. ``lo`` and ``step`` are float16 (``lo`` rounded
down, ``step`` up, so the grid still covers the group after rounding).

Correction. MatQuant slices with rounding, ``round(q / 2^(8-b))``, which needs a carry from the
dropped bits and so is not a prefix. We keep the prefix (floor) and correct in two places:

* reconstruction at the *middle* of the int8 codes that share the prefix,
  ``W_b = lo + step * (k * q_b + (k - 1) / 2)`` with ``k = 2^(8-b)``;
* the int8 grid spans ``e`` times the group's range ``r``, centred (``range_ext``, e). With
  ``e = 1`` the floor bins of a b-bit slice are narrower than a native b-bit quantizer's and
  its levels sit inside the group's range, which shrinks the largest weights: on the model
  trained here the 2-bit slice had 22% lower relative weight error than native min/max 2-bit
  yet 3.6% higher perplexity. With ``e_b = 2^b / (2^b - 1)`` the slice *is* the native b-bit
  min/max quantizer (same bins, same levels; ``tests/edge/moe/test_nested.py``). One grid serves
  every width, so the default ``e = 8/7`` is exact at 3 bits and in between elsewhere: measured
  held-out perplexity within +1.1% (2 bits), -0.0% (3 bits) and +0.1% (4 bits) of native
  quantization (``python -m benchmarks.moe``), for 18% more error at 8 bits (0.52% -> 0.62%
  relative), where it does not matter.

The storage side (bit-planes, page buffers, the expert file format) is :mod:`edge.moe.planes`.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from lowband.errors import ConfigError

WIDTHS = (8, 4, 3, 2)  # the precisions a nested expert can be served at, high to low
DEFAULT_RANGE_EXT = 8 / 7  # e: int8 grid span / group range; 8/7 makes the 3-bit slice native
EXPERT_TENSORS = ("w1", "w2", "w3")


@dataclass(frozen=True, kw_only=True)
class NestedQuantConfig:
    """How expert weights are quantized. ``group_size`` is g, weights per (lo, step) pair."""

    group_size: int = 64
    range_ext: float = DEFAULT_RANGE_EXT  # e, see the module docstring
    layout: str = "planes"  # "bytes": plain int8 codes, for a conventional int8 baseline

    def __post_init__(self) -> None:
        if self.group_size < 8 or self.group_size % 8:
            raise ConfigError(
                "group_size", f"must be a multiple of 8 (>= 8), got {self.group_size}"
            )
        if not 1.0 <= self.range_ext <= 2.0:
            raise ConfigError("range_ext", f"must be in [1, 2], got {self.range_ext}")
        if self.layout not in ("planes", "bytes"):
            raise ConfigError("layout", f"must be 'planes' or 'bytes', got {self.layout!r}")


@dataclass(frozen=True)
class QuantizedMatrix:
    """int8 codes of one matrix: ``codes`` (out, in) uint8; ``lo``/``step`` (out, in/g) float16."""

    codes: torch.Tensor
    lo: torch.Tensor
    step: torch.Tensor

    @property
    def group_size(self) -> int:
        return self.codes.shape[1] // self.lo.shape[1]


def _fp16_down(x: torch.Tensor) -> torch.Tensor:
    h = x.half()
    return torch.where(h.float() > x, torch.nextafter(h, torch.full_like(h, -torch.inf)), h)


def _fp16_up(x: torch.Tensor) -> torch.Tensor:
    h = x.half()
    return torch.where(h.float() < x, torch.nextafter(h, torch.full_like(h, torch.inf)), h)


def _groups(w: torch.Tensor, group_size: int) -> torch.Tensor:
    if w.dim() != 2 or w.shape[1] % group_size:
        raise ConfigError(
            "group_size", f"{group_size} does not divide the input dim of a {tuple(w.shape)} matrix"
        )
    return w.detach().float().reshape(w.shape[0], w.shape[1] // group_size, group_size)


def _minmax_grid(
    w: torch.Tensor, group_size: int, levels: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Native min/max grid: ``levels`` codes from the group minimum to its maximum.
    (codes (out, G, g) uint8, lo float16, step float16)."""
    wg = _groups(w, group_size)
    lo = _fp16_down(wg.amin(-1))
    # 2^-24 is the smallest float16 step: a constant group still gets a valid grid.
    step = _fp16_up(((wg.amax(-1) - lo.float()) / (levels - 1)).clamp_min(2.0**-24))
    q = torch.round((wg - lo.float()[..., None]) / step.float()[..., None])
    return q.clamp_(0, levels - 1).to(torch.uint8), lo, step


def _nested_grid(
    w: torch.Tensor, group_size: int, ext: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """int8 codes as the centres of 256 equal cells tiling ``ext`` x each group's range.

    Cells rather than end points: the 2^(8-b) codes sharing a b-bit prefix then tile exactly
    1/2^b of the span, so b-bit floor bins are equal and their mid-range levels are the centres
    (with ``ext = 2^b/(2^b-1)``, the native b-bit min/max quantizer's bins and levels).
    """
    wg = _groups(w, group_size)
    lo32, hi32 = wg.amin(-1), wg.amax(-1)
    step = _fp16_up(((hi32 - lo32) * (ext / 256)).clamp_min(2.0**-24))
    lo = _fp16_down((hi32 + lo32) / 2 - 127.5 * step.float())
    # Rounding lo down can cost coverage at the top when the range is tiny next to |lo|.
    step = torch.maximum(step, _fp16_up((hi32 - lo.float()) / 255.5))
    q = torch.round((wg - lo.float()[..., None]) / step.float()[..., None])
    return q.clamp_(0, 255).to(torch.uint8), lo, step


def quantize_int8(
    w: torch.Tensor, group_size: int, range_ext: float = DEFAULT_RANGE_EXT
) -> QuantizedMatrix:
    """Per-group asymmetric int8 codes of a 2-D weight, grid over ``range_ext`` x the range."""
    if not 1.0 <= range_ext <= 2.0:
        raise ConfigError("range_ext", f"must be in [1, 2], got {range_ext}")
    q, lo, step = _nested_grid(w, group_size, range_ext)
    return QuantizedMatrix(codes=q.reshape(w.shape), lo=lo, step=step)


def slice_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """The b-bit nested codes: the top ``bits`` bits of the int8 codes."""
    _check_bits(bits)
    return codes >> (8 - bits)


def slice_affine(
    lo: torch.Tensor, step: torch.Tensor, bits: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-group float32 (scale, offset) with ``W_b = offset + scale * q_b`` (mid-range
    correction)."""
    k = 2 ** (8 - bits)
    s = step.float()
    return s * k, lo.float() + s * ((k - 1) / 2)


def dequantize_nested(
    codes_b: torch.Tensor, lo: torch.Tensor, step: torch.Tensor, bits: int, *, scratch: bool = False
) -> torch.Tensor:
    """Float32 weight (out, in) from b-bit nested codes (out, in) and the int8 group parameters.

    ``scratch=True``: into this thread's reusable buffer (see ``planes_to_codes``).
    """
    return apply_affine(codes_b, *slice_affine(lo, step, bits), scratch=scratch)


def apply_affine(
    codes_b: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, *, scratch: bool = False
) -> torch.Tensor:
    """``offset + scale * codes`` per group of consecutive codes: float32 shaped like ``codes_b``
    ((out, in) with (out, in/g) parameters, or flat (N,) with (N/g,) parameters: a whole expert's
    tensors back to back, their groups in the same order)."""
    groups = scale.numel()
    q = work_buffer("weight", codes_b.numel(), torch.float32, scratch).view(groups, -1)
    q.copy_(codes_b.reshape(groups, -1))
    return q.mul_(scale.reshape(groups, 1)).add_(offset.reshape(groups, 1)).view(codes_b.shape)


def quantize_independent(w: torch.Tensor, bits: int, group_size: int) -> torch.Tensor:
    """Baseline: a natively quantized b-bit min/max model (same g, same float16 lo/step),
    dequantized."""
    _check_bits(bits)
    q, lo, step = _minmax_grid(w, group_size, 2**bits)
    return (lo.float()[..., None] + step.float()[..., None] * q.float()).reshape(w.shape)


def _check_bits(bits: int) -> None:
    if not 1 <= bits <= 8:
        raise ConfigError("bits", f"must be in 1..8, got {bits}")


_scratch = threading.local()


def work_buffer(name: str, numel: int, dtype: torch.dtype, reuse: bool) -> torch.Tensor:
    """A (numel,) buffer: fresh, or this thread's reusable one for ``name`` (grown on demand)."""
    if not reuse:
        return torch.empty(numel, dtype=dtype)
    bufs = _scratch.__dict__.setdefault("bufs", {})
    buf = bufs.get(name)
    if buf is None or buf.numel() < numel or buf.dtype != dtype:
        # A normal tensor even when first needed under torch.inference_mode: it is written in
        # place later, maybe outside inference mode, which inference tensors do not allow.
        with torch.inference_mode(False):
            buf = bufs[name] = torch.empty(numel, dtype=dtype)
    return buf[:numel]
