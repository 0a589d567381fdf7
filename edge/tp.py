"""Tensor parallelism applied after construction: ``shard(model, plan, rank, world, reduce)``.

Megatron-style split of every decoder layer (TPI-LLM §3.1): the attention block is split by
whole KV groups (a group = one KV head and the query heads that read it), so each rank runs
ordinary grouped-query attention on its heads and ``o_proj`` produces a partial sum; the
SwiGLU FFN (and every Mixtral expert) is split by intermediate columns, so ``down_proj``/``w2``
produce partial sums. Two all-reduces per layer combine them (the ``reduce`` hooks of
``lowband.models.llama``). Norms and the MoE router are replicated; the embedding lives on rank 0
only (the master embeds tokens and samples; workers see hidden states).

The LM head is split by vocabulary rows (``TPPlan.vocab``): after the last all-reduce every rank
holds the same final hidden state, so each applies the final norm and its rows of ``lm_head``.
On a small model the head is a large part of the step (32000 x 512 is 41 % of the ~40 M weights
one token reads in the 56 M benchmark model); left on the master it capped the TP speed-up near
1.2x however fast the link. :func:`gather_logits` then brings to the master only what its sampler
can pick: each rank's best ``top`` candidates (greedy: one value and index per rank), or every
logit when the sampler needs the whole distribution. A plan from an older split directory
(no ``vocab`` entry) keeps the whole head on rank 0.

Uneven splits: ``weights`` (device memory or speed) apportion KV groups and FFN columns by the
largest-remainder method. A rank may get zero KV groups when there are more ranks than groups;
it still takes part in the all-reduce with a zero contribution.

Bit-exact TP: column-parallel matrices (q/k/v, gate/up, the head's rows) compute each output
over the whole input on one rank, with the activations quantized per 32 values as one device
quantizes them (every split is on whole blocks), so their outputs have one device's bits.
Row-parallel ones (``o_proj``, ``down_proj``, expert ``w2``) add partial sums over their input
columns; for ggml blocks (``GGMLLinear``) one device computes them in the same order: split-K
into ``REDUCE_LEAVES`` (2) leaves added pairwise (:func:`split_row_parallel`,
``edge/quant/csrc/splitk.h``), so a rank holding an aligned power of two of leaves computes a
subtree, and the all-reduce adds the subtrees. Two ranks: ``a + b == b + a``, so an even
2-way split gives one device's logits bit for bit. Where it cannot hold: more than two ranks
(a rank's columns are not whole leaves of the 2-leaf tree; 4 leaves would fix the kernels'
side, but the star all-reduce adds ``((r0 + r1) + r2) + r3``, not ``(r0 + r1) + (r2 + r3)``);
a 2-way split off the leaf boundary (uneven ``weights``; ``o_proj`` when the KV groups do not
split evenly; a rank with no KV group is fine: it adds zeros, which is exact); a bias on a
row-parallel matrix (rank 0 adds it before the sum); Q8_0/Q4_0 matrices (``QuantLinear``:
no split-K); a wire codec (int8 rounds the partials).

:func:`slice_of` is the single source of truth for "which part of tensor ``name`` does rank r
hold"; ``shard``, the checkpoint loader and ``lowband edge split`` all use it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Literal, Protocol, Sequence, overload

import torch
from torch import nn

from edge.quant import QuantLinear
from edge.quant.embedding import GGMLEmbedding, QuantEmbedding
from edge.quant.linear import GGMLLinear
from lowband.comm import Algorithm, Codec
from lowband.errors import ConfigError
from lowband.models.config import ModelConfig
from lowband.models.llama import LlamaForCausalLM, unfuse_projections

Reduce = Callable[[torch.Tensor], torch.Tensor]

HEAD_KEYS = ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")


class AllReduceLink(Protocol):
    """What :func:`make_reduce` needs of a link: a ``lowband.comm.Communicator`` or a star link
    (``transport.starlink.StarHub`` / ``StarSpoke``)."""

    def all_reduce(
        self,
        x: torch.Tensor,
        op: Literal["sum"],
        /,
        *,
        codec: Codec | None,
        algorithm: Algorithm,
        tag: str | None,
        timeout: float | None,
    ) -> torch.Tensor: ...


def apportion(total: int, weights: Sequence[float], unit: int = 1) -> list[int]:
    """Split ``total`` (a multiple of ``unit`` except for the remainder given to the largest
    share) into parts proportional to ``weights`` with the largest-remainder method."""
    if total < 0:
        raise ConfigError("total", f"must be >= 0, got {total}")
    if not weights or any(w <= 0 for w in weights):
        raise ConfigError("weights", f"need positive weights, got {list(weights)}")
    units, rest = divmod(total, unit)
    s = float(sum(weights))
    exact = [units * w / s for w in weights]
    parts = [int(e) for e in exact]
    # Hand the remaining units to the largest fractional parts (ties: lower rank first).
    order = sorted(range(len(weights)), key=lambda r: (-(exact[r] - parts[r]), r))
    for r in order[: units - sum(parts)]:
        parts[r] += 1
    parts = [p * unit for p in parts]
    parts[max(range(len(parts)), key=lambda r: (parts[r], -r))] += rest
    return parts


def _ranges(sizes: Sequence[int]) -> tuple[tuple[int, int], ...]:
    out, start = [], 0
    for n in sizes:
        out.append((start, start + n))
        start += n
    return tuple(out)


@dataclass(frozen=True, kw_only=True)
class TPPlan:
    """Which slice of each layer every rank holds.

    ``kv[r]``: half-open range of KV heads of rank r (its query heads follow: ``kv * G``).
    ``ffn[r]``: half-open range of intermediate (FFN / expert) columns of rank r.
    ``vocab[r]``: half-open range of LM-head rows (token ids) of rank r; None: all on rank 0.
    """

    world: int
    weights: tuple[float, ...]
    kv: tuple[tuple[int, int], ...]
    ffn: tuple[tuple[int, int], ...]
    group: int  # G: query heads per KV head
    head_dim: int  # D
    vocab: tuple[tuple[int, int], ...] | None = None

    def __post_init__(self) -> None:
        if self.world < 1:
            raise ConfigError("world", f"must be >= 1, got {self.world}")
        for name in ("weights", "kv", "ffn") + (("vocab",) if self.vocab is not None else ()):
            if len(getattr(self, name)) != self.world:
                raise ConfigError(
                    name, f"needs {self.world} entries, got {len(getattr(self, name))}"
                )
        if self.vocab is not None and (
            self.vocab[0][0] != 0
            or any(a > b or b != c for (a, b), (c, _) in zip(self.vocab, self.vocab[1:]))
        ):
            raise ConfigError(
                "vocab", f"rows must tile [0, V) in rank order, got {list(self.vocab)}"
            )

    @property
    def vocab_split(self) -> bool:
        """Whether the LM head is split over several ranks (else rank 0 holds all of it)."""
        return self.vocab is not None and sum(b > a for a, b in self.vocab) > 1

    def vocab_rows(self, rank: int, vocab_size: int) -> tuple[int, int]:
        """The LM-head rows rank ``rank`` holds. When the proportional split would leave the rows
        on one rank only (a tiny weight rounds to none), the head is not split and rank 0 holds
        it whole, as :func:`slice_of` loads it."""
        if self.vocab is None or not self.vocab_split:
            return (0, vocab_size) if rank == 0 else (vocab_size, vocab_size)
        return self.vocab[rank]

    def q_heads(self, rank: int) -> tuple[int, int]:
        a, b = self.kv[rank]
        return a * self.group, b * self.group

    def to_dict(self) -> dict[str, Any]:
        out = {
            "world": self.world,
            "weights": list(self.weights),
            "kv": [list(r) for r in self.kv],
            "ffn": [list(r) for r in self.ffn],
            "group": self.group,
            "head_dim": self.head_dim,
        }
        if self.vocab is not None:
            out["vocab"] = [list(r) for r in self.vocab]
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "TPPlan":
        return cls(
            world=int(d["world"]),
            weights=tuple(float(w) for w in d["weights"]),
            kv=tuple((int(a), int(b)) for a, b in d["kv"]),
            ffn=tuple((int(a), int(b)) for a, b in d["ffn"]),
            group=int(d["group"]),
            head_dim=int(d["head_dim"]),
            vocab=tuple((int(a), int(b)) for a, b in d["vocab"]) if d.get("vocab") else None,
        )


def make_plan(
    cfg: ModelConfig,
    world: int,
    weights: Sequence[float] | None = None,
    ffn_unit: int = 8,
    vocab_parallel: bool = True,
) -> TPPlan:
    """Plan a ``world``-way split. ``ffn_unit`` keeps column blocks SIMD-friendly (a quantized
    model passes its group size, so ``down_proj`` splits on whole groups). ``vocab_parallel``:
    split the LM head by rows in the same proportions (else it stays whole on rank 0)."""
    if world < 1:
        raise ConfigError("devices", f"must be >= 1, got {world}")
    w = tuple(float(x) for x in (weights or [1.0] * world))
    if len(w) != world:
        raise ConfigError("weights", f"{len(w)} weights given for {world} devices")
    unit = ffn_unit if cfg.intermediate_size >= ffn_unit * world else 1
    return TPPlan(
        world=world,
        weights=w,
        kv=_ranges(apportion(cfg.n_kv_heads, w)),
        ffn=_ranges(apportion(cfg.intermediate_size, w, unit)),
        group=cfg.num_attention_heads // cfg.n_kv_heads,
        head_dim=cfg.dim_per_head,
        vocab=(
            _ranges(apportion(cfg.vocab_size, w, 32 if cfg.vocab_size >= 32 * world else 1))
            if vocab_parallel and world > 1
            else None
        ),
    )


# Leaves of the split-K tree of a row-parallel ggml matrix: an even 2-way split holds whole
# subtrees. Each leaf costs a horizontal sum per output and its own activation pass; 4 leaves
# would make 4-way splits subtrees too, but the star all-reduce does not add 4 ranks in the
# tree's order (see the module doc), so one device pays only for the 2-way tree.
REDUCE_LEAVES = 2

_ROW_PARALLEL = re.compile(
    r"model\.layers\.\d+\.(self_attn\.o_proj|mlp\.down_proj|block_sparse_moe\.experts\.\d+\.w2)$"
)


def canonical_chunk(in_features: int, group: int, leaves: int = REDUCE_LEAVES) -> int:
    """Values per leaf of a row-parallel matrix's split-K tree: ``in_features`` cut into the
    largest power of two of leaves, at most ``leaves``, each whole blocks of ``group``; 0 where
    it cannot be cut in two."""
    n = leaves
    while n > 1 and in_features % (n * group):
        n //= 2
    return in_features // n if n > 1 else 0


def split_row_parallel(model: nn.Module) -> None:
    """Give every row-parallel ggml matrix of a whole (unsharded) model its split-K tree, so one
    device adds partial sums as an even 2-way tensor-parallel split does (:func:`shard` keeps a
    rank's subtree through ``GGMLLinear.narrow_in``)."""
    for name, mod in model.named_modules():
        if isinstance(mod, GGMLLinear) and _ROW_PARALLEL.search(name):
            mod.split_k(canonical_chunk(mod.in_features, mod.group))


_ATTN = re.compile(r"model\.layers\.\d+\.self_attn\.(q|k|v|o)_proj\.(weight|bias)$")
_FFN = re.compile(
    r"model\.layers\.\d+\.(mlp\.(gate|up|down)_proj|block_sparse_moe\.experts\.\d+\.(w1|w2|w3))"
    r"\.weight$"
)


def slice_of(name: str, plan: TPPlan, rank: int) -> tuple[int, int, int] | bool:
    """How rank ``rank`` holds tensor ``name``: ``(dim, start, end)`` for a slice, ``True`` for
    the whole tensor (replicated), ``False`` when the rank does not hold it at all."""
    if name in HEAD_KEYS:
        if plan.vocab is None or not plan.vocab_split or name == "model.embed_tokens.weight":
            return rank == 0
        if name == "model.norm.weight":  # every rank applies it before its rows of the head
            return True
        a, b = plan.vocab[rank]
        return (0, a, b) if b > a else False
    m = _ATTN.search(name)
    if m:
        proj, D = m.group(1), plan.head_dim
        if proj == "q":
            a, b = plan.q_heads(rank)
            return (0, a * D, b * D)
        if proj in ("k", "v"):
            a, b = plan.kv[rank]
            return (0, a * D, b * D)
        if m.group(2) == "bias":  # o_proj bias would be added once per rank: keep it on rank 0
            return rank == 0
        a, b = plan.q_heads(rank)
        return (1, a * D, b * D)
    m = _FFN.search(name)
    if m:
        a, b = plan.ffn[rank]
        rows = m.group(2) in ("gate", "up") or m.group(3) in ("w1", "w3")
        return (0, a, b) if rows else (1, a, b)
    return True


@overload
def take(t: torch.Tensor, spec: tuple[int, int, int] | Literal[True]) -> torch.Tensor: ...
@overload
def take(t: torch.Tensor, spec: Literal[False]) -> None: ...
@overload
def take(t: torch.Tensor, spec: tuple[int, int, int] | bool) -> torch.Tensor | None: ...
def take(t: torch.Tensor, spec: tuple[int, int, int] | bool) -> torch.Tensor | None:
    """Apply a :func:`slice_of` answer to a full tensor (a meta tensor stays meta)."""
    if spec is False:
        return None
    if spec is True:
        return t
    dim, a, b = spec
    return t.narrow(dim, a, b - a)


def shard(
    model: LlamaForCausalLM, plan: TPPlan, rank: int, world: int, reduce: Reduce | None = None
) -> LlamaForCausalLM:
    """Slice ``model`` in place to rank ``rank``'s part and install ``reduce`` at the two
    reduce points of every layer. Works on a materialised model (slices are copied so the full
    tensors can be freed) and on a ``meta`` model (shapes change, load the slice afterwards).
    Tensors a rank does not hold become empty meta tensors."""
    if world != plan.world:
        raise ConfigError("world", f"plan was made for {plan.world} devices, got world {world}")
    if not 0 <= rank < world:
        raise ConfigError("rank", f"{rank} is not in [0, {world})")
    if world == 1:
        return model
    unfuse_projections(model)
    _shard_quantized(model, plan, rank)
    for name, param in list(model.named_parameters(remove_duplicate=False)):
        spec = slice_of(name, plan, rank)
        if spec is True:
            continue
        owner_name, _, pname = name.rpartition(".")
        owner = model.get_submodule(owner_name)
        part = take(param.data, spec)
        if part is None:
            new = torch.empty(0, device="meta", dtype=param.dtype)
        elif part.is_meta and part.numel() == 0:  # held but empty (no heads here): real
            new = torch.empty(part.shape, dtype=param.dtype)
        elif part.is_meta:
            new = torch.empty(part.shape, device="meta", dtype=param.dtype)
        else:
            new = part.contiguous().clone()
        owner._parameters[pname] = nn.Parameter(new, requires_grad=False)
    qa, qb = plan.q_heads(rank)
    ka, kb = plan.kv[rank]
    for layer in model.model.layers:
        attn = layer.self_attn
        attn.n_heads, attn.n_kv_heads = qb - qa, kb - ka
        attn.reduce = reduce
        layer.ffn.reduce = reduce
    return model


def _shard_quantized(model: nn.Module, plan: TPPlan, rank: int) -> None:
    """Packed linears keep their packing: rows and whole groups of columns are sliced out of
    the packed buffers (``QuantLinear.narrow_out`` / ``narrow_in``), never requantized. A packed
    token embedding stays whole on rank 0 and leaves the others."""
    for name, mod in list(model.named_modules()):
        if isinstance(mod, (GGMLEmbedding, QuantEmbedding)):
            if not slice_of(name + ".weight", plan, rank):  # the master embeds; nobody slices
                parent, _, child = name.rpartition(".")
                setattr(model.get_submodule(parent), child, nn.Embedding(0, 0, device="meta"))
            continue
        if not isinstance(mod, (QuantLinear, GGMLLinear)):  # GGMLLinear: group = block size
            continue
        spec = slice_of(name + ".weight", plan, rank)
        if spec is True:
            continue
        parent, _, child = name.rpartition(".")
        if spec is False:  # e.g. the LM head on a worker: never called there
            new: nn.Module = nn.Linear(0, 0, bias=False, device="meta")
        else:
            dim, a, b = spec
            if dim == 1 and (a % mod.group or b % mod.group):
                raise ConfigError(
                    "devices",
                    f"{name}: columns [{a}, {b}) of rank {rank} cut a "
                    f"quantization group of {mod.group}; use fewer devices or a "
                    f"smaller group",
                )
            new = (
                mod.narrow_out(a, b - a)
                if dim == 0
                else mod.narrow_in(a, b - a, keep_bias=rank == 0)
            )
        setattr(model.get_submodule(parent) if parent else model, child, new)


def make_reduce(
    comm: AllReduceLink,
    *,
    codec: Codec | None = None,
    algorithm: Algorithm = "star",
    timeout: float | None = None,
    tags: Callable[[], str] | None = None,
) -> Reduce:
    """The all-reduce hook for :func:`shard`: sums partial outputs over ``comm``.

    Without ``tags`` collectives are matched by call order, which is the same on every rank
    because every rank runs the same layers in the same order. A runtime that may abort a
    forward half-way passes ``tags`` (e.g. forward id + counter) so that a half-finished
    forward can never be matched against the next one."""

    def reduce(x: torch.Tensor) -> torch.Tensor:
        return comm.all_reduce(
            x,
            "sum",
            codec=codec,
            algorithm=algorithm,
            timeout=timeout,
            tag=tags() if tags is not None else None,
        )

    def exact(x: torch.Tensor) -> torch.Tensor:  # float32 whatever the wire codec: logits
        return comm.all_reduce(
            x,
            "sum",
            codec=None,
            algorithm=algorithm,
            timeout=timeout,
            tag=tags() if tags is not None else None,
        )

    reduce.exact = exact  # type: ignore[attr-defined]
    # A star link carrying float32 can be driven natively by the compiled decode step
    # (edge.fastpath); it reads these. Anything else goes through the call above.
    reduce.native_link = comm if codec is None and hasattr(comm, "native_spec") else None  # type: ignore[attr-defined]
    reduce.timeout = timeout  # type: ignore[attr-defined]
    return reduce


def exact_reduce(reduce: Reduce) -> Reduce:
    """The float32 (codec-free) sum over the same link as ``reduce``: what carries logits."""
    return getattr(reduce, "exact", reduce)


def gather_logits(
    local: torch.Tensor | None, plan: TPPlan, rank: int, vocab_size: int, top: int, reduce: Reduce
) -> torch.Tensor | None:
    """Bring the vocabulary-parallel head's logits to rank 0. Every rank calls it once per
    forward, after its head, in the same order as the layers' all-reduces.

    ``local``: (V_r,) logits of this rank's rows (None when it holds none). ``top``: how many
    of the largest logits the master's sampler can pick from (1 for greedy, ``top_k``) or 0 for
    all of them. The exchange is a float32 sum over ``reduce`` in which every rank writes only
    its own slots (x + 0 is exact): with ``top = k`` each rank contributes its k best values
    and their token ids (2·k floats, ids exact below 2^24), else its rows of the full vector.

    Returns, on rank 0, (V,) float32 logits equal to the unsplit head's wherever the sampler
    can pick and -inf elsewhere, so greedy and top-k(+top-p) sampling draw exactly what they
    would from the whole vector (the global top k are among the union of every rank's top k;
    ties between equal logits keep the lowest token id, like ``argmax``). Other ranks: None."""
    k = top if 0 < top and 2 * top * plan.world < vocab_size and vocab_size < 2**24 else 0
    a, b = plan.vocab_rows(rank, vocab_size)
    if local is not None and local.numel() != b - a:
        raise ValueError(f"rank {rank} holds rows [{a}, {b}) but produced {local.numel()} logits")
    if k == 0:
        buf = torch.zeros(vocab_size, dtype=torch.float32)
        if local is not None:
            buf[a:b] = local.float()
        total = reduce(buf)
        return total if rank == 0 else None
    # Slots [r, 0, :] hold rank r's values, [r, 1, :] its token ids + 1 (0: no candidate, when a
    # rank holds fewer than k rows); every other rank leaves them 0, so the sum is rank r's own.
    buf = torch.zeros(plan.world, 2, k, dtype=torch.float32)
    if local is not None and b > a:
        n = min(k, b - a)
        if n == 1:
            i = torch.argmax(local).view(1)  # first of equal maxima, like argmax over all
            v = local.float()[i]
        else:
            v, i = torch.topk(local.float(), n)
        buf[rank, 0, :n] = v
        buf[rank, 1, :n] = (i + a + 1).float()
    total = reduce(buf.view(-1)).view(plan.world, 2, k)
    if rank != 0:
        return None
    ids, vals = total[:, 1].reshape(-1), total[:, 0].reshape(-1)
    keep = ids > 0
    out = torch.full((vocab_size,), float("-inf"), dtype=torch.float32)
    out[ids[keep].long() - 1] = vals[keep]
    return out
