"""Bit-planes, page buffers and the expert file format of bit-nested expert weights.

The quantization maths is :mod:`edge.moe.quant`.

Bit-planes
----------
Plane ``j`` (j = 0 is the most significant) holds bit ``7 - j`` of every code, 8 weights per
byte, weight ``8 i + t`` in bit ``t`` of byte ``i``. Reading b bits reads planes ``0..b-1``;
raising a resident expert from b to b' bits reads only planes ``b..b'-1``.

File format (one file per expert, little-endian)
------------------------------------------------
``[magic "LBNQ"][u16 version][u16 flags][u32 meta_len][u32 crc32(meta)]`` then msgpack metadata
(layer, expert, group size, tensors with shapes, and for the scales block and each of the 8
planes: offset, length, crc32), then the scales block (per tensor: ``lo`` then ``step``, float16,
shape (out, in/g)), then planes 0..7, each the concatenation of that plane of every tensor.
Planes ``0..b-1`` are therefore one contiguous read. Every block is checked against its crc32
when read; a bad length or checksum raises :class:`CorruptWeights`.
"""

from __future__ import annotations

import contextlib
import functools
import mmap
import struct
import sys
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Mapping, Sequence

import msgpack
import torch

from edge.moe.quant import EXPERT_TENSORS, WIDTHS, QuantizedMatrix, work_buffer
from lowband.errors import ConfigError, CorruptWeights

MAGIC = b"LBNQ"
VERSION = 2  # 2: scales block holds every lo, then every step
_HEADER = struct.Struct("<4sHHII")
_ALIGN = 64


# ---- bit-planes ----------------------------------------------------------------------------------
@functools.cache
def _spread_lut(bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Lookup for decoding ``bits`` planes: (table (bits*256,) int64, row offsets (bits, 1)).

    ``table[256 j + v]`` is an int64 whose byte t is bit t of plane byte v, already shifted to
    code bit ``bits - 1 - j``: one gather spreads a plane byte over 8 code bytes.
    """
    if sys.byteorder != "little":  # the int64 -> uint8 view in planes_to_codes relies on it
        raise RuntimeError("bit-plane decoding assumes a little-endian host")
    v = torch.arange(256, dtype=torch.int64)
    spread = torch.zeros_like(v)
    for t in range(8):
        spread |= ((v >> t) & 1) << (8 * t)
    table = torch.cat([spread << (bits - 1 - j) for j in range(bits)])
    return table, (torch.arange(bits, dtype=torch.int32) * 256).view(bits, 1)


def to_planes(codes: torch.Tensor) -> torch.Tensor:
    """(8, N/8) uint8 bit-planes, MSB first, of int8 codes with N a multiple of 8."""
    c = codes.reshape(-1, 8)  # (M, 8)
    shifts = torch.arange(7, -1, -1, dtype=torch.uint8).view(8, 1, 1)
    bits = (c.unsqueeze(0) >> shifts) & 1  # (8, M, 8)
    place = torch.arange(8, dtype=torch.uint8)
    return (bits << place).sum(-1, dtype=torch.int32).to(torch.uint8)  # (8, M)


def planes_to_codes(planes: torch.Tensor, *, scratch: bool = False) -> torch.Tensor:
    """(N,) uint8 b-bit codes from the top b planes (b, N/8).

    One gather over b*N/8 words and one sum: bytes never carry into each other because every
    code is < 256. (Measured here: ~3x faster than unpacking bits one plane at a time.)
    ``scratch=True`` works in this thread's reusable buffers and returns a view of one of them,
    valid until the thread's next scratch call: the decode path of every expert call then
    allocates nothing, so the heap does not grow holes between resident experts.
    """
    b, m = planes.shape
    table, offsets = _spread_lut(b)
    idx = work_buffer("idx", b * m, torch.int32, scratch).view(b, m)  # int32: half the scratch
    idx.copy_(planes)
    idx += offsets
    gathered = work_buffer("gather", b * m, torch.int64, scratch)
    torch.index_select(table, 0, idx.view(-1), out=gathered)
    codes = work_buffer("codes", m, torch.int64, scratch)
    torch.sum(gathered.view(b, m), 0, out=codes)
    return codes.view(torch.uint8)


def page_buffer(nbytes: int) -> torch.Tensor:
    """A (nbytes,) uint8 tensor on its own anonymous pages, unmapped when the tensor dies.

    Resident expert buffers live here rather than on the malloc heap: experts come and go in
    every size, and on the heap their holes keep the process's memory far above the budget
    (measured: +20 MB on a 10.7 MB budget). Pages are returned to the OS on release.
    """
    with torch.inference_mode(False):  # see _work: resident buffers outlive any mode
        return torch.frombuffer(mmap.mmap(-1, max(nbytes, 1)), dtype=torch.uint8, count=nbytes)


# ---- file format ---------------------------------------------------------------------------------
def _pad(n: int) -> int:
    return -n % _ALIGN


LAYOUTS = ("planes", "bytes")


def write_expert_file(
    path: Path,
    *,
    layer: int,
    expert: int,
    tensors: Mapping[str, QuantizedMatrix],
    layout: str = "planes",
) -> int:
    """Write one expert; returns the file size.

    ``layout="planes"`` is the nested format. ``"bytes"`` stores the same int8 codes as plain
    bytes (one code per weight): the layout of a conventional int8 runtime, which the int8
    baseline reads so that it does not pay for decoding planes.
    """
    if layout not in LAYOUTS:
        raise ConfigError("layout", f"must be one of {LAYOUTS}, got {layout!r}")
    names = list(tensors)
    group = {tensors[n].group_size for n in names}
    if len(group) != 1:
        raise ConfigError("group_size", f"tensors of one expert use different group sizes {group}")
    # All tensors' lo, then all their steps: one expert's (scale, offset) are two vectors.
    scales = b"".join(t.lo.contiguous().numpy().tobytes() for t in tensors.values()) + b"".join(
        t.step.contiguous().numpy().tobytes() for t in tensors.values()
    )
    if layout == "planes":
        planes_of = {n: to_planes(tensors[n].codes) for n in names}
        body = [b"".join(planes_of[n][j].numpy().tobytes() for n in names) for j in range(8)]
    else:
        body = [b"".join(tensors[n].codes.contiguous().numpy().tobytes() for n in names)]

    def meta_for(start: int) -> bytes:
        off = start + len(scales) + _pad(len(scales))
        spans = []
        for blk in body:
            spans.append([off, len(blk), zlib.crc32(blk)])
            off += len(blk)
        meta = {
            "layer": layer,
            "expert": expert,
            "group_size": next(iter(group)),
            "layout": layout,
            "tensors": [{"name": n, "shape": list(tensors[n].codes.shape)} for n in names],
            "scales": [start, len(scales), zlib.crc32(scales)],
            "file_size": off,
            ("planes" if layout == "planes" else "codes"): spans
            if layout == "planes"
            else spans[0],
        }
        return msgpack.packb(meta)

    # The metadata holds offsets that depend on its own length: size it once with a guess.
    guess = len(meta_for(0)) + 32
    start = _HEADER.size + guess + _pad(_HEADER.size + guess)
    meta = meta_for(start)
    if len(meta) > guess:
        raise AssertionError("metadata grew past its reserved size")
    with open(path, "wb") as f:
        f.write(_HEADER.pack(MAGIC, VERSION, 0, len(meta), zlib.crc32(meta)))
        f.write(meta)
        f.write(b"\0" * (start - _HEADER.size - len(meta)))
        f.write(scales)
        f.write(b"\0" * _pad(len(scales)))
        for blk in body:
            f.write(blk)
        return f.tell()


@dataclass(frozen=True)
class TensorLayout:
    name: str
    shape: tuple[int, int]
    group_size: int

    @property
    def numel(self) -> int:
        return self.shape[0] * self.shape[1]

    @property
    def n_groups(self) -> int:
        return self.numel // self.group_size


class ExpertFile:
    """Read access to one expert file through mmap. Opening checks structure, not checksums;
    every read checks the crc32 of the blocks it returns (``verify()`` checks them all)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        try:
            self._f = open(self.path, "rb")
        except FileNotFoundError:
            raise CorruptWeights(f"{self.path}: expert file is missing") from None
        size = self.path.stat().st_size
        if size < _HEADER.size:
            self.close()
            raise CorruptWeights(f"{self.path}: truncated ({size} bytes, no header)")
        self._mm = mmap.mmap(self._f.fileno(), 0, access=mmap.ACCESS_READ)
        # No readahead: it would read the planes a narrow expert does not want from storage.
        self._mm.madvise(mmap.MADV_RANDOM)
        try:
            self._parse(size)
        except CorruptWeights:
            self.close()
            raise

    def _parse(self, size: int) -> None:
        magic, version, _flags, meta_len, meta_crc = _HEADER.unpack_from(self._mm, 0)
        if magic != MAGIC:
            raise CorruptWeights(f"{self.path}: not a lowband nested expert file (magic {magic!r})")
        if version != VERSION:
            raise CorruptWeights(
                f"{self.path}: format version {version}, this build reads {VERSION}"
            )
        raw = bytes(self._mm[_HEADER.size : _HEADER.size + meta_len])
        if len(raw) != meta_len or zlib.crc32(raw) != meta_crc:
            raise CorruptWeights(f"{self.path}: metadata checksum mismatch (file damaged)")
        try:
            meta = msgpack.unpackb(raw)
            self.layer, self.expert = int(meta["layer"]), int(meta["expert"])
            self.group_size = int(meta["group_size"])
            self.tensors = tuple(
                TensorLayout(t["name"], tuple(t["shape"]), self.group_size) for t in meta["tensors"]
            )
            self.layout = meta.get("layout", "planes")
            self._scales = tuple(meta["scales"])
            if self.layout == "planes":
                self._planes = tuple(tuple(p) for p in meta["planes"])
                self._codes = None
            elif self.layout == "bytes":
                self._planes, self._codes = (), tuple(meta["codes"])
            else:
                raise ValueError(f"unknown layout {self.layout!r}")
            expect_size = int(meta["file_size"])
        except (KeyError, TypeError, ValueError, msgpack.UnpackException) as exc:
            raise CorruptWeights(f"{self.path}: unreadable metadata ({exc})") from None
        if size != expect_size:
            raise CorruptWeights(
                f"{self.path}: {size} bytes on disk, header says {expect_size} "
                "(truncated or padded file)"
            )
        plane_len = sum(t.numel // 8 for t in self.tensors)
        scale_len = sum(4 * t.n_groups for t in self.tensors)
        bad = self._scales[1] != scale_len
        if self._codes is not None:
            bad |= self._codes[1] != 8 * plane_len
        else:
            bad |= len(self._planes) != 8 or any(p[1] != plane_len for p in self._planes)
        if bad:
            raise CorruptWeights(f"{self.path}: block sizes disagree with the tensor shapes")
        for j in range(len(self._planes) - 1):  # back to back: a b-bit prefix is one read
            if self._planes[j][0] + plane_len != self._planes[j + 1][0]:
                raise CorruptWeights(f"{self.path}: planes are not contiguous")
        self._plane_len = plane_len

    @property
    def plane_bytes(self) -> int:
        """Bytes of one bit-plane of all tensors (N/8); the bytes layout holds 8 of these."""
        return self._plane_len

    @property
    def widths(self) -> tuple[int, ...]:
        """Widths this file can serve: every nested width, or only 8 for the bytes layout."""
        return WIDTHS if self.layout == "planes" else (8,)

    @property
    def scale_bytes(self) -> int:
        return self._scales[1]

    def nbytes(self, bits: int) -> int:
        """Bytes of the scales plus the top ``bits`` planes: what serving at ``bits`` holds."""
        if bits not in self.widths:
            raise ConfigError(
                "bits", f"{self.path.name} ({self.layout} layout) cannot serve {bits} bits"
            )
        return self.scale_bytes + bits * self.plane_bytes

    @contextlib.contextmanager
    def _view(self, span: Sequence[int], what: str) -> Iterator[memoryview]:
        """A checksum-verified view of one block of the mapping, released on exit (an
        unreleased view would keep ``close()`` from unmapping the file)."""
        off, length, crc = span
        start = off - off % mmap.PAGESIZE  # ask for exactly this block, ahead of the faults
        self._mm.madvise(
            mmap.MADV_WILLNEED, start, min(len(self._mm) - start, length + off - start)
        )
        with memoryview(self._mm) as whole, whole[off : off + length] as view:
            if zlib.crc32(view) != crc:
                raise CorruptWeights(f"{self.path}: checksum mismatch in {what} (file damaged)")
            yield view

    @property
    def n_groups(self) -> int:
        """Groups of all tensors together (G): the scales block holds G lo values, then G steps."""
        return sum(t.n_groups for t in self.tensors)

    @property
    def index(self) -> dict[str, tuple[int, int, tuple[int, int]]]:
        """{tensor: (first code, numel, shape)}: tensors back to back in code order (the order
        of a plane's bytes x 8, of the bytes layout, and of the groups in the scales block)."""
        out, pos = {}, 0
        for t in self.tensors:
            out[t.name] = (pos, t.numel, t.shape)
            pos += t.numel
        return out

    def read_scale_block(self) -> torch.Tensor:
        """(2G,) float16 in a page buffer: every group's lo, then every group's step."""
        with self._view(self._scales, "scales") as view:
            buf = page_buffer(len(view))
            buf.numpy()[:] = view
        self.release()
        return buf.view(torch.float16)

    def read_scales(self) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """{tensor: (lo, step)} float16 tensors of shape (out, in/g)."""
        block, groups = self.read_scale_block(), self.n_groups
        out = {}
        for name, (pos, numel, (rows, cols)) in self.index.items():
            g0, n = pos // self.group_size, numel // self.group_size
            shape = (rows, cols // self.group_size)
            out[name] = (
                block[g0 : g0 + n].view(shape),
                block[groups + g0 : groups + g0 + n].view(shape),
            )
        return out

    def read_planes(self, first: int, last: int) -> torch.Tensor:
        """Planes ``first..last-1`` of all tensors as (last - first, plane_bytes) uint8 in one page
        buffer: one contiguous region of the file, each plane checked against its crc32."""
        if not 0 <= first < last <= 8:
            raise ConfigError("planes", f"need 0 <= first < last <= 8, got {first}..{last}")
        if self.layout != "planes":
            raise ConfigError("layout", f"{self.path.name} stores plain int8 codes, not bit-planes")
        out = page_buffer((last - first) * self.plane_bytes).view(last - first, self.plane_bytes)
        dst = out.numpy()
        for i, j in enumerate(range(first, last)):
            with self._view(self._planes[j], f"bit-plane {j}") as view:
                dst[i] = view
        self.release()
        return out

    def read_codes(self) -> torch.Tensor:
        """Bytes layout: the (N,) uint8 int8 codes of all tensors, in one page buffer."""
        if self._codes is None:
            raise ConfigError("layout", f"{self.path.name} stores bit-planes, not plain codes")
        with self._view(self._codes, "the int8 codes") as view:
            flat = page_buffer(len(view))
            flat.numpy()[:] = view
        self.release()
        return flat

    def split(self, codes: torch.Tensor) -> dict[str, torch.Tensor]:
        """{tensor: (out, in) view} of an (N,) code or weight vector in ``index`` order."""
        return {
            name: codes[pos : pos + n].view(shape) for name, (pos, n, shape) in self.index.items()
        }

    def release(self) -> None:
        """Drop every mapped page of the file from this process's resident set (the page cache
        keeps them): bytes we copied out must not be counted twice against the memory budget.
        The whole file, not just the block read: page faults map neighbouring pages too."""
        self._mm.madvise(mmap.MADV_DONTNEED)

    def verify(self) -> None:
        """Check every block's checksum (reads the whole file once)."""
        blocks = [(self._scales, "scales")] + [
            (p, f"bit-plane {j}") for j, p in enumerate(self._planes)
        ]
        if self._codes is not None:
            blocks.append((self._codes, "the int8 codes"))
        for span, what in blocks:
            with self._view(span, what):
                pass
        self.release()

    def close(self) -> None:
        mm = getattr(self, "_mm", None)
        if mm is not None:
            mm.close()
        self._f.close()

    def __enter__(self) -> ExpertFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def is_expert_key(key: str) -> bool:
    return any(True for _ in iter_expert_keys([key]))


def iter_expert_keys(names: Sequence[str]) -> Iterator[tuple[int, int, str, str]]:
    """(layer, expert, tensor, key) for every Mixtral expert weight key among ``names``."""
    for key in names:
        parts = key.split(".")
        # model.layers.{L}.block_sparse_moe.experts.{E}.{w1|w2|w3}.weight
        if (
            len(parts) == 8
            and parts[0] == "model"
            and parts[1] == "layers"
            and parts[3] == "block_sparse_moe"
            and parts[4] == "experts"
            and parts[6] in EXPERT_TENSORS
            and parts[7] == "weight"
        ):
            yield int(parts[2]), int(parts[5]), parts[6], key
