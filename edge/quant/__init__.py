"""lowband.edge.quant: weight-only int8 / 4-bit quantized linear layers for CPU decode.

* ``formats``: llama.cpp-compatible Q8_0 / Q4_0 quantization maths (groups of 32, 64 or 128
  along the input dimension, fp16 scales) and the packed layout (``PackedWeight``).
* ``kernel``: a C++ GEMV kernel (AVX2+FMA, NEON, scalar) compiled on first use with
  ``torch.utils.cpp_extension`` and cached in ``~/.cache/lowband/kernels/<hash>``, with a
  PyTorch fallback when no compiler is available (``kernel.available()``,
  ``kernel.unavailable_reason()``, ``kernel.configure(enabled=False)``).
* ``linear``: ``QuantLinear`` (packed buffers, kernel for few rows, dequantize + matmul for
  prefill, ``narrow_out`` / ``narrow_in`` for tensor-parallel shards) and ``quantize_modules``.

Example::

    from edge.quant import quantize_modules
    quantize_modules(model, bits=4, group=32, skip=("lm_head",))
"""

from . import kernel
from .formats import (
    BITS,
    GROUPS,
    GroupBoundaryError,
    PackedWeight,
    QuantError,
    QuantShapeError,
    QuantSpec,
    UnsupportedBitsError,
    UnsupportedGroupError,
    dequantize,
    narrow,
    quantize,
    quantize_q4,
    quantize_q8,
)
from .kernel import KernelConfig, available, configure, gemv, gemv_fallback, unavailable_reason
from .linear import DEFAULT_MAX_KERNEL_ROWS, QuantLinear, quantize_modules

__all__ = [
    "BITS",
    "GROUPS",
    "DEFAULT_MAX_KERNEL_ROWS",
    "GroupBoundaryError",
    "KernelConfig",
    "PackedWeight",
    "QuantError",
    "QuantLinear",
    "QuantShapeError",
    "QuantSpec",
    "UnsupportedBitsError",
    "UnsupportedGroupError",
    "available",
    "configure",
    "dequantize",
    "gemv",
    "gemv_fallback",
    "kernel",
    "narrow",
    "quantize",
    "quantize_modules",
    "quantize_q4",
    "quantize_q8",
    "unavailable_reason",
]
