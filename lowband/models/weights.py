"""Hugging Face checkpoint I/O: ``config.json`` + ``model.safetensors`` (or a sharded index).

Loading builds the model on the ``meta`` device and then materialises parameters straight from
the memory-mapped safetensors files, so peak memory is one copy of the weights (none extra for
an fp32 checkpoint loaded as fp32 beyond the page cache).
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Iterator

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from lowband.errors import ConfigError
from lowband.models.bounds import check_checkpoint
from lowband.models.config import ModelConfig
from lowband.models.llama import LlamaForCausalLM, rope_inv_freq

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def weight_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a checkpoint directory, honouring a sharded index."""
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / s for s in shards]
    single = model_dir / "model.safetensors"
    if single.exists():
        return [single]
    found = sorted(model_dir.glob("*.safetensors"))
    if not found:
        raise ConfigError("model_dir", f"no *.safetensors in {model_dir}")
    return found


FUSED_FAMILIES = ("phi3",)  # checkpoints with fused qkv_proj / gate_up_proj
_FUSED = re.compile(r"^(model\.layers\.\d+\.)(self_attn\.qkv_proj|mlp\.gate_up_proj)\.weight$")
# Qwen3-MoE's names for the routed experts -> the runtime's (Mixtral's) names, so tensor
# parallelism, the expert store and quantization see one layout.
_QWEN_MOE = re.compile(
    r"^(model\.layers\.\d+\.)mlp\.(gate|experts\.\d+\.(gate|up|down)_proj)\.weight$"
)
_EXPERT_NAMES = {"gate": "w1", "up": "w3", "down": "w2"}


def is_renamed(cfg: ModelConfig, key: str) -> bool:
    """Whether :func:`split_fused` turns checkpoint tensor ``key`` into other names."""
    if cfg.model_type in FUSED_FAMILIES:
        return _FUSED.match(key) is not None
    return cfg.model_type == "qwen3_moe" and _QWEN_MOE.match(key) is not None


def split_fused(cfg: ModelConfig, key: str, t: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """A checkpoint tensor as the runtime's tensors. Phi-3 stores q/k/v as one ``qkv_proj``
    (rows q | k | v) and gate/up as one ``gate_up_proj`` (rows gate | up); the runtime keeps
    Llama's separate projections (so TP, quantization and the fused decode path are shared)
    and re-fuses them itself for decode. Qwen3-MoE's ``mlp.experts.E.gate_proj`` etc. become
    ``block_sparse_moe.experts.E.w1`` etc. Every other tensor passes through unchanged."""
    if not is_renamed(cfg, key):
        yield key, t
        return
    if cfg.model_type == "qwen3_moe":
        prefix, what, proj = _QWEN_MOE.match(key).groups()  # type: ignore[union-attr]
        if proj is None:
            yield f"{prefix}block_sparse_moe.gate.weight", t
        else:
            e = what.split(".")[1]
            yield f"{prefix}block_sparse_moe.experts.{e}.{_EXPERT_NAMES[proj]}.weight", t
        return
    prefix, what = _FUSED.match(key).groups()  # type: ignore[union-attr]
    if what == "self_attn.qkv_proj":
        nq, nkv = cfg.num_attention_heads * cfg.dim_per_head, cfg.n_kv_heads * cfg.dim_per_head
        if t.shape[0] != nq + 2 * nkv:
            raise ConfigError("weights", f"{key} has {t.shape[0]} rows, expected {nq + 2 * nkv}")
        q, k, v = t.split((nq, nkv, nkv))
        yield from ((f"{prefix}self_attn.{n}_proj.weight", x) for n, x in zip("qkv", (q, k, v)))
    else:
        if t.shape[0] != 2 * cfg.intermediate_size:
            raise ConfigError(
                "weights", f"{key} has {t.shape[0]} rows, expected {2 * cfg.intermediate_size}"
            )
        g, u = t.chunk(2)
        yield f"{prefix}mlp.gate_proj.weight", g
        yield f"{prefix}mlp.up_proj.weight", u


def fuse_for_checkpoint(cfg: ModelConfig, state: dict[str, torch.Tensor]) -> None:
    """The inverse of :func:`split_fused`, in place: the family's own checkpoint names."""
    if cfg.model_type == "qwen3_moe":
        back = {v: k for k, v in _EXPERT_NAMES.items()}
        for key in list(state):
            hit = re.match(r"^(model\.layers\.\d+\.)block_sparse_moe\.(.*)\.weight$", key)
            if hit is None:
                continue
            prefix, rest = hit.groups()
            if rest != "gate":  # experts.E.wN -> experts.E.{gate,up,down}_proj
                e, w = rest.split(".")[1:]
                rest = f"experts.{e}.{back[w]}_proj"
            state[f"{prefix}mlp.{rest}.weight"] = state.pop(key)
    if cfg.model_type not in FUSED_FAMILIES:
        return
    for i in range(cfg.num_hidden_layers):
        a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        qkv = [state.pop(f"{a}{n}_proj.weight") for n in "qkv"]
        state[f"{a}qkv_proj.weight"] = torch.cat(qkv).contiguous()
        gu = [state.pop(f"{m}{n}_proj.weight") for n in ("gate", "up")]
        state[f"{m}gate_up_proj.weight"] = torch.cat(gu).contiguous()


def save_pretrained(
    model: LlamaForCausalLM, out_dir: str | Path, *, dtype: torch.dtype | None = None
) -> Path:
    """Write ``config.json`` + ``model.safetensors`` in the layout ``transformers`` reads."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = model.config.to_hf_dict()
    state = {}
    for k, v in model.state_dict().items():
        if model.config.tie_word_embeddings and k == "lm_head.weight":
            continue
        t = v.detach()
        state[k] = (t.to(dtype) if dtype is not None else t).contiguous()
    fuse_for_checkpoint(model.config, state)
    if dtype is not None:
        cfg["torch_dtype"] = {v: k for k, v in DTYPES.items()}[dtype]
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def load_pretrained(
    model_dir: str | Path, *, dtype: torch.dtype | None = None, strict: bool = True
) -> LlamaForCausalLM:
    """Load a checkpoint into :class:`LlamaForCausalLM` (dtype defaults to the checkpoint's)."""
    d = Path(model_dir)
    cfg = ModelConfig.from_json(d)
    check_checkpoint(cfg, weight_files(d))  # config bounded by the headers, before building
    dtype = dtype or DTYPES.get(cfg.torch_dtype, torch.float32)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    expected = {
        k for k in model.state_dict() if not (cfg.tie_word_embeddings and k == "lm_head.weight")
    }
    tensors: dict[str, torch.Tensor] = {}
    for f in weight_files(d):
        with safe_open(str(f), framework="pt") as sf:
            for name in sf.keys():
                if not is_renamed(cfg, name) and name not in expected:
                    if strict and not name.endswith("rotary_emb.inv_freq"):
                        raise ConfigError("weights", f"{f.name} has unexpected tensor {name!r}")
                    continue
                for key, t in split_fused(cfg, name, sf.get_tensor(name)):
                    tensors[key] = t.to(dtype)
    missing = expected - tensors.keys()
    if missing:
        raise ConfigError(
            "weights", f"checkpoint lacks {len(missing)} tensors, e.g. {sorted(missing)[:3]}"
        )
    model.load_state_dict(tensors, strict=False, assign=True)
    model.inv_freq = rope_inv_freq(cfg)  # buffers are not in the checkpoint: rebuild off meta
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval()
