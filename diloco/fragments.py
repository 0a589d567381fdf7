"""Splitting a model's parameters into P fragments (Streaming DiLoCo §2.2).

Transformer blocks are the natural unit: the paper assigns whole blocks to fragments either
*strided* (block b -> fragment b mod P, so every fragment spans the depth of the network) or
*sequential* (contiguous runs of blocks). Parameters outside the blocks (embeddings, final norm,
LM head) are placed greedily, largest first, into the currently smallest fragment, which keeps
the per-sync payload (and so the peak bandwidth) close to 1/P of the model.

A model without numbered blocks is split over its individual parameters, in module order.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal, Sequence

import torch

from lowband.errors import ConfigError

BLOCK_PATTERN = r"(?:^|\.)layers\.(\d+)\."
"""Matches the block index in HF names such as ``model.layers.3.mlp.up_proj.weight``."""


@dataclass(frozen=True)
class FragmentPlan:
    """``names[p]``: the parameter names of fragment p, in the model's parameter order."""

    names: tuple[tuple[str, ...], ...]

    @property
    def n_fragments(self) -> int:
        return len(self.names)


def _units(
    named: Sequence[tuple[str, torch.Tensor]], pattern: str
) -> tuple[list[list[str]], list[list[str]]]:
    """(blocks in index order, other units in model order); a unit is a list of names."""
    blocks: dict[int, list[str]] = {}
    others: list[list[str]] = []
    rx = re.compile(pattern)
    for name, _ in named:
        m = rx.search(name)
        if m:
            blocks.setdefault(int(m.group(1)), []).append(name)
        else:
            others.append([name])
    return [blocks[i] for i in sorted(blocks)], others


def plan_fragments(
    named: Sequence[tuple[str, torch.Tensor]],
    n_fragments: int,
    strategy: Literal["strided", "sequential"] = "strided",
    block_pattern: str = BLOCK_PATTERN,
) -> FragmentPlan:
    """Assign every parameter to exactly one of ``n_fragments`` fragments."""
    sizes = {name: t.numel() for name, t in named}
    blocks, others = _units(named, block_pattern)
    if len(blocks) < n_fragments:  # too few blocks: split over all units in module order
        units = [[name] for name, _ in named]
        others = []
    else:
        units = blocks
    if len(units) < n_fragments:
        raise ConfigError(
            "n_fragments",
            f"P={n_fragments} exceeds the {len(units)} parameter "
            "units this model can be split into",
        )
    groups: list[list[str]] = [[] for _ in range(n_fragments)]
    if strategy == "strided":
        for i, unit in enumerate(units):
            groups[i % n_fragments].extend(unit)
    elif strategy == "sequential":
        total = sum(sizes[n] for u in units for n in u)
        done, prev = 0, 0
        for i, unit in enumerate(units):
            # The fragment whose share of the parameters this unit starts in, but never skip a
            # fragment and never leave a later one without a unit: no fragment ends up empty.
            p = min(done * n_fragments // max(total, 1), prev + 1, n_fragments - 1)
            p = max(p, n_fragments - (len(units) - i))
            groups[p].extend(unit)
            done += sum(sizes[n] for n in unit)
            prev = p
    else:
        raise ConfigError("fragment_strategy", f"unknown strategy {strategy!r}")
    load = [sum(sizes[n] for n in g) for g in groups]
    for unit in sorted(others, key=lambda u: -sum(sizes[n] for n in u)):
        p = min(range(n_fragments), key=lambda i: (load[i], i))
        groups[p].extend(unit)
        load[p] += sum(sizes[n] for n in unit)
    order = {name: i for i, (name, _) in enumerate(named)}
    return FragmentPlan(tuple(tuple(sorted(g, key=order.__getitem__)) for g in groups))
