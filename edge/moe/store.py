"""Serving Mixtral-style experts from bit-nested plane files under a memory budget.

An :class:`ExpertCache` owns the resident experts of one process (all of a model's experts, or
the subset a tensor-parallel rank or a placement gives it) and a byte budget. It plugs into the
model through ``SparseMoE.expert_fn`` / ``on_route`` (:func:`attach`), so the model's code never
knows where expert weights live. Two policies:

* ``LRUConfig`` — the baseline of on-device MoE runtimes: experts at one fixed width (int8), the
  least recently used one is evicted when a miss needs room.
* ``HEBFConfig`` — hottest-expert-bit-first (D²MoE): router counts, exponentially decayed, give
  each expert a hotness; every ``replan_every`` tokens :func:`edge.moe.hebf.hebf_plan` picks a width
  per expert within the budget, and the cache reads the missing planes in the background
  (an upgrade reads only planes ``b..b'-1``), taking bytes from experts the plan wants narrower
  (a downgrade is free: the b-bit slice is a prefix, planes are just dropped). A miss loads the
  narrowest width, so the stall is as short as possible, and asks for the planned width in the
  background.

Both can prefetch: when layer ``l`` routes, the router of layer ``l+1`` is applied to layer
``l``'s input (the residual stream changes little between layers) and the experts it ranks
highest are read by the I/O thread while layer ``l`` computes.

Memory accounting: the budget counts the bytes of every resident plane/code buffer and its
float16 group parameters, plus bytes reserved for reads in flight, and it is never exceeded
(``stats.peak_bytes``). Resident buffers live on their own pages (``page_buffer``), so freeing
them returns memory to the OS; pages read through mmap are dropped from the process's resident
set after the copy (``ExpertFile.release``). Not counted: for the moment an upgrade copies an
expert's old planes next to the new ones, both copies exist (at most one expert's planes), and
the decoding thread's scratch buffers (one expert's codes and float weights, fixed size).

Concurrency. One lock (a Condition) guards the tables; reads happen outside it on a single I/O
thread or on the caller's thread, serialised by :class:`StorageDevice` like requests to one
flash chip. The I/O thread never waits for the decoding thread, so a decoding thread that waits
for a read in flight always wakes up: no deadlock.
"""

from __future__ import annotations

import functools
import heapq
import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, TypeVar, Union

import torch
import torch.nn.functional as F

from edge import fastpath
from edge.moe.checkpoint import ExpertKey, NestedCheckpoint, load_backbone
from edge.moe.hebf import hebf_plan
from edge.moe.planes import ExpertFile, page_buffer, planes_to_codes
from edge.moe.quant import WIDTHS, apply_affine
from lowband.errors import ConfigError, CorruptWeights
from lowband.models.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)


# ---- configuration -------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class LRUConfig:
    """Fixed-width experts, least-recently-used eviction."""

    bits: int = 8

    def __post_init__(self) -> None:
        if self.bits not in WIDTHS:
            raise ConfigError("lru.bits", f"must be one of {WIDTHS}, got {self.bits}")


@dataclass(frozen=True, kw_only=True)
class HEBFConfig:
    """Hottest-expert-bit-first. ``decay`` is γ: hotness ← γ·hotness + routed count, per token."""

    min_bits: int = 2
    decay: float = 0.98  # half-life ~34 tokens: follows a request, not every token
    replan_every: int = 8  # tokens between plans

    def __post_init__(self) -> None:
        if self.min_bits not in WIDTHS:
            raise ConfigError("hebf.min_bits", f"must be one of {WIDTHS}, got {self.min_bits}")
        if not 0.0 < self.decay <= 1.0:
            raise ConfigError("hebf.decay", f"must be in (0, 1], got {self.decay}")
        if self.replan_every < 1:
            raise ConfigError("hebf.replan_every", f"must be >= 1, got {self.replan_every}")


@dataclass(frozen=True, kw_only=True)
class PrefetchConfig:
    """Read the ``top`` experts the next layer's router ranks highest on this layer's input."""

    top: int = 2

    def __post_init__(self) -> None:
        if self.top < 1:
            raise ConfigError("prefetch.top", f"must be >= 1, got {self.top}")


@dataclass(frozen=True, kw_only=True)
class ExpertStoreConfig:
    """``budget_bytes`` (M): bytes of expert weights that may be resident at once.

    ``read_mb_per_s`` (B_io) models the device's storage: every read takes at least
    bytes / B_io seconds (None: as fast as the local file system and page cache).
    """

    budget_bytes: int
    policy: Union[LRUConfig, HEBFConfig] = field(default_factory=HEBFConfig)
    prefetch: PrefetchConfig | None = None
    read_mb_per_s: float | None = None
    verify_on_open: bool = True

    def __post_init__(self) -> None:
        if self.budget_bytes < 1:
            raise ConfigError("budget_bytes", f"must be >= 1, got {self.budget_bytes}")
        if self.read_mb_per_s is not None and self.read_mb_per_s <= 0:
            raise ConfigError("read_mb_per_s", f"must be > 0 or None, got {self.read_mb_per_s}")

    @property
    def floor_bits(self) -> int:
        return self.policy.bits if isinstance(self.policy, LRUConfig) else self.policy.min_bits


# ---- storage and resident experts ----------------------------------------------------------------
_T = TypeVar("_T")


class StorageDevice:
    """Serialises reads like one storage device; optionally paces them to ``bytes_per_s``.

    A read costs max(its real time, bytes / bytes_per_s): the page cache of a 24 GB build
    machine must not make a phone's flash look free.
    """

    def __init__(self, bytes_per_s: float | None) -> None:
        self.bytes_per_s = bytes_per_s
        self._lock = threading.Lock()
        self.bytes_read = 0
        self.busy_s = 0.0

    def read(self, fn: Callable[[], _T], nbytes: int) -> _T:
        with self._lock:
            t0 = time.perf_counter()
            out = fn()
            if self.bytes_per_s:
                rest = t0 + nbytes / self.bytes_per_s - time.perf_counter()
                if rest > 0:
                    time.sleep(rest)
            self.bytes_read += nbytes
            self.busy_s += time.perf_counter() - t0
            return out


def _paged(t: torch.Tensor) -> torch.Tensor:
    """Copy of a uint8 tensor on its own pages (see ``edge.moe.planes.page_buffer``)."""
    out = page_buffer(t.numel()).view(t.shape)
    out.copy_(t)
    return out


def _paged_rows(top: torch.Tensor, rest: torch.Tensor) -> torch.Tensor:
    """Planes ``top`` followed by ``rest`` in one fresh page buffer."""
    out = page_buffer((top.shape[0] + rest.shape[0]) * top.shape[1]).view(-1, top.shape[1])
    out[: top.shape[0]].copy_(top)
    out[top.shape[0] :].copy_(rest)
    return out


@dataclass
class Resident:
    """One expert in memory: its float16 scales block (every group's lo, then every step) and
    the top ``bits`` of its codes, all tensors back to back: a (bits, plane_bytes) plane matrix
    read from a nested file, or an (N,) int8 code vector read from a plain int8 file (``codes``).
    ``nbytes`` is what the budget charges for it.

    Nested experts stay planes even at 8 bits: converting to and from code vectors on every
    8-bit upgrade/downgrade made ~1 MB transients in the reader thread that its malloc arena
    never gave back (measured: +80 MB at a 50% budget)."""

    bits: int
    scales: torch.Tensor
    index: dict[str, tuple[int, int, tuple[int, int]]]  # ExpertFile.index
    data: torch.Tensor
    nbytes: int
    codes: bool = False

    def weights(self, *, scratch: bool = False) -> dict[str, torch.Tensor]:
        """Float32 (out, in) weights of every tensor at this expert's width, decoded in one go
        (one gather, one affine for the whole expert). With ``scratch`` they live in this
        thread's reusable buffer until its next scratch call."""
        groups = self.scales.numel() // 2
        k = 2 ** (8 - self.bits)
        f = self.scales.float()
        lo, step = f[:groups], f[groups:]
        codes = self.data if self.codes else planes_to_codes(self.data, scratch=scratch)
        flat = apply_affine(
            codes, step * k, torch.add(lo, step, alpha=(k - 1) / 2), scratch=scratch
        )
        return {
            name: flat[pos : pos + n].view(shape) for name, (pos, n, shape) in self.index.items()
        }

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Mixtral expert on (N, H) rows: w2(silu(w1 x) * w3 x)."""
        w = self.weights(scratch=True)
        return F.linear(F.silu(F.linear(x, w["w1"])) * F.linear(x, w["w3"]), w["w2"])

    def narrowed(self, bits: int, nbytes: int) -> Resident:
        """This expert at fewer bits: a prefix of its planes, copied so the rest is freed."""
        if self.codes:
            raise ConfigError("bits", "an expert read from a plain int8 file cannot be narrowed")
        return Resident(
            bits=bits,
            scales=self.scales,
            index=self.index,
            data=_paged(self.data[:bits]),
            nbytes=nbytes,
        )


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    waits: int = 0  # needed while its read was in flight (prefetch too late)
    prefetched: int = 0
    upgrades: int = 0
    downgrades: int = 0
    evictions: int = 0
    stall_s: float = 0.0  # decoding thread blocked on reads
    peak_bytes: int = 0
    calls_by_bits: dict[int, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:  # a JSON report: numbers and a dict of counts
        calls = sum(self.calls_by_bits.values())
        mean = sum(b * n for b, n in self.calls_by_bits.items()) / calls if calls else 0.0
        return {
            "hits": self.hits,
            "misses": self.misses,
            "waits": self.waits,
            "prefetched": self.prefetched,
            "upgrades": self.upgrades,
            "downgrades": self.downgrades,
            "evictions": self.evictions,
            "hit_rate": self.hits / max(1, self.hits + self.misses),
            "stall_s": round(self.stall_s, 4),
            "peak_bytes": self.peak_bytes,
            "mean_bits_per_call": round(mean, 3),
            "calls_by_bits": {str(k): v for k, v in sorted(self.calls_by_bits.items())},
        }


# ---- the cache -----------------------------------------------------------------------------------
@dataclass(order=True)
class _Job:
    priority: int  # 0: prefetch for the next layer, 1: planned upgrade
    seq: int
    key: ExpertKey = field(compare=False)
    bits: int = field(compare=False)
    token: int = field(compare=False)  # prefetches go stale once their layer has routed


class ExpertCache:
    """Resident experts of one process under ``cfg.budget_bytes`` (see the module docstring)."""

    def __init__(self, ckpt: NestedCheckpoint, cfg: ExpertStoreConfig) -> None:
        self.ckpt, self.cfg = ckpt, cfg
        self.sizes = ckpt.sizes()
        if not self.sizes:
            raise ConfigError("experts", "the expert store was given no experts")
        self.floor = cfg.floor_bits
        self.hebf = cfg.policy if isinstance(cfg.policy, HEBFConfig) else None
        need = set(WIDTHS) if self.hebf is not None else {self.floor}
        if any(not need <= set(s) for s in self.sizes.values()):
            raise ConfigError(
                "policy",
                f"{ckpt.root} holds plain int8 experts; serving "
                f"{type(cfg.policy).__name__} at {sorted(need)} bits needs a bit-nested "
                "conversion (lowband edge quantize --nested)",
            )
        biggest = max(s[self.floor] for s in self.sizes.values())
        if biggest > cfg.budget_bytes:
            raise ConfigError(
                "budget_bytes",
                f"{cfg.budget_bytes} bytes cannot hold one expert at "
                f"{self.floor} bits ({biggest} bytes); raise the budget",
            )
        self.device = StorageDevice(cfg.read_mb_per_s * 1e6 if cfg.read_mb_per_s else None)
        self.stats = CacheStats()
        self.hotness = {k: 0.0 for k in self.sizes}
        self.plan: dict[ExpertKey, int] = {}
        self._layers = sorted({k[0] for k in self.sizes})
        self._by_layer = {i: [k for k in self.sizes if k[0] == i] for i in self._layers}
        self._cv = threading.Condition()
        self._res: OrderedDict[ExpertKey, Resident] = OrderedDict()  # LRU order, oldest first
        self._pending: set[ExpertKey] = set()
        self._pins: dict[ExpertKey, int] = {}
        self._protected: set[ExpertKey] = set()
        self._used = self._reserved = 0
        self._tokens = self._seq = self._plan_at = 0
        self._routed: dict[int, int] = {}  # layer -> token count when it last routed
        self._jobs: list[_Job] = []
        self._gates: dict[int, torch.nn.Linear] = {}
        self._inputs: dict[int, torch.Tensor] = {}
        self._closed = False
        self._worker = threading.Thread(target=self._work, name="expert-io", daemon=True)
        self._worker.start()

    # -- public API --------------------------------------------------------------------------------
    @property
    def keys(self) -> list[ExpertKey]:
        return list(self.sizes)

    @property
    def resident_bytes(self) -> int:
        return self._used

    def resident_bits(self) -> dict[ExpertKey, int]:
        with self._cv:
            return {k: r.bits for k, r in self._res.items()}

    def forward(self, layer: int, expert: int, x: torch.Tensor) -> torch.Tensor:
        """``SparseMoE.expert_fn``: expert ``(layer, expert)`` applied to rows x (N, H)."""
        key = (layer, expert)
        res = self._acquire(key)
        try:
            return res.forward(x)
        finally:
            with self._cv:
                self._pins[key] -= 1
                if not self._pins[key]:
                    del self._pins[key]
                    self._cv.notify_all()  # a reader may be waiting for these bytes

    def on_route(self, layer: int, chosen: torch.Tensor) -> None:
        """``SparseMoE.on_route``: chosen (N, k) expert ids of layer ``layer``."""
        if layer not in self._by_layer:
            return
        counts: dict[ExpertKey, int] = {}
        for e in chosen.reshape(-1).tolist():
            counts[(layer, e)] = counts.get((layer, e), 0) + 1
        n_tok = chosen.shape[0]
        with self._cv:
            if layer == self._layers[0]:
                self._tokens += n_tok
            self._routed[layer] = self._tokens
            self._protected = set(counts)
            if self.hebf is not None:
                g = self.hebf.decay**n_tok
                heat = self.hotness
                for k in self._by_layer[layer]:
                    heat[k] *= g
                for k, c in counts.items():
                    if k in heat:
                        heat[k] += c
                if (
                    layer == self._layers[-1]
                    and self._tokens >= self._plan_at + self.hebf.replan_every
                ):
                    self._replan()
        if self.cfg.prefetch is not None:
            self._prefetch_after(layer)

    def warm(self) -> None:
        """Fill the budget before serving: HEBF loads its plan for uniform hotness, LRU loads
        experts in (layer, expert) order. Synchronous; not counted in the statistics."""
        if self.hebf is not None:
            target = hebf_plan(
                {k: 1.0 for k in self.sizes}, self.sizes, self.cfg.budget_bytes, min_bits=self.floor
            )
            self.plan = target
        else:
            target, left = {}, self.cfg.budget_bytes
            for k in self.sizes:
                if self.sizes[k][self.floor] <= left:
                    target[k], left = self.floor, left - self.sizes[k][self.floor]
        for k, b in target.items():
            if b > 0:
                with self._cv:
                    if not self._reserve(k, b, mode="warm"):
                        continue
                self._load(k, b)
        self.stats = CacheStats(peak_bytes=self.stats.peak_bytes)
        self.device.bytes_read, self.device.busy_s = 0, 0.0

    def set_gates(self, gates: dict[int, torch.nn.Linear]) -> None:
        self._gates = dict(gates)

    def observe(self, layer: int, x: torch.Tensor) -> None:
        """Input (B, T, H) of layer ``layer``'s MoE block, for predicting the next layer."""
        self._inputs[layer] = x.detach()

    def drain(self, timeout: float = 30.0) -> None:
        """Wait until no background read is queued or in flight (tests, benchmarks)."""
        with self._cv:
            if not self._cv.wait_for(lambda: not self._jobs and not self._pending, timeout):
                raise TimeoutError(f"expert reads still pending after {timeout}s")

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._worker.join(timeout=10)
        self.ckpt.close()

    def report(self) -> dict[str, Any]:
        out = self.stats.as_dict()
        out.update(
            bytes_read=self.device.bytes_read,
            io_busy_s=round(self.device.busy_s, 4),
            resident_bytes=self._used,
            budget_bytes=self.cfg.budget_bytes,
        )
        return out

    # -- demand path -------------------------------------------------------------------------------
    def _acquire(self, key: ExpertKey) -> Resident:
        if key not in self.sizes:
            raise ConfigError("expert", f"layer/expert {key} is not held by this expert store")
        t0 = time.perf_counter()
        with self._cv:
            if key in self._res:
                self.stats.hits += 1
            elif key in self._pending:
                self.stats.waits += 1
            else:
                self.stats.misses += 1
            load, blocked = False, key not in self._res
            while key not in self._res:
                if key not in self._pending and self._reserve(key, self.floor, mode="demand"):
                    load = True
                    break
                # Every evictable byte is promised to reads in flight (or our read is in
                # flight): those reads finish without us, then we retry.
                self._cv.wait()
            if not load:
                res = self._pin(key)
        if load:
            res = self._load(key, self.floor, pin=True)
            if self.plan.get(key, 0) > self.floor:
                with self._cv:
                    self._push(_Job(1, self._next_seq(), key, self.plan[key], self._tokens))
        if blocked:
            self.stats.stall_s += time.perf_counter() - t0
        return res

    def _pin(self, key: ExpertKey) -> Resident:
        res = self._res[key]
        self._res.move_to_end(key)
        self._pins[key] = self._pins.get(key, 0) + 1
        self.stats.calls_by_bits[res.bits] = self.stats.calls_by_bits.get(res.bits, 0) + 1
        return res

    # -- budget ------------------------------------------------------------------------------------
    def _reserve(self, key: ExpertKey, bits: int, *, mode: str) -> bool:
        """Under the lock: make room for ``key`` at ``bits`` and reserve it (marks it pending).

        ``mode`` says whom we may take bytes from: ``demand`` (a routed expert is missing: any
        unpinned expert, coldest / least recent first), ``prefetch`` (not the experts the current
        layer routed to), ``plan`` (only bytes the current plan does not want), ``warm`` (none).
        """
        cur = self._res.get(key)
        need = self.sizes[key][bits] - (cur.nbytes if cur is not None else 0)
        if need <= 0 or key in self._pending:
            return False
        if not self._make_room(need, key, mode):
            return False
        self._reserved += need
        self._pending.add(key)
        return True

    def _victims(self, exclude: ExpertKey, mode: str) -> list[tuple[ExpertKey, int]]:
        """(expert, width to shrink it to) in the order bytes are taken."""
        if mode == "warm":
            return []
        if self.hebf is None:
            order = list(self._res)  # least recently used first
        else:
            order = sorted(self._res, key=lambda k: (self.hotness[k], k))  # coldest first
        out = []
        for k in order:
            if k == exclude or k in self._pins or k in self._pending:
                continue
            if mode != "demand" and k in self._protected:
                continue
            bits = self._res[k].bits
            if mode == "plan":
                if bits > self.plan.get(k, 0):
                    out.append((k, self.plan.get(k, 0)))
            elif self.hebf is not None and bits > self.floor:
                out.append((k, self.floor))  # coldest first: its extra planes, then itself
                out.append((k, 0))
            else:
                out.append((k, 0))
        return out

    def _make_room(self, need: int, key: ExpertKey, mode: str) -> bool:
        free = self.cfg.budget_bytes - self._used - self._reserved
        if free >= need:
            return True
        plan: list[tuple[ExpertKey, int]] = []
        bits_now: dict[ExpertKey, int] = {}
        for k, to in self._victims(key, mode):  # dry run: take nothing unless enough
            was = bits_now.get(k, self._res[k].bits)
            if to >= was:
                continue
            free += self.sizes[k][was] - (self.sizes[k][to] if to else 0)
            bits_now[k] = to
            plan.append((k, to))
            if free >= need:
                break
        if free < need:
            return False
        for k, to in plan:
            self._shrink(k, to)
        return True

    def _shrink(self, key: ExpertKey, bits: int) -> None:
        res = self._res[key]
        if bits == 0:
            del self._res[key]
            self._used -= res.nbytes
            self.stats.evictions += 1
            return
        new = res.narrowed(bits, self.sizes[key][bits])
        self._res[key] = new
        self._used -= res.nbytes - new.nbytes
        self.stats.downgrades += 1

    # -- reads -------------------------------------------------------------------------------------
    def _load(self, key: ExpertKey, bits: int, *, pin: bool = False) -> Resident:
        """Read planes ``cur..bits-1`` (or the int8 codes) of a reserved, pending expert and
        install it."""
        f = self.ckpt.files[key]
        with self._cv:
            cur = self._res.get(key)
        first = cur.bits if cur is not None else 0
        reserved = self.sizes[key][bits] - (cur.nbytes if cur is not None else 0)
        nbytes = (bits - first) * f.plane_bytes + (f.scale_bytes if cur is None else 0)

        def read() -> tuple[torch.Tensor | None, torch.Tensor]:
            scales = f.read_scale_block() if cur is None else None
            return scales, f.read_codes() if f.layout == "bytes" else f.read_planes(first, bits)

        try:
            scales, data = self.device.read(read, nbytes)
            new = self._merge(key, cur, bits, scales, data, f)
        except BaseException:
            with self._cv:
                self._reserved -= reserved
                self._pending.discard(key)
                self._cv.notify_all()
            raise
        with self._cv:
            self._reserved -= reserved
            self._pending.discard(key)
            self._res[key] = new
            self._used += new.nbytes - (cur.nbytes if cur is not None else 0)
            self.stats.peak_bytes = max(self.stats.peak_bytes, self._used + self._reserved)
            if cur is not None:
                self.stats.upgrades += 1
            out = self._pin(key) if pin else new
            self._cv.notify_all()
        return out

    def _merge(
        self,
        key: ExpertKey,
        cur: Resident | None,
        bits: int,
        scales: torch.Tensor | None,
        data: torch.Tensor,
        f: ExpertFile,
    ) -> Resident:
        if cur is not None:
            data, scales = _paged_rows(cur.data, data), cur.scales
        elif scales is None:  # a first read carries the expert's scales
            raise CorruptWeights(f"expert {key}: no scale block read")
        return Resident(
            bits=bits,
            scales=scales,
            index=f.index,
            data=data,
            nbytes=self.sizes[key][bits],
            codes=f.layout == "bytes",
        )

    # -- background work ---------------------------------------------------------------------------
    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def _push(self, job: _Job) -> None:
        heapq.heappush(self._jobs, job)
        self._cv.notify_all()

    def _wanted(self, job: _Job) -> bool:
        cur = self._res.get(job.key)
        if job.key in self._pending:
            return False
        if job.priority == 0:  # prefetch: useless once its layer has routed this token
            return cur is None and self._routed.get(job.key[0], -1) < job.token
        return self.plan.get(job.key, 0) >= job.bits > (cur.bits if cur is not None else 0)

    def _work(self) -> None:
        while True:
            with self._cv:
                while not self._closed and not self._jobs:
                    self._cv.wait()
                if self._closed:
                    return
                job = heapq.heappop(self._jobs)
                mode = "prefetch" if job.priority == 0 else "plan"
                go = self._wanted(job) and self._reserve(job.key, job.bits, mode=mode)
            if go:
                try:
                    self._load(job.key, job.bits)
                except Exception:  # the demand path re-reads and raises to the caller
                    logger.exception("background read of expert %s failed", job.key)

    def _prefetch_after(self, layer: int) -> None:
        later = [i for i in self._layers if i > layer]
        x = self._inputs.pop(layer, None)
        if not later or x is None or later[0] != layer + 1 or later[0] not in self._gates:
            return
        nxt = later[0]
        if all(k in self._res for k in self._by_layer.get(nxt, ())):
            return  # nothing to fetch (HEBF at a budget that covers every expert)
        with torch.no_grad():
            logits = self._gates[nxt](x.reshape(-1, x.shape[-1]))
            probs = torch.softmax(logits.float(), dim=-1).mean(0)
        prefetch = self.cfg.prefetch
        if prefetch is None:
            return
        top = probs.topk(min(prefetch.top, probs.numel())).indices.tolist()
        with self._cv:
            for e in top:
                key = (nxt, e)
                if key in self.sizes and key not in self._res and key not in self._pending:
                    self.stats.prefetched += 1
                    self._push(_Job(0, self._next_seq(), key, self.floor, self._tokens))

    # -- HEBF planning -----------------------------------------------------------------------------
    def _replan(self) -> None:
        """Under the lock: new plan; queue the reads it wants, hottest first.

        Planes the plan no longer wants are dropped lazily, when a planned read needs their
        bytes (``_victims(mode="plan")``): an expert whose hotness hovers at a boundary keeps its
        planes instead of being dropped and re-read every few tokens.
        """
        self._plan_at = self._tokens
        self.plan = hebf_plan(self.hotness, self.sizes, self.cfg.budget_bytes, min_bits=self.floor)
        self._jobs = [j for j in self._jobs if j.priority == 0]
        heapq.heapify(self._jobs)
        for k in sorted(self.plan, key=lambda k: -self.hotness[k]):
            cur = self._res.get(k)
            if self.plan[k] > (cur.bits if cur is not None else 0):
                self._push(_Job(1, self._next_seq(), k, self.plan[k], self._tokens))


def _zeros(layer: int, expert: int, x: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(x)


def attach(model: LlamaForCausalLM, cache: ExpertCache, *, placed: bool = False) -> None:
    """Route the model's experts through ``cache`` (layers it holds no expert of are left alone).

    ``placed``: the cache holds this rank's share of a tensor-parallel placement; an expert it
    does not hold (in any MoE layer) contributes zero, because another rank computes it and the
    post-MoE all-reduce adds it in. Without ``placed`` such a call raises instead: one device
    must never silently drop an expert.

    A compiled decode step installed before would read the experts' own weights and skip the
    store: it is dropped (``edge.fastpath.install`` again calls the store's block back)."""
    fastpath.uninstall(model)
    layers = model.model.layers
    held = {k[0] for k in cache.keys}
    keys = set(cache.keys)
    gates = {}
    for i, layer in enumerate(layers):
        moe = getattr(layer, "block_sparse_moe", None)
        if moe is None:
            continue
        if i not in held:
            if placed:
                moe.expert_fn = functools.partial(_zeros, i)
            continue
        if placed:
            moe.expert_fn = functools.partial(
                lambda i, e, x: cache.forward(i, e, x) if (i, e) in keys else _zeros(i, e, x), i
            )
        else:
            moe.expert_fn = functools.partial(cache.forward, i)
        moe.on_route = functools.partial(cache.on_route, i)
        gates[i] = moe.gate
        if cache.cfg.prefetch is not None:
            moe.register_forward_pre_hook(lambda _m, args, i=i: cache.observe(i, args[0]))
    cache.set_gates(gates)


def open_store(
    root: str | Path,
    cfg: ExpertStoreConfig,
    *,
    experts: Iterable[ExpertKey] | None = None,
    warm: bool = True,
) -> tuple[LlamaForCausalLM, ExpertCache]:
    """Load a nested checkpoint for serving: backbone in memory, experts through a cache.

    Every check (manifest, shapes against config.json, file sizes, checksums when
    ``cfg.verify_on_open``, the budget against one expert) runs here, before the first token.
    """
    ckpt = NestedCheckpoint(
        root, experts=list(experts) if experts is not None else None, verify=cfg.verify_on_open
    )
    try:
        cache = ExpertCache(ckpt, cfg)
    except BaseException:
        ckpt.close()
        raise
    model = load_backbone(root)
    attach(model, cache)
    if warm:
        cache.warm()
    return model, cache
