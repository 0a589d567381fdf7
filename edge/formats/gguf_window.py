"""The sliding window (``edge.window``) straight on a GGUF file: ``--window`` and
``--memory-budget-mb`` with no split directory.

The file is memory-mapped once (:class:`edge.window.MappedBytes`). Each decoder layer's tensors
that the runtime uses as stored become zero-copy views of that mapping: ggml blocks (Q4_K,
Q6_K, Q5_0, ... kept as ``GGMLWeight``) and F32 tensors when the run dtype is float32. A
layer's window block is the byte ranges of its views (:class:`edge.window.MappedSpans`: no
layout is assumed, tensors lying apart give several spans), populated and evicted by the
:class:`edge.window.WindowScheduler` as a split directory's layer files are.

What needs a transform is copied once and stays resident: Q8_0 / Q4_0 (repacked into
``PackedWeight``, the scales split out), llama-architecture ``attn_q`` / ``attn_k`` (rows
un-permuted), Gemma's norms (shifted), F16/BF16 tensors or another run dtype (converted), fused
Phi-3 / MoE tensors (split), and every tensor outside the layers (token embedding, final norm,
LM head). Those are the *fixed* bytes next to which ``memory_budget_mb`` sizes the window.

A tensor-parallel rank slices the model after it is built: an output-row slice of a view is
still a view (its block is only its rows' bytes), an input-column slice is a copy (fixed). A
pipeline stage maps only the layers of its range; the others are views it never touches.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable, Sequence

import torch
from torch import nn

from edge.formats.gguf import load_gguf_shard
from edge.tp import Reduce, TPPlan
from edge.window import PAGE, MappedBytes, MappedSpans, WindowScheduler
from lowband.errors import ConfigError
from lowband.models.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)


def _tensors(module: nn.Module) -> list[torch.Tensor]:
    """``module``'s parameters and buffers, each once."""
    seen: dict[int, torch.Tensor] = {}
    for t in (*module.parameters(), *module.buffers()):
        if t is not None and not t.is_meta:
            seen.setdefault(id(t), t)
    return list(seen.values())


def fixed_bytes(model: LlamaForCausalLM, mapping: MappedBytes, layers: range) -> int:
    """Bytes of ``model``'s weights, other decoder layers than ``layers`` left out, that are not
    views of ``mapping``: whole storages, counted once each (a row slice kept from a copied
    tensor holds all of it)."""
    others = {
        id(t) for i, m in enumerate(model.model.layers) if i not in layers for t in _tensors(m)
    }
    storages: dict[int, int] = {}
    for t in _tensors(model):
        if id(t) not in others and not mapping.holds(t):
            s = t.untyped_storage()
            storages[s.data_ptr()] = s.nbytes()
    return sum(storages.values())


def layer_blocks(model: LlamaForCausalLM, mapping: MappedBytes, layers: range) -> list[MappedSpans]:
    """One window block per decoder layer of ``layers``: the spans of its views of ``mapping``.
    Where the layers' hulls do not interleave (llama.cpp writes a layer's tensors back to
    back), evicting a block drops its whole hull: the file bytes of a tensor that was copied
    instead, mapped along with a huge folio, do not stay mapped for good."""
    blocks = [
        MappedSpans(mapping, [t for t in _tensors(model.model.layers[i]) if mapping.holds(t)])
        for i in layers
    ]
    hulls = sorted(b.hull for b in blocks if b.spans)
    if all(h[1] - PAGE <= n[0] for h, n in zip(hulls, hulls[1:])):  # (an edge page shared)
        for b in blocks:
            b.evict_hull()
    else:
        logger.warning(
            "%s: the layers' tensors interleave in the file; a copied tensor's bytes may stay "
            "mapped next to the window's blocks",
            mapping.path.name,
        )
    return blocks


def _compact(model: LlamaForCausalLM, mapping: MappedBytes) -> None:
    """A decoder layer's copied tensors that are a slice of a bigger copy (a TP rank's output
    rows of an un-permuted or repacked matrix) become copies of just that slice, so a rank keeps
    only its own rows of them too. The mapping's views are left as they are."""

    def sliced(t: torch.Tensor | None) -> bool:
        return (
            t is not None
            and not t.is_meta
            and not mapping.holds(t)
            and t.untyped_storage().nbytes() > t.numel() * t.element_size()
        )

    for layer in model.model.layers:
        for m in layer.modules():
            for name, p in m._parameters.items():
                if p is not None and sliced(p):
                    m._parameters[name] = nn.Parameter(p.detach().clone(), requires_grad=False)
            for name, b in m._buffers.items():
                if b is not None and sliced(b):
                    m._buffers[name] = b.clone()


def stage_sizes(path: str | Path) -> tuple[list[int], int, int, bool]:
    """From the file's header, the bytes a pipeline stage's memory budget counts
    (``edge.cluster.layout.budget_ranges``): each decoder layer's tensors as stored, the token
    embedding with the other tensors outside the layers (final norm, rope factors), the LM
    head (the embedding's bytes where the head is tied) and whether it is tied."""
    from edge.formats.bounds import open_gguf

    reader = open_gguf(path, tokenizer=False)
    layers: dict[int, int] = {}
    embed = head = 0
    tied = True
    for t in reader.tensors:
        n = int(t.n_bytes)
        if t.name.startswith("blk."):
            i = int(t.name.split(".")[1])
            layers[i] = layers.get(i, 0) + n
        elif t.name == "output.weight":
            head, tied = n, False
        else:
            embed += n
            if t.name == "token_embd.weight" and tied:
                head = n
    if sorted(layers) != list(range(len(layers))) or not layers:
        raise ConfigError("model", f"{Path(path).name}: decoder layers missing in the file")
    return [layers[i] for i in range(len(layers))], embed, head, tied


def load_gguf_window(
    path: str | Path,
    rank: int,
    world: int,
    *,
    weights: Sequence[float] | None,
    reduce: Reduce | None,
    dtype: torch.dtype | None,
) -> tuple[LlamaForCausalLM, TPPlan, MappedBytes]:
    """Rank ``rank``'s slice of the GGUF file at ``path`` with its decoder layers' usable
    tensors as views of one mapping of the file (returned with the model)."""
    mapping = MappedBytes(Path(path))
    model, plan = load_gguf_shard(
        path, rank, world, weights=weights, reduce=reduce, dtype=dtype, view=mapping.view
    )
    _compact(model, mapping)
    return model, plan, mapping


def gguf_scheduler(
    model: LlamaForCausalLM,
    mapping: MappedBytes,
    blocks_for: Callable[[Sequence[int], int], int],
    layers: tuple[int, int] | None = None,
    loader_cores: Sequence[int] | None = None,
) -> WindowScheduler:
    """The window over ``model``'s layers ``layers`` (all by default): ``blocks_for(sizes,
    fixed)`` gives W (``shardio.WindowConfig.blocks``) from the blocks' mapped bytes and the
    bytes that stay resident."""
    n = model.config.num_hidden_layers
    lo, hi = layers if layers is not None else (0, n)
    if not 0 <= lo < hi <= n:
        raise ConfigError("layers", f"need 0 <= lo < hi <= {n}, got [{lo}, {hi})")
    blocks = layer_blocks(model, mapping, range(lo, hi))
    fixed = fixed_bytes(model, mapping, range(lo, hi))
    w = blocks_for([b.size for b in blocks], fixed)
    logger.info(
        "sliding window on %s: %d of %d layer blocks resident (%.1f MiB mapped per block at "
        "most, %.1f MiB always resident)",
        mapping.path.name,
        w,
        hi - lo,
        max(b.size for b in blocks) / 2**20,
        fixed / 2**20,
    )
    layer_list = [model.model.layers[i] for i in range(lo, hi)]
    return WindowScheduler(layer_list, blocks, w, loader_cores)


__all__ = ["load_gguf_window", "stage_sizes", "gguf_scheduler", "fixed_bytes", "layer_blocks"]
