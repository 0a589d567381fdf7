"""How a site of N ranks splits the outer synchronization: the shard layout and shard fragments.

A *site* is one torch.distributed job (torchrun, N ranks) that trains a single replica of the
model; only the outer sync crosses the WAN. Rank r of every site owns the same shard of every
parameter and syncs it with rank r of the other sites over its own lowband group (per-shard peer
groups, as torchft and PCCL do), so each rank puts ~1/N of the bytes on the wire.

The shard of a parameter is chunk r of ``torch.chunk(p, N, dim=0)``: the rows FSDP2
(``fully_shard``, ``Shard(0)``) keeps on rank r, so with FSDP2 a rank's shard is simply its
DTensor's ``.to_local()``; with DDP (replicas) it is a view of those rows of the replica.

The outer maths of ``diloco.outer`` is elementwise, so a shard works like a smaller fragment:
:class:`ShardFragment` is a :class:`FragmentSync` whose local tensors are the shards (re-read at
every use, since FSDP2 may re-point a DTensor's local storage) and whose global copy, outer
optimizer state and error-feedback residual cover the shard only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal, Sequence

import torch

from diloco.outer import FragmentSync
from lowband.comm import Codec
from lowband.errors import ConfigError

Engine = Literal["fsdp2", "ddp"]
OuterFactory = Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]  # OptimizerConfig.build
ENGINES = ("fsdp2", "ddp")


@dataclass(frozen=True, kw_only=True)
class ShardLayout:
    """Where one rank sits in its site: rank ``rank`` of ``size`` (N), inner engine ``engine``."""

    size: int  # N: ranks of the site (torch.distributed world of the site)
    rank: int  # r: this rank in the site; also which lowband group (shard) it syncs
    engine: Engine = "fsdp2"

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ConfigError("site.size", f"N must be >= 1, got {self.size}")
        if not 0 <= self.rank < self.size:
            raise ConfigError("site.rank", f"must be in [0, {self.size}), got {self.rank}")
        if self.engine not in ENGINES:
            raise ConfigError("site.engine", f"must be one of {ENGINES}, got {self.engine!r}")

    def describe(self) -> str:
        """Names the layout in errors: two sites whose shards do not map differ here."""
        return f"a site of {self.size} rank(s) ({self.engine}, dim-0 chunks), shard {self.rank}"


def shard_rows(rows: int, size: int, rank: int) -> tuple[int, int]:
    """[start, stop) of chunk ``rank`` of ``torch.chunk`` over ``rows`` rows in ``size`` parts.
    torch.chunk gives every chunk ceil(rows/size) rows except the tail, and may leave trailing
    ranks empty (e.g. 3 rows over 4 ranks: 1,1,1,0). Pure."""
    step = -(-rows // size) if rows else 0
    start = min(rows, rank * step)
    return start, min(rows, start + step)


def batch_rows(batch_size: int, size: int, rank: int) -> slice:
    """The rows of the site's batch that rank ``rank`` trains on: equal parts, so the average of
    the ranks' mean losses is the mean loss of the whole batch (the 1-rank site's gradient)."""
    if batch_size % size:
        raise ConfigError(
            "data.batch_size",
            f"B={batch_size} must be divisible by the site's "
            f"{size} ranks (each rank trains on B/N sequences)",
        )
    part = batch_size // size
    return slice(rank * part, (rank + 1) * part)


def local_shard(param: torch.Tensor, layout: ShardLayout) -> torch.Tensor:
    """This rank's shard of ``param`` as a tensor sharing its storage (in-place writes land in
    the model): the DTensor's local tensor under FSDP2, a row view of the replica under DDP."""
    to_local = getattr(param, "to_local", None)
    if to_local is not None:  # a DTensor (FSDP2): its local tensor is exactly chunk r of dim 0
        return to_local().detach()
    if param.dim() == 0:
        return param.detach().reshape(1) if layout.rank == 0 else param.detach().reshape(-1)[:0]
    start, stop = shard_rows(param.shape[0], layout.size, layout.rank)
    return param.detach()[start:stop]


class ShardFragment(FragmentSync):
    """Fragment p restricted to this rank's shards. ``local`` is re-read on every access."""

    def __init__(
        self,
        index: int,
        names: Sequence[str],
        params: Sequence[torch.nn.Parameter],
        layout: ShardLayout,
        outer: OuterFactory,
        codec: Codec | None,
        error_feedback: bool,
    ) -> None:
        self.layout = layout
        shards = [local_shard(p, layout) for p in params]
        global_ = [torch.nn.Parameter(s.clone(), requires_grad=True) for s in shards]
        super().__init__(index, names, params, global_, outer(global_), codec, error_feedback)

    @property  # type: ignore[override]
    def local(self) -> list[torch.Tensor]:
        return [local_shard(p, self.layout) for p in self._params]

    @local.setter
    def local(self, params: list[torch.nn.Parameter]) -> None:
        self._params = list(params)


def gather_rows(shard: torch.Tensor, rows: int, size: int, all_gather) -> torch.Tensor:
    """The full tensor from every rank's dim-0 chunk. ``all_gather(list_out, tensor)`` is the
    site's collective (torch.distributed.all_gather with the site group); chunks are padded to
    ceil(rows/size) rows so every rank sends the same shape. Everything stays on ``shard``'s
    device: pass the shard on the device the site's collectives run on (CUDA under NCCL)."""
    step = -(-rows // size) if rows else 0
    pad = torch.zeros((step,) + tuple(shard.shape[1:]), dtype=shard.dtype, device=shard.device)
    pad[: shard.shape[0]] = shard
    parts = [torch.empty_like(pad) for _ in range(size)]
    all_gather(parts, pad)
    return torch.cat(parts)[:rows]
