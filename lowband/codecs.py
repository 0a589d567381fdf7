"""Wire codecs: how a float tensor is encoded for the network.

The caller owns the codec and hands it to a collective (``comm.all_reduce(x, codec=...)``); the
transport only moves the frames. Every codec decodes to float32 so reductions accumulate in
float32 whatever the wire precision.

Block-scaled codecs split the flattened tensor into blocks of ``block`` elements and store one
float32 scale per block (the block's absolute maximum mapped to the top of the code range). The
tail block is zero-padded. Bits per element on the wire = code bits + 32 / block.

Every codec is pure torch: a tensor is encoded and decoded on its own device (the frames live
there too), with no host synchronisation, so a worker computes its error-feedback residual
x − Q(x) on the GPU. The transport encodes host tensors with the same code; the bytes are the
same on either device (IEEE division and round-half-even on both).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch

from lowband.comm import Codec, Encoded
from lowband.errors import ConfigError, ProtocolError

__all__ = [
    "Fp32Codec",
    "Fp16Codec",
    "Bf16Codec",
    "Int8BlockCodec",
    "FourBitCodec",
    "CODEBOOKS",
    "get_codec",
    "codec_names",
]


def _shape_meta(t: torch.Tensor) -> dict:
    return {"shape": list(t.shape)}


@dataclass(frozen=True)
class _CastCodec:
    """Sends the tensor cast to ``wire_dtype``; decodes back to float32."""

    name: str
    wire_dtype: torch.dtype

    def encode(self, tensor: torch.Tensor) -> Encoded:
        frame = tensor.detach().to(self.wire_dtype).contiguous()
        return Encoded(frames=(frame,), meta=_shape_meta(tensor))

    def decode(self, encoded: Encoded) -> torch.Tensor:
        (frame,) = encoded.frames
        return frame.to(torch.float32).reshape(encoded.meta["shape"])


def Fp32Codec() -> Codec:  # noqa: N802 - reads like a class at call sites
    return _CastCodec("fp32", torch.float32)


def Fp16Codec() -> Codec:  # noqa: N802
    return _CastCodec("fp16", torch.float16)


def Bf16Codec() -> Codec:  # noqa: N802
    return _CastCodec("bf16", torch.bfloat16)


# Elements per chunk of an encode or decode: the float32 temporaries of a block codec are one
# chunk (4 MiB), not the whole tensor. A fragment of a 270 M model is ~100 M elements; encoding
# it at once held two float32 copies of it (and the 4-bit codes' int64 indices), ~12 bytes per
# element on top of the fragment itself. Results do not depend on the chunking (every operation
# is per element or per block). 1 Mi elements rather than 4: the temporaries were ~1.3 B/param
# of a 50 M-parameter worker's peak, and the smaller chunks stay in cache (int8 encode+decode of
# 25 M elements 0.29 -> 0.24 s, nf4 2.06 -> 1.08 s, one core).
_CHUNK = 1 << 20


def _block_chunks(tensor: torch.Tensor, block: int) -> Iterator[tuple[int, torch.Tensor]]:
    """(first block, (k, block) float32 blocks) over ``tensor`` flattened, ``_CHUNK`` elements
    at a time; a float32 tensor's chunks are views, only the zero-padded tail is a copy."""
    flat = tensor.detach().reshape(-1)
    n = flat.numel()
    step = max(1, _CHUNK // block) * block
    for start in range(0, n, step):
        part = flat[start : start + step].to(torch.float32)
        pad = (-part.numel()) % block
        if pad:
            part = torch.cat([part, part.new_zeros(pad)])
        yield start // block, part.view(-1, block)


def _absmax_scales(blocks: torch.Tensor, top: float) -> torch.Tensor:
    """Per-block scale mapping the block's absmax onto ``top``; empty blocks get scale 1."""
    amax = blocks.abs().amax(dim=1)
    # Divide by a tensor, not a Python float: CUDA turns division by a host scalar into a product
    # with its (rounded) reciprocal, which is one ulp off the CPU's quotient for 127; a device
    # tensor divisor keeps IEEE division, so both devices write the same wire bytes.
    scale = amax / torch.full_like(amax, top)
    return torch.where(scale > 0, scale, torch.ones_like(scale))


# Largest tensor a decoder will produce from one peer's payload (elements). The real bound is the
# payload itself (checked below); this only keeps a forged shape from overflowing the arithmetic.
_MAX_NUMEL = 1 << 40


def _checked_layout(
    encoded: Encoded, block: int, codes: torch.Tensor, codes_per_elem: int
) -> tuple[list[int], int, int]:
    """``(shape, numel, n_blocks)`` of a received payload, checked against its frames before
    anything is allocated: the peer's metadata is untrusted, and a block size or shape that the
    frames do not carry would otherwise make decode allocate what the peer claims."""
    meta = encoded.meta
    raw_shape, raw_block = meta.get("shape"), meta.get("block")
    if not isinstance(raw_shape, (list, tuple)) or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in raw_shape
    ):
        raise ProtocolError(
            f"codec payload: shape must be a list of non-negative ints, got {raw_shape!r}"
        )
    if raw_block != block:
        raise ProtocolError(f"codec payload: block {raw_block!r}, this codec decodes block {block}")
    numel = math.prod(raw_shape)
    if numel > _MAX_NUMEL:
        raise ProtocolError(f"codec payload: shape {raw_shape} has too many elements")
    n_blocks = -(-numel // block)
    scale = encoded.frames[1]
    if codes.numel() * codes_per_elem != n_blocks * block or scale.numel() != n_blocks:
        raise ProtocolError(
            f"codec payload: {codes.numel()} code bytes and {scale.numel()} scales do not carry "
            f"shape {raw_shape} in blocks of {block}"
        )
    return list(raw_shape), numel, n_blocks


@dataclass(frozen=True)
class Int8BlockCodec:
    """Symmetric int8 with one float32 absmax scale per block (8 + 32/block bits per element)."""

    block: int = 256
    name: str = field(default="int8", init=False)

    def __post_init__(self) -> None:
        if self.block < 1:
            raise ConfigError("block", f"must be >= 1, got {self.block}")

    def encode(self, tensor: torch.Tensor) -> Encoded:
        n_blocks = -(-tensor.numel() // self.block)
        q = torch.empty(n_blocks * self.block, dtype=torch.int8, device=tensor.device)
        scale = torch.empty(n_blocks, dtype=torch.float32, device=tensor.device)
        codes = q.view(-1, self.block)
        for first, blocks in _block_chunks(tensor, self.block):
            k = blocks.shape[0]
            s = scale[first : first + k]
            s.copy_(_absmax_scales(blocks, 127.0))
            scaled = blocks / s[:, None]  # the one float32 temporary: one chunk
            codes[first : first + k].copy_(scaled.round_().clamp_(-127, 127))
        meta = {"shape": list(tensor.shape), "block": self.block}
        return Encoded(frames=(q, scale), meta=meta)

    def decode(self, encoded: Encoded) -> torch.Tensor:
        if len(encoded.frames) != 2:
            raise ProtocolError(f"int8 payload: 2 frames expected, got {len(encoded.frames)}")
        q, scale = encoded.frames
        block = self.block
        shape, numel, _ = _checked_layout(encoded, block, q, 1)
        out = q.to(torch.float32).view(-1, block)
        out.mul_(scale.to(torch.float32)[:, None])  # in place: the output is the one copy
        return out.reshape(-1)[:numel].reshape(shape)

    def decode_add_(self, encoded: Encoded, out: torch.Tensor) -> None:
        """``out += decode(encoded)`` in place, its float32 temporaries one chunk instead of a
        decoded copy of the whole tensor (a sum of n contributions holds one tensor, not two).
        The same two roundings per element as the unchunked form, so the same bits."""
        self._decode_chunks(encoded, out, add=True)

    def decode_into(self, encoded: Encoded, out: torch.Tensor) -> None:
        """``out[:] = decode(encoded)`` chunk by chunk: an all-reduce's result written into the
        caller's buffer (``out=``) without a decoded copy of the whole tensor. Same bits."""
        self._decode_chunks(encoded, out, add=False)

    def _decode_chunks(self, encoded: Encoded, out: torch.Tensor, *, add: bool) -> None:
        if len(encoded.frames) != 2:
            raise ProtocolError(f"int8 payload: 2 frames expected, got {len(encoded.frames)}")
        q, scale = encoded.frames
        block = self.block
        _, numel, _ = _checked_layout(encoded, block, q, 1)
        flat = out.view(-1)
        if flat.numel() != numel or out.dtype != torch.float32:
            raise ProtocolError(
                f"int8 payload of {numel} elements decoded into {tuple(out.shape)} {out.dtype}"
            )
        step = max(1, _CHUNK // block) * block
        for start in range(0, numel, step):
            end = min(numel, start + step)
            first, k = start // block, -(-(end - start) // block)
            part = q[start : start + k * block].to(torch.float32).view(k, block)
            part.mul_(scale[first : first + k].to(torch.float32)[:, None])
            dst = flat[start:end]
            if add:
                dst.add_(part.view(-1)[: end - start])
            else:
                dst.copy_(part.view(-1)[: end - start])


# 4-bit code books, normalised so the largest magnitude is 1.0. Values are facts from the
# formats' definitions: E2M1 is the OCP MX FP4 element type; NF4 is the QLoRA normal-float grid
# (Dettmers et al., 2023); E3M0 is sign + 3-bit exponent, no mantissa (powers of two).
_E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
CODEBOOKS: dict[str, list[float]] = {
    "e2m1": sorted({s * v / 6.0 for v in _E2M1 for s in (-1.0, 1.0)}),
    "nf4": [
        -1.0,
        -0.6961928009986877,
        -0.5250730514526367,
        -0.39491748809814453,
        -0.28444138169288635,
        -0.18477343022823334,
        -0.09105003625154495,
        0.0,
        0.07958029955625534,
        0.16093020141124725,
        0.24611230194568634,
        0.33791524171829224,
        0.44070982933044434,
        0.5626170039176941,
        0.7229568362236023,
        1.0,
    ],
    "e3m0": sorted({0.0} | {s * 2.0**-e for e in range(7) for s in (-1.0, 1.0)}),
}


@functools.cache
def _codebook(kind: str, device: torch.device) -> torch.Tensor:
    """The code book as a float32 tensor on ``device``, built once per (kind, device): encoding
    a device tensor then needs no host-to-device copy (a synchronising one from pageable memory)
    on every call."""
    book = torch.tensor(CODEBOOKS[kind], dtype=torch.float32)
    if device.type == "cpu":
        return book
    return book.pin_memory().to(device, non_blocking=True)


@dataclass(frozen=True)
class FourBitCodec:
    """4-bit codes from a 16-entry code book, one float32 absmax scale per block.

    Two codes are packed per byte (low nibble first). Rounding is to the nearest code-book value.
    """

    kind: str = "e2m1"
    block: int = 128
    name: str = field(default="", init=False)

    def __post_init__(self) -> None:
        if self.kind not in CODEBOOKS:
            raise ConfigError(
                "kind", f"unknown 4-bit format {self.kind!r}; one of {sorted(CODEBOOKS)}"
            )
        if self.block < 2 or self.block % 2:
            raise ConfigError("block", f"must be an even number >= 2, got {self.block}")
        object.__setattr__(self, "name", {"e2m1": "fp4", "nf4": "nf4", "e3m0": "e3m0"}[self.kind])

    def encode(self, tensor: torch.Tensor) -> Encoded:
        book = _codebook(self.kind, tensor.device)
        mids = (book[1:] + book[:-1]) / 2
        n_blocks = -(-tensor.numel() // self.block)
        packed = torch.empty(n_blocks * self.block // 2, dtype=torch.uint8, device=tensor.device)
        scale = torch.empty(n_blocks, dtype=torch.float32, device=tensor.device)
        half = self.block // 2  # bytes per block
        for first, blocks in _block_chunks(tensor, self.block):
            k = blocks.shape[0]
            s = scale[first : first + k]
            s.copy_(_absmax_scales(blocks, 1.0))
            normed = (blocks / s[:, None]).reshape(-1)
            idx = torch.bucketize(normed, mids).to(torch.uint8)
            packed[first * half : (first + k) * half] = idx[0::2] | (idx[1::2] << 4)
        meta = {"shape": list(tensor.shape), "block": self.block, "kind": self.kind}
        return Encoded(frames=(packed, scale), meta=meta)

    def decode(self, encoded: Encoded) -> torch.Tensor:
        if len(encoded.frames) != 2:
            raise ProtocolError(f"4-bit payload: 2 frames expected, got {len(encoded.frames)}")
        packed, scale = encoded.frames
        if encoded.meta.get("kind") != self.kind:
            kind = encoded.meta.get("kind")
            raise ProtocolError(f"4-bit payload of kind {kind!r}, this codec decodes {self.kind!r}")
        book = _codebook(self.kind, packed.device)
        block = self.block
        shape, numel, n_blocks = _checked_layout(encoded, block, packed, 2)
        out = torch.empty(n_blocks, block, dtype=torch.float32, device=packed.device)
        scale = scale.to(torch.float32)
        half, step = block // 2, max(1, _CHUNK // block)
        for first in range(0, n_blocks, step):  # the int64 indices: one chunk at a time
            k = min(step, n_blocks - first)
            codes = packed[first * half : (first + k) * half]
            idx = torch.stack([codes & 0x0F, codes >> 4], dim=1).reshape(-1).long()
            chunk = out[first : first + k]
            torch.index_select(book, 0, idx, out=chunk.view(-1))
            chunk.mul_(scale[first : first + k, None])
        return out.reshape(-1)[:numel].reshape(shape)


_REGISTRY: dict[str, Callable[[], Codec]] = {
    "fp32": Fp32Codec,
    "fp16": Fp16Codec,
    "bf16": Bf16Codec,
    "int8": Int8BlockCodec,
    "fp4": lambda: FourBitCodec("e2m1"),
    "nf4": lambda: FourBitCodec("nf4"),
    "e3m0": lambda: FourBitCodec("e3m0"),
}


def codec_names() -> list[str]:
    return sorted(_REGISTRY)


def get_codec(name: str) -> Codec:
    """Codec by its CLI name: ``fp32``, ``fp16``, ``bf16``, ``int8``, ``fp4``, ``nf4``, ``e3m0``."""
    try:
        return _REGISTRY[name]()
    except KeyError:
        raise ConfigError("codec", f"unknown codec {name!r}; one of {codec_names()}") from None
