"""File layout of a split checkpoint directory, shared by the checkpoint splitter
(:mod:`edge.shardio`) and the GGUF splitter (:mod:`edge.formats.gguf_split`): the marker file,
where each rank's layers and head go, and how a loaded slice is filled from saved tensors."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from lowband.errors import ConfigError
from lowband.models.llama import LlamaForCausalLM
from lowband.models.weights import DTYPES

SPLIT_MARKER = "lowband_split.json"


def layer_file(out: Path, rank: int, layer: int) -> Path:
    return out / f"rank{rank}" / f"layer{layer:05d}.safetensors"


def head_file(out: Path, rank: int = 0) -> Path:
    """Rank 0: embedding, final norm and its LM-head rows; rank r > 0 (a vocabulary-parallel
    head): the final norm and its LM-head rows."""
    return out / f"rank{rank}" / "head.safetensors"


def split_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ConfigError("dtype", f"unknown dtype {name!r}; one of {sorted(DTYPES)}")
    return DTYPES[name]


def wanted_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every tensor a checkpoint fills: parameters and persistent buffers (packed weights)."""
    out: dict[str, torch.Tensor] = dict(model.named_parameters(remove_duplicate=False))
    for mname, mod in model.named_modules(remove_duplicate=False):
        for bname, b in mod._buffers.items():
            if b is not None and bname not in mod._non_persistent_buffers_set:
                out[f"{mname}.{bname}" if mname else bname] = b
    return out


def assign_tensors(
    model: LlamaForCausalLM,
    tensors: dict[str, torch.Tensor],
    partial: bool = False,
    tied_head: bool = True,
) -> None:
    """``tied_head``: the LM head will be tied to the embedding afterwards (rank 0)."""
    missing = {
        k for k, p in wanted_tensors(model).items() if not p.is_meta or p.numel()
    } - tensors.keys()
    if model.config.tie_word_embeddings and tied_head:
        missing.discard("lm_head.weight")
    if not partial and missing:
        raise ConfigError(
            "weights", f"checkpoint lacks {len(missing)} tensors, e.g. {sorted(missing)[:3]}"
        )
    model.load_state_dict(tensors, strict=False, assign=True)
