"""``QuantLinear``: an inference-only ``nn.Linear`` with Q8/Q4 packed weights.

The packed tensors are registered buffers (``qweight``, ``scales``, optional ``bias``), so
``state_dict()`` / ``load_state_dict()`` and safetensors work as for any module.  A model-wide
dtype cast (``model.half()``) leaves ``qweight`` and the fp16 ``scales`` untouched.
"""

from __future__ import annotations

import fnmatch
from typing import Callable, Iterable

import torch
import torch.nn as nn

from . import kernel
from .formats import (
    GroupBoundaryError,
    PackedWeight,
    QuantShapeError,
    QuantSpec,
    dequantize,
    narrow,
    quantize,
)
from .ggml import GGMLWeight, dequantize_ggml, ggml_type, narrow_ggml

__all__ = [
    "GGMLLinear",
    "QuantLinear",
    "quantize_modules",
    "repack_for_batches",
    "DEFAULT_MAX_KERNEL_ROWS",
]

# Rows (tokens) up to which forward() uses the GEMV kernel; above it, blockwise dequantize +
# F.linear (a BLAS GEMM).  Measured at 1 thread (AVX2+VNNI): ``benchmarks/quant_gemv.py
# --prefill``: the kernel beat dequantize+matmul at every M in 1..128 (2-50x) and still matched
# or beat even a plain fp32 GEMM at M=512 (2048x5632: Q8 107 ms vs 109-117 ms, Q4 76 ms vs
# 110-122 ms); the fused K-quant kernels on Llama-3.2-1B's Q4_K_M layers beat dequantize+matmul
# at M = 264, 512 and 1024 by 1.15-1.5x (Q4_K 2048x2048 at 1024 rows: 81.5 vs 94.1 ms; Q6_K
# 2048x8192: 388 vs 542 ms).  1024 keeps a prefill chunk (256) plus a decode batch on the kernel.
DEFAULT_MAX_KERNEL_ROWS = 1024


def _linear(
    x: torch.Tensor,
    in_features: int,
    out_features: int,
    bias: torch.Tensor | None,
    matmul: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """The forward of both quantized linears: ``x`` of shape ``(..., in_features)`` flattened to
    rows for ``matmul`` (rows -> float32 outputs, bias added), the result back in ``x``'s dtype
    and leading shape. A layer with no rows or no columns (a TP rank that holds no heads of it:
    GQA with fewer KV heads than devices) answers a zero (or empty) partial sum plus the bias."""
    if x.shape[-1] != in_features:
        raise QuantShapeError(f"expected last dim {in_features}, got {tuple(x.shape)}")
    lead = x.shape[:-1]
    if in_features == 0 or out_features == 0:
        y = torch.zeros(*lead, out_features, dtype=torch.float32, device=x.device)
        if bias is not None:
            y += bias
        return y.to(x.dtype)
    y = matmul(x.reshape(-1, in_features))
    return y.to(x.dtype).reshape(*lead, out_features)


def keep_fp16_scales(module: nn.Module, apply: Callable[[], nn.Module]) -> nn.Module:
    """Run ``apply`` (a module's ``_apply``) keeping ``module.scales`` fp16. Module.half() and
    .to(dtype) cast every floating buffer, but the fp16 scales are part of the packed format:
    only device moves apply to them."""
    scales = module.scales
    assert isinstance(scales, torch.Tensor)
    out = apply()
    now = module.scales
    assert isinstance(now, torch.Tensor)
    if now.dtype != torch.float16:
        module.scales = scales.to(device=now.device)
    return out


class QuantLinear(nn.Module):
    """``y = x @ dequant(W)^T + b`` with ``W`` stored as Q8 or Q4 groups (see ``formats``).

    Args:
        in_features, out_features, bias: as ``nn.Linear``.
        bits: 8 or 4.  group: 32, 64 or 128 (``in_features`` must be a multiple).
        max_kernel_rows: inputs with at most this many rows (product of leading dims) use the
            C++ GEMV kernel; larger ones dequantize per call and use ``F.linear``.
        use_kernel: ``False`` forces the PyTorch path for this module.
    """

    qweight: torch.Tensor
    scales: torch.Tensor
    bias: torch.Tensor | None

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        bits: int = 8,
        group: int = 32,
        *,
        max_kernel_rows: int = DEFAULT_MAX_KERNEL_ROWS,
        use_kernel: bool = True,
    ) -> None:
        super().__init__()
        self.spec = QuantSpec(bits, group, (out_features, in_features))
        self.in_features = in_features
        self.out_features = out_features
        self.bits = bits
        self.group = group
        self.max_kernel_rows = int(max_kernel_rows)
        self.use_kernel = bool(use_kernel)
        self.register_buffer(
            "qweight", torch.zeros(self.spec.qweight_shape, dtype=self.spec.qweight_dtype)
        )
        self.register_buffer("scales", torch.zeros(self.spec.scales_shape, dtype=torch.float16))
        self.register_buffer("bias", torch.zeros(out_features) if bias else None)

    # -- construction ------------------------------------------------------------------------
    @classmethod
    def from_packed(
        cls, packed: PackedWeight, bias: torch.Tensor | None = None, **kwargs
    ) -> "QuantLinear":
        """Wrap an already packed weight (no requantization)."""
        n, k = packed.spec.shape
        m = cls(k, n, bias is not None, packed.spec.bits, packed.spec.group, **kwargs)
        m.qweight = packed.qweight.contiguous()
        m.scales = packed.scales.contiguous()
        if bias is not None:
            if tuple(bias.shape) != (n,):
                raise QuantShapeError(f"bias must have shape ({n},), got {tuple(bias.shape)}")
            m.bias = bias.detach().to(torch.float32).contiguous()
        return m

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, bits: int = 8, group: int = 32, **kwargs
    ) -> "QuantLinear":
        """Quantize an ``nn.Linear`` (its weight is not modified)."""
        packed = quantize(linear.weight, bits, group)
        return cls.from_packed(packed, linear.bias, **kwargs)

    @property
    def packed(self) -> PackedWeight:
        return PackedWeight(
            QuantSpec(self.bits, self.group, (self.out_features, self.in_features)),
            self.qweight,
            self.scales,
        )

    def dequantize_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The ``[out_features, in_features]`` weight this module represents."""
        return dequantize(self.packed, dtype=dtype)

    # -- forward -----------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _linear(x, self.in_features, self.out_features, self.bias, self._matmul)

    def _matmul(self, x2: torch.Tensor) -> torch.Tensor:
        use = self.use_kernel and x2.shape[0] <= self.max_kernel_rows
        return kernel.gemv(
            x2, self.qweight, self.scales, self.bits, self.group, self.bias, force_fallback=not use
        )

    # -- sharding ----------------------------------------------------------------------------
    def _like(self, packed: PackedWeight, bias: torch.Tensor | None) -> "QuantLinear":
        return QuantLinear.from_packed(
            packed, bias, max_kernel_rows=self.max_kernel_rows, use_kernel=self.use_kernel
        )

    def narrow_out(self, start: int, length: int) -> "QuantLinear":
        """Output rows ``start:start+length`` (column-parallel shard), bias sliced alike."""
        p = narrow(self.packed, 0, start, length)
        b = None if self.bias is None else self.bias[start : start + length].contiguous()
        return self._like(p, b)

    def narrow_in(self, start: int, length: int, keep_bias: bool = False) -> "QuantLinear":
        """Input columns ``start:start+length`` (row-parallel shard), in whole groups.

        Raises ``GroupBoundaryError`` unless ``start`` and ``length`` are multiples of ``group``.
        The shard's outputs are partial sums, so the bias is dropped unless ``keep_bias`` (add it
        once, after summing the shards).
        """
        if start % self.group or length % self.group:
            raise GroupBoundaryError(
                f"narrow_in({start}, {length}): column splits of a {self.bits}-bit weight must be "
                f"multiples of its group size {self.group}"
            )
        p = narrow(self.packed, 1, start, length)
        return self._like(p, self.bias.clone() if (keep_bias and self.bias is not None) else None)

    # -- housekeeping ------------------------------------------------------------------------
    def _apply(self, fn, recurse: bool = True):
        return keep_fp16_scales(self, lambda: super(QuantLinear, self)._apply(fn, recurse))

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, bits={self.bits}, group={self.group}"
        )


class GGMLLinear(nn.Module):
    """``y = x @ W^T + b`` with ``W`` kept as llama.cpp blocks exactly as in the GGUF file
    (Q4_1, Q5_0, Q5_1, Q2_K .. Q6_K; see ``ggml``), never dequantized as a whole.

    Buffers: ``blocks`` (``uint8 [N, K / qk * size]``) and optional fp32 ``bias``.  ``group`` is
    the block size (32 or 256): tensor-parallel column splits must be multiples of it.  Inputs
    with at most ``max_kernel_rows`` rows use the C++ kernel; larger ones dequantize ~1 MB of rows
    at a time (with the C++ decoders when the kernel is loaded) and use ``F.linear``.
    """

    blocks: torch.Tensor
    bias: torch.Tensor | None

    def __init__(
        self,
        weight: GGMLWeight,
        bias: torch.Tensor | None = None,
        *,
        max_kernel_rows: int = DEFAULT_MAX_KERNEL_ROWS,
        use_kernel: bool = True,
    ) -> None:
        super().__init__()
        self.qtype = weight.type  # not "type": that is nn.Module.type()
        self.out_features, self.in_features = weight.shape
        self.group = weight.type.qk
        self.max_kernel_rows = int(max_kernel_rows)
        self.use_kernel = bool(use_kernel)
        self.register_buffer("blocks", weight.data.contiguous())
        if bias is not None and tuple(bias.shape) != (self.out_features,):
            raise QuantShapeError(
                f"bias must have shape ({self.out_features},), got {tuple(bias.shape)}"
            )
        b = None if bias is None else bias.detach().to(torch.float32).contiguous()
        self.register_buffer("bias", b)
        # the batch GEMM's layout of the blocks (repack()); not state: rebuilt after a load
        self.packed: torch.Tensor | None = None
        # split-K: leaves of this many input values, each computed on its own and added in a
        # fixed tree (kernel.split_k_sum); 0: none. Set on row-parallel layers so that one
        # device adds what tensor-parallel ranks add (edge/tp.py, "Bit-exact TP").
        self.k_chunk = 0

    @classmethod
    def from_blocks(cls, type_name: str, shape: tuple[int, int], data: torch.Tensor, **kw):
        """Wrap raw block bytes ``uint8 [N, row_bytes]`` of ggml type ``type_name``."""
        return cls(GGMLWeight(ggml_type(type_name), shape, data), **kw)

    @property
    def weight_blocks(self) -> GGMLWeight:
        return GGMLWeight(self.qtype, (self.out_features, self.in_features), self.blocks)

    def dequantize_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_ggml(self.weight_blocks, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _linear(x, self.in_features, self.out_features, self.bias, self._matmul)

    def split_k(self, chunk: int) -> None:
        """Compute in split-K leaves of ``chunk`` input values (0: not split): whole blocks
        that cut ``in_features`` into a power of two of leaves (else ``QuantShapeError``).
        Drops a repacked layout (:meth:`repack` again: the leaves have their own)."""
        k = self.in_features
        n = k // chunk if chunk > 0 else 0
        if chunk and (chunk % self.group or k % chunk or n & (n - 1)):
            raise QuantShapeError(
                f"split-K chunk {chunk} must be whole blocks of {self.group} and cut "
                f"K={k} into a power of two of leaves"
            )
        self.k_chunk = chunk if 0 < chunk < k else 0
        self.packed = None

    def packed_bytes(self) -> int:
        """What :meth:`repack` would add (0: nothing to repack here)."""
        return kernel.ggml_packed_bytes(self.weight_blocks) if self.use_kernel else 0

    def repack(self) -> int:
        """Keep a copy of the weight in the batch GEMM's layout (``kernel.ggml_pack``), so
        batches of rows skip the unpack: the same outputs, more memory. Returns the bytes
        added (0 where this build or type has no such layout). Split-K leaves are laid out
        one after the other (the same bytes as the whole weight's layout)."""
        if not self.use_kernel:
            packed = None
        elif self.k_chunk:
            c, w = self.k_chunk, self.weight_blocks
            leaves = [kernel.ggml_pack(narrow_ggml(w, 1, a, c)) for a in range(0, w.shape[1], c)]
            packed = (
                None
                if any(p is None for p in leaves)
                else torch.cat([p for p in leaves if p is not None])
            )
        else:
            packed = kernel.ggml_pack(self.weight_blocks)
        self.packed = packed
        return 0 if packed is None else packed.numel()

    def _matmul(self, x2: torch.Tensor) -> torch.Tensor:
        w, c = self.weight_blocks, self.k_chunk
        if self.use_kernel and x2.shape[0] <= self.max_kernel_rows:
            return kernel.ggml_gemv(x2, w, self.bias, packed=self.packed, chunk=c)
        # prefill (or use_kernel=False: the PyTorch reference decoder)
        return kernel.ggml_gemv_fallback(x2, w, self.bias, native_dequant=self.use_kernel, chunk=c)

    def _like(self, w: GGMLWeight, bias: torch.Tensor | None) -> "GGMLLinear":
        return GGMLLinear(w, bias, max_kernel_rows=self.max_kernel_rows, use_kernel=self.use_kernel)

    def narrow_out(self, start: int, length: int) -> "GGMLLinear":
        """Output rows ``start:start+length`` (column-parallel shard): a plain row slice (its
        split-K leaves kept)."""
        b = None if self.bias is None else self.bias[start : start + length].contiguous()
        out = self._like(narrow_ggml(self.weight_blocks, 0, start, length), b)
        out.k_chunk = self.k_chunk
        return out

    def narrow_in(self, start: int, length: int, keep_bias: bool = False) -> "GGMLLinear":
        """Input columns in whole blocks (row-parallel shard; else ``GroupBoundaryError``);
        the bias is dropped unless ``keep_bias`` (partial sums get it once, after the sum).
        A slice that is a whole subtree of the split-K tree (an aligned power of two of
        leaves) keeps the leaves, so it computes that subtree's bits; any other runs unsplit."""
        w = narrow_ggml(self.weight_blocks, 1, start, length)
        keep = keep_bias and self.bias is not None
        out = self._like(w, self.bias.clone() if keep else None)  # type: ignore[union-attr]
        c = self.k_chunk
        n = length // c if c else 0
        if c and length % c == 0 and n and not n & (n - 1) and start % (n * c) == 0:
            out.k_chunk = c if n > 1 else 0
        return out

    def extra_repr(self) -> str:
        split = f", k_chunk={self.k_chunk}" if self.k_chunk else ""
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, type={self.qtype.name}{split}"
        )


def _matches(name: str, patterns: Iterable[str]) -> bool:
    last = name.rsplit(".", 1)[-1]
    return any(fnmatch.fnmatchcase(name, p) or fnmatch.fnmatchcase(last, p) for p in patterns)


def quantize_modules(
    model: nn.Module,
    bits: int = 8,
    group: int = 32,
    skip: Iterable[str] = (),
    **kwargs,
) -> nn.Module:
    """Replace every ``nn.Linear`` in ``model`` (in place) by a ``QuantLinear``; returns ``model``.

    ``skip``: fnmatch patterns matched against each Linear's qualified name
    (``"model.layers.0.mlp"`` style) and its last component, e.g. ``skip=("lm_head",)`` or
    ``("*.down_proj",)``.
    A Linear whose ``in_features`` is not a multiple of ``group`` raises ``QuantShapeError``
    (skip it by name).  ``kwargs`` go to ``QuantLinear`` (``max_kernel_rows``, ``use_kernel``).
    """
    skip = tuple(skip)
    if type(model) is nn.Linear:
        raise TypeError(
            "quantize_modules replaces children; wrap a bare nn.Linear with QuantLinear.from_linear"
        )
    targets = [
        (name, mod)
        for name, mod in model.named_modules(remove_duplicate=False)
        if type(mod) is nn.Linear and not _matches(name, skip)
    ]
    for name, mod in targets:
        if mod.in_features % group:
            raise QuantShapeError(
                f"{name}: in_features={mod.in_features} is not a multiple of group={group}; "
                f"add it to skip="
            )
    done: dict[int, QuantLinear] = {}  # a Linear shared under several names is quantized once
    for name, mod in targets:
        q = done.get(id(mod))
        if q is None:
            q = done[id(mod)] = QuantLinear.from_linear(mod, bits, group, **kwargs)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, q)
    return model


def repack_for_batches(model: nn.Module, budget_bytes: int) -> int:
    """:meth:`GGMLLinear.repack` every ggml linear of ``model`` if all the copies together fit
    ``budget_bytes`` (all or none: a server's memory use should not depend on module order);
    returns the bytes added."""
    mods = [m for m in model.modules() if isinstance(m, GGMLLinear)]
    need = sum(m.packed_bytes() for m in mods)
    if need == 0 or need > budget_bytes:
        return 0
    return sum(m.repack() for m in mods)
