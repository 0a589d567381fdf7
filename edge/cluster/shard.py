"""What master and workers both do with their slice of the model: load it, encode the
all-reduces, tag them, and compute the logits of the vocabulary-parallel head."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch

from edge.moe.serve import ExpertServeConfig, is_nested_dir, load_nested_shard
from edge.shardio import LoadedShard, WindowConfig, load_shard
from edge.tp import exact_reduce, gather_logits, make_reduce
from lowband.codecs import Int8BlockCodec, get_codec
from lowband.comm import Algorithm, Codec, Communicator
from lowband.errors import ConfigError
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
) -> LoadedShard:
    """Slot ``slot`` of a ``world``-device plan of ``model_dir``, its all-reduces over ``net``
    (whatever carries them: the communicator or a star link)."""
    if algorithm not in _ALGORITHMS:
        raise ConfigError("algorithm", f"must be star, ring or auto, got {algorithm!r}")
    reduce = make_reduce(
        net, codec=codec, algorithm=_ALGORITHMS[algorithm], timeout=timeout, tags=tags
    )
    # experts is not None when the directory is nested: check_experts refuses that
    if check_experts(model_dir, experts) and experts is not None:
        return load_nested_shard(
            model_dir,
            slot,
            world,
            experts=experts,
            weights=weights,
            reduce=reduce,
            window=window,
            dtype=dtype,
        )
    return load_shard(
        model_dir, slot, world, weights=weights, dtype=dtype, reduce=reduce, window=window
    )


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
