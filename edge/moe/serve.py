"""A bit-nested MoE in the edge runtime: one device, tensor parallel with placed experts, and the
sliding window over the backbone.

A nested directory (``lowband edge quantize --nested``) holds a backbone (``model.safetensors``:
attention, norms, routers, embedding, head) and one plane file per expert. Serving it loads the
backbone like any checkpoint and routes every expert call through an
:class:`edge.moe.store.ExpertCache` under a byte budget.

Tensor parallelism (TPI-LLM §3.1 for the backbone, expert parallelism for the MoE blocks):
attention is head-split by :func:`edge.tp.shard` as for a dense model, but experts are *placed*
whole on ranks (:func:`place_experts`) instead of sliced. Every rank runs the replicated router,
computes only the routed experts it holds (the others contribute zero) and the post-MoE
all-reduce that TP runs anyway sums the contributions: the same two all-reduces per layer, no
extra message. The result equals one device exactly up to float summation order, because the
routed mixture ``sum_e w_e * expert_e(x)`` is a sum over experts and a sum does not care where
each term was computed. Each rank opens only its experts' files with a share of the budget
proportional to the int8 bytes it holds (:func:`rank_budgets`).

Decode runs through the compiled step (``edge.fastpath``) with each MoE block called back into
Python for the store's experts; a sliding window keeps the eager layers.

Sliding window (one device): the backbone's layer tensors are streamed through
:class:`edge.window.WindowScheduler` as regions of the one mapped ``model.safetensors`` (each
layer's tensors are contiguous in it), so the device holds W backbone blocks plus the expert
budget.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch
from safetensors import safe_open

from edge import fastpath
from edge.formats.split_layout import assign_tensors
from edge.moe.checkpoint import MANIFEST, ExpertKey, NestedCheckpoint
from edge.moe.planes import is_expert_key
from edge.moe.quant import WIDTHS
from edge.moe.store import (
    ExpertCache,
    ExpertStoreConfig,
    HEBFConfig,
    LRUConfig,
    PrefetchConfig,
    attach,
)
from edge.shardio import LoadedShard, WindowConfig
from edge.tp import Reduce, TPPlan, make_plan, shard, slice_of
from edge.window import MappedFile, MappedRegion, WindowScheduler
from lowband.errors import ConfigError, CorruptWeights
from lowband.models.config import ModelConfig
from lowband.models.llama import LlamaForCausalLM, rope_inv_freq

logger = logging.getLogger(__name__)

MB = 1e6  # expert budgets are decimal megabytes, as in ``lowband edge moe-generate``
POLICIES = ("hebf", "lru")


def is_nested_dir(path: str | Path) -> bool:
    return (Path(path) / MANIFEST).exists()


@dataclass(frozen=True, kw_only=True)
class ExpertServeConfig:
    """How a nested MoE's experts are served. ``budget_mb`` (M) is the expert budget of the
    whole cluster; each rank gets the share of it that its placed experts take at int8."""

    budget_mb: float
    policy: str = "hebf"  # hebf | lru
    lru_bits: int = 8  # LRU: the one width every expert is served at
    min_bits: int = 2  # HEBF: the narrowest width (what a miss loads)
    prefetch: int = 2  # experts the next layer's router is asked for (0: off)
    read_mb_per_s: float | None = None  # B_io: model a storage device this fast
    verify: bool = True  # checksum every plane file when opening

    def __post_init__(self) -> None:
        if not self.budget_mb > 0:
            raise ConfigError("expert_budget_mb", f"must be > 0, got {self.budget_mb}")
        if self.policy not in POLICIES:
            raise ConfigError("expert_policy", f"must be one of {POLICIES}, got {self.policy!r}")
        if self.prefetch < 0:
            raise ConfigError("expert_prefetch", f"must be >= 0, got {self.prefetch}")
        self.store_config(1)  # validates the widths and the read rate

    @property
    def floor_bits(self) -> int:
        return self.lru_bits if self.policy == "lru" else self.min_bits

    def store_config(self, budget_bytes: int) -> ExpertStoreConfig:
        policy = (
            LRUConfig(bits=self.lru_bits)
            if self.policy == "lru"
            else HEBFConfig(min_bits=self.min_bits)
        )
        return ExpertStoreConfig(
            budget_bytes=budget_bytes,
            policy=policy,
            prefetch=PrefetchConfig(top=self.prefetch) if self.prefetch else None,
            read_mb_per_s=self.read_mb_per_s,
            verify_on_open=self.verify,
        )

    def to_dict(self) -> dict[str, Any]:
        """Plain values for the cluster's msgpack ``assign`` message."""
        return {
            "budget_mb": self.budget_mb,
            "policy": self.policy,
            "lru_bits": self.lru_bits,
            "min_bits": self.min_bits,
            "prefetch": self.prefetch,
            "read_mb_per_s": self.read_mb_per_s,
            "verify": self.verify,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ExpertServeConfig:
        return cls(
            budget_mb=float(d["budget_mb"]),
            policy=str(d["policy"]),
            lru_bits=int(d["lru_bits"]),
            min_bits=int(d["min_bits"]),
            prefetch=int(d["prefetch"]),
            read_mb_per_s=None if d.get("read_mb_per_s") is None else float(d["read_mb_per_s"]),
            verify=bool(d["verify"]),
        )


# ---- placement (pure) --------------------------------------------------------------------------
def place_experts(
    n_layers: int, n_experts: int, world: int, weights: Sequence[float] | None = None
) -> dict[int, list[ExpertKey]]:
    """Whole experts to ranks: ``{rank: [(layer, expert), ...]}``, every expert exactly once.

    Smooth weighted round robin over the experts in (layer, expert) order: each step every rank
    earns its weight, the richest takes the expert and pays the total. So rank r gets a share
    of experts within one of ``weights[r] / sum(weights)`` of the total, and consecutive experts
    of a layer go to different ranks: a layer's top-k experts are usually computed on k
    different devices in parallel. With equal weights it is plain round robin continued across
    layers, so the leftovers of one layer go to other ranks in the next."""
    if n_layers < 1 or n_experts < 1:
        raise ConfigError("experts", f"need >= 1 layer and expert, got {n_layers} x {n_experts}")
    if world < 1:
        raise ConfigError("devices", f"must be >= 1, got {world}")
    w = [1.0] * world if weights is None else [float(x) for x in weights]
    if len(w) != world or any(not x > 0 for x in w):
        raise ConfigError("weights", f"need {world} positive weights, got {list(w)}")
    total = sum(w)
    credit = [0.0] * world
    out: dict[int, list[ExpertKey]] = {r: [] for r in range(world)}
    for layer in range(n_layers):
        for e in range(n_experts):
            for r in range(world):
                credit[r] += w[r]
            r = max(range(world), key=lambda i: (credit[i], -i))
            credit[r] -= total
            out[r].append((layer, e))
    return out


def rank_budgets(
    placement: dict[int, list[ExpertKey]], int8_bytes: dict[ExpertKey, int], budget_bytes: int
) -> dict[int, int]:
    """Each rank's share of ``budget_bytes``, proportional to the int8 bytes of its experts
    (a rank holding no expert gets 0)."""
    total = sum(int8_bytes[k] for keys in placement.values() for k in keys)
    return {
        r: (budget_bytes * sum(int8_bytes[k] for k in keys) // total if keys else 0)
        for r, keys in placement.items()
    }


def manifest_sizes(root: str | Path) -> dict[ExpertKey, dict[int, int]]:
    """{expert: {bits: bytes}} from the manifest (no file opened; checked again on open)."""
    try:
        manifest = json.loads((Path(root) / MANIFEST).read_text())
        return {
            (int(e["layer"]), int(e["expert"])): {int(b): int(n) for b, n in e["bytes"].items()}
            for e in manifest["experts"]
        }
    except FileNotFoundError:
        raise ConfigError(
            "model_dir",
            f"{root} has no {MANIFEST}: convert it with "
            "`lowband edge quantize MODEL_DIR --nested --out DIR`",
        ) from None
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise CorruptWeights(f"{Path(root) / MANIFEST}: unreadable manifest ({exc})") from None


@dataclass(frozen=True)
class RankExperts:
    keys: list[ExpertKey]
    budget_bytes: int


def plan_ranks(
    root: str | Path, world: int, weights: Sequence[float] | None, cfg: ExpertServeConfig
) -> dict[int, RankExperts]:
    """Placement and budget share of every rank; refuses (ConfigError) a budget in which some
    rank cannot hold its largest expert at the narrowest width the policy serves."""
    mcfg = ModelConfig.from_json(root)
    if not mcfg.is_moe:
        raise ConfigError("model_dir", f"{root} is not a mixture-of-experts model")
    sizes = manifest_sizes(root)
    need_widths = {cfg.floor_bits} if cfg.policy == "lru" else set(WIDTHS)
    for k, s in sizes.items():
        if not need_widths <= set(s):
            raise ConfigError(
                "expert_policy",
                f"{root}: expert {k} is stored at widths {sorted(s)}; "
                f"{cfg.policy} needs {sorted(need_widths)}",
            )
    placement = (
        place_experts(mcfg.num_hidden_layers, mcfg.num_local_experts, world, weights)
        if world > 1
        else {0: sorted(sizes)}
    )
    missing = {k for keys in placement.values() for k in keys} - sizes.keys()
    if missing:
        raise CorruptWeights(f"{root}/{MANIFEST} lacks expert (layer, expert) {min(missing)}")
    budget = int(cfg.budget_mb * MB)
    shares = rank_budgets(placement, {k: s[8] for k, s in sizes.items()}, budget)
    out = {}
    for r, keys in placement.items():
        if keys:
            biggest = max(sizes[k][cfg.floor_bits] for k in keys)
            if biggest > shares[r]:
                # The smallest total budget at which every rank's share holds its biggest expert.
                need = (
                    max(
                        max(sizes[k][cfg.floor_bits] for k in ks) * budget / max(1, shares[q])
                        for q, ks in placement.items()
                        if ks
                    )
                    if budget
                    else 0
                )
                raise ConfigError(
                    "expert_budget_mb",
                    f"{cfg.budget_mb:g} MB of experts"
                    f"{'' if world == 1 else f' over {world} devices'} "
                    f"cannot hold one expert at {cfg.floor_bits} bits on device {r} (its share "
                    f"{shares[r] / MB:.3f} MB, one expert {biggest / MB:.3f} MB); raise "
                    f"--expert-budget-mb to at least {need / MB:.3f}",
                )
        out[r] = RankExperts(keys=keys, budget_bytes=shares[r])
    return out


_SUMMED = (
    "hits",
    "misses",
    "waits",
    "prefetched",
    "upgrades",
    "downgrades",
    "evictions",
    "stall_s",
    "peak_bytes",
    "bytes_read",
    "io_busy_s",
    "resident_bytes",
    "budget_bytes",
)


def merge_reports(reports: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One report for a cluster from each device's ``ExpertCache.report()``: counters, bytes and
    seconds are summed (``stall_s``: device-seconds blocked on reads; ``peak_bytes``: the sum of
    per-device peaks, an upper bound of the simultaneous total), rates are recomputed."""
    out: dict[str, Any] = {k: 0 for k in _SUMMED}
    calls: dict[str, int] = {}
    for rep in reports:
        for k in _SUMMED:
            out[k] += rep.get(k, 0)
        for b, n in rep.get("calls_by_bits", {}).items():
            calls[str(b)] = calls.get(str(b), 0) + int(n)
    n_calls = sum(calls.values())
    out["stall_s"] = round(out["stall_s"], 4)
    out["io_busy_s"] = round(out["io_busy_s"], 4)
    out["hit_rate"] = out["hits"] / max(1, out["hits"] + out["misses"])
    out["mean_bits_per_call"] = (
        round(sum(int(b) * n for b, n in calls.items()) / n_calls, 3) if n_calls else 0.0
    )
    out["calls_by_bits"] = dict(sorted(calls.items(), key=lambda kv: int(kv[0])))
    out["devices_reporting"] = len(reports)
    return out


# ---- loading one rank --------------------------------------------------------------------------
def load_nested_shard(
    root: str | Path,
    rank: int = 0,
    world: int = 1,
    *,
    experts: ExpertServeConfig,
    weights: Sequence[float] | None = None,
    reduce: Reduce | None = None,
    window: WindowConfig | None = None,
    dtype: str | None = None,
) -> LoadedShard:
    """Rank ``rank``'s backbone slice (head-split attention, replicated norms and routers) and an
    expert store holding only its placed experts under its budget share. Every check (budget,
    manifest, shapes, checksums) runs here, before the first token."""
    d = Path(root)
    if dtype not in (None, "float32"):
        raise ConfigError("dtype", "a nested MoE is served in float32 (experts decode to float32)")
    if window is not None and world > 1:
        raise ConfigError(
            "window",
            "the sliding window over a nested MoE's backbone runs on one "
            "device; with --devices > 1 use --expert-budget-mb alone",
        )
    mine = plan_ranks(d, world, weights, experts)[rank]
    cfg = ModelConfig.from_json(d)
    # The nested MoE keeps the whole LM head on the master (its loaders read it there).
    plan = make_plan(cfg, world, weights, vocab_parallel=False)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    shard(model, plan, rank, world, reduce)
    sched: WindowScheduler | None = None
    if window is not None:
        sched = _load_backbone_window(model, d, window)
    else:
        _load_backbone(model, d, plan, rank)
    model.inv_freq = rope_inv_freq(cfg)
    if cfg.tie_word_embeddings and rank == 0:
        model.lm_head.weight = model.model.embed_tokens.weight
    cache = None
    try:
        if mine.keys:
            ckpt = NestedCheckpoint(d, experts=mine.keys, verify=experts.verify)
            try:
                cache = ExpertCache(ckpt, experts.store_config(mine.budget_bytes))
            except BaseException:
                ckpt.close()
                raise
            attach(model, cache, placed=world > 1)
            cache.warm()
        else:
            attach_nothing(model)
    except BaseException:
        if sched is not None:
            sched.close()
        raise
    if sched is None:  # the compiled step, the store's experts called back from it
        fastpath.install(model)
    return LoadedShard(
        model=model.eval(), plan=plan, rank=rank, scheduler=sched, store=cache, reduce=reduce
    )


def attach_nothing(model: LlamaForCausalLM) -> None:
    """A rank that holds no expert at all (more ranks than experts): every MoE block of it
    contributes zero to the all-reduce."""
    for layer in model.model.layers:
        moe = getattr(layer, "block_sparse_moe", None)
        if moe is not None:
            moe.expert_fn = lambda e, x: torch.zeros_like(x)


def _backbone_names(model: LlamaForCausalLM) -> set[str]:
    """Parameters this rank holds outside the experts (what model.safetensors must provide)."""
    tied = model.config.tie_word_embeddings
    return {
        k
        for k, p in model.named_parameters(remove_duplicate=False)
        if not is_expert_key(k)
        and not (p.is_meta and p.numel() == 0)
        and not (tied and k == "lm_head.weight")
    }


def _load_backbone(model: LlamaForCausalLM, d: Path, plan: TPPlan, rank: int) -> None:
    """Read this rank's slice of every backbone tensor through the safetensors memory map."""
    wanted = _backbone_names(model)
    tensors: dict[str, torch.Tensor] = {}
    with safe_open(str(d / "model.safetensors"), framework="pt") as sf:
        for key in sf.keys():
            if key not in wanted:
                continue
            spec = slice_of(key, plan, rank)
            if spec is True:
                t = sf.get_tensor(key)
            elif spec is False:  # not held: shard() left it empty, so it is not wanted
                continue
            else:
                dim, a, b = spec
                sl = sf.get_slice(key)
                t = sl[a:b] if dim == 0 else sl[:, a:b]
            tensors[key] = t.float().contiguous()
    _check_backbone(d, wanted, tensors.keys())
    assign_tensors(model, tensors, partial=True)


def _check_backbone(d: Path, wanted: set[str], got) -> None:
    missing = wanted - set(got)
    if missing:
        raise CorruptWeights(
            f"{d}/model.safetensors lacks {len(missing)} backbone tensors, e.g. "
            f"{sorted(missing)[:3]}"
        )


def _load_backbone_window(
    model: LlamaForCausalLM, d: Path, window: WindowConfig
) -> WindowScheduler:
    """Embedding/norm/head copied into memory; each decoder layer's tensors a region of the one
    mapped model.safetensors, streamed by the window."""
    wanted = _backbone_names(model)
    mapped = MappedFile(d / "model.safetensors")
    if any(t.dtype != torch.float32 for k, t in mapped.tensors.items() if k in wanted):
        raise ConfigError(
            "window",
            f"{d}/model.safetensors is not float32: the window maps "
            "weights as stored and a nested MoE computes in float32",
        )
    _check_backbone(d, wanted, mapped.tensors.keys())
    n = model.config.num_hidden_layers
    head = {k: mapped.tensors[k].clone() for k in wanted if not k.startswith("model.layers.")}
    assign_tensors(model, head, partial=True)
    mapped.evict()  # the copy above mapped the head's pages; from here only blocks are mapped
    regions = []
    for i in range(n):
        prefix = f"model.layers.{i}."
        names = [k for k in wanted if k.startswith(prefix)]
        regions.append(MappedRegion(mapped, names))
    from edge.window import attach as attach_tensors

    for i, (layer, reg) in enumerate(zip(model.model.layers, regions)):
        attach_tensors(layer, reg.tensors, f"model.layers.{i}.")
    fixed = sum(t.numel() * t.element_size() for t in head.values())
    w = window.blocks([r.size for r in regions], fixed)
    logger.info("sliding window: %d of %d backbone blocks resident", w, n)
    return WindowScheduler(list(model.model.layers), regions, w, window.loader_cores)
