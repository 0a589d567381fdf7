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

LAYOUTS = ("auto", "single", "tp", "pipeline", "replica")
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


def head_rows_last(vocab: int, first: int, last: int) -> int:
    """Vocabulary rows of the LM head the last of two or more stages holds when the head is
    split in the proportion of the first and last stages' layers (``first``, ``last``), as
    ``edge.cluster.pipeline.PipelineRunner`` cuts it."""
    a = min(vocab - 1, max(1, round(vocab * first / (first + last))))
    return vocab - a


def stage_weight_bytes(
    ranges: Sequence[LayerRange],
    layer_bytes: Sequence[int],
    embed_bytes: int,
    head_bytes: int,
    tied: bool,
) -> list[int]:
    """Weight bytes each stage holds: its layers; the first stage also the token embedding
    (and, untied, its rows of the head); the last stage its rows of the head (its slice of a
    tied head's table: the rest of the embedding is not kept, ``Stage.cut_head``)."""
    out = [sum(layer_bytes[r.lo : r.hi]) for r in ranges]
    out[0] += embed_bytes + (head_bytes if len(ranges) == 1 and not tied else 0)
    if len(ranges) > 1:
        first, last = ranges[0].hi - ranges[0].lo, ranges[-1].hi - ranges[-1].lo
        vocab = 1 << 20  # rows as a fraction (the byte count of a row is head_bytes / V)
        share = head_rows_last(vocab, first, last) / vocab
        out[-1] += round(head_bytes * share)
        if not tied:
            out[0] += round(head_bytes * (1 - share))
    return out


def budget_ranges(
    weights: Sequence[float],
    budget_bytes: int,
    layer_bytes: Sequence[int],
    embed_bytes: int,
    head_bytes: int,
    tied: bool,
) -> list[LayerRange]:
    """:func:`stage_ranges` whose stages each hold at most ``budget_bytes`` of weights
    (:func:`stage_weight_bytes`): a device over the budget gives up layers one at a time
    until every stage fits. A ``ConfigError`` says exactly why when no split can."""
    L, n = len(layer_bytes), len(weights)
    caps = [L] * n
    while True:  # ends: every round lowers a cap, and a cap below 1 raises
        ranges = stage_ranges(L, weights, caps)
        held = stage_weight_bytes(ranges, layer_bytes, embed_bytes, head_bytes, tied)
        over = [i for i in range(n) if held[i] > budget_bytes]
        if not over:
            return ranges
        for i in over:
            caps[i] = ranges[i].hi - ranges[i].lo - 1
        if min(caps) < 1 or sum(caps) < L:
            mb = 2**20
            raise ConfigError(
                "memory_budget_mb",
                f"{n} devices of {budget_bytes / mb:.0f} MB cannot hold the {L} layers "
                f"({sum(layer_bytes) / mb:.0f} MB, {max(layer_bytes) / mb:.1f} MB the largest) "
                f"beside the first stage's token embedding ({embed_bytes / mb:.0f} MB) and the "
                f"LM head's rows ({head_bytes / mb:.0f} MB in all"
                + (", the embedding's own rows" if tied else "")
                + f"): a split over the budget leaves stage(s) {over} holding "
                + ", ".join(f"{held[i] / mb:.0f} MB" for i in over),
            )


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
