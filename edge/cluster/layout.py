"""Pure schedules of the pipeline layout: which layers each stage holds, and how a batched step
is cut into micro-batches that are in flight at once.

Why micro-batches (GPipe, Flover's temporal fusion): with S stages a step of one group keeps
one stage busy at a time. Cut into G groups, stage 1 runs group g+1 while stage 2 runs
group g, so with enough streams every stage works and the step costs about
``max_stage * (G + S - 1) / G`` instead of ``sum(stages)``. Groups are contiguous runs of the
engine's work items, so each group's wanted rows are the next rows of the whole step's
(``edge.engine.wanted_rows``), and the logits are simply concatenated.

Ordering (deadlock reasoning): the master sends every group to stage 1 before it waits for
any answer; each worker serves its messages in order and answers each group once; the master
then takes the answers in the order it sent the groups. Nobody waits for something that is
sent after its own wait, so the exchange cannot deadlock, whatever the group count.
"""

from __future__ import annotations

import math
from typing import Sequence, TypeVar

from edge.cluster.stage import LayerRange
from lowband.errors import ConfigError

LAYOUTS = ("auto", "single", "tp", "pipeline")
T = TypeVar("T")


def stage_ranges(
    layers: int, weights: Sequence[float], caps: Sequence[int] | None = None
) -> list[LayerRange]:
    """Contiguous layer ranges, one per stage, sized in proportion to ``weights`` (the
    devices' speeds) and never above ``caps`` (the layers each device's memory holds).
    Every stage gets at least one layer."""
    n = len(weights)
    if not 1 <= n <= layers:
        raise ConfigError("devices", f"{n} stages for {layers} layers: need 1 <= stages <= layers")
    if not all(math.isfinite(w) and w > 0 for w in weights):
        raise ConfigError("weights", f"must be finite and > 0, got {list(weights)}")
    cap = list(caps) if caps is not None else [layers] * n
    if len(cap) != n or any(c < 1 for c in cap) or sum(cap) < layers:
        raise ConfigError(
            "memory", f"the devices hold {sum(cap)} of {layers} layers (per device {cap})"
        )
    # largest remainder on the ideal shares, then move layers off devices over their cap
    total = sum(weights)
    ideal = [layers * w / total for w in weights]
    counts = [max(1, math.floor(x)) for x in ideal]
    while sum(counts) < layers:
        i = max(range(n), key=lambda j: ideal[j] - counts[j])
        counts[i] += 1
    while sum(counts) > layers:
        i = max((j for j in range(n) if counts[j] > 1), key=lambda j: counts[j] - ideal[j])
        counts[i] -= 1
    for i in range(n):
        while counts[i] > cap[i]:
            j = max((j for j in range(n) if counts[j] < cap[j]), key=lambda j: cap[j] - counts[j])
            counts[i] -= 1
            counts[j] += 1
    out, lo = [], 0
    for c in counts:
        out.append(LayerRange(lo, lo + c, layers))
        lo += c
    return out


def micro_batches(items: Sequence[T], sizes: Sequence[int], groups: int) -> list[list[T]]:
    """``items`` (with token counts ``sizes``) cut into at most ``groups`` contiguous, non-empty
    runs of about equal tokens (a prompt chunk is not split: it rides in one group)."""
    if groups < 1:
        raise ConfigError("micro_batches", f"must be >= 1, got {groups}")
    if len(items) != len(sizes):
        raise ValueError("one size per item")
    g = min(groups, len(items))
    if g <= 1:
        return [list(items)] if items else []
    total = sum(sizes)
    out: list[list[T]] = [[]]
    done = 0
    for k, (item, n) in enumerate(zip(items, sizes)):
        left_items = len(items) - k
        left_groups = g - len(out)
        # close the current group at its share of the tokens, or when every remaining item is
        # needed to give each remaining group one
        if (
            out[-1]
            and left_groups > 0
            and (done >= total * len(out) / g or left_items <= left_groups)
        ):
            out.append([])
        out[-1].append(item)
        done += n
    return out
