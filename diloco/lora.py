"""LoRA under Streaming DiLoCo (Hu et al., 2021, arXiv 2106.09685), through ``peft``.

Each target ``nn.Linear`` gets low-rank adapters ``W + (α/r)·B·A`` (A: (r, K), B: (N, r), B
starts at zero so the model starts as it was); the base weights are frozen. The trainer plans
its fragments over the parameters that require a gradient, so only the adapters get a
pseudo-gradient, an outer optimizer and a place on the wire: a sync is megabytes for a model
of gigabytes. Every worker injects the adapters under the run's seed, so θ_g starts identical
everywhere. :func:`merged` folds the adapters into the base weights for export.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn

from lowband.errors import ConfigError

# Attention and MLP projections of the Llama family (lowband's model and HF's share the names).
DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True, kw_only=True)
class LoraConfig:
    """Low-rank adapters on the target linears; only they train and sync."""

    rank: int  # r
    alpha: int | None = None  # α; the update is scaled by α/r (default α = 2r)
    targets: tuple[str, ...] = DEFAULT_TARGETS  # module names (their last component)
    dropout: float = 0.0

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ConfigError("lora.rank", f"r must be >= 1, got {self.rank}")
        if self.alpha is not None and not self.alpha > 0:
            raise ConfigError("lora.alpha", f"must be > 0, got {self.alpha}")
        if not self.targets:
            raise ConfigError("lora.targets", "name at least one module")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError("lora.dropout", f"must be in [0, 1), got {self.dropout}")


def with_lora(model: nn.Module, cfg: LoraConfig, seed: int) -> nn.Module:
    """``model`` with adapters injected in place (A initialised under ``seed``, identical on
    every worker), every other parameter frozen."""
    import peft

    present = {name.rsplit(".", 1)[-1] for name, m in model.named_modules()}
    if not present & set(cfg.targets):
        raise ConfigError("lora.targets", f"none of {list(cfg.targets)} is a module of the model")
    pcfg = peft.LoraConfig(
        r=cfg.rank,
        lora_alpha=cfg.alpha if cfg.alpha is not None else 2 * cfg.rank,
        lora_dropout=cfg.dropout,
        target_modules=[t for t in cfg.targets if t in present],
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        peft.inject_adapter_in_model(pcfg, model)
    for name, p in model.named_parameters():
        p.requires_grad_("lora_" in name)
    return model


def merged(model: nn.Module) -> nn.Module:
    """A copy of ``model`` with every adapter folded into its base weight and the adapter
    modules replaced by the base linears: the plain model, for export."""
    from peft.tuners.lora import LoraLayer

    out = copy.deepcopy(model)
    for name, mod in list(out.named_modules()):
        if isinstance(mod, LoraLayer):
            mod.merge()
            parent, _, child = name.rpartition(".")
            setattr(out.get_submodule(parent) if parent else out, child, mod.get_base_layer())
    for p in out.parameters():
        p.requires_grad_(True)
    return out


def trainable(model: nn.Module) -> int:
    """Parameters that train (and sync)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
