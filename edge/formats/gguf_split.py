"""``lowband edge split FILE.gguf``: per-device, per-layer shard files that keep the file's
quantized blocks as they are.

The split directory has the layout of ``edge.shardio`` (``config.json``, ``lowband_split.json``,
``rank{r}/head.safetensors``, ``rank{r}/layer{i}.safetensors``) plus ``tokenizer.gguf``: the
file's metadata without tensors, so every device gets the same tokenizer and chat template.
A packed matrix is stored as its raw buffers (``GGMLLinear``: ``.blocks`` uint8 rows of ggml
blocks; ``QuantLinear`` from Q8_0/Q4_0: ``.qweight`` / ``.scales``), already sliced for the
rank on block boundaries, and ``lowband_split.json`` lists, per rank, each packed module with
its type and shape (``"packed"``), which safetensors cannot say. Nothing is requantized. A
quantized token embedding (rank 0) is stored the same way with ``"embedding": true``; a head
tied to it is not stored on rank 0 (it is the embedding's rows again at load).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from edge.formats.gguf import load_gguf_shard, write_tokenizer_gguf
from edge.formats.gguf_arch import TOKENIZER_GGUF
from edge.formats.split_layout import (
    SPLIT_MARKER,
    assign_tensors,
    head_file,
    layer_file,
    split_dtype,
    wanted_tensors,
)
from edge.quant import QuantLinear
from edge.quant.embedding import GGMLEmbedding, QuantEmbedding, packed_embedding
from edge.quant.formats import PackedWeight, QuantSpec
from edge.quant.ggml import GGMLWeight, ggml_type
from edge.quant.linear import GGMLLinear
from edge.tp import Reduce, TPPlan, shard
from lowband.errors import ConfigError
from lowband.models.config import ModelConfig
from lowband.models.llama import LlamaForCausalLM, rope_inv_freq


def _packed_spec(mod: Any) -> dict[str, Any] | None:
    if isinstance(mod, GGMLLinear):
        w = mod.weight_blocks
        split = {"k_chunk": mod.k_chunk} if mod.k_chunk else {}  # its split-K leaves (edge.tp)
        return {"ggml": w.type.name, "shape": list(w.shape), **split}
    if isinstance(mod, QuantLinear):
        return {"bits": mod.bits, "group": mod.group, "shape": [mod.out_features, mod.in_features]}
    if isinstance(mod, GGMLEmbedding):
        kind: dict[str, Any] = {"ggml": mod.qtype.name}
    elif isinstance(mod, QuantEmbedding):
        kind = {"bits": mod.bits, "group": mod.group}
    else:
        return None
    return {**kind, "shape": [mod.num_embeddings, mod.embedding_dim], "embedding": True}


def split_gguf(
    src: Path, out: Path, devices: int, weights: Sequence[float] | None, dtype: str | None
) -> Path:
    """Rank r's slice of every tensor of ``src``, one file per layer (see the module doc)."""

    dname = dtype or "float32"
    dt = split_dtype(dname)
    out.mkdir(parents=True, exist_ok=True)
    packed: dict[str, dict[str, Any]] = {}
    plan: TPPlan | None = None
    for r in range(devices):
        model, plan = load_gguf_shard(src, r, devices, weights=weights, dtype=dt)
        packed[str(r)] = {
            n: s for n, m in model.named_modules() if (s := _packed_spec(m)) is not None
        }
        state = model.state_dict()
        if model.config.tie_word_embeddings and r == 0:
            # the embedding itself (float or packed), tied again at load (shardio.tie_head)
            packed[str(r)].pop("lm_head", None)
            state = {k: t for k, t in state.items() if not k.startswith("lm_head.")}
        files: dict[Path, dict[str, torch.Tensor]] = {head_file(out, r): {}}
        for i in range(model.config.num_hidden_layers):
            files[layer_file(out, r, i)] = {}
        for key, t in state.items():
            if t.is_meta:
                continue
            parts = key.split(".")
            f = layer_file(out, r, int(parts[2])) if parts[1] == "layers" else head_file(out, r)
            files[f][key] = t.contiguous()
        (out / f"rank{r}").mkdir(exist_ok=True)
        for f, tensors in files.items():
            if tensors or f == head_file(out, 0):
                save_file(tensors, str(f), metadata={"format": "pt"})
        cfg = model.config
    assert plan is not None  # devices >= 1
    (out / "config.json").write_text(
        json.dumps({**cfg.to_hf_dict(), "torch_dtype": dname}, indent=2, sort_keys=True)
    )
    meta = {"format": 1, "dtype": dname, "plan": plan.to_dict(), "packed": packed}
    (out / SPLIT_MARKER).write_text(json.dumps(meta, indent=2))
    write_tokenizer_gguf(src, out / TOKENIZER_GGUF)
    return out


def _packed_module(
    spec: dict[str, Any], tensors: dict[str, torch.Tensor], name: str, dt: torch.dtype
) -> Any:
    bias = tensors.pop(name + ".bias", None)
    n, k = spec["shape"]
    w: GGMLWeight | PackedWeight
    if "ggml" in spec:
        w = GGMLWeight(ggml_type(spec["ggml"]), (n, k), tensors.pop(name + ".blocks"))
    else:
        q = QuantSpec(spec["bits"], spec["group"], (n, k))
        w = PackedWeight(q, tensors.pop(name + ".qweight"), tensors.pop(name + ".scales"))
    if spec.get("embedding"):
        return packed_embedding(w, dt)
    if isinstance(w, GGMLWeight):
        mod = GGMLLinear(w, bias)
        mod.split_k(int(spec.get("k_chunk", 0)))
        return mod
    return QuantLinear.from_packed(w, bias)


def load_gguf_split(
    d: Path,
    cfg: ModelConfig,
    plan: TPPlan,
    packed: dict[str, dict[str, Any]],
    rank: int,
    dt: torch.dtype,
    reduce: Reduce | None,
) -> LlamaForCausalLM:
    """Rank ``rank``'s model from a split of a GGUF file: the packed modules rebuilt from their
    stored buffers, everything else loaded as floats."""

    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    shard(model, plan, rank, plan.world, reduce)
    model.to(dtype=dt)
    tensors: dict[str, torch.Tensor] = {}
    paths = [head_file(d, rank)] + [layer_file(d, rank, i) for i in range(cfg.num_hidden_layers)]
    for p in paths:
        if not p.exists():
            if p == head_file(d, rank) and rank > 0:
                continue
            raise ConfigError(
                "model_dir", f"missing shard file {p}: copy rank{rank}/ from the split"
            )
        with safe_open(str(p), framework="pt") as sf:
            tensors.update({k: sf.get_tensor(k) for k in sf.keys()})
    for name, spec in packed.items():
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, _packed_module(spec, tensors, name, dt))
    floats = {k: t.to(dt) if t.is_floating_point() else t for k, t in tensors.items()}
    assign_tensors(model, floats, partial=True)  # the packed modules' buffers are set already
    left = {k for k, t in wanted_tensors(model).items() if t.is_meta and t.numel()}
    if cfg.tie_word_embeddings and rank == 0:
        left.discard("lm_head.weight")
    if left:
        raise ConfigError("model_dir", f"{d} rank{rank} lacks {sorted(left)[:3]}")
    model.inv_freq = rope_inv_freq(cfg)
    return model


__all__ = ["split_gguf", "load_gguf_split"]
