"""The lean decode step: one compiled call runs every decoder layer for one token.

Where the time went (``py-spy`` / ``torch.profiler`` on the ~56 M-parameter benchmark model, one
pinned core): eager PyTorch ran ~25 operators per layer for a single token (norm, fused q/k/v,
views, rotary, cache writes, attention, o_proj, SwiGLU, down_proj, residuals), and at 4-bit about
three quarters of the step was spent outside the matrix kernels, in the interpreter, the
dispatcher and allocation. :class:`FastDecode` hands the whole single-token pass to
``Decoder`` in ``edge/quant/csrc/decode.cpp``: the same arithmetic on the weights' memory, with
preallocated scratch and the KV cache written in place; prefill (many tokens) stays on PyTorch,
which is already efficient there, and both paths share one ``KVCache``.

:func:`install` attaches it to a loaded model (``model.fast_decode``, which
``LlamaForCausalLM.forward_layers`` and ``head`` use for one token) when everything it needs is
there: the C++ extension, float32 activations, a dense (non-MoE) model whose linears are float32
``nn.Linear`` or ``QuantLinear`` in memory. Otherwise the eager path keeps running and the reason
is returned (and logged), never an error. Tensor parallelism: the model's ``reduce`` hooks are
called from C++ between the blocks, so the same transport carries the partial sums.
"""

from __future__ import annotations

import logging
from typing import Any, cast

import torch
from torch import nn

from edge.quant import QuantLinear
from edge.quant import kernel as qkernel
from lowband.errors import PeerLost, ProtocolError, TransportTimeout
from lowband.models.config import ModelConfig
from lowband.models.llama import KVCache, LlamaForCausalLM
from transport.starlink import native_table

logger = logging.getLogger(__name__)

__all__ = ["FastDecode", "install", "uninstall", "unsupported_reason"]


def _lin(mod: nn.Module) -> tuple:
    """``(kind, weight | qweight, scales | None, group, bias | None)`` for the C++ side."""
    bias = getattr(mod, "bias", None)
    if bias is not None:
        bias = bias.detach().to(torch.float32).contiguous()
    if isinstance(mod, QuantLinear):
        return (mod.bits, mod.qweight.contiguous(), mod.scales.contiguous(), mod.group, bias)
    w = cast(torch.Tensor, mod.weight).detach()
    return (32, w if w.is_contiguous() else w.contiguous(), None, 0, bias)


def _lin_ok(mod: nn.Module | None) -> str | None:
    if mod is None:
        return "a projection is missing"
    if isinstance(mod, QuantLinear):
        return None if mod.qweight.device.type == "cpu" else "packed weights are not on the CPU"
    if type(mod) is not nn.Linear:
        return f"{type(mod).__name__} layers are not supported"
    w = mod.weight
    if w.is_meta:
        return "weights are not loaded (meta)"
    if w.device.type != "cpu":
        return f"weights live on {w.device}"
    if w.dtype != torch.float32:
        return f"{w.dtype} weights (the compiled step computes in float32)"
    return None


def unsupported_reason(model: LlamaForCausalLM) -> str | None:
    """Why :func:`install` would leave ``model`` on the eager path (None: it can be installed)."""
    cfg = model.config
    why = _family_reason(cfg)
    if why is not None:
        return f"{cfg.model_type}: {why} (the compiled step does Llama's maths only)"
    if not qkernel.available():
        return f"the C++ kernel is unavailable ({qkernel.unavailable_reason()})"
    if cfg.is_moe:
        return "routed-expert (MoE) layers run on the eager path"
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            if (
                norm.weight.is_meta
                or norm.weight.dtype != torch.float32
                or norm.weight.device.type != "cpu"
            ):
                return f"layer {i}: norm weights must be float32 on the CPU"
        qkv = [attn.qkv] if attn.qkv is not None else [attn.q_proj, attn.k_proj, attn.v_proj]
        gu = (
            [layer.mlp.gate_up]
            if layer.mlp.gate_up is not None
            else [layer.mlp.gate_proj, layer.mlp.up_proj]
        )
        for mod in (*qkv, attn.o_proj, *gu, layer.mlp.down_proj):
            why = _lin_ok(mod)
            if why is not None:
                return f"layer {i}: {why}"
    return None


def _family_reason(cfg: ModelConfig) -> str | None:
    """The first of a family's departures from plain Llama maths (None: there are none)."""
    checks = (
        (cfg.qk_norm, "per-head q/k norms"),
        (cfg.norm_unit_offset, "(1 + weight) norms"),
        (cfg.sandwich_norms, "sandwich norms"),
        (cfg.hidden_act not in ("silu", "swish"), f"{cfg.hidden_act} MLP"),
        (cfg.query_pre_attn_scalar not in (None, cfg.dim_per_head), "query_pre_attn_scalar"),
        (cfg.final_logit_softcapping is not None, "final logit softcapping"),
        (cfg.no_rope_layers is not None and 0 in cfg.no_rope_layers, "NoPE layers"),
        (cfg.rope_local_theta is not None, "a separate rope base for sliding layers"),
        (cfg.cache_window != cfg.layer_window(0), "per-layer sliding windows"),
    )
    return next((why for bad, why in checks if bad), None)


class FastDecode:
    """The compiled single-token step of one model (see the module docstring)."""

    def __init__(self, model: LlamaForCausalLM) -> None:
        mod = qkernel.load()
        if mod is None:
            raise RuntimeError(f"the C++ kernel is unavailable ({qkernel.unavailable_reason()})")
        cfg = model.config
        self._mod = mod
        self.hidden = cfg.hidden_size
        self.head_dim = cfg.dim_per_head
        self.eps = cfg.rms_norm_eps
        layers = model.model.layers
        self.n_kv = layers[0].self_attn.n_kv_heads if len(layers) else 0
        self.reduce = layers[0].self_attn.reduce if len(layers) else None
        inv = model.inv_freq.detach().to(torch.float32).contiguous()
        self._dec = mod.Decoder(
            self.hidden, self.head_dim, float(self.eps), inv, int(cfg.sliding_window or 0)
        )
        for layer in layers:
            attn, mlp = layer.self_attn, layer.mlp
            if attn.reduce is not self.reduce or mlp.reduce is not self.reduce:
                raise ValueError("every layer must use the same reduce hook")
            qkv = [attn.qkv] if attn.qkv is not None else [attn.q_proj, attn.k_proj, attn.v_proj]
            gu = [mlp.gate_up] if mlp.gate_up is not None else [mlp.gate_proj, mlp.up_proj]
            self._dec.add_layer(
                layer.input_layernorm.weight.detach(),
                layer.post_attention_layernorm.weight.detach(),
                [_lin(m) for m in qkv],
                _lin(attn.o_proj),
                [_lin(m) for m in gu],
                _lin(mlp.down_proj),
                attn.n_heads,
                attn.n_kv_heads,
            )
        self._norm = None
        self._head: tuple | None = None
        lm = getattr(model, "lm_head", None)
        if lm is not None and _lin_ok(lm) is None and not model.model.norm.weight.is_meta:
            self._norm = model.model.norm.weight.detach().to(torch.float32).contiguous()
            self._head = _lin(lm)
        self._model_head = model
        self._bound: tuple[int, int] | None = None  # (id(cache), cache.generation) last set
        # A float32 star link is driven from C++ (no GIL, no per-message Python); any other
        # reduce hook (a Communicator, a wire codec) is called back into Python.
        self.link = getattr(self.reduce, "native_link", None)
        self._table = native_table(self.hidden) if self.link is not None else b""

    def layers(self, x: torch.Tensor, cache: KVCache, start: int) -> torch.Tensor:
        """x: (1, 1, H) at position ``start``; the K/V of this position go into ``cache``."""
        if cache.capacity() <= start - cache.base:
            cache.reserve(start + 1, 1, self.n_kv, self.head_dim, torch.float32)
        key = (id(cache), cache.generation)
        if key != self._bound:
            self._dec.set_cache(cache.k, cache.v)
            self._bound = key
        if x.dtype != torch.float32 or not x.is_contiguous():
            x = x.to(torch.float32).contiguous()
        link = self.link
        if link is None:
            return self._dec.layers(x, start, self.reduce, None, cache.base)
        spec = (*link.native_spec(getattr(self.reduce, "timeout", None)), self._table)
        try:
            return self._dec.layers(x, start, None, spec, cache.base)
        except RuntimeError as exc:
            raise _link_error(exc) from None
        finally:
            link.native_done(*self._dec.link_state())

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """Logits for one token's final hidden state, shaped like ``x`` with V last."""
        if self._head is None:  # e.g. a bf16 head: let PyTorch do it
            m = self._model_head
            return m.lm_head(m.model.norm(x))
        lead = x.shape[:-1]
        if x.dtype != torch.float32 or not x.is_contiguous():
            x = x.to(torch.float32).contiguous()
        return self._mod.head(x, self._norm, float(self.eps), self._head).view(*lead, -1)


_LINK_ERRORS = {
    "PeerLost": PeerLost,
    "TransportTimeout": TransportTimeout,
    "ProtocolError": ProtocolError,
}


def _link_error(exc: RuntimeError) -> Exception:
    """The transport's error type for a failure of the native link (others unchanged)."""
    text = str(exc)
    if text.startswith("lowband-link:"):
        kind, _, msg = text.removeprefix("lowband-link:").partition(":")
        cls = _LINK_ERRORS.get(kind)
        if cls is not None:
            return cls(msg)
    return exc


def install(model: LlamaForCausalLM) -> str | None:
    """Attach the compiled step to ``model``; returns why not (eager stays) or None."""
    why = unsupported_reason(model)
    if why is None:
        try:
            model.__dict__["fast_decode"] = FastDecode(model)
        except (RuntimeError, ValueError) as exc:
            why = f"{type(exc).__name__}: {exc}"
    if why is not None:
        model.__dict__["fast_decode"] = None
        logger.info("decode runs on the eager PyTorch path: %s", why)
    return why


def uninstall(model: LlamaForCausalLM) -> None:
    model.__dict__["fast_decode"] = None


def active(model: Any) -> bool:
    """Whether ``model`` decodes through the compiled step."""
    return getattr(model, "__dict__", {}).get("fast_decode") is not None
