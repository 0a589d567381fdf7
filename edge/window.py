"""Sliding-window weight scheduler: at most W layer blocks resident per device (TPI-LLM §3.3).

Every layer's weights sit in their own safetensors file (``lowband edge split`` writes them),
or are byte ranges of one GGUF file (``edge.formats.gguf_window``). Each file is memory-mapped
once and the tensors are zero-copy ``torch.frombuffer`` views, so the model's parameters *are*
the mapping and always stay valid. Residency is then purely a
page-table matter, driven by :func:`window_plan`:

* load  = ``madvise(MADV_POPULATE_READ)`` in a background thread (ctypes drops the GIL): reads
  from disk if needed and maps every page, while the current block computes. Kernels older
  than 5.14 lack POPULATE_READ; the thread then touches one byte per page (torch, no GIL).
* evict = ``madvise(MADV_DONTNEED)``: the pages leave this process (RSS really drops) and stay
  in the page cache, from where the kernel may reclaim them under memory pressure.

Huge pages are what make this cheap. Measured here on 43 MB layer files: with 4 KiB page-cache
folios, POPULATE_READ costs ~1.6 µs per page (~18 ms per layer, ~450 ms per token for 700 MB:
slower than copying the bytes). With ``madvise(MADV_HUGEPAGE)`` on the mapping, pages read
through it land in 2 MiB folios and re-mapping a cached layer takes ~0.12 ms; a cold read runs
at ~860 MB/s. So the mapping asks for huge pages and the scheduler first drops the files'
small-folio cache (left by ``edge split`` writing them) so the first read rebuilds it huge.
(On kernels without file THP it still works, at the 4 KiB cost.)

Correctness never depends on the scheduler: touching an evicted block just faults it back in.
"""

from __future__ import annotations

import ctypes
import json
import logging
import mmap
import os
import queue
import struct
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
from torch import nn

from lowband.errors import ConfigError

logger = logging.getLogger(__name__)

MADV_WILLNEED = 3
MADV_DONTNEED = 4
MADV_HUGEPAGE = 14
MADV_POPULATE_READ = 22  # Linux >= 5.14
PAGE = mmap.PAGESIZE

_ST_DTYPES = {
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I8": torch.int8,
    "U8": torch.uint8,
}


# ---- the pure schedule ---------------------------------------------------------------------
@dataclass(frozen=True)
class WindowStep:
    """What to do right after computing ``block``."""

    block: int
    evict: tuple[int, ...]
    load: tuple[int, ...]


def window_warmup(n_blocks: int, window: int) -> tuple[int, ...]:
    """Blocks to load before the first forward pass: the first W."""
    _check(n_blocks, window)
    return tuple(range(min(window, n_blocks)))


def window_plan(block: int, n_blocks: int, window: int) -> WindowStep:
    """Residency change after computing ``block``.

    Blocks run 0..L-1 and then wrap to 0 for the next token, so the schedule is cyclic. Before
    block i runs, blocks i..i+W-1 (mod L) are resident or in flight. After i, evict i and only
    then start loading i+W: evicting first is what keeps the count at W, never W+1. The load
    of i+W overlaps the compute of i+1..i+W-1; with W=1 nothing overlaps (pure streaming).
    With W >= L everything stays resident and nothing moves.
    """
    _check(n_blocks, window)
    if not 0 <= block < n_blocks:
        raise ConfigError("block", f"{block} is not in [0, {n_blocks})")
    if window >= n_blocks:
        return WindowStep(block, (), ())
    return WindowStep(block, (block,), ((block + window) % n_blocks,))


def window_for_budget(budget_bytes: int, block_bytes: Sequence[int], fixed_bytes: int = 0) -> int:
    """Largest W such that ``fixed_bytes`` plus the W largest blocks fit in the budget."""
    if not block_bytes:
        raise ConfigError("memory_budget_mb", "the model has no layer blocks")
    biggest = sorted(block_bytes, reverse=True)
    room = budget_bytes - fixed_bytes
    w, used = 0, 0
    for b in biggest:
        if used + b > room:
            break
        used += b
        w += 1
    if w == 0:
        need = (fixed_bytes + biggest[0]) / 2**20
        raise ConfigError(
            "memory_budget_mb",
            f"{budget_bytes / 2**20:.0f} MB cannot hold even one layer block: "
            f"need at least {need:.0f} MB",
        )
    return w


def _check(n_blocks: int, window: int) -> None:
    if n_blocks < 1:
        raise ConfigError("n_blocks", f"must be >= 1, got {n_blocks}")
    if window < 1:
        raise ConfigError("window", f"must be >= 1, got {window}")


# ---- memory-mapped layer files -------------------------------------------------------------
_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.madvise.restype = ctypes.c_int
_populate_ok = True


def _madvise(addr: int, length: int, advice: int) -> bool:
    return _libc.madvise(ctypes.c_void_p(addr), ctypes.c_size_t(length), advice) == 0


def _populate(addr: int, size: int, pages: torch.Tensor) -> None:
    """Fault in [addr, addr + size) (``pages`` is the same memory as bytes): one madvise where
    the kernel has MADV_POPULATE_READ, else one read per page (in torch, without the GIL)."""
    global _populate_ok
    if _populate_ok and _madvise(addr, size, MADV_POPULATE_READ):
        return
    if _populate_ok:
        _populate_ok = False
        logger.info(
            "MADV_POPULATE_READ unavailable (errno %d); touching pages instead", ctypes.get_errno()
        )
    pages[::PAGE].sum()


def release(t: torch.Tensor, start: int, stop: int) -> int:
    """Give the whole pages within bytes ``[start, stop)`` of contiguous ``t`` back to the
    kernel (``MADV_DONTNEED``): the process stops holding them, and reading them afterwards
    gives zeros (anonymous memory) or the file's bytes again (a mapping). For weights nothing
    reads any more, e.g. the embedding rows a pipeline's last stage keeps no use for (its
    table is one allocation with the head rows it does use). Returns the bytes released."""
    if not t.is_contiguous() or not 0 <= start <= stop <= t.numel() * t.element_size():
        raise ValueError("release needs a contiguous tensor and a byte range inside it")
    lo = -(-(t.data_ptr() + start) // PAGE) * PAGE
    hi = (t.data_ptr() + stop) // PAGE * PAGE
    if hi <= lo or not _madvise(lo, hi - lo, MADV_DONTNEED):
        return 0
    return hi - lo


class MappedBytes:
    """A whole file mapped read-only as bytes (``u8``), asking for huge pages; a weight kept
    as a zero-copy view of it (:meth:`view`) *is* the mapping."""

    def __init__(self, path: Path) -> None:
        self.path = path
        with open(path, "rb") as f:
            self.size = os.fstat(f.fileno()).st_size
            self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        with warnings.catch_warnings():  # the mapping is read-only and nobody writes weights
            warnings.simplefilter("ignore", UserWarning)
            self._u8 = torch.frombuffer(self._mm, dtype=torch.uint8)
        self.addr = self._u8.data_ptr()
        _madvise(self.addr, self.size, MADV_HUGEPAGE)  # see the module docstring

    def view(self, offset: int, nbytes: int) -> torch.Tensor:
        """Bytes ``[offset, offset + nbytes)`` of the file, without copying."""
        if not 0 <= offset <= offset + nbytes <= self.size:
            raise ConfigError(
                "weights", f"{self.path}: bytes [{offset}, {offset + nbytes}) lie outside the file"
            )
        return self._u8[offset : offset + nbytes]

    def resident_bytes(self) -> int | None:
        """The mapping's resident bytes now (its Rss in ``/proc/self/smaps``, Linux); None where
        that cannot be read."""
        here = False
        try:
            with open("/proc/self/smaps") as f:
                for line in f:
                    head = line.split()
                    if head and "-" in head[0] and not head[0].endswith(":"):
                        here = int(head[0].split("-")[0], 16) == self.addr
                    elif here and head and head[0] == "Rss:":
                        return int(head[1]) * 1024
        except OSError:
            return None
        return None

    def holds(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is a view of this mapping (not a copy)."""
        return t.untyped_storage().data_ptr() == self.addr

    def populate(self) -> None:
        """Map every page (reading from disk if needed)."""
        _populate(self.addr, self.size, self._u8)

    def evict(self) -> None:
        _madvise(self.addr, self.size, MADV_DONTNEED)

    def drop_page_cache(self) -> None:
        """Ask the kernel to forget this file's cached pages (for cold-cache measurements)."""
        fd = os.open(self.path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


class MappedFile(MappedBytes):
    """One safetensors file mapped read-only; ``tensors`` are zero-copy views of it."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        (n,) = struct.unpack("<Q", self._mm[:8])
        header = json.loads(self._mm[8 : 8 + n])
        base = 8 + n
        self.tensors: dict[str, torch.Tensor] = {}
        for name, info in header.items():
            if name == "__metadata__":
                continue
            dtype = _ST_DTYPES.get(info["dtype"])
            if dtype is None:
                raise ConfigError("weights", f"{path}: unsupported dtype {info['dtype']} of {name}")
            a, b = info["data_offsets"]
            raw = self._u8[base + a : base + b]
            if (self.addr + base + a) % dtype.itemsize:  # unaligned: copy (never in our files)
                raw = raw.clone()
            self.tensors[name] = raw.view(dtype).view(info["shape"])


class MappedSpans:
    """The tensors of one window block that are views of one :class:`MappedBytes` (a decoder
    layer of a GGUF file): their byte ranges, merged where they meet within a page and widened
    to whole pages, are populated and evicted together. No layout is assumed: tensors that lie
    apart in the file give several spans. As with :class:`MappedRegion`, an edge page may be
    shared with a neighbouring block: evicting it only costs the neighbour a page fault.

    Populating maps whole huge folios (2 MiB of the file), so the bytes between a block's
    spans (a tensor that was copied instead) get mapped too: :meth:`evict_hull` makes evicting
    drop everything from the first span to the last, for blocks that do not interleave."""

    def __init__(self, file: MappedBytes, tensors: Sequence[torch.Tensor]) -> None:
        self.file, self.path = file, file.path
        ranges = []
        for t in tensors:
            if not file.holds(t):
                raise ConfigError("weights", f"{file.path}: a block tensor is not of the mapping")
            lo = t.data_ptr() - file.addr
            ranges.append((lo, lo + t.numel() * t.element_size()))
        spans: list[tuple[int, int]] = []  # page-widened (offset, end), ascending, disjoint
        for lo, hi in sorted(r for r in ranges if r[1] > r[0]):
            a, b = lo // PAGE * PAGE, min(file.size, -(-hi // PAGE) * PAGE)
            if spans and a <= spans[-1][1]:
                spans[-1] = (spans[-1][0], max(spans[-1][1], b))
            else:
                spans.append((a, b))
        self.spans = spans
        self.size = sum(b - a for a, b in spans)
        self._evict = spans

    @property
    def hull(self) -> tuple[int, int]:
        """(offset, end) from the first span to the last; (0, 0) for no span."""
        return (self.spans[0][0], self.spans[-1][1]) if self.spans else (0, 0)

    def evict_hull(self) -> None:
        """Evict the whole :attr:`hull`, not only the spans (no other block may lie inside)."""
        self._evict = [self.hull] if self.spans else []

    def populate(self) -> None:
        for a, b in self.spans:
            _populate(self.file.addr + a, b - a, self.file._u8[a:b])

    def evict(self) -> None:
        for a, b in self._evict:
            _madvise(self.file.addr + a, b - a, MADV_DONTNEED)

    def drop_page_cache(self) -> None:
        fd = os.open(self.path, os.O_RDONLY)
        try:
            for a, b in self.spans:
                os.posix_fadvise(fd, a, b - a, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


class MappedRegion(MappedSpans):
    """Some tensors of a :class:`MappedFile` taken as one window block: their pages are
    populated and evicted together. The tensors must lie back to back in the file (a decoder
    layer's tensors do in a safetensors file: it orders same-dtype tensors by name, and
    ``model.layers.1.`` sorts before ``model.layers.10.``), so they make one span. The span is
    widened to whole pages, so an edge page may be shared with the neighbouring block:
    evicting it only costs the neighbour a page fault, never a wrong value."""

    def __init__(self, file: MappedFile, names: Sequence[str]) -> None:
        if not names:
            raise ConfigError("weights", f"{file.path}: an empty block")
        self.tensors = {n: file.tensors[n] for n in names}
        spans = sorted(
            (t.data_ptr() - file.addr, t.data_ptr() - file.addr + t.numel() * t.element_size())
            for t in self.tensors.values()
        )
        lo, hi = spans[0][0], spans[-1][1]
        inside = [
            n
            for n, t in file.tensors.items()
            if n not in self.tensors and lo <= t.data_ptr() - file.addr < hi and t.numel()
        ]
        if inside:
            raise ConfigError(
                "weights",
                f"{file.path}: the tensors of one block are not contiguous "
                f"({inside[0]!r} lies between them); re-save the file",
            )
        super().__init__(file, list(self.tensors.values()))

    @property
    def offset(self) -> int:
        """The span's first byte in the file (page-aligned)."""
        return self.hull[0]


def attach(module: nn.Module, tensors: dict[str, torch.Tensor], prefix: str) -> None:
    """Make ``module``'s parameters the given tensors (keys are full names under ``prefix``)."""
    for name, t in tensors.items():
        if not name.startswith(prefix):
            raise ConfigError("weights", f"tensor {name!r} does not belong under {prefix!r}")
        owner_name, _, pname = name[len(prefix) :].rpartition(".")
        owner = module.get_submodule(owner_name) if owner_name else module
        is_buffer = pname in owner._buffers  # packed quantized weights are buffers
        old = owner._buffers.get(pname) if is_buffer else owner._parameters.get(pname)
        if old is None or tuple(old.shape) != tuple(t.shape):
            raise ConfigError(
                "weights",
                f"{name}: file has shape {tuple(t.shape)}, model expects "
                f"{None if old is None else tuple(old.shape)} (wrong split?)",
            )
        if is_buffer:
            owner._buffers[pname] = t
        else:
            owner._parameters[pname] = nn.Parameter(t, requires_grad=False)


# ---- the scheduler ---------------------------------------------------------------------------
class WindowScheduler:
    """Keeps at most ``window`` of ``layers`` resident, prefetching ahead in a thread.

    ``layers[i]`` runs block ``files[i]``. Hooks on each layer wait for its block before it
    runs and apply :func:`window_plan` after it ran."""

    def __init__(
        self,
        layers: Sequence[nn.Module],
        files: Sequence[MappedFile | MappedRegion | MappedSpans],
        window: int,
        loader_cores: Sequence[int] | None = None,
        recache: bool = True,
    ) -> None:
        if len(layers) != len(files):
            raise ConfigError("files", f"{len(files)} layer files for {len(layers)} layers")
        _check(len(layers), window)
        self.files = list(files)
        self.window = window
        self.n = len(files)
        self._ready = [threading.Event() for _ in files]
        self._queued = [False] * self.n
        self._loader_cores = tuple(loader_cores) if loader_cores else None
        # Jobs run in order: ("evict", b) before the ("load", b') queued after it, so the
        # resident count never exceeds W even though the compute thread does neither.
        self._jobs: queue.SimpleQueue[tuple[str, int] | None] = queue.SimpleQueue()
        self._errors: list[BaseException] = []
        self._thread = threading.Thread(target=self._run, name="edge-window-loader", daemon=True)
        self._thread.start()
        self._handles = []
        for i, layer in enumerate(layers):
            self._handles.append(layer.register_forward_pre_hook(self._pre_hook(i)))
            self._handles.append(layer.register_forward_hook(self._post_hook(i)))
        if recache:  # rebuild the page cache in huge folios (module docstring)
            for f in self.files:
                f.evict()
                f.drop_page_cache()
        for b in window_warmup(self.n, window):
            self._load(b)

    def _run(self) -> None:
        if self._loader_cores:  # Linux: pid 0 is this thread only
            os.sched_setaffinity(0, set(self._loader_cores))
        while True:
            job = self._jobs.get()
            if job is None:
                return
            kind, b = job
            try:
                if kind == "evict":
                    self.files[b].evict()
                    continue
                self.files[b].populate()
            except BaseException as exc:  # noqa: BLE001 - surfaced on the compute thread
                self._errors.append(exc)
            self._ready[b].set()

    def _load(self, b: int) -> None:
        if not self._queued[b]:
            self._queued[b] = True
            self._jobs.put(("load", b))

    def _pre_hook(self, i: int):
        def hook(module: nn.Module, args: tuple) -> None:
            self._load(i)  # no-op unless the pass started out of order (e.g. after reset)
            self._ready[i].wait()
            if self._errors:
                raise self._errors.pop()

        return hook

    def _post_hook(self, i: int):
        def hook(module: nn.Module, args: tuple, out: torch.Tensor) -> None:
            step = window_plan(i, self.n, self.window)
            for e in step.evict:
                self._ready[e].clear()
                self._queued[e] = False
                self._jobs.put(("evict", e))
            for b in step.load:
                self._load(b)

        return hook

    @property
    def streams(self) -> bool:
        """Whether weights move every token: fewer blocks resident than there are layers
        (the compiled decode step then stays off: it needs every block mapped)."""
        return self.window < self.n

    def resident(self) -> list[int]:
        return [i for i in range(self.n) if self._queued[i]]

    def settle(self, timeout: float = 30.0) -> None:
        """Wait until the loads queued so far, and the evictions queued before them, are done
        (jobs run in order): what is mapped is then what :meth:`resident` says."""
        for i in self.resident():
            self._ready[i].wait(timeout)

    def drop_page_cache(self) -> None:
        """Drop the non-resident blocks from the page cache (cold-cache measurements)."""
        for i, f in enumerate(self.files):
            if not self._queued[i]:
                f.drop_page_cache()

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._jobs.put(None)
        self._thread.join(timeout=10)
