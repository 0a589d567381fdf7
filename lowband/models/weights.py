"""Hugging Face checkpoint I/O: ``config.json`` + ``model.safetensors`` (or a sharded index).

Loading builds the model on the ``meta`` device and then materialises parameters straight from
the memory-mapped safetensors files, so peak memory is one copy of the weights (none extra for
an fp32 checkpoint loaded as fp32 beyond the page cache).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from lowband.errors import ConfigError
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
    dtype = dtype or DTYPES.get(cfg.torch_dtype, torch.float32)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    expected = {
        k for k in model.state_dict() if not (cfg.tie_word_embeddings and k == "lm_head.weight")
    }
    tensors: dict[str, torch.Tensor] = {}
    for f in weight_files(d):
        with safe_open(str(f), framework="pt") as sf:
            for key in sf.keys():
                if key in expected:
                    tensors[key] = sf.get_tensor(key).to(dtype)
                elif strict and not key.endswith("rotary_emb.inv_freq"):
                    raise ConfigError("weights", f"{f.name} has unexpected tensor {key!r}")
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
