"""Where and how a worker computes: device, autocast, optimizer kernels, staging to the host.

The trainers stay device-agnostic: they ask this module for the resolved ``torch.device``, an
autocast context and an optimizer built with fused/foreach kernels; :class:`diloco.staging.
HostStaging` moves an outer-step payload between the device and the host buffers the transport
reads.

Precision (``ComputeConfig.precision``): parameters, inner optimizer moments, θ_g and the outer
optimizer state are float32 ("master weights"); only the forward/backward runs under
``torch.autocast`` in bf16 or fp16. fp16 adds a gradient scaler (its range is too small for raw
gradients); bf16 has fp32's range and needs none.

CUDA path (``device.type == "cuda"``): the pseudo-gradient is computed (and, with error feedback,
quantized) on the device, copied into a pinned host buffer on a side stream and handed to the
transport once that copy's event completes; inner steps keep running on the main stream while
the transport sends (the τ overlap). The averaged result comes back the same way, and the main
stream waits on the side stream's event before the outer step reads it. That is
:class:`diloco.staging.HostStaging`; on the CPU every one of these is the
identity: the tensor already lives where the transport reads it.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
from typing import ContextManager

import torch
from torch import nn

from lowband.errors import ConfigError

logger = logging.getLogger(__name__)

AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def resolve_device(spec: str) -> torch.device:
    """``auto`` → the first CUDA device if there is one, else the CPU; ``cuda:N`` must exist."""
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(spec)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(
                "compute.device",
                f"{spec!r} asked for, but torch sees no CUDA "
                "device (a CPU build of torch, or no GPU): use --device cpu",
            )
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ConfigError(
                "compute.device", f"{spec!r}: only {torch.cuda.device_count()} CUDA device(s)"
            )
    elif dev.type != "cpu":
        raise ConfigError("compute.device", f"must be auto, cpu, cuda or cuda:N, got {spec!r}")
    return dev


def autocast(device: torch.device, precision: str) -> ContextManager:
    """The forward/backward context: ``torch.autocast`` for bf16/fp16, nothing for fp32."""
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=AUTOCAST_DTYPES[precision])


def grad_scaler(device: torch.device, precision: str) -> torch.amp.GradScaler | None:
    """A loss scaler for fp16 only (bf16 and fp32 gradients do not underflow)."""
    if precision != "fp16":
        return None
    return torch.amp.GradScaler(device.type)


_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter (malloc.h)
HEAP_MMAP_THRESHOLD = 128 * 1024
"""Bytes from which a host allocation gets its own mapping, returned to the OS when freed."""


def limit_heap_retention() -> bool:
    """Make glibc return a freed tensor's memory to the OS at once (process-wide; the
    launchers call it once per worker process, before the model is built).

    By default glibc raises its mmap threshold to the size of the largest block freed so far
    (up to 32 MiB), after which every tensor up to that size comes from the heap, and freed heap
    is kept: a 50 M-parameter CPU worker's resident set grew by ~2 B/param at each sync round
    (gradients, Δ, decoded sums of different sizes fragmenting the heap) to ~9 B/param above
    what it held. A fixed threshold keeps every tensor above it in its own mapping. The cost is
    page faults on re-allocation (the gradients of each step). False where the C library is
    not glibc (nothing to do)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, HEAP_MMAP_THRESHOLD))
    except (OSError, AttributeError):
        return False


def optimizer_kernels(name: str, device: torch.device, impl: str) -> dict[str, bool]:
    """Keyword arguments selecting torch's optimizer implementation.

    ``auto``: fused on CUDA (one kernel for all parameters); on the CPU fused for Adam(W), whose
    foreach kernels hold a full-model temporary (``sqrt(v)``, 4 B/param) at every step, the
    largest transient of a worker's peak memory, and foreach for SGD (one ``torch._foreach_*``
    call per operation over all parameters, Nesterov in place on the gradients); ``fused`` /
    ``foreach`` / ``loop`` force one."""
    if name not in ("adamw", "adam", "sgd"):
        return {}
    if impl == "auto":
        if device.type == "cuda" or name in ("adamw", "adam"):
            return {"fused": True}
        return {"foreach": True}
    if impl == "fused":
        return {"fused": True}
    if impl == "foreach":
        return {"foreach": True}
    return {"foreach": False}


def compiles(compile: bool | None, device: torch.device) -> bool:
    """Whether the inner step runs compiled: ``None`` (the default) means on CUDA,
    where it fuses the elementwise work between the matrix products, and off on the CPU, where
    compiling costs more than a short run gains."""
    return device.type == "cuda" if compile is None else compile


def enable_checkpointing(model: nn.Module) -> None:
    """Recompute each decoder block's activations in backward instead of storing them.

    Hugging Face models have their own switch; lowband's Llama (and any model with a
    ``layers`` ModuleList of blocks) gets each block's forward wrapped in
    ``torch.utils.checkpoint`` (non-reentrant, so keyword arguments and no-grad inputs work).
    """
    enable = getattr(model, "gradient_checkpointing_enable", None)  # a Hugging Face model
    if enable is not None:
        enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return
    blocks = [
        m
        for name, m in model.named_modules()
        if isinstance(m, nn.ModuleList) and name.split(".")[-1] == "layers"
    ]
    if not blocks:
        raise ConfigError(
            "compute.activation_checkpointing",
            f"{type(model).__name__} has no `layers` ModuleList of blocks to wrap",
        )
    for block in blocks[0]:
        block.forward = _checkpointed(block.forward)


def _checkpointed(forward):
    from torch.utils.checkpoint import checkpoint

    def run(*args, **kwargs):
        if not torch.is_grad_enabled():  # eval / generation: nothing to save memory on
            return forward(*args, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return run


def model_device(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")
