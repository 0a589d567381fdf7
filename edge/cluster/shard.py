"""What master and workers both do with their slice of the model: load it, encode the
all-reduces, tag them, check where a batch may append to a KV cache, and compute the logits
of the vocabulary-parallel head (one row, or several rows of a batch at once)."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Collection, Sequence

import torch

from edge.cluster.protocol import MAX_SEQS
from edge.embeddings import embed_ragged
from edge.engine import Work
from edge.moe.serve import ExpertServeConfig, is_nested_dir, load_nested_shard
from edge.shardio import LoadedShard, WindowConfig, load_shard
from edge.tp import Reduce, TPPlan, exact_reduce, gather_logits, make_reduce
from lowband.codecs import Int8BlockCodec, get_codec
from lowband.comm import Algorithm, Codec, Communicator
from lowband.errors import ConfigError
from lowband.models.llama import KVCache, LlamaForCausalLM
from transport.starlink import StarHub, StarSpoke

WIRE_CODECS = ("fp32", "fp16", "bf16", "int8")
_ALGORITHMS: dict[str, Algorithm] = {"auto": "auto", "ring": "ring", "star": "star"}


def wire_codec(name: str) -> Codec | None:
    """Activation codec for the all-reduces; ``None`` sends fp32 as is. int8 uses blocks of 64
    values: activations are short vectors, a 256 block would be mostly padding."""
    if name not in WIRE_CODECS:
        raise ConfigError("wire", f"unknown activation encoding {name!r}; one of {WIRE_CODECS}")
    if name == "fp32":
        return None
    return Int8BlockCodec(block=64) if name == "int8" else get_codec(name)


class Tags:
    """All-reduce tags ``f{fid}.{k}``: a half-finished forward of an old epoch can never be
    matched with a new one (see ``edge.cluster``)."""

    def __init__(self) -> None:
        self.fid = 0
        self.k = 0

    def start(self, fid: int) -> None:
        self.fid, self.k = fid, 0

    def __call__(self) -> str:
        self.k += 1
        return f"f{self.fid}.{self.k}"


def check_experts(model_dir: str | Path, experts: ExpertServeConfig | None) -> bool:
    """Whether ``model_dir`` is a nested MoE; refuses a missing or a pointless expert budget."""
    nested = is_nested_dir(model_dir)
    if nested and experts is None:
        raise ConfigError(
            "expert_budget_mb",
            f"{model_dir} is a bit-nested MoE: give the memory "
            "its experts may use (--expert-budget-mb)",
        )
    if not nested and experts is not None:
        raise ConfigError(
            "expert_budget_mb",
            f"{model_dir} is not a bit-nested MoE directory "
            "(convert with 'lowband edge quantize MODEL --nested --out DIR')",
        )
    return nested


def load_slot(
    model_dir: str,
    slot: int,
    world: int,
    weights: Sequence[float] | None,
    dtype: str | None,
    net: Communicator | StarHub | StarSpoke,
    codec: Codec | None,
    algorithm: str,
    timeout: float,
    window: WindowConfig | None,
    tags: Tags,
    experts: ExpertServeConfig | None = None,
    repack: str = "off",
) -> LoadedShard:
    """Slot ``slot`` of a ``world``-device plan of ``model_dir``, its all-reduces over ``net``
    (whatever carries them: the communicator or a star link); ``repack``: its K-quant weights
    also in the batch GEMM's layout (:meth:`LoadedShard.repack`)."""
    if algorithm not in _ALGORITHMS:
        raise ConfigError("algorithm", f"must be star, ring or auto, got {algorithm!r}")
    reduce = make_reduce(
        net, codec=codec, algorithm=_ALGORITHMS[algorithm], timeout=timeout, tags=tags
    )
    # experts is not None when the directory is nested: check_experts refuses that
    if check_experts(model_dir, experts) and experts is not None:
        loaded = load_nested_shard(
            model_dir,
            slot,
            world,
            experts=experts,
            weights=weights,
            reduce=reduce,
            window=window,
            dtype=dtype,
        )
    else:
        loaded = load_shard(
            model_dir, slot, world, weights=weights, dtype=dtype, reduce=reduce, window=window
        )
    loaded.repack(repack)
    return loaded


def shard_logits(shard: LoadedShard, h: torch.Tensor, top: int) -> torch.Tensor | None:
    """Next-token logits from the last position of ``h`` (1, T, H): the master's (V,) float32
    answer, None on a worker. With a vocabulary-parallel head every rank computes its rows and
    takes part in :func:`edge.tp.gather_logits` (``top``: see there)."""
    model, plan = shard.model, shard.plan
    V = model.config.vocab_size
    a, b = plan.vocab_rows(shard.rank, V)
    local = model.head(h[:, -1]).float()[0] if b > a else None
    if not plan.vocab_split or shard.reduce is None:
        return local
    return gather_logits(local, plan, shard.rank, V, top, exact_reduce(shard.reduce))


def append_problem(cache: KVCache | None, start: int) -> str | None:
    """Why a forward may not append at ``start`` to ``cache`` (None when it may): positions
    follow on what the cache holds (no gap), and a sliding-window cache restarts only at 0 or
    from its floor. Master and workers check the same caches before a batch, so a bad one is
    refused everywhere before any rank computes (else the ranks would leave step)."""
    held = cache.length if cache is not None else 0
    if start > held:
        return f"appends at position {start}, but the cache holds {held}"
    floor = cache.restart_floor() if cache is not None else 0
    if 0 < start < floor:
        return f"restarts at {start}, below the sliding window's floor {floor}"
    return None


def scratch_caches(held: Collection[int], n: int) -> list[int]:
    """``n`` KV-cache ids for throw-away passes (embeddings): the top of the ids every rank
    accepts, far above the engine's slots (``parallel`` + prefix caches); refused
    (RuntimeError) when one of them holds an engine sequence or ``n`` is beyond half of them."""
    ids = list(range(MAX_SEQS - n, MAX_SEQS))
    if not 0 < n <= MAX_SEQS // 2 or any(i in held for i in ids):
        raise RuntimeError(f"no {n} free cache ids for a throw-away pass")
    return ids


def embed_in_scratch(
    model: LlamaForCausalLM,
    held: Collection[int],
    drop: Callable[[int], None],
    seqs: Sequence[Sequence[int]],
    pooling: str,
    chunk: int,
    ragged: Callable[[list[Work]], torch.Tensor],
) -> torch.Tensor:
    """:func:`edge.embeddings.embed_ragged` on a cluster: each ragged pass is ``ragged(work)``
    (the (N, H) hidden states before the final norm, computed on every rank or stage) over
    throw-away caches (:func:`scratch_caches`, clear of the ``held`` ones), which ``drop``
    removes everywhere afterwards, whatever happened."""
    scratch = scratch_caches(held, len(seqs))

    def run(items: Sequence[tuple[int, int, Sequence[int]]]) -> torch.Tensor:
        return ragged(
            [Work(slot=scratch[i], ids=list(t), start=p, logits="none") for i, p, t in items]
        )

    try:
        return embed_ragged(model, seqs, pooling, chunk, run)
    finally:
        for c in scratch:
            drop(c)


def shard_rows_logits(shard: LoadedShard, h: torch.Tensor, top: int) -> torch.Tensor | None:
    """Next-token logits of every row of ``h`` (R, H), R >= 1, in one exchange: the master's
    (R, V) float32 answer, None on a worker (see :func:`shard_logits`, its one-row case)."""
    model, plan = shard.model, shard.plan
    V = model.config.vocab_size
    a, b = plan.vocab_rows(shard.rank, V)
    local = model.head(h).float().reshape(h.shape[0], -1) if b > a else None
    if not plan.vocab_split or shard.reduce is None:
        return local
    return gather_rows(local, plan, shard.rank, V, h.shape[0], top, exact_reduce(shard.reduce))


def gather_rows(
    local: torch.Tensor | None,
    plan: TPPlan,
    rank: int,
    vocab_size: int,
    n_rows: int,
    top: int,
    reduce: Reduce,
) -> torch.Tensor | None:
    """:func:`edge.tp.gather_logits` for ``n_rows`` rows at once, in one all-reduce: a batch
    pays the link's round trip once, not once per sequence. ``local``: (R, V_r) logits of
    this rank's vocabulary rows (None when it holds none). Rank 0 gets (R, V) float32, each
    row exactly what ``gather_logits`` gives for it (the same candidates, the same bytes per
    row); other ranks None."""
    R, V, world = n_rows, vocab_size, plan.world
    k = top if 0 < top and 2 * top * world < V and V < 2**24 else 0
    a, b = plan.vocab_rows(rank, V)
    if local is not None and tuple(local.shape) != (R, b - a):
        raise ValueError(f"rank {rank} holds rows [{a}, {b}) of {R} rows, got {tuple(local.shape)}")
    if k == 0:
        buf = torch.zeros(R, V, dtype=torch.float32)
        if local is not None:
            buf[:, a:b] = local.float()
        total = reduce(buf.view(-1)).view(R, V)
        return total if rank == 0 else None
    # as in gather_logits: [row, r, 0, :] rank r's best values, [row, r, 1, :] their ids + 1
    buf = torch.zeros(R, world, 2, k, dtype=torch.float32)
    if local is not None and b > a:
        n = min(k, b - a)
        lf = local.float()
        if n == 1:
            i = torch.argmax(lf, dim=-1, keepdim=True)  # first of equal maxima, like argmax
            v = lf.gather(-1, i)
        else:
            v, i = torch.topk(lf, n, dim=-1)
        buf[:, rank, 0, :n] = v
        buf[:, rank, 1, :n] = (i + a + 1).float()
    total = reduce(buf.view(-1)).view(R, world, 2, k)
    if rank != 0:
        return None
    ids, vals = total[:, :, 1].reshape(R, -1), total[:, :, 0].reshape(R, -1)
    keep = ids > 0
    row = torch.arange(R).view(R, 1).expand_as(ids)
    out = torch.full((R, V), float("-inf"), dtype=torch.float32)
    out[row[keep], ids[keep].long() - 1] = vals[keep]
    return out
