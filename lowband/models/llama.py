"""A Llama-family decoder in plain single-device PyTorch, with Hugging Face parameter names.

Covers Llama / Mistral / Qwen2 (attention bias) / Mixtral (top-k routed experts): RMSNorm,
rotary embeddings (default, linear and llama3 scaling, or precomputed per-frequency factors),
grouped-query attention, SwiGLU, tied embeddings; and the switches today's small families add
(see ``ModelConfig``): per-head q/k norms (Qwen3, Gemma 3), Gemma's (1 + w) norms, sandwich
norms, scaled embeddings, GeGLU, ``query_pre_attn_scalar``, logit softcapping, interleaved
sliding/global layers with their own rope bases (Gemma 3) and NoPE layers (SmolLM3).

The module tree mirrors the HF checkpoints so ``state_dict()`` keys are the safetensors keys
(Phi-3's fused q/k/v and gate/up are split on load, ``weights.split_fused``). Tensor
parallelism is applied afterwards by ``edge.tp.shard``, which changes the per-module head/column
counts stored on the modules (``n_heads``, ``n_kv_heads``) and sets a ``reduce`` hook where
partial sums must be combined; this file never knows about the network.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence, cast

import torch
import torch.nn.functional as F
from torch import nn

from lowband.errors import ConfigError
from lowband.models.config import ModelConfig
from lowband.models.tied import tied_lookup, trained_tied_weight

Reduce = Callable[[torch.Tensor], torch.Tensor]

ROWWISE_ROWS = 16
"""Up to this many rows (a decode batch, a speculative verification group) a plain
``nn.Linear`` runs row by row and a short ragged span attends one query at a time, so every
row gets exactly the float sequence of a single-token decode: BLAS GEMMs block the reduction
differently for 1, 2-3 and 4+ rows, and SDPA's masked path rounds unlike the one-query
matmuls, which flips near-tie argmaxes (greedy speculative decoding must equal plain decoding
bit for bit). Quantized linears are row-invariant already (their kernels' own contract)."""


def linear_rows(mod: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``mod(x)``, row by row for a plain ``nn.Linear`` on 2..``ROWWISE_ROWS`` rows."""
    rows = x.numel() // max(x.shape[-1], 1)
    if type(mod) is not nn.Linear or not 1 < rows <= ROWWISE_ROWS:
        return mod(x)
    x2 = x.reshape(rows, 1, x.shape[-1])
    return torch.cat([mod(x2[i : i + 1]) for i in range(rows)]).reshape(*x.shape[:-1], -1)


HEAD_MARGIN = 1e-3
"""A batched LM head row is recomputed alone when its two largest logits are closer than this
(relative): elsewhere the GEMM's rounding (~1e-5 here) cannot change the argmax."""


def head_rows(mod: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The LM head over 2..``ROWWISE_ROWS`` rows in one GEMM (the head is most of a small
    model's weights: reading it once per row would cost what speculation saves), every row
    whose top-2 margin is within ``HEAD_MARGIN`` recomputed alone, so each row's argmax is
    the one a single-token decode picks; the other logits may differ in the last bits."""
    rows = x.numel() // max(x.shape[-1], 1)
    if type(mod) is not nn.Linear or not 1 < rows <= ROWWISE_ROWS:
        return mod(x)
    out = mod(x)
    flat = out.reshape(rows, -1)
    top = flat.topk(2, dim=-1).values
    close = top[:, 0] - top[:, 1] <= HEAD_MARGIN * (1.0 + top[:, 0].abs())
    x2 = x.reshape(rows, 1, x.shape[-1])
    for i in close.nonzero().flatten().tolist():
        flat[i] = mod(x2[i : i + 1]).reshape(-1)
    return out


class RMSNorm(nn.Module):
    """``unit_offset`` (Gemma): the scale is 1 + weight, applied before casting back."""

    def __init__(self, dim: int, eps: float, unit_offset: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if unit_offset else torch.ones(dim))
        self.eps = eps
        self.unit_offset = unit_offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.unit_offset:  # Gemma: (x * (1 + w)).to(dtype), all in float32
            xf = x.float()
            xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
            return (xf * (1.0 + self.weight.float())).to(x.dtype)
        # Normalise in float32 and cast back, as the reference implementation does.
        if x.dtype == torch.float32:  # decode fast path: no casts, one fused scale
            return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_inv_freq(cfg: ModelConfig, local: bool = False) -> torch.Tensor:
    """Inverse frequencies (D/2,) including the configured rope scaling (or the precomputed
    ``rope_freq_factors``). ``local``: those of the sliding layers when they have their own
    base (Gemma 3 ``rope_local_base_freq``, unscaled)."""
    d = cfg.dim_per_head
    theta = cfg.rope_local_theta if local and cfg.rope_local_theta is not None else cfg.rope_theta
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    if local and cfg.rope_local_theta is not None:
        return inv
    if cfg.rope_freq_factors is not None:  # GGUF rope_freqs: theta_i = pos * inv_i / f_i
        return inv / torch.tensor(cfg.rope_freq_factors, dtype=torch.float32)
    sc = cfg.rope_scaling or {}
    kind = sc.get("rope_type", sc.get("type", "default"))
    if kind == "linear":
        inv = inv / float(sc["factor"])
    elif kind == "llama3":
        # Llama 3.1: leave high frequencies, divide low ones by `factor`, blend in between.
        factor, lo, hi = (
            float(sc["factor"]),
            float(sc["low_freq_factor"]),
            float(sc["high_freq_factor"]),
        )
        old_ctx = float(sc["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        smooth = (old_ctx / wavelen - lo) / (hi - lo)
        scaled = torch.where(wavelen > old_ctx / lo, inv / factor, inv)
        mid = (wavelen <= old_ctx / lo) & (wavelen >= old_ctx / hi)
        inv = torch.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)
    elif kind != "default":
        raise NotImplementedError(f"rope scaling {kind!r} is not supported")
    return inv


def llama3_rope_freq_factors(cfg: ModelConfig) -> torch.Tensor:
    """The (D/2,) divisors that turn the unscaled inverse frequencies into Llama 3.1's scaled
    ones, computed the way llama.cpp's converter writes GGUF ``rope_freqs.weight`` (wavelength
    below original_ctx/high_freq_factor: 1; above original_ctx/low_freq_factor: factor; in
    between the reciprocal of the smooth blend). ``with_rope_freq_factors`` applies them."""
    sc = cfg.rope_scaling or {}
    if sc.get("rope_type", sc.get("type")) != "llama3":
        raise ConfigError("rope_scaling", f"not llama3 scaling: {sc!r}")
    factor, lo, hi = (
        float(sc["factor"]),
        float(sc["low_freq_factor"]),
        float(sc["high_freq_factor"]),
    )
    old_ctx = float(sc["original_max_position_embeddings"])
    d = cfg.dim_per_head
    out = []
    for i in range(0, d, 2):
        wavelen = 2 * math.pi * cfg.rope_theta ** (i / d)
        if wavelen < old_ctx / hi:
            out.append(1.0)
        elif wavelen > old_ctx / lo:
            out.append(factor)
        else:
            smooth = (old_ctx / wavelen - lo) / (hi - lo)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(out, dtype=torch.float32)


def with_rope_freq_factors(cfg: ModelConfig, factors: torch.Tensor) -> ModelConfig:
    """``cfg`` with rope given by precomputed per-frequency divisors (a GGUF's
    ``rope_freqs.weight``) in place of ``rope_scaling``: inv_freq_i = theta^(-2i/D) / f_i."""
    flat = factors.detach().to(torch.float32).reshape(-1)
    return dataclasses.replace(
        cfg, rope_scaling=None, rope_freq_factors=tuple(float(v) for v in flat)
    )


def rope_cos_sin(
    inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of shape (T, D) for integer positions (T,)."""
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat([-x[..., h:], x[..., :h]], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (B, H, T, D); cos/sin: (T, D)."""
    return x * cos + _rotate_half(x) * sin


_generations = itertools.count(1)


class KVCache:
    """Per-layer key/value cache with preallocated storage: (B, n_kv, capacity, D).

    With a sliding ``window`` W the cache stops growing: before a forward at ``start`` it may
    drop positions no later query can see (older than ``start - W + 1``), moving the last W - 1
    to the front; slot j then holds position ``base + j``. Capacity stays within a few W (plus
    the longest chunk), and restarting below :meth:`restart_floor` is refused.

    ``generation`` changes whenever a buffer is (re)allocated, dropped or shifted, so code holding
    raw views of the buffers (the compiled decode step) knows when to take them again."""

    def __init__(self, n_layers: int, window: int | None = None) -> None:
        self.k: list[torch.Tensor | None] = [None] * n_layers
        self.v: list[torch.Tensor | None] = [None] * n_layers
        self.length = 0
        self.window = window
        self.base = 0  # absolute position held by slot 0
        self.generation = next(_generations)

    def capacity(self) -> int:
        """Slots every layer has without reallocating (0 before the first use)."""
        return min((k.shape[2] if k is not None else 0) for k in self.k) if self.k else 0

    def restart_floor(self) -> int:
        """The smallest ``start`` a forward may use (0 unless a window dropped positions)."""
        return self.base + self.window - 1 if self.base > 0 and self.window else 0

    def prepare(self, start: int, T: int) -> None:
        """Called before every forward of T positions at ``start``: a windowed cache makes room
        by dropping positions older than the window instead of growing."""
        if start == 0 and self.base:  # a fresh sequence: nothing older is needed
            self.base = 0
            self.generation = next(_generations)
        if start < self.restart_floor():
            raise RuntimeError(
                f"position {start} needs keys the sliding-window cache has dropped "
                f"(it restarts from {self.restart_floor()} or 0)"
            )
        W, cap = self.window, self.capacity()
        if W is None or cap == 0 or start + T - self.base <= cap:
            return
        keep_from = max(self.base, start - (W - 1))
        n_keep = min(start, self.length) - keep_from
        if keep_from == self.base or n_keep < 0 or 2 * (n_keep + T) > cap:
            return  # shifting would not free enough room: let update()/reserve() grow it
        shift = keep_from - self.base
        for layer in range(len(self.k)):
            for buf in (self.k[layer], self.v[layer]):
                buf[:, :, :n_keep] = buf[:, :, shift : shift + n_keep].clone()  # type: ignore[index]
        self.base = keep_from
        self.generation = next(_generations)

    def reserve(
        self,
        end: int,
        batch: int,
        n_kv: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        """Make every layer hold positions up to ``end`` (grown by doubling, contents kept)."""
        need = end - self.base
        for layer, k in enumerate(self.k):
            if k is None or k.shape[2] < need:
                cap = max(need, 2 * k.shape[2] if k is not None else 64)
                new_k = torch.zeros(batch, n_kv, cap, head_dim, dtype=dtype, device=device)
                new_v = torch.zeros_like(new_k)
                if k is not None:
                    n = min(k.shape[2], self.length - self.base)
                    new_k[:, :, :n] = k[:, :, :n]
                    new_v[:, :, :n] = self.v[layer][:, :, :n]  # type: ignore[index]
                self.k[layer], self.v[layer] = new_k, new_v
                self.generation = next(_generations)

    def update(
        self, layer: int, k: torch.Tensor, v: torch.Tensor, start: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store positions start..start+T-1; the keys/values of every held position up to them
        (slot j = position base + j)."""
        t = k.shape[2]
        a = start - self.base
        end = a + t
        buf_k = self.k[layer]
        if buf_k is None or buf_k.shape[2] < end:
            cap = max(end, 2 * buf_k.shape[2] if buf_k is not None else 64)
            new_k = k.new_zeros(k.shape[0], k.shape[1], cap, k.shape[3])
            new_v = v.new_zeros(v.shape[0], v.shape[1], cap, v.shape[3])
            if buf_k is not None:
                new_k[:, :, :a] = buf_k[:, :, :a]
                new_v[:, :, :a] = self.v[layer][:, :, :a]  # type: ignore[index]
            self.k[layer], self.v[layer] = new_k, new_v
            self.generation = next(_generations)
        self.k[layer][:, :, a:end] = k  # type: ignore[index]
        self.v[layer][:, :, a:end] = v  # type: ignore[index]
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]  # type: ignore[index]

    def reset(self) -> None:
        self.k = [None] * len(self.k)
        self.v = [None] * len(self.v)
        self.length = 0
        self.base = 0
        self.generation = next(_generations)

    def copy_prefix(self, other: "KVCache", n: int) -> None:
        """Hold positions 0..n-1 of ``other`` (a shared prompt prefix), dropping what this
        cache held. ``other`` must still hold them (``other.base == 0``)."""
        if not 0 <= n <= other.length or other.base != 0:
            raise RuntimeError(f"the source cache does not hold positions 0..{n - 1}")
        self.base = 0
        self.generation = next(_generations)
        for layer, (k, v) in enumerate(zip(other.k, other.v)):
            if k is None or v is None:
                raise RuntimeError("the source cache is empty")
            mine = self.k[layer]
            if mine is None or mine.shape[2] < n or mine.shape[1:] != k.shape[1:]:
                cap = max(n, 64, k.shape[2])
                self.k[layer] = k.new_zeros(k.shape[0], k.shape[1], cap, k.shape[3])
                self.v[layer] = v.new_zeros(v.shape[0], v.shape[1], cap, v.shape[3])
            # a cache the runners filled (under inference mode) holds inference tensors, which
            # take in-place writes only inside it (outside it the copy raised, and the engine
            # recomputed the whole prompt instead)
            with torch.inference_mode(self.k[layer].is_inference()):  # type: ignore[union-attr]
                self.k[layer][:, :, :n] = k[:, :, :n]  # type: ignore[index]
                self.v[layer][:, :, :n] = v[:, :, :n]  # type: ignore[index]
        self.length = n


@dataclasses.dataclass(frozen=True)
class Span:
    """One sequence's run of tokens in a ragged batch: ``length`` tokens at positions
    ``start..start+length-1``, whose keys and values go into (and attend over) ``cache``."""

    cache: KVCache
    start: int
    length: int


class Attention(nn.Module):
    # Declared for type checkers: nn.Module's __getattr__ would type submodules as
    # ``Tensor | Module``. The projections may be swapped for quantized modules after loading.
    q_proj: nn.Module
    k_proj: nn.Module
    v_proj: nn.Module
    o_proj: nn.Module
    q_norm: RMSNorm
    k_norm: RMSNorm
    qkv: nn.Module | None

    def __init__(self, cfg: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads = cfg.num_attention_heads
        self.n_kv_heads = cfg.n_kv_heads
        self.head_dim = cfg.dim_per_head
        self.window = cfg.layer_window(layer_idx)  # W: keys j with i - j < W (None: all)
        self.use_rope = cfg.layer_rope(layer_idx) is not None  # False: NoPE (SmolLM3)
        # softmax scale: query_pre_attn_scalar**-0.5 (Gemma), None: SDPA's head_dim**-0.5
        self.scale = (
            cfg.query_pre_attn_scalar**-0.5 if cfg.query_pre_attn_scalar is not None else None
        )
        self.qk_norm = cfg.qk_norm
        h, d = cfg.hidden_size, cfg.dim_per_head
        if cfg.qk_norm:  # one (D,) weight shared by every head: replicated under TP
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps, cfg.norm_unit_offset)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps, cfg.norm_unit_offset)
        self.q_proj = nn.Linear(h, self.n_heads * d, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(h, self.n_kv_heads * d, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(h, self.n_kv_heads * d, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.n_heads * d, h, bias=False)
        self.reduce: Reduce | None = None  # set by tensor parallelism: sums partial o_proj outputs
        # q/k/v as one matmul (set by ``fuse_projections``); kept out of the module tree so the
        # state dict keeps its HF names. q/k/v_proj then hold views into it.
        self.__dict__["qkv"] = None

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: KVCache | None,
        start: int,
    ) -> torch.Tensor:
        B, T, _ = x.shape
        nq, nkv = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        if self.qkv is not None:
            q, k, v = self.qkv(x).split((nq, nkv, nkv), dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        k = k.view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        if self.qk_norm:  # per head, before rope (Qwen3, Gemma 3)
            q, k = self.q_norm(q), self.k_norm(k)
        if self.use_rope:
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            k, v = cache.update(self.layer_idx, k, v, start)
        out = self._attend(q, k, v, start)
        out = self.o_proj(out.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))
        return self.reduce(out) if self.reduce is not None else out

    def forward_ragged(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, spans: Sequence[Span]
    ) -> torch.Tensor:
        """x: (1, N, H) holding the tokens of several sequences back to back (``spans`` in
        order); cos/sin: (N, D) at each token's own position. The projections run once for
        all N rows (each weight read once per step); attention runs per sequence."""
        N = x.shape[1]
        nh, nkv, D = self.n_heads, self.n_kv_heads, self.head_dim
        if self.qkv is not None:
            q, k, v = linear_rows(self.qkv, x).split((nh * D, nkv * D, nkv * D), dim=-1)
        else:
            q, k, v = (linear_rows(m, x) for m in (self.q_proj, self.k_proj, self.v_proj))
        q = q.view(N, nh, D).transpose(0, 1)  # (heads, N, D)
        k = k.view(N, nkv, D).transpose(0, 1)
        v = v.view(N, nkv, D).transpose(0, 1)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.use_rope:
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        outs, off = [], 0
        for s in spans:
            sl = slice(off, off + s.length)
            ks, vs = s.cache.update(self.layer_idx, k[None, :, sl], v[None, :, sl], s.start)
            qs = q[None, :, sl]
            if 1 < s.length <= ROWWISE_ROWS:  # as s.length single-token decodes would
                S = ks.shape[2] - s.length
                for j in range(s.length):
                    kj, vj = ks[:, :, : S + j + 1], vs[:, :, : S + j + 1]
                    qj = qs[:, :, j : j + 1].contiguous()
                    outs.append(self._attend(qj, kj, vj, s.start + j)[0])
            else:
                outs.append(self._attend(qs, ks, vs, s.start)[0])
            off += s.length
        out = torch.cat(outs, dim=1) if len(outs) > 1 else outs[0]  # (heads, N, D)
        out = linear_rows(self.o_proj, out.transpose(0, 1).reshape(1, N, nh * D))
        return self.reduce(out) if self.reduce is not None else out

    def _attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int
    ) -> torch.Tensor:
        """(B, H, T, D) attention of T queries at start.. over the S cached keys (the last T
        of them being the queries' own); GQA via enable_gqa avoids repeating K/V."""
        T = q.shape[2]
        S, W, sc = k.shape[2], self.window, self.scale
        gqa = self.n_kv_heads != self.n_heads
        if T == 1:
            if W is not None and S > W:  # the window: only the last W keys (this one included)
                k, v = k[:, :, S - W :], v[:, :, S - W :]
            # One query: three small matmuls (each group of query heads against its KV head)
            # cost a few microseconds where SDPA's flash kernel spends a quarter millisecond.
            B, H, _, D = q.shape
            nkv = k.shape[1]
            if nkv == 0:  # a tensor-parallel rank that holds no heads of this layer
                return q.new_zeros(B, H, 1, D)
            qg = q.reshape(B, nkv, H // nkv, D)
            w = torch.matmul(qg, k.transpose(-1, -2)) * (sc if sc is not None else D**-0.5)
            w = torch.softmax(w.float(), dim=-1).to(v.dtype)
            out = torch.matmul(w, v).view(B, H, 1, D)
        elif start == 0 and (W is None or S <= W):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=sc, enable_gqa=gqa)
        else:  # chunk after a prefix (causal in the chunk, full to the prefix) and/or a window
            mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(S - T)
            if W is not None:  # query at S-T+t may see key j only if (S-T+t) - j < W
                mask &= ~torch.ones(T, S, dtype=torch.bool, device=q.device).tril(S - T - W)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=sc, enable_gqa=gqa)
        return out


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The gate activation named by HF ``hidden_act`` (see ``config.ACTIVATIONS``)."""
    if name in ("silu", "swish"):
        return F.silu
    if name == "gelu_pytorch_tanh":
        return lambda x: F.gelu(x, approximate="tanh")
    raise ConfigError("hidden_act", f"{name!r} is not implemented")


class MLP(nn.Module):
    """Gated feed-forward: down(act(gate(x)) * up(x)); SwiGLU (silu) or GeGLU (Gemma)."""

    gate_proj: nn.Module
    up_proj: nn.Module
    down_proj: nn.Module
    gate_up: nn.Module | None

    def __init__(self, hidden: int, inter: int, act: str = "silu") -> None:
        super().__init__()
        self.act = activation(act)
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)
        self.reduce: Reduce | None = None
        self.__dict__["gate_up"] = None  # gate and up as one matmul (``fuse_projections``)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up is not None:
            g, u = linear_rows(self.gate_up, x).chunk(2, dim=-1)
        else:
            g, u = linear_rows(self.gate_proj, x), linear_rows(self.up_proj, x)
        out = linear_rows(self.down_proj, self.act(g) * u)
        return self.reduce(out) if self.reduce is not None else out


class Expert(nn.Module):
    """One Mixtral expert, HF names: w2(silu(w1 x) * w3 x)."""

    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(hidden, inter, bias=False)
        self.w2 = nn.Linear(inter, hidden, bias=False)
        self.w3 = nn.Linear(hidden, inter, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class SparseMoE(nn.Module):
    """Mixtral-style top-k routed experts (HF name ``block_sparse_moe``).

    Routing: softmax over all experts in float32, keep the top k, renormalise them to sum to 1
    (unless ``norm_topk_prob`` is off: Qwen3-MoE may keep the raw probabilities).
    ``expert_fn``, when set (by the expert store of the bit-nested runtime), replaces the call of
    ``experts[e]`` so weights can live outside the module; ``on_route`` receives the chosen
    expert ids, which feeds hotness statistics.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.top_k = cfg.num_experts_per_tok
        self.num_experts = cfg.num_local_experts
        self.norm_topk_prob = cfg.norm_topk_prob
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_local_experts, bias=False)
        self.experts = nn.ModuleList(
            Expert(cfg.hidden_size, cfg.intermediate_size) for _ in range(cfg.num_local_experts)
        )
        self.reduce: Reduce | None = None
        self.expert_fn: Callable[[int, torch.Tensor], torch.Tensor] | None = None
        self.on_route: Callable[[torch.Tensor], None] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.mix(x)
        return self.reduce(out) if self.reduce is not None else out

    def mix(self, x: torch.Tensor) -> torch.Tensor:
        """The routed mixture of x (B, T, H) before the TP reduce (a rank's partial sum)."""
        B, T, H = x.shape
        flat = x.reshape(-1, H)
        probs = F.softmax(self.gate(flat), dim=-1, dtype=torch.float32)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(x.dtype)
        if self.on_route is not None:
            self.on_route(chosen)
        out = torch.zeros_like(flat)
        for e in torch.unique(chosen).tolist():
            rows, slot = torch.nonzero(chosen == e, as_tuple=True)
            y = self.expert_fn(e, flat[rows]) if self.expert_fn else self.experts[e](flat[rows])
            # index_put_ with accumulate: the same sums as index_add_ at a fraction of its
            # cost on small CPU tensors (index_add_ took milliseconds per call here)
            out.index_put_((rows,), y * weights[rows, slot, None], accumulate=True)
        return out.view(B, T, H)


class DecoderLayer(nn.Module):
    self_attn: Attention
    mlp: MLP
    block_sparse_moe: SparseMoE
    input_layernorm: RMSNorm
    post_attention_layernorm: RMSNorm
    pre_feedforward_layernorm: RMSNorm
    post_feedforward_layernorm: RMSNorm

    def __init__(self, cfg: ModelConfig, idx: int) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, idx)
        if cfg.is_moe:
            self.block_sparse_moe = SparseMoE(cfg)
        else:
            self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)
        h, eps, off = cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_unit_offset
        self.input_layernorm = RMSNorm(h, eps, off)
        # Llama: the norm before the MLP. Sandwich (Gemma): the norm of the attention output,
        # and the MLP gets its own pre and post norms.
        self.post_attention_layernorm = RMSNorm(h, eps, off)
        self.sandwich = cfg.sandwich_norms
        if cfg.sandwich_norms:
            self.pre_feedforward_layernorm = RMSNorm(h, eps, off)
            self.post_feedforward_layernorm = RMSNorm(h, eps, off)

    @property
    def ffn(self) -> MLP | SparseMoE:
        return self.block_sparse_moe if hasattr(self, "block_sparse_moe") else self.mlp

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: KVCache | None,
        start: int,
        spans: Sequence[Span] | None = None,
    ) -> torch.Tensor:
        h = self.input_layernorm(x)
        if spans is None:
            a = self.self_attn(h, cos, sin, cache, start)
        else:
            a = self.self_attn.forward_ragged(h, cos, sin, spans)
        if self.sandwich:
            x = x + self.post_attention_layernorm(a)
            return x + self.post_feedforward_layernorm(self.ffn(self.pre_feedforward_layernorm(x)))
        x = x + a
        return x + self.ffn(self.post_attention_layernorm(x))


class LayerList(nn.ModuleList):
    """An ``nn.ModuleList`` of :class:`DecoderLayer` (the element type spelled out for type
    checkers; at run time it is a plain module list)."""

    if TYPE_CHECKING:

        def __iter__(self) -> Iterator[DecoderLayer]: ...

        def __getitem__(self, idx: int) -> DecoderLayer: ...  # type: ignore[override]


class LlamaModel(nn.Module):
    embed_tokens: nn.Embedding
    layers: LayerList
    norm: RMSNorm

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = LayerList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_unit_offset)


def fast_ragged(fast: Any, x: torch.Tensor, spans: Sequence[Span]) -> torch.Tensor | None:
    """The ragged pass through the compiled step ``fast`` (a model's ``fast_decode``, or a
    stage's over its layer range) where it takes this batch, else None (the eager layers run
    it): a batch of single tokens (``layers`` / ``layers_batch``), or spans of several tokens
    (``layers_spans``: each row computed exactly as its token alone) up to the step's
    ``max_rows`` in one call: prompt chunks, speculative verification groups, both beside
    decodes. So temperature 0 is repeatable: a token's bits do not depend on whether its
    prefix came from the prefix cache, on how the prompt was chunked or on what shared its
    step (the eager path's GEMMs round differently from the single-token kernels). One routing
    for one device and for pipeline stages, so a stage computes the bits one device does.
    Sets each cache's length on success."""
    if fast is None:
        return None
    if (
        hasattr(fast, "layers_spans")
        and any(s.length > 1 for s in spans)
        and sum(s.length for s in spans) <= getattr(fast, "max_rows", ROWWISE_ROWS)
    ):
        caches, starts = [s.cache for s in spans], [s.start for s in spans]
        return fast.layers_spans(x, caches, starts, [s.length for s in spans])
    if not all(s.length == 1 for s in spans):
        return None
    if len(spans) == 1:
        x = fast.layers(x, spans[0].cache, spans[0].start)
    elif hasattr(fast, "layers_batch"):
        x = fast.layers_batch(
            x.view(len(spans), 1, -1), [s.cache for s in spans], [s.start for s in spans]
        ).view(1, len(spans), -1)
    else:
        return None
    for s in spans:
        s.cache.length = s.start + 1
    return x


class LlamaForCausalLM(nn.Module):
    """Decoder with an LM head. ``forward(ids) -> logits (B, T, V)``."""

    model: LlamaModel
    lm_head: nn.Module
    inv_freq: torch.Tensor

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)
        self._rope_tables: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        # the rotary table of each layer ("local": Gemma 3's sliding layers, own base)
        self._layer_tables = [
            "local" if cfg.layer_rope(i) == "local" else "global"
            for i in range(cfg.num_hidden_layers)
        ]
        # A compiled single-token step installed by the runtime after loading (see
        # ``edge.fastpath``): an object with ``layers(x, cache, start)`` and ``head(x)``; kept
        # out of the module tree. This file only calls it.
        self.__dict__["fast_decode"] = None

    def forward(
        self, input_ids: torch.Tensor, *, cache: KVCache | None = None, start: int | None = None
    ) -> torch.Tensor:
        """input_ids: (B, T). With a cache, ``start`` defaults to ``cache.length``, which is
        advanced by T afterwards."""
        if start is None:
            start = cache.length if cache is not None else 0
        x = self.forward_layers(self.embed(input_ids), cache=cache, start=start)
        return self.head(x)

    # The three pieces below let a tensor-parallel master run embed/head alone while every
    # rank runs ``forward_layers`` on its shard (workers never hold the embedding or LM head).
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        weight = trained_tied_weight(self.model.embed_tokens, self.lm_head)
        if weight is not None:  # training a tied E on the CPU: its gradient added in place
            x = tied_lookup(input_ids, weight)
        else:
            x = self.model.embed_tokens(input_ids)
        if self.config.scale_embeddings:  # Gemma: sqrt(H), rounded to the weights' dtype first
            x = x * torch.tensor(self.config.hidden_size**0.5).to(x.dtype)
        return x

    def forward_layers(self, x: torch.Tensor, *, cache: KVCache | None, start: int) -> torch.Tensor:
        """x: (B, T, H) hidden states at positions start..start+T-1."""
        T = x.shape[1]
        if cache is not None:
            cache.prepare(start, T)
        fast: Any = self.fast_decode
        if fast is not None and cache is not None and x.shape[0] == 1:
            out = fast_ragged(fast, x, [Span(cache, start, T)])  # a prompt: rows as tokens alone
            if out is not None:
                return out
        tables = {k: self.rope(start, T, x.dtype, k) for k in set(self._layer_tables)}
        for layer, kind in zip(self.model.layers, self._layer_tables):
            x = layer(x, *tables[kind], cache, start)
        if cache is not None:
            cache.length = start + T
        return x

    def forward_ragged(
        self, x: torch.Tensor, spans: Sequence[Span], layers: tuple[int, int] | None = None
    ) -> torch.Tensor:
        """Several sequences in one pass: x (1, N, H) holds ``spans[0].length`` tokens of the
        first, then the second's, ... (N = the sum); returns (1, N, H). Each span appends to
        its own cache. Every matmul runs once for the N rows (continuous batching, and a
        prompt chunk piggybacking on decodes); through the compiled step when one is installed
        and takes the batch (:func:`fast_ragged`: every row computed as its token alone).
        ``layers`` (lo, hi): only decoder layers lo..hi-1, x entering layer lo (a pipeline
        stage's range, whose compiled step is installed over that range)."""
        if not spans or sum(s.length for s in spans) != x.shape[1] or x.shape[0] != 1:
            raise ValueError("x must be (1, N, H) with N the spans' total length")
        if len({id(s.cache) for s in spans}) != len(spans):
            raise ValueError("each span needs its own cache")
        for s in spans:
            if s.length < 1 or s.start < 0:
                raise ValueError(f"bad span: start {s.start}, length {s.length}")
            s.cache.prepare(s.start, s.length)
        out = fast_ragged(self.fast_decode, x, spans)
        if out is not None:
            return out
        lo, hi = layers if layers is not None else (0, len(self.model.layers))
        kinds = self._layer_tables
        pos = torch.cat([torch.arange(s.start, s.start + s.length) for s in spans])
        end = max(s.start + s.length for s in spans)
        tables = {}
        for kind in set(kinds[lo:hi]):
            cos, sin = self.rope(0, end, x.dtype, kind)
            tables[kind] = (cos[pos], sin[pos])
        for i in range(lo, hi):
            x = self.model.layers[i](x, *tables[kinds[i]], None, 0, spans)
        for s in spans:
            s.cache.length = s.start + s.length
        return x

    def head(self, x: torch.Tensor) -> torch.Tensor:
        fast: Any = self.fast_decode
        if fast is not None and (x.numel() == x.shape[-1] or hasattr(fast, "layers_batch")):
            return fast.head(x)
        logits = head_rows(self.lm_head, self.model.norm(x))
        cap = self.config.final_logit_softcapping
        if cap is not None:  # elementwise: also right on a rank's rows of a split head
            logits = torch.tanh(logits / cap) * cap
        return logits

    def rope(
        self, start: int, T: int, dtype: torch.dtype, kind: str = "global"
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin (T, D) for positions start..start+T-1, sliced from a table that grows by
        doubling, so a decode step does no trigonometry. ``kind``: "global" (``inv_freq``) or
        "local" (the sliding layers' own base)."""
        end = start + T
        table = self._rope_tables.get(kind)
        if table is None or table[0].shape[0] < end or table[0].dtype != dtype:
            n = max(end, 2 * (table[0].shape[0] if table is not None else 256))
            pos = torch.arange(n, device=self.inv_freq.device)
            inv = self.inv_freq
            if kind == "local":
                inv = rope_inv_freq(self.config, local=True).to(inv.device)
            self._rope_tables[kind] = table = rope_cos_sin(inv, pos, dtype)
        return table[0][start:end], table[1][start:end]

    def new_cache(self) -> KVCache:
        # one window for the whole cache only when every layer shares it (else keep all)
        return KVCache(self.config.num_hidden_layers, window=self.config.cache_window)


Fuser = Callable[[list[nn.Module]], "nn.Module | None"]


def _fuse_rows(mods: list[nn.Module], other: Fuser | None) -> nn.Module | None:
    """One module computing ``cat([m(x) for m in mods], -1)``; the originals are re-pointed at
    row views of its storage, so memory is not doubled and ``state_dict`` is unchanged. Works
    for ``nn.Linear``; ``other`` fuses other kinds (quantized linears live above this layer).
    None when the weights cannot be fused (meta, mixed kinds)."""
    if all(type(m) is nn.Linear for m in mods):
        lins = cast(list[nn.Linear], mods)
        ws = [m.weight for m in lins]
        if any(w.is_meta for w in ws) or len({w.dtype for w in ws}) != 1:
            return None
        has_bias = [m.bias is not None for m in lins]
        fused = nn.Linear(
            ws[0].shape[1], sum(w.shape[0] for w in ws), bias=any(has_bias), device="meta"
        )
        fused.weight = nn.Parameter(torch.cat([w.detach() for w in ws]), requires_grad=False)
        if any(has_bias):
            fused.bias = nn.Parameter(
                torch.cat(
                    [
                        m.bias.detach() if m.bias is not None else ws[i].new_zeros(ws[i].shape[0])
                        for i, m in enumerate(lins)
                    ]
                ),
                requires_grad=False,
            )
        a = 0
        for m in lins:  # re-point the originals at views: the old tensors can be freed
            n = m.weight.shape[0]
            m.weight = nn.Parameter(fused.weight[a : a + n], requires_grad=False)
            if m.bias is not None:
                m.bias = nn.Parameter(fused.bias[a : a + n], requires_grad=False)
            a += n
        return fused
    return other(mods) if other is not None else None


def fuse_projections(model: LlamaForCausalLM, other: Fuser | None = None) -> LlamaForCausalLM:
    """Lean decode: q/k/v and gate/up each become one matmul (fewer, larger GEMVs and fewer
    interpreter round trips per layer). Call after loading (and after ``edge.tp.shard``);
    weights must be materialised in memory: a sliding window streams per-tensor mappings,
    which this would copy, so windowed models are left unfused."""
    with torch.no_grad():
        for layer in model.model.layers:
            attn = layer.self_attn
            attn.__dict__["qkv"] = _fuse_rows([attn.q_proj, attn.k_proj, attn.v_proj], other)
            if hasattr(layer, "mlp"):
                layer.mlp.__dict__["gate_up"] = _fuse_rows(
                    [layer.mlp.gate_proj, layer.mlp.up_proj], other
                )
    return model


def unfuse_projections(model: LlamaForCausalLM) -> None:
    """Drop the fused modules and any compiled decode step that reads them (before
    re-slicing or re-loading weights)."""
    model.__dict__["fast_decode"] = None
    for layer in model.model.layers:
        layer.self_attn.__dict__["qkv"] = None
        if hasattr(layer, "mlp"):
            layer.mlp.__dict__["gate_up"] = None


def init_weights(model: LlamaForCausalLM, std: float = 0.02, seed: int | None = None) -> None:
    """GPT-style init: normal(0, std) for matrices, scaled by 1/sqrt(2L) on residual outputs."""
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    n_layers = model.config.num_hidden_layers
    for name, p in model.named_parameters():
        if p.dim() < 2:
            continue
        s = (
            std / math.sqrt(2 * n_layers)
            if name.endswith(("o_proj.weight", "down_proj.weight", "w2.weight"))
            else std
        )
        with torch.no_grad():
            p.copy_(torch.randn(p.shape, generator=gen) * s)
