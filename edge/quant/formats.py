"""Weight-only quantization formats: Q8/Q4 maths and the packed layout (pure PyTorch, no I/O;
the checkpoint directories that store packed weights are ``edge.formats.quantized_checkpoint``).

Two formats, both per output row, grouped along the input dimension K:

``Q8`` (``bits=8``), llama.cpp ``Q8_0`` semantics per group of ``G`` (default 32) values::

    d = max(|x|) / 127            (computed in fp32, stored as fp16)
    q = roundf(x * (1/d))         (round half away from zero; 0 when d == 0), int8 in [-127, 127]
    x' = q * fp16(d)

``Q4`` (``bits=4``), llama.cpp ``Q4_0`` semantics per group of ``G`` in {32, 64, 128}::

    m = the value with the largest |x| (first one on ties), d = m / -8   (stored as fp16)
    q = min(15, floor(x * (1/d) + 8.5))   (0 when d == 0 gives q = 8), in [0, 15]
    x' = (q - 8) * fp16(d)

With ``G=32`` this reproduces ``quantize_row_q4_0_ref`` / ``dequantize_row_q4_0`` bit for bit
(the scale is computed in fp32 and used unrounded for quantizing, then stored as fp16).

Storage (``PackedWeight``; all tensors contiguous, row-major):

* ``qweight``: Q8 -> ``int8 [N, K]``; Q4 -> ``uint8 [N, K // 2]``.
* ``scales``: ``float16 [N, K // G]``; ``scales[n, g]`` belongs to columns ``g*G .. g*G+G-1``.

Q4 byte layout: group ``g`` of row ``n`` occupies bytes ``qweight[n, g*G/2 : (g+1)*G/2]``.
Byte ``j`` (``0 <= j < G/2``) of a group holds element ``g*G + j`` in its low nibble and element
``g*G + G/2 + j`` in its high nibble (``byte = q[j] | q[j + G/2] << 4``).  For ``G=32`` this is
exactly llama.cpp's ``block_q4_0.qs``; the fp16 scales are kept in a separate array rather than
interleaved (``block_q4_0.d``).  Because a group never straddles a byte outside its own range,
slicing whole groups of columns is a plain byte slice (see ``narrow``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lowband.errors import LowbandError

__all__ = [
    "BITS",
    "GROUPS",
    "QuantError",
    "UnsupportedBitsError",
    "UnsupportedGroupError",
    "QuantShapeError",
    "GroupBoundaryError",
    "QuantSpec",
    "PackedWeight",
    "check_spec",
    "quantize",
    "quantize_q8",
    "quantize_q4",
    "dequantize",
    "narrow",
]

BITS = (4, 8)
GROUPS = (32, 64, 128)


class QuantError(LowbandError, ValueError):
    """Base class for invalid quantization parameters or inputs (a ``ValueError`` too, as the
    argument checks of PyTorch and NumPy raise)."""


class UnsupportedBitsError(QuantError):
    """``bits`` is not 4 or 8."""


class UnsupportedGroupError(QuantError):
    """``group`` is not one of 32, 64, 128."""


class QuantShapeError(QuantError):
    """A weight/tensor shape does not fit the format (not 2-D, K not a multiple of the group...)."""


class GroupBoundaryError(QuantShapeError):
    """A column slice of a packed weight does not start and end on group boundaries."""


def check_spec(bits: int, group: int) -> None:
    """Raise ``UnsupportedBitsError`` / ``UnsupportedGroupError`` unless the pair is supported."""
    if isinstance(bits, bool) or bits not in BITS:
        raise UnsupportedBitsError(f"bits must be one of {BITS}, got {bits!r}")
    if isinstance(group, bool) or group not in GROUPS:
        raise UnsupportedGroupError(f"group must be one of {GROUPS}, got {group!r}")


@dataclass(frozen=True)
class QuantSpec:
    """What a packed weight is: ``bits`` (4/8), ``group`` (G) and the logical ``shape`` (N, K)."""

    bits: int
    group: int
    shape: tuple[int, int]

    def __post_init__(self) -> None:
        check_spec(self.bits, self.group)
        if len(self.shape) != 2 or any(int(s) < 0 for s in self.shape):
            raise QuantShapeError(f"shape must be (out_features, in_features), got {self.shape!r}")
        object.__setattr__(self, "shape", (int(self.shape[0]), int(self.shape[1])))
        if self.shape[1] % self.group:
            raise QuantShapeError(
                f"in_features={self.shape[1]} is not a multiple of group={self.group}"
            )

    @property
    def out_features(self) -> int:
        return self.shape[0]

    @property
    def in_features(self) -> int:
        return self.shape[1]

    @property
    def n_groups(self) -> int:
        """Groups per row (``K // G``)."""
        return self.shape[1] // self.group

    @property
    def qweight_shape(self) -> tuple[int, int]:
        n, k = self.shape
        return (n, k) if self.bits == 8 else (n, k // 2)

    @property
    def qweight_dtype(self) -> torch.dtype:
        return torch.int8 if self.bits == 8 else torch.uint8

    @property
    def scales_shape(self) -> tuple[int, int]:
        return (self.shape[0], self.n_groups)

    @property
    def nbytes(self) -> int:
        """Bytes of ``qweight`` plus ``scales``."""
        qn, qk = self.qweight_shape
        return qn * qk + 2 * self.shape[0] * self.n_groups


@dataclass(frozen=True, eq=False)
class PackedWeight:
    """A quantized ``[N, K]`` weight: ``spec`` plus ``qweight`` and ``scales`` (layout above)."""

    spec: QuantSpec
    qweight: torch.Tensor
    scales: torch.Tensor

    def __post_init__(self) -> None:
        validate_packed(self.spec, self.qweight, self.scales)


def validate_packed(spec: QuantSpec, qweight: torch.Tensor, scales: torch.Tensor) -> None:
    """Raise ``QuantShapeError`` unless ``qweight``/``scales`` match ``spec`` in shape and dtype."""
    if tuple(qweight.shape) != spec.qweight_shape or qweight.dtype != spec.qweight_dtype:
        raise QuantShapeError(
            f"qweight must be {spec.qweight_dtype} {spec.qweight_shape} for {spec}, "
            f"got {qweight.dtype} {tuple(qweight.shape)}"
        )
    if tuple(scales.shape) != spec.scales_shape or scales.dtype != torch.float16:
        raise QuantShapeError(
            f"scales must be float16 {spec.scales_shape} for {spec}, "
            f"got {scales.dtype} {tuple(scales.shape)}"
        )


def _grouped(w: torch.Tensor, group: int) -> torch.Tensor:
    """Validate a 2-D finite weight and view it as fp32 ``[N, K//G, G]``."""
    if not isinstance(w, torch.Tensor):
        raise QuantShapeError(f"weight must be a torch.Tensor, got {type(w).__name__}")
    if w.dim() != 2:
        raise QuantShapeError(
            f"weight must be 2-D [out_features, in_features], got {tuple(w.shape)}"
        )
    if not (w.is_floating_point()):
        raise QuantShapeError(f"weight must be floating point, got {w.dtype}")
    n, k = w.shape
    if k % group:
        raise QuantShapeError(f"in_features={k} is not a multiple of group={group}")
    w = w.detach().to(device="cpu", dtype=torch.float32).contiguous()
    if not bool(torch.isfinite(w).all()):
        raise QuantError("weight contains NaN or Inf")
    return w.view(n, k // group, group)


def _roundf(v: torch.Tensor) -> torch.Tensor:
    """C ``roundf``: nearest, halves away from zero (``torch.round`` rounds halves to even)."""
    t = torch.trunc(v)
    frac = v - t  # exact in fp32
    return t + torch.where(frac.abs() >= 0.5, torch.sign(v), torch.zeros_like(v))


def quantize_q8(w: torch.Tensor, group: int = 32) -> PackedWeight:
    """Quantize ``w [N, K]`` to Q8 (llama.cpp ``Q8_0`` per group of ``group``)."""
    check_spec(8, group)
    g = _grouped(w, group)
    amax = g.abs().amax(dim=-1, keepdim=True)
    d = amax / 127.0
    inv = torch.where(d != 0, 1.0 / torch.where(d != 0, d, torch.ones_like(d)), torch.zeros_like(d))
    q = _roundf(g * inv).clamp_(-127, 127).to(torch.int8)
    n, k = w.shape
    return PackedWeight(
        QuantSpec(8, group, (n, k)),
        q.reshape(n, k).contiguous(),
        d.squeeze(-1).to(torch.float16).contiguous(),
    )


def quantize_q4(w: torch.Tensor, group: int = 32) -> PackedWeight:
    """Quantize ``w [N, K]`` to Q4 (llama.cpp ``Q4_0`` per group of ``group``), two per byte."""
    check_spec(4, group)
    g = _grouped(w, group)
    idx = g.abs().argmax(dim=-1, keepdim=True)  # first maximal |x|, like llama.cpp's strict '<'
    mx = torch.gather(g, -1, idx)
    d = mx / -8.0
    inv = torch.where(d != 0, 1.0 / torch.where(d != 0, d, torch.ones_like(d)), torch.zeros_like(d))
    q = torch.floor(g * inv + 8.5).clamp_(0, 15).to(torch.uint8)  # (int8_t)(x0 + 8.5f), min 15
    half = group // 2
    packed = q[..., :half] | (q[..., half:] << 4)
    n, k = w.shape
    return PackedWeight(
        QuantSpec(4, group, (n, k)),
        packed.reshape(n, k // 2).contiguous(),
        d.squeeze(-1).to(torch.float16).contiguous(),
    )


def quantize(w: torch.Tensor, bits: int, group: int = 32) -> PackedWeight:
    """``quantize_q8`` or ``quantize_q4`` by ``bits``."""
    check_spec(bits, group)
    return quantize_q8(w, group) if bits == 8 else quantize_q4(w, group)


def unpack_q4(qweight: torch.Tensor, group: int) -> torch.Tensor:
    """``uint8 [N, K/2]`` packed nibbles -> ``uint8 [N, K]`` values 0..15 (the packing undone)."""
    n, kh = qweight.shape
    b = qweight.view(n, (2 * kh) // group, group // 2)
    return torch.cat((b & 0x0F, b >> 4), dim=-1).view(n, 2 * kh)


def dequantize(
    packed: PackedWeight | QuantSpec,
    qweight: torch.Tensor | None = None,
    scales: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The ``[N, K]`` weight that the packed form represents.

    Call as ``dequantize(packed)`` or ``dequantize(spec, qweight, scales)``.
    """
    if isinstance(packed, PackedWeight):
        spec, qweight, scales = packed.spec, packed.qweight, packed.scales
    else:
        spec = packed
        if qweight is None or scales is None:
            raise QuantError("dequantize(spec, qweight, scales) needs qweight and scales")
        validate_packed(spec, qweight, scales)
    n, k = spec.shape
    G = spec.group
    if spec.bits == 8:
        q = qweight.to(torch.float32)
    else:
        q = unpack_q4(qweight, G).to(torch.float32) - 8.0
    w = q.view(n, k // G, G) * scales.to(torch.float32).unsqueeze(-1)
    return w.view(n, k).to(dtype)


def check_slice(shape: tuple[int, int], dim: int, start: int, length: int) -> None:
    """Refuse (``QuantShapeError``) a ``dim`` other than 0 (rows) or 1 (columns), or a slice
    ``[start, start + length)`` outside that dimension of ``shape``."""
    if dim not in (0, 1):
        raise QuantShapeError(f"dim must be 0 (rows) or 1 (columns), got {dim}")
    size = shape[dim]
    if start < 0 or length < 0 or start + length > size:
        raise QuantShapeError(f"slice [{start}, {start + length}) out of range for size {size}")


def narrow(packed: PackedWeight, dim: int, start: int, length: int) -> PackedWeight:
    """Slice a packed weight without requantizing.

    ``dim=0`` takes output rows ``start:start+length``; ``dim=1`` takes input columns, which must
    begin and end on group boundaries (else ``GroupBoundaryError``).
    """
    spec = packed.spec
    n, k = spec.shape
    check_slice(spec.shape, dim, start, length)
    if dim == 0:
        return PackedWeight(
            QuantSpec(spec.bits, spec.group, (length, k)),
            packed.qweight[start : start + length].contiguous(),
            packed.scales[start : start + length].contiguous(),
        )
    G = spec.group
    if start % G or length % G:
        raise GroupBoundaryError(
            f"column slice [{start}, {start + length}) does not fall on group boundaries "
            f"(group={G}); choose a split that is a multiple of {G}"
        )
    per = 1 if spec.bits == 8 else 2  # values per byte
    return PackedWeight(
        QuantSpec(spec.bits, G, (n, length)),
        packed.qweight[:, start // per : (start + length) // per].contiguous(),
        packed.scales[:, start // G : (start + length) // G].contiguous(),
    )
