"""Per-device shard files (``lowband edge split``) and loading one rank's slice of a model.

Split directory layout (``format`` 1)::

    OUT/config.json                HF config of the whole model
    OUT/lowband_split.json         {"format": 1, "dtype": ..., "plan": TPPlan.to_dict()}
    OUT/tokenizer.json | lowband_tokenizer.json   copied from the checkpoint
    OUT/rank{r}/head.safetensors   embedding, final norm, LM head (rank 0 only)
    OUT/rank{r}/layer{i:05d}.safetensors   rank r's slice of layer i

A device copies only ``OUT/rank{r}`` (plus the two json files). One file per layer is what lets
the sliding window (``edge.window``) map, populate and evict a layer as one unit.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence, cast

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from edge import fastpath
from edge.formats.gguf_arch import is_gguf
from edge.formats.quantized_checkpoint import (
    QuantLayout,
    apply_quant_layout,
    fuse_quant_rows,
    is_quant_tensor,
    quant_slice,
    read_layout,
)
from edge.formats.split_layout import (
    SPLIT_MARKER,
    assign_tensors,
    head_file,
    layer_file,
    split_dtype,
    wanted_tensors,
)
from edge.quant.embedding import GGMLEmbedding, QuantEmbedding
from edge.quant.linear import repack_for_batches
from edge.tp import HEAD_KEYS, Reduce, TPPlan, make_plan, shard, slice_of, take
from edge.window import MappedFile, WindowScheduler, attach, window_for_budget
from lowband.errors import ConfigError
from lowband.models.config import ModelConfig
from lowband.models.llama import LlamaForCausalLM, fuse_projections, rope_inv_freq
from lowband.models.weights import is_renamed, split_fused, weight_files

logger = logging.getLogger(__name__)

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "lowband_tokenizer.json",
    "generation_config.json",
)
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def is_split_dir(path: str | Path) -> bool:
    return (Path(path) / SPLIT_MARKER).exists()


def _split_meta(path: str | Path) -> dict[str, Any]:
    return json.loads((Path(path) / SPLIT_MARKER).read_text())


def read_split_meta(path: str | Path) -> tuple[TPPlan, str]:
    meta = _split_meta(path)
    if meta.get("format") != 1:
        raise ConfigError("model_dir", f"{path}: unknown split format {meta.get('format')}")
    return TPPlan.from_dict(meta["plan"]), meta["dtype"]


def _plan(
    cfg: ModelConfig, world: int, weights: Sequence[float] | None, layout: QuantLayout | None
) -> TPPlan:
    # A packed down_proj is split on whole quantization groups.
    return make_plan(cfg, world, weights, ffn_unit=max(8, layout.group) if layout else 8)


def _spec(
    key: str, plan: TPPlan, rank: int, layout: QuantLayout | None
) -> tuple[int, int, int] | bool:
    """:func:`slice_of` for any stored tensor, packed ones included."""
    if layout is not None and is_quant_tensor(key):
        base = key.rpartition(".")[0] + ".weight"
        return quant_slice(key, slice_of(base, plan, rank), layout)
    return slice_of(key, plan, rank)


def _cast(key: str, t: torch.Tensor, dt: torch.dtype) -> torch.Tensor:
    """Floating tensors to the run dtype; packed weights and their fp16 scales stay as stored."""
    return t if is_quant_tensor(key) or not t.is_floating_point() else t.to(dt)


def split_checkpoint(
    model_dir: str | Path,
    out_dir: str | Path,
    devices: int,
    weights: Sequence[float] | None = None,
    dtype: str | None = None,
) -> Path:
    """Write per-device, per-layer shard files for a ``devices``-way tensor-parallel split.
    Reads the checkpoint one layer at a time through the safetensors memory map."""
    src, out = Path(model_dir), Path(out_dir)
    if is_gguf(src):  # the file's blocks kept as they are (edge.formats.gguf_split)
        from edge.formats.gguf_split import split_gguf

        return split_gguf(src, out, devices, weights, dtype)
    cfg = ModelConfig.from_json(src)
    dname = dtype or cfg.torch_dtype
    dt = split_dtype(dname)
    layout = read_layout(cfg)
    plan = _plan(cfg, devices, weights, layout)
    by_layer: dict[int | None, list[tuple[Path, str]]] = {}
    for f in weight_files(src):
        with safe_open(str(f), framework="pt") as sf:
            for key in sf.keys():
                m = _LAYER.match(key)
                by_layer.setdefault(int(m.group(1)) if m else None, []).append((f, key))
    out.mkdir(parents=True, exist_ok=True)
    for r in range(devices):
        (out / f"rank{r}").mkdir(exist_ok=True)
    for layer in [None, *range(cfg.num_hidden_layers)]:
        full: dict[str, torch.Tensor] = {}
        for f, key in by_layer.get(layer, []):
            if key.endswith("rotary_emb.inv_freq"):
                continue
            with safe_open(str(f), framework="pt") as sf:
                full[key] = sf.get_tensor(key)
        if layer is not None and not full:
            raise ConfigError("model_dir", f"{src} has no tensors for layer {layer}")
        # the runtime's names (Phi-3's fused q/k/v and gate/up split, Qwen3-MoE's experts
        # renamed): what slice_of knows and what the split's loader fills
        full = {k: t for key, whole in full.items() for k, t in split_fused(cfg, key, whole)}
        for r in range(devices):
            part = {}
            for key, t in full.items():
                spec = _spec(key, plan, r, layout)
                if spec is False:
                    continue
                part[key] = _cast(key, take(t, spec), dt).contiguous()
            if layer is None:
                embed = full.get("model.embed_tokens.weight")
                if r > 0 and cfg.tie_word_embeddings and plan.vocab_split and embed is not None:
                    a, b = plan.vocab_rows(r, cfg.vocab_size)  # a tied head: rows of the embedding
                    part["lm_head.weight"] = _cast("lm_head.weight", embed[a:b], dt).contiguous()
                if r == 0 or part:
                    save_file(part, str(head_file(out, r)), metadata={"format": "pt"})
            else:
                save_file(part, str(layer_file(out, r, layer)), metadata={"format": "pt"})
    hf = json.loads((src / "config.json").read_text())
    hf["torch_dtype"] = dname
    (out / "config.json").write_text(json.dumps(hf, indent=2, sort_keys=True))
    (out / SPLIT_MARKER).write_text(
        json.dumps({"format": 1, "dtype": dname, "plan": plan.to_dict()}, indent=2)
    )
    for name in TOKENIZER_FILES:
        if (src / name).exists():
            shutil.copy(src / name, out / name)
    return out


@dataclass(frozen=True, kw_only=True)
class WindowConfig:
    """Sliding window over layer blocks. Exactly one of ``window`` (W, blocks resident) or
    ``memory_budget_mb`` (W is derived from it) is set."""

    window: int | None = None
    memory_budget_mb: float | None = None
    loader_cores: tuple[int, ...] | None = None  # CPU cores of the prefetch thread (None: inherit)

    def __post_init__(self) -> None:
        if (self.window is None) == (self.memory_budget_mb is None):
            raise ConfigError("window", "set exactly one of window or memory_budget_mb")
        if self.window is not None and self.window < 1:
            raise ConfigError("window", f"must be >= 1, got {self.window}")
        if self.memory_budget_mb is not None and self.memory_budget_mb <= 0:
            raise ConfigError("memory_budget_mb", f"must be > 0, got {self.memory_budget_mb}")

    def blocks(self, block_bytes: Sequence[int], fixed_bytes: int) -> int:
        """W for blocks of these sizes: the set window, or as many as the budget holds next to
        ``fixed_bytes`` of always-resident weights; never more than there are blocks."""
        w = self.window
        if w is None:
            # cast: exactly one of window and memory_budget_mb is set (__post_init__)
            budget_mb = cast(float, self.memory_budget_mb)
            w = window_for_budget(int(budget_mb * 2**20), block_bytes, fixed_bytes)
        return min(w, len(block_bytes))


@dataclass
class LoadedShard:
    """One rank's model slice; ``scheduler`` is set when weights stream through a window."""

    model: LlamaForCausalLM
    plan: TPPlan
    rank: int
    scheduler: WindowScheduler | None = None
    store: Any = None  # edge.moe.store.ExpertCache of a nested MoE (its experts live there)
    reduce: Reduce | None = None  # the all-reduce hook the layers use (TP; None alone)

    def close(self) -> None:
        if self.scheduler is not None:
            self.scheduler.close()
        if self.store is not None:
            self.store.close()

    def store_report(self) -> dict | None:
        """The expert store's statistics (None for a dense model)."""
        return {**self.store.report(), "devices_reporting": 1} if self.store is not None else None

    def repack(self, mode: str) -> int:
        """Keep the slice's K-quant weights also in the batch GEMM's layout
        (:func:`repack_for_batches`): ``mode`` "on", "auto" (if the copy fits half the memory
        available now) or "off". Streamed (window) and swapped (expert store) weights are left
        as they are. Returns the bytes added."""
        if mode not in REPACK_MODES:
            raise ConfigError("repack", f"must be one of {REPACK_MODES}, got {mode!r}")
        if mode == "off" or self.scheduler is not None or self.store is not None:
            return 0
        budget = available_memory() // 2 if mode == "auto" else 1 << 62
        added = repack_for_batches(self.model, budget)
        if added:
            if getattr(self.model, "fast_decode", None) is not None:
                fastpath.install(self.model)  # its tables point at the weights: rebuilt
            logger.info(
                "rank %d: repacked K-quant weights for batches: %.0f MiB more memory",
                self.rank,
                added / 2**20,
            )
        return added


REPACK_MODES = ("auto", "on", "off")


def available_memory() -> int:
    """MemAvailable from /proc/meminfo (bytes); 1 GiB where that cannot be read."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 2**30


def load_shard(
    model_dir: str | Path,
    rank: int = 0,
    world: int = 1,
    *,
    weights: Sequence[float] | None = None,
    dtype: str | None = None,
    reduce: Reduce | None = None,
    window: WindowConfig | None = None,
    fuse: bool = True,
    fast: bool = True,
    layers: tuple[int, int] | None = None,
) -> LoadedShard:
    """Build rank ``rank``'s slice on the meta device and load only that slice.

    ``model_dir`` is a split directory (the plan comes from it), a plain HF checkpoint (the
    plan is made here from ``weights``; slices are read through the safetensors memory map) or
    a GGUF file. The sliding window needs a split directory or a GGUF file (its layers' blocks
    mapped from the file: ``edge.formats.gguf_window``); ``layers`` (a pipeline stage's
    ``(lo, hi)``, GGUF only) limits the window to those decoder layers.

    ``fuse``: q/k/v and gate/up as one matmul each. ``fast``: single-token decode through the
    compiled step (``edge.fastpath``) where the model qualifies; weights streamed through a
    window (fewer blocks resident than layers) stay on the eager path."""
    d = Path(model_dir)
    if layers is not None and (window is None or not is_gguf(d)):
        raise ConfigError("layers", "a window over some layers needs a GGUF file and a window")
    if is_gguf(d):
        if window is not None:
            return _gguf_window(d, rank, world, weights, reduce, dtype, window, fast, layers)
        from edge.formats.gguf import load_gguf_shard

        model, plan = load_gguf_shard(
            d,
            rank,
            world,
            weights=weights,
            reduce=reduce,
            dtype=split_dtype(dtype) if dtype else None,
        )
        return _in_memory(model, plan, rank, reduce, fuse, fast)
    cfg = ModelConfig.from_json(d)
    packed = _split_meta(d).get("packed") if is_split_dir(d) else None
    if packed is not None:  # a split of a GGUF file: its blocks as stored
        from edge.formats.gguf_split import load_gguf_split

        if window is not None:
            raise ConfigError(
                "window",
                f"{d} is a split of a GGUF file, which loads whole; for the sliding window "
                "split the output of 'lowband edge convert' instead",
            )
        plan, file_dtype = read_split_meta(d)
        if plan.world != world:
            raise ConfigError("devices", f"{d} was split for {plan.world} devices, not {world}")
        dt = split_dtype(dtype or file_dtype)
        model = load_gguf_split(d, cfg, plan, packed[str(rank)], rank, dt, reduce)
        return _in_memory(model, plan, rank, reduce, fuse, fast)
    layout = read_layout(cfg)
    if is_split_dir(d):
        plan, file_dtype = read_split_meta(d)
        if plan.world != world:
            raise ConfigError("devices", f"{d} was split for {plan.world} devices, not {world}")
        if weights is not None and tuple(float(w) for w in weights) != plan.weights:
            raise ConfigError("weights", f"{d} was split with weights {list(plan.weights)}")
    else:
        plan, file_dtype = _plan(cfg, world, weights, layout), cfg.torch_dtype
        if window is not None:
            raise ConfigError(
                "window",
                f"the sliding window streams per-layer files: run "
                f"'lowband edge split {d} --devices {world} --out DIR' first",
            )
    dt = split_dtype(dtype or file_dtype)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    if layout is not None:
        apply_quant_layout(model, layout)
    shard(model, plan, rank, world, reduce)
    model.to(dtype=dt)
    if is_split_dir(d):
        sched = _load_split(model, d, rank, dt, file_dtype, window, layout)
    else:
        _load_from_checkpoint(model, d, plan, rank, dt, layout)
        sched = None
    model.inv_freq = rope_inv_freq(cfg)
    if cfg.tie_word_embeddings and rank == 0:
        tie_head(model, plan)
    if fuse and sched is None:
        # Lean decode: one GEMV for q/k/v and one for gate/up. Only for weights in anonymous
        # memory; mapped (window / zero-copy resident) weights would be copied.
        fuse_projections(model, fuse_quant_rows)
    if fast and (sched is None or not sched.streams):
        # Fully resident weights (in memory, or every block of a split mapped and never
        # evicted) stay where they are: the compiled step can read them. A real window moves
        # blocks in and out around each layer's hooks, which the compiled step would bypass.
        fastpath.install(model)
    return LoadedShard(model=model.eval(), plan=plan, rank=rank, scheduler=sched, reduce=reduce)


def _gguf_window(
    path: Path,
    rank: int,
    world: int,
    weights: Sequence[float] | None,
    reduce: Reduce | None,
    dtype: str | None,
    window: WindowConfig,
    fast: bool,
    layers: tuple[int, int] | None,
) -> LoadedShard:
    """A GGUF file's slice with its layers streamed through the window from one mapping of
    the file. Never fused (a fused q/k/v is a copy); compiled only where every block stays."""
    from edge.formats.gguf_window import gguf_scheduler, load_gguf_window

    model, plan, mapping = load_gguf_window(
        path,
        rank,
        world,
        weights=weights,
        reduce=reduce,
        dtype=split_dtype(dtype) if dtype else None,
    )
    if model.config.tie_word_embeddings and rank == 0:
        tie_head(model, plan)
    sched = gguf_scheduler(model, mapping, window.blocks, layers, window.loader_cores)
    if fast and not sched.streams and layers is None:
        fastpath.install(model)
    return LoadedShard(model=model.eval(), plan=plan, rank=rank, scheduler=sched, reduce=reduce)


def _in_memory(
    model: LlamaForCausalLM, plan: TPPlan, rank: int, reduce: Reduce | None, fuse: bool, fast: bool
) -> LoadedShard:
    """A shard whose weights are all in memory (a GGUF file or a split of one), made ready."""
    if model.config.tie_word_embeddings and rank == 0:
        tie_head(model, plan)  # rank 0's head rows are a view of the embedding, not a copy
    if fuse:
        fuse_projections(model, fuse_quant_rows)
    if fast:
        fastpath.install(model)
    return LoadedShard(model=model.eval(), plan=plan, rank=rank, reduce=reduce)


def tie_head(model: LlamaForCausalLM, plan: TPPlan) -> None:
    """Rank 0 of a model with tied embeddings: its LM head is (its rows of) the embedding, a
    view, never a copy. A quantized embedding (a GGUF file's) gives a quantized head over the
    same bytes."""
    a, b = plan.vocab_rows(0, model.config.vocab_size)
    table = model.model.embed_tokens
    if isinstance(table, (GGMLEmbedding, QuantEmbedding)):
        model.lm_head = table.tied_head(a, b - a)
        return
    emb = table.weight
    if (a, b) == (0, emb.shape[0]):
        model.lm_head.weight = emb
    else:
        model.lm_head.weight = nn.Parameter(emb.detach()[a:b], requires_grad=False)


def _load_from_checkpoint(
    model: LlamaForCausalLM,
    d: Path,
    plan: TPPlan,
    rank: int,
    dt: torch.dtype,
    layout: QuantLayout | None = None,
) -> None:
    wanted = wanted_tensors(model)
    tensors: dict[str, torch.Tensor] = {}
    for f in weight_files(d):
        with safe_open(str(f), framework="pt") as sf:
            for key in sf.keys():
                if is_renamed(model.config, key):
                    # Phi-3's fused q/k/v and gate/up (read whole: each part is cut on its own
                    # heads or columns), Qwen3-MoE's expert names: the runtime's tensors
                    for name, whole in split_fused(model.config, key, sf.get_tensor(key)):
                        spec = _spec(name, plan, rank, layout)
                        if spec is not False:
                            tensors[name] = _cast(name, take(whole, spec), dt).contiguous()
                    continue
                if key not in wanted:
                    continue
                src, spec = key, _spec(key, plan, rank, layout)
                if (
                    key == "model.embed_tokens.weight"
                    and rank > 0
                    and plan.vocab_split
                    and model.config.tie_word_embeddings
                ):  # a tied head: embedding rows
                    key, spec = "lm_head.weight", slice_of("lm_head.weight", plan, rank)
                if spec is False:
                    continue
                if spec is True:
                    t = sf.get_tensor(src)
                else:  # read only this rank's rows/columns from the mapped file
                    dim, a, b = spec
                    sl = sf.get_slice(src)
                    t = sl[a:b] if dim == 0 else sl[:, a:b]
                tensors[key] = _cast(key, t, dt).contiguous()
    assign_tensors(model, tensors, tied_head=rank == 0)


def _load_split(
    model: LlamaForCausalLM,
    d: Path,
    rank: int,
    dt: torch.dtype,
    file_dtype: str,
    window: WindowConfig | None,
    layout: QuantLayout | None = None,
) -> WindowScheduler | None:
    tensors: dict[str, torch.Tensor] = {}
    if rank == 0 or head_file(d, rank).exists():
        with safe_open(str(head_file(d, rank)), framework="pt") as sf:
            tensors.update({k: _cast(k, sf.get_tensor(k), dt) for k in sf.keys()})
    n = model.config.num_hidden_layers
    paths = [layer_file(d, rank, i) for i in range(n)]
    for p in paths:
        if not p.exists():
            raise ConfigError(
                "model_dir", f"missing shard file {p}: copy rank{rank}/ from the split"
            )
    if dt != split_dtype(file_dtype):
        if window is not None:
            raise ConfigError(
                "dtype",
                f"the sliding window maps weights as stored ({file_dtype}); "
                f"split again with --dtype to run in another dtype",
            )
        for p in paths:  # converting: copy into memory
            with safe_open(str(p), framework="pt") as sf:
                tensors.update({k: _cast(k, sf.get_tensor(k), dt) for k in sf.keys()})
        assign_tensors(model, tensors)
        return None
    assign_tensors(model, tensors, partial=True)
    files = [MappedFile(p) for p in paths]
    for i, (layer, f) in enumerate(zip(model.model.layers, files)):
        attach(layer, f.tensors, f"model.layers.{i}.")
    if window is None:
        # Fully resident, zero-copy: the same huge-page mapping as the window, all populated
        # once, never evicted (faster to load and to run than a 4 KiB anonymous copy).
        return WindowScheduler(list(model.model.layers), files, n)
    fixed = sum(t.numel() * t.element_size() for t in tensors.values())
    w = window.blocks([f.size for f in files], fixed)
    logger.info("sliding window: %d of %d layer blocks resident", w, n)
    return WindowScheduler(list(model.model.layers), files, w, window.loader_cores)


__all__ = [
    "split_checkpoint",
    "load_shard",
    "LoadedShard",
    "WindowConfig",
    "is_split_dir",
    "read_split_meta",
    "HEAD_KEYS",
]
