"""The lean decode step: one compiled call runs every decoder layer for one token (of one
sequence, or of each of B sequences decoding together).

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
there: the C++ extension, float32 activations, linears that are float32 ``nn.Linear``,
``QuantLinear`` or ``GGMLLinear`` (K-quant blocks as in a GGUF file) in memory, of Llama's
maths, Qwen3's (per-head q/k RMSNorm before rotary) or Gemma's ((1 + w) norms, sandwich norms,
GeGLU, ``query_pre_attn_scalar``, the sliding layers' own rope base and window, logit
softcapping; the embedding scale is the model's ``embed``), NoPE layers included, and
routed-expert MLPs (Mixtral, Qwen3-MoE: router, softmax, top-k with or without
renormalisation, each chosen expert through the same kernels, see ``moe_block`` in decode.cpp;
bit-nested experts, which an expert store decodes in Python, are called back as the block).
Otherwise the eager path keeps running and the reason is returned (and logged), never an error.
Tensor parallelism: the model's ``reduce`` hooks are called from C++ between the blocks, so the
same transport carries the partial sums.

Serving many users: :meth:`FastDecode.layers_batch` runs the next token of B sequences (each
with its own ``KVCache`` and position) in one call. Decode is bound by memory bandwidth (every
weight is read once per token for a few flops per byte), so each linear runs ONE kernel pass
over its weights for all B rows and the step costs little more than a single sequence's until
the arithmetic catches up; attention stays per row, and under TP one all-reduce per block
carries the whole batch, shaped (1, B, H) like the eager path's ragged batch of B single tokens.
A batch row computes exactly what the same token alone does.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any, Callable, NamedTuple, Sequence, cast

import torch
from torch import nn

from edge.quant import QuantLinear
from edge.quant import kernel as qkernel
from edge.quant.linear import DEFAULT_MAX_KERNEL_ROWS, GGMLLinear
from lowband.errors import PeerLost, ProtocolError, TransportTimeout
from lowband.models.config import ModelConfig
from lowband.models.llama import (
    ROWWISE_ROWS,
    Expert,
    KVCache,
    LlamaForCausalLM,
    SparseMoE,
    rope_inv_freq,
)
from transport.starlink import native_table

logger = logging.getLogger(__name__)

__all__ = [
    "FastDecode",
    "HeadRows",
    "MAX_BATCH",
    "head_slice",
    "install",
    "uninstall",
    "unsupported_reason",
]

# Most rows one layers_batch call takes: the scratch (activations, q/k/v, gate/up) grows with B.
MAX_BATCH = 1024

_GGML = 0  # the C++ side's kind of a linear held as ggml blocks (its type id goes in "group")
_F32_HEAD_ROWS = 32  # see FastDecode.__init__


def _lin(mod: nn.Module) -> tuple:
    """``(kind, weight | qweight | blocks, scales | None, group | ggml type, bias | None
    [, split-K chunk])`` for the C++ side (``parse_lin`` in decode.cpp)."""
    bias = getattr(mod, "bias", None)
    if bias is not None:
        bias = bias.detach().to(torch.float32).contiguous()
    if isinstance(mod, QuantLinear):
        return (mod.bits, mod.qweight.contiguous(), mod.scales.contiguous(), mod.group, bias)
    if isinstance(mod, GGMLLinear):  # split-K leaves of k_chunk values (0: none)
        return (_GGML, mod.blocks.contiguous(), mod.packed, mod.qtype.type_id, bias, mod.k_chunk)
    w = cast(torch.Tensor, mod.weight).detach()
    return (32, w if w.is_contiguous() else w.contiguous(), None, 0, bias)


def _lin_ok(mod: nn.Module | None) -> str | None:
    if mod is None:
        return "a projection is missing"
    if isinstance(mod, QuantLinear):
        return None if mod.qweight.device.type == "cpu" else "packed weights are not on the CPU"
    if isinstance(mod, GGMLLinear):
        if mod.blocks.is_meta:
            return "weights are not loaded (meta)"
        return None if mod.blocks.device.type == "cpu" else "ggml blocks are not on the CPU"
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


def _range(model: LlamaForCausalLM, layers: tuple[int, int] | None) -> tuple[int, int]:
    n = len(model.model.layers)
    if layers is None:
        return 0, n
    lo, hi = layers
    if not 0 <= lo < hi <= n:
        raise ValueError(f"a layer range needs 0 <= lo < hi <= {n}, got [{lo}, {hi})")
    return lo, hi


def unsupported_reason(
    model: LlamaForCausalLM, layers: tuple[int, int] | None = None
) -> str | None:
    """Why :func:`install` would leave ``model`` on the eager path (None: it can be installed).
    ``layers``: only decoder layers ``lo..hi-1`` are checked (a pipeline stage's)."""
    lo, hi = _range(model, layers)
    cfg = model.config
    why = _family_reason(cfg)
    if why is not None:
        return f"{cfg.model_type}: the compiled step has no {why}"
    if not qkernel.available():
        return f"the C++ kernel is unavailable ({qkernel.unavailable_reason()})"
    for i in range(lo, hi):
        layer = model.model.layers[i]
        attn = layer.self_attn
        norms = [layer.input_layernorm, layer.post_attention_layernorm]
        if cfg.sandwich_norms:
            norms += [layer.pre_feedforward_layernorm, layer.post_feedforward_layernorm]
        if cfg.qk_norm:
            norms += [attn.q_norm, attn.k_norm]
        for norm in norms:
            if (
                norm.weight.is_meta
                or norm.weight.dtype != torch.float32
                or norm.weight.device.type != "cpu"
            ):
                return f"layer {i}: norm weights must be float32 on the CPU"
        qkv = [attn.qkv] if attn.qkv is not None else [attn.q_proj, attn.k_proj, attn.v_proj]
        ffn = layer.ffn
        mlp: list[nn.Module]
        if isinstance(ffn, SparseMoE):
            why = _moe_reason(ffn)
            if why is not None:
                return f"layer {i}: {why}"
            mlp = [] if _external(ffn) else [ffn.gate, *_expert_lins(ffn)]
        else:
            gu = [ffn.gate_up] if ffn.gate_up is not None else [ffn.gate_proj, ffn.up_proj]
            mlp = [*gu, ffn.down_proj]
        for mod in (*qkv, attn.o_proj, *mlp):
            why = _lin_ok(mod)
            if why is not None:
                return f"layer {i}: {why}"
    return None


def _moe_reason(moe: SparseMoE) -> str | None:
    """Why a routed-expert block stays eager (None: the compiled step computes it)."""
    if moe._forward_hooks:
        return "the routed-expert block has forward hooks the compiled step would skip"
    return None


def _external(moe: SparseMoE) -> bool:
    """Experts outside the model: the bit-nested store (edge.moe.store) decodes each expert
    from its bit planes in Python at the width its hotness plan gives it, pages experts under
    a byte budget from the routes it is told (``on_route``) and predicts the next layer's
    experts from this block's input (a forward pre-hook). None of that is weights the C++ side
    could hold, so the compiled step calls the block back (:func:`_block_call`)."""
    return moe.expert_fn is not None or moe.on_route is not None or bool(moe._forward_pre_hooks)


def _block_call(moe: SparseMoE) -> Callable[[torch.Tensor], torch.Tensor]:
    """The block as the eager layer runs it, pre-hooks, routing and the store's experts,
    without the TP reduce (the compiled step sums the partial outputs); a weak reference, so
    the compiled step does not keep the model alive."""
    ref = weakref.ref(moe)

    def block(x: torch.Tensor) -> torch.Tensor:  # x (1, B, H): the normed rows
        m = ref()
        if m is None:
            raise RuntimeError("the routed-expert block of this compiled step was freed")
        for hook in m._forward_pre_hooks.values():
            out = hook(m, (x,))
            if out is not None:
                x = out[0] if isinstance(out, tuple) else out
        return m.mix(x)

    return block


def _expert_lins(moe: SparseMoE) -> list[nn.Module]:
    return [
        m for e in moe.experts for m in (cast(Expert, e).w1, cast(Expert, e).w3, cast(Expert, e).w2)
    ]


def _moe_spec(moe: SparseMoE) -> tuple:
    """``(router, [([w1, w3], w2) per expert], top_k, norm_topk, block)`` for ``add_layer``'s
    ``moe``: the weights for the C++ side, or (experts outside the model) the block to call."""
    k, norm = int(moe.top_k), bool(moe.norm_topk_prob)
    if _external(moe):
        return (None, [], k, norm, _block_call(moe))
    experts = [
        ([_lin(e.w1), _lin(e.w3)], _lin(e.w2)) for e in (cast(Expert, x) for x in moe.experts)
    ]
    return (_lin(moe.gate), experts, k, norm, None)


# The compiled step's gate activations (``Act`` in decode.cpp) by HF ``hidden_act``.
_ACTS = {"silu": 0, "swish": 0, "gelu_pytorch_tanh": 1}
_ROPES = {None: 0, "global": 1, "local": 2}  # Layer::rope in decode.cpp


def _family_reason(cfg: ModelConfig) -> str | None:
    """The first of a family's departures from the maths the compiled step does (None: none).
    It does Llama's, Qwen3's per-head q/k norms, Gemma's (1 + w) norms, sandwich norms, GeGLU,
    softmax scale, local rope base, per-layer windows and logit softcapping, and NoPE layers."""
    if cfg.hidden_act not in _ACTS:
        return f"{cfg.hidden_act} MLP"
    return None


def _norm_w(norm: nn.Module) -> torch.Tensor:
    """The float32 scale a norm multiplies by: ``weight``, or ``1 + weight`` for Gemma's
    unit-offset norms (taken once: later edits of such a weight need a new install)."""
    w = cast(torch.Tensor, norm.weight).detach()
    if getattr(norm, "unit_offset", False):
        return (1.0 + w.float()).contiguous()
    return w


class _Bound(NamedTuple):
    """A cache as the C++ side last saw it: valid while ``generation`` is the cache's; holds the
    buffers the table points into, so they live as long as the table."""

    generation: int
    capacity: int
    table: torch.Tensor
    k: tuple[torch.Tensor, ...]
    v: tuple[torch.Tensor, ...]


class FastDecode:
    """The compiled single-token step of one model (see the module docstring). ``layers``:
    only decoder layers ``lo..hi-1`` (a pipeline stage's, ``edge.cluster.stage``): the step
    takes the hidden state entering layer ``lo`` and returns the one leaving layer ``hi-1``,
    with a cache of ``hi - lo`` layers; each layer keeps its own window and rotary table."""

    # rows one layers_spans call takes: the engine's prompt chunks (prefill_chunk, 256 by
    # default) and decodes fit, so every row of a step computes as its token alone
    max_rows = MAX_BATCH

    def __init__(self, model: LlamaForCausalLM, layers: tuple[int, int] | None = None) -> None:
        lo, hi = _range(model, layers)
        self.range = (lo, hi)
        mod = qkernel.load()
        if mod is None:
            raise RuntimeError(f"the C++ kernel is unavailable ({qkernel.unavailable_reason()})")
        cfg = model.config
        self._mod = mod
        self.hidden = cfg.hidden_size
        self.head_dim = cfg.dim_per_head
        self.eps = cfg.rms_norm_eps
        blocks = model.model.layers
        self.n_kv = blocks[lo].self_attn.n_kv_heads if hi > lo else 0
        self.reduce = blocks[lo].self_attn.reduce if hi > lo else None
        inv = model.inv_freq.detach().to(torch.float32).contiguous()
        local = None
        if cfg.rope_local_theta is not None:
            local = rope_inv_freq(cfg, local=True).to(torch.float32).contiguous()
        scale = cfg.query_pre_attn_scalar**-0.5 if cfg.query_pre_attn_scalar is not None else 0.0
        self._dec = mod.Decoder(
            self.hidden,
            self.head_dim,
            float(self.eps),
            inv,
            int(cfg.cache_window or 0),
            scale=float(scale),
            act=_ACTS[cfg.hidden_act],
            inv_freq_local=local,
        )
        self.softcap = cfg.final_logit_softcapping
        for i in range(lo, hi):
            layer = blocks[i]
            attn, ffn = layer.self_attn, layer.ffn
            if attn.reduce is not self.reduce or ffn.reduce is not self.reduce:
                raise ValueError("every layer must use the same reduce hook")
            qkv = [attn.qkv] if attn.qkv is not None else [attn.q_proj, attn.k_proj, attn.v_proj]
            # a dense MLP's gate/up and down, or a routed-expert block's spec
            gu: list[tuple] = []
            down: tuple | None = None
            moe: tuple | None = None
            if isinstance(ffn, SparseMoE):
                moe = _moe_spec(ffn)
            else:
                parts = [ffn.gate_up] if ffn.gate_up is not None else [ffn.gate_proj, ffn.up_proj]
                gu, down = [_lin(m) for m in parts], _lin(ffn.down_proj)
            qk = (_norm_w(attn.q_norm), _norm_w(attn.k_norm)) if attn.qk_norm else (None, None)
            # Llama: ln2 is the norm before the MLP; Gemma's sandwich: the pre-feedforward
            # norm, and the post-attention / post-feedforward norms go on the blocks' outputs.
            ln2 = layer.post_attention_layernorm
            post: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)
            if layer.sandwich:
                ln2 = layer.pre_feedforward_layernorm
                post = (
                    _norm_w(layer.post_attention_layernorm),
                    _norm_w(layer.post_feedforward_layernorm),
                )
            self._dec.add_layer(
                _norm_w(layer.input_layernorm),
                _norm_w(ln2),
                [_lin(m) for m in qkv],
                _lin(attn.o_proj),
                gu,
                down,
                attn.n_heads,
                attn.n_kv_heads,
                *qk,
                *post,
                window=int(cfg.layer_window(i) or 0),
                rope=_ROPES[cfg.layer_rope(i)],
                moe=moe,
            )
        self._norm = None
        self._head: tuple | None = None
        self._head_rows = 0
        lm = getattr(model, "lm_head", None)
        if lm is not None and _lin_ok(lm) is None and not model.model.norm.weight.is_meta:
            self._norm = _norm_w(model.model.norm).to(torch.float32).contiguous()
            self._head = _lin(lm)
            # Rows up to which the compiled head runs. fp32, one core, 32000 x 2048 head:
            # 58 ms against PyTorch's 67 ms at 16 rows, 174 against 144 at 64. Packed heads:
            # as far as the modules themselves use their kernel.
            self._head_rows = _F32_HEAD_ROWS if self._head[0] == 32 else DEFAULT_MAX_KERNEL_ROWS
        self._model_head = model
        self._bound: tuple[int, int] | None = None  # (id(cache), cache.generation) last set
        # A float32 star link is driven from C++ (no GIL, no per-message Python); any other
        # reduce hook (a Communicator, a wire codec) is called back into Python.
        self.link = getattr(self.reduce, "native_link", None)
        self._table = native_table(self.hidden) if self.link is not None else b""
        self._batch_tables: dict[int, bytes] = {}  # rows -> frame table of a (1, rows, H) sum
        # the caches layers_batch has seen; an entry goes when its cache is collected
        self._caches: weakref.WeakKeyDictionary[KVCache, _Bound] = weakref.WeakKeyDictionary()

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

    def layers_batch(
        self, x: torch.Tensor, caches: Sequence[KVCache], starts: Sequence[int]
    ) -> torch.Tensor:
        """The next token of B sequences at once: x (B, 1, H) or (B, H), row b at absolute
        position ``starts[b]`` of the sequence whose cache is ``caches[b]`` (B distinct caches);
        returns the rows after every layer, shaped like ``x``. Row b's K/V go into
        ``caches[b]`` (prepared, grown and windowed as :meth:`layers` does) and its
        ``length`` becomes ``starts[b] + 1``. Each linear is one kernel pass over its weights
        for all rows; under TP one (1, B, H) all-reduce per block carries the batch."""
        B = len(caches)
        if len(starts) != B:
            raise ValueError(f"layers_batch got {B} caches but {len(starts)} positions")
        shape = tuple(x.shape)
        if shape not in ((B, 1, self.hidden), (B, self.hidden)):
            raise ValueError(
                f"x must be ({B}, 1, {self.hidden}) or ({B}, {self.hidden}) for {B} caches, "
                f"got {shape}"
            )
        if len({id(c) for c in caches}) != B:
            raise ValueError("every row of a batch needs its own KVCache")
        return self.layers_spans(x, caches, starts, [1] * B).view(shape)

    def layers_spans(
        self,
        x: torch.Tensor,
        caches: Sequence[KVCache],
        starts: Sequence[int],
        lengths: Sequence[int],
    ) -> torch.Tensor:
        """Several short spans of consecutive tokens in one call: span i is ``lengths[i]``
        tokens at positions ``starts[i]..`` of the sequence whose cache is ``caches[i]``
        (distinct caches); x holds their N = sum(lengths) rows back to back, (N, H) or
        (1, N, H), and the result is shaped like it. Every row is computed exactly as the same
        token alone in :meth:`layers` (a speculative verification group of k + 1 tokens costs
        one pass over the weights, and each of its rows gets a single-token decode's bits);
        ``caches[i].length`` becomes ``starts[i] + lengths[i]``."""
        n_spans = len(caches)
        if len(starts) != n_spans or len(lengths) != n_spans:
            raise ValueError(
                f"got {n_spans} caches, {len(starts)} starts and {len(lengths)} lengths"
            )
        if len({id(c) for c in caches}) != n_spans:
            raise ValueError("each span needs its own KVCache")
        B = sum(int(n) for n in lengths)
        if not 1 <= B <= MAX_BATCH or min(lengths, default=0) < 1:
            raise ValueError(f"spans must hold 1..{MAX_BATCH} rows, each at least one")
        shape = tuple(x.shape)
        if x.numel() != B * self.hidden or shape[-1] != self.hidden:
            raise ValueError(f"x must hold {B} rows of {self.hidden} values, got {shape}")
        if min(int(s) for s in starts) < 0:
            raise ValueError(f"positions must be >= 0, got {min(starts)}")
        pos: list[int] = []
        tables: list[torch.Tensor] = []
        bases: list[int] = []
        for cache, start, n in zip(caches, starts, lengths):
            start, n = int(start), int(n)
            cache.prepare(start, n)  # a no-op when the caller already did it
            table = self._cache_table(cache, start + n - 1)
            pos.extend(range(start, start + n))
            tables.extend([table] * n)
            bases.extend([cache.base] * n)
        x2 = x.reshape(B, self.hidden)
        if x2.dtype != torch.float32 or not x2.is_contiguous():
            x2 = x2.to(torch.float32).contiguous()
        link = self.link
        if link is None:
            out = self._dec.layers_batch(x2, pos, bases, tables, self.reduce, None)
        else:
            spec = (
                *link.native_spec(getattr(self.reduce, "timeout", None)),
                self._batch_table(B),
            )
            try:
                out = self._dec.layers_batch(x2, pos, bases, tables, None, spec)
            except RuntimeError as exc:
                raise _link_error(exc) from None
            finally:
                link.native_done(*self._dec.link_state())
        for cache, start, n in zip(caches, starts, lengths):
            cache.length = int(start) + int(n)
        return out.view(shape)

    def _cache_table(self, cache: KVCache, start: int) -> torch.Tensor:
        """The C++ side's table of ``cache``'s buffers with room for position ``start``; taken
        again only when the cache reallocated or shifted (a new ``generation``)."""
        bound = self._caches.get(cache)
        if (
            bound is None
            or bound.generation != cache.generation
            or start - cache.base >= bound.capacity
            or (bound.k and bound.k[0] is not cache.k[0])  # replaced without a new generation
        ):
            if cache.capacity() <= start - cache.base:
                cache.reserve(start + 1, 1, self.n_kv, self.head_dim, torch.float32)
            ks, vs = cast(list[torch.Tensor], cache.k), cast(list[torch.Tensor], cache.v)
            table = self._dec.cache_table(ks, vs)
            bound = _Bound(cache.generation, cache.capacity(), table, tuple(ks), tuple(vs))
            self._caches[cache] = bound
        return bound.table

    def _batch_table(self, rows: int) -> bytes:
        """The frame table of a (1, rows, H) float32 all-reduce on the star link: what the
        Python end of the link sends for the same tensor, byte for byte."""
        if rows == 1:
            return self._table
        table = self._batch_tables.get(rows)
        if table is None:
            table = self._batch_tables[rows] = native_table(self.hidden, rows)
        return table

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """Logits of final hidden states: x (..., H) -> (..., V), one pass over the head's
        weights for every row (one token, or a decode batch's B rows). Many rows of an fp32
        head (a prompt's every position) go to PyTorch's GEMM, which wins there."""
        rows = x.numel() // max(x.shape[-1], 1)
        if self._head is None or rows > self._head_rows:  # e.g. a bf16 head: PyTorch does it
            m = self._model_head
            logits = m.lm_head(m.model.norm(x))
        else:
            lead = x.shape[:-1]
            if x.dtype != torch.float32 or not x.is_contiguous():
                x = x.to(torch.float32).contiguous()
            logits = self._mod.head(x, self._norm, float(self.eps), self._head).view(*lead, -1)
        if self.softcap is not None:  # Gemma 2: cap * tanh(logits / cap), as the eager head
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


def head_slice(model: LlamaForCausalLM, a: int, b: int) -> nn.Module | None:
    """A module computing rows ``a..b-1`` of the LM head's output (a view of its weights), or
    None where the head's kind cannot be cut (then the head stays whole)."""
    tied = getattr(model.model.embed_tokens, "tied_head", None)
    if model.config.tie_word_embeddings and callable(tied):
        return cast(nn.Module, tied(a, b - a))
    lm = getattr(model, "lm_head", None)
    if type(lm) is nn.Linear and lm.bias is None and not lm.weight.is_meta:
        out = nn.Linear(lm.in_features, b - a, bias=False, dtype=lm.weight.dtype)
        out.weight = nn.Parameter(lm.weight.detach()[a:b], requires_grad=False)
        return out
    return None


class HeadRows:
    """Logits of the LM head's vocabulary rows ``a..b-1`` only (a pipeline's split head,
    ``edge.cluster.pipeline``): the same norm, kernels and row threshold as the model's whole
    head (:meth:`FastDecode.head`), so each logit equals the whole head's bit for bit."""

    def __init__(self, model: LlamaForCausalLM, a: int, b: int) -> None:
        mod = head_slice(model, a, b)
        if mod is None:
            raise ValueError(f"the LM head ({type(model.lm_head).__name__}) cannot be cut")
        self.rows, self.mod, self._model = (a, b), mod, model
        self._fast: FastDecode | None = model.__dict__.get("fast_decode")
        self._lin: tuple | None = None
        self.refresh()

    def refresh(self) -> None:
        """Take the weights' layout again (after :meth:`GGMLLinear.repack`)."""
        fast = self._fast
        if fast is not None and fast._head is not None and _lin_ok(self.mod) is None:
            self._lin = _lin(self.mod)

    def repack(self) -> int:
        fn = getattr(self.mod, "repack", None)
        added = int(fn()) if fn is not None else 0
        self.refresh()
        return added

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x (R, H) final hidden states -> (R, b - a) logits."""
        fast, m = self._fast, self._model
        if fast is None or self._lin is None or x.shape[0] > fast._head_rows:
            logits = self.mod(m.model.norm(x))
        else:
            if x.dtype != torch.float32 or not x.is_contiguous():
                x = x.to(torch.float32).contiguous()
            logits = fast._mod.head(x, fast._norm, float(fast.eps), self._lin).view(x.shape[0], -1)
        cap = m.config.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits


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


def install(model: LlamaForCausalLM, layers: tuple[int, int] | None = None) -> str | None:
    """Attach the compiled step to ``model``; returns why not (eager stays) or None.
    ``layers``: a pipeline stage's range (see :class:`FastDecode`); None: the range of the
    step installed now (re-installing after a repack), else every layer."""
    if layers is None:
        layers = getattr(model.__dict__.get("fast_decode"), "range", None)
    try:
        why = unsupported_reason(model, layers)
    except ValueError as exc:
        why = str(exc)
    if why is None:
        try:
            model.__dict__["fast_decode"] = FastDecode(model, layers)
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


def set_repeatable(model: LlamaForCausalLM, on: bool) -> None:
    """On (the default): prompt spans of any length run through the compiled step's rows
    path, every row computed as its token alone, so a token's bits do not depend on the prefix
    cache, the prompt's chunking or what shared its step. Off: spans longer than
    ``ROWWISE_ROWS`` go through the eager layers' GEMMs (other rounding; no faster than the rows
    path on Gemma 3 270M Q4_K_M here, benchmarks/results/edge_vs_llamacpp-gemma3-270m*.json).
    Nothing to do where the model has no compiled step."""
    fast = model.__dict__.get("fast_decode")
    if fast is not None:
        fast.max_rows = MAX_BATCH if on else ROWWISE_ROWS
