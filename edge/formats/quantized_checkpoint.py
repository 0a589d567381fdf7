"""Weight-only quantized checkpoint directories (I/O): ``lowband edge quantize MODEL --bits 8|4``.

A quantized checkpoint is an ordinary HF directory (``config.json`` + ``model.safetensors``)
whose quantized linears store ``<name>.qweight`` and ``<name>.scales`` (the packed layout of
``edge.quant.formats``) instead of ``<name>.weight``, and whose ``config.json`` carries::

    "quantization_config": {"quant_method": "lowband", "bits": 4, "group": 64,
                            "modules": ["model.layers.0.self_attn.q_proj", ...]}

Everything that loads a model (``edge.shardio.load_shard``, hence generate / serve / run /
split / TP workers / the sliding window) first calls :func:`apply_quant_layout` on the meta
model, so the packed buffers are loaded as stored and never requantized. Tensor-parallel
slicing of packed weights is :func:`quant_slice` (whole groups only).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
from safetensors.torch import save_file
from torch import nn

from edge.formats.gguf_arch import is_gguf
from edge.quant import QuantLinear, quantize_modules
from edge.quant.formats import GROUPS, PackedWeight, QuantError, QuantSpec
from lowband.errors import ConfigError
from lowband.models.config import ModelConfig
from lowband.models.llama import LlamaForCausalLM

QUANT_KEY = "quantization_config"
METHOD = "lowband"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "lowband_tokenizer.json",
    "generation_config.json",
)


@dataclass(frozen=True, kw_only=True)
class QuantConfig:
    """Weight-only quantization of the dense linears. ``bits``: 8 (Q8_0-style) or 4 (Q4_0-style
    groups); ``group``: G, weights per fp16 scale along the input dimension; ``skip``: fnmatch
    patterns of linears left in floating point (e.g. ``lm_head``)."""

    bits: int = 8
    group: int = 64
    skip: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.bits not in (4, 8):
            raise ConfigError("bits", f"must be 8 or 4, got {self.bits}")
        if self.group not in GROUPS:
            raise ConfigError("group", f"must be one of {GROUPS}, got {self.group}")


@dataclass(frozen=True)
class QuantLayout:
    """What ``config.json`` says about a quantized checkpoint."""

    bits: int
    group: int
    modules: tuple[str, ...]


def read_layout(cfg: ModelConfig) -> QuantLayout | None:
    """The quantization of a checkpoint, None for a floating-point one. Refuses a foreign
    ``quantization_config`` (GPTQ, AWQ, bitsandbytes...) instead of loading garbage."""
    qc = cfg.extra.get(QUANT_KEY)
    if qc is None:
        return None
    if not isinstance(qc, dict) or qc.get("quant_method") != METHOD:
        method = qc.get("quant_method") if isinstance(qc, dict) else qc
        raise ConfigError(
            QUANT_KEY,
            f"quant_method {method!r} is not supported; lowband loads "
            f"its own ('lowband edge quantize') and GGUF Q8_0/Q4_0 files",
        )
    return QuantLayout(int(qc["bits"]), int(qc["group"]), tuple(qc["modules"]))


def apply_quant_layout(model: nn.Module, layout: QuantLayout) -> None:
    """Replace the listed linears by empty ``QuantLinear``s of the same shape (on ``meta`` when
    the model is), ready for ``load_state_dict(..., assign=True)``."""
    for name in layout.modules:
        lin = model.get_submodule(name)
        if not isinstance(lin, nn.Linear):
            raise ConfigError(QUANT_KEY, f"{name} (in its modules) is not a linear layer")
        meta = lin.weight.is_meta
        with torch.device("meta" if meta else "cpu"):
            q = QuantLinear(
                lin.in_features, lin.out_features, lin.bias is not None, layout.bits, layout.group
            )
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, q)


def quantize_model(model: LlamaForCausalLM, cfg: QuantConfig) -> QuantLayout:
    """Quantize ``model``'s linears in place; the embedding stays in floating point (a lookup
    reads one row per token, quantizing it saves memory but no time)."""
    try:
        quantize_modules(model, cfg.bits, cfg.group, skip=cfg.skip)
    except QuantError as exc:
        raise ConfigError("group", str(exc)) from None
    names = tuple(n for n, m in model.named_modules() if isinstance(m, QuantLinear))
    return QuantLayout(cfg.bits, cfg.group, names)


def save_quantized(
    model: LlamaForCausalLM,
    layout: QuantLayout,
    out_dir: str | Path,
    src_dir: str | Path | None = None,
) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    hf = model.config.to_hf_dict()
    hf[QUANT_KEY] = {
        "quant_method": METHOD,
        "bits": layout.bits,
        "group": layout.group,
        "modules": list(layout.modules),
    }
    state = {
        k: v.detach().contiguous()
        for k, v in model.state_dict().items()
        if not (model.config.tie_word_embeddings and k == "lm_head.weight")
    }
    (out / "config.json").write_text(json.dumps(hf, indent=2, sort_keys=True))
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    if src_dir is not None:
        for name in TOKENIZER_FILES:
            if (Path(src_dir) / name).exists():
                shutil.copy(Path(src_dir) / name, out / name)
    return out


def quantize_checkpoint(model_dir: str | Path, out_dir: str | Path, cfg: QuantConfig) -> Path:
    """``lowband edge quantize MODEL --bits B --group G --out DIR``."""
    from lowband.models.weights import load_pretrained

    if is_gguf(model_dir):  # its own format: edge.formats.gguf.quantize_gguf
        raise ConfigError(
            "model_dir", f"{model_dir} is a GGUF file: quantize it with quantize_gguf"
        )
    mcfg = ModelConfig.from_json(model_dir)
    if read_layout(mcfg) is not None:
        raise ConfigError("model_dir", f"{model_dir} is already quantized")
    if mcfg.is_moe:
        raise ConfigError("model_dir", "a mixture of experts is quantized with --nested")
    model = load_pretrained(model_dir, dtype=torch.float32)
    layout = quantize_model(model, cfg)
    if mcfg.tie_word_embeddings and "lm_head" in layout.modules:
        # The head is now packed and the embedding is not: they are no longer one tensor.
        model.config = untied_config(mcfg)
    return save_quantized(model, layout, out_dir, model_dir)


def untied_config(cfg: ModelConfig) -> ModelConfig:
    from dataclasses import replace

    return replace(cfg, tie_word_embeddings=False)


def is_quant_tensor(name: str) -> bool:
    return name.endswith((".qweight", ".scales"))


def quant_slice(
    name: str, spec: tuple[int, int, int] | bool, layout: QuantLayout
) -> tuple[int, int, int] | bool:
    """Translate a :func:`edge.tp.slice_of` answer for ``<linear>.weight`` into the slice of
    its packed tensor ``name`` (``.qweight`` or ``.scales``): rows are rows; a column range
    [a, b) must fall on group boundaries and becomes bytes (Q4: two weights a byte) or groups."""
    if spec is True or spec is False:
        return spec
    dim, a, b = spec
    if dim == 0:
        return spec
    g = layout.group
    if a % g or b % g:
        raise ConfigError(
            "devices",
            f"{name}: the split at columns [{a}, {b}) cuts a quantization "
            f"group of {g}; use fewer devices or a smaller --group",
        )
    if name.endswith(".scales"):
        return (1, a // g, b // g)
    return (1, a // 2, b // 2) if layout.bits == 4 else spec


def fuse_quant_rows(mods: Sequence[nn.Module]) -> nn.Module | None:
    """Row-concatenate ``QuantLinear``s sharing bits, group and input width into one (rows are
    independent in the packed layout, so this is exact); the originals are re-pointed at views."""
    qs = [m for m in mods if isinstance(m, QuantLinear)]
    if len(qs) != len(mods):
        return None
    first = qs[0]
    if not all(
        m.bits == first.bits and m.group == first.group and m.in_features == first.in_features
        for m in qs
    ):
        return None
    if any(m.qweight.is_meta for m in qs):
        return None
    n = sum(m.out_features for m in qs)
    packed = PackedWeight(
        QuantSpec(first.bits, first.group, (n, first.in_features)),
        torch.cat([m.qweight for m in qs]),
        torch.cat([m.scales for m in qs]),
    )
    bias = None
    if any(m.bias is not None for m in qs):
        bias = torch.cat(
            [m.bias if m.bias is not None else torch.zeros(m.out_features) for m in qs]
        )
    fused = QuantLinear.from_packed(
        packed, bias, max_kernel_rows=first.max_kernel_rows, use_kernel=first.use_kernel
    )
    a = 0
    for m in qs:
        k = m.out_features
        m.qweight, m.scales = fused.qweight[a : a + k], fused.scales[a : a + k]
        if m.bias is not None and fused.bias is not None:  # fused has one when any of them has
            m.bias = fused.bias[a : a + k]
        a += k
    return fused
