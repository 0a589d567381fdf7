"""Hottest-expert-bit-first (HEBF) planning: which experts stay resident, at how many bits.

``hebf_plan`` is a pure function of the experts' hotness (decayed router counts), their sizes
at every width and a byte budget. The expert store calls it every few tokens and moves the
resident set towards the plan (``edge.moe.store``).

Reasoning (D²MoE §5 states the principle; the procedure below is ours)
-----------------------------------------------------------------------
Two things cost throughput and quality on a device that cannot hold every expert at int8:

* a *miss* (a routed expert that is not resident) stalls decoding on storage I/O, and
* a *narrow* expert (few bits) adds quantization error to every token routed through it.

Misses are far more expensive than narrowness, so the plan first buys coverage: experts enter
the resident set at the minimum width in order of hotness (hottest first) until the budget is
spent or every expert is in. Only then are bits added, by a greedy on the expected error removed
per byte: raising expert ``e`` from width ``b`` to the next width ``b'`` is worth

    hotness[e] * (err_e(b) - err_e(b')) / (size_e(b') - size_e(b))

(the error an average token sees falls by hotness-weighted error; the cost is the extra planes).
With the default model ``err(b) = 4^-b`` (a b-bit uniform grid's mean squared error scales with
its step squared) the gain per byte falls with every step (2->3 > 3->4 > 4->8), so the greedy is
the optimum of the continuous relaxation, and upgrades go to the hottest experts first.

Guarantees (tested in ``tests/edge/moe/test_hebf.py``)
* the bytes of the plan never exceed ``budget``;
* every expert in ``required`` (those routed right now) gets at least ``min_bits``;
* with the default error model, among experts not in ``required`` and of equal sizes a hotter
  expert never gets fewer bits than a colder one (coverage and every upgrade step are taken in
  hotness order, and a step a hotter expert cannot afford is one a colder expert at the same
  width cannot afford either: the remaining budget only shrinks);
* an impossible budget (smaller than one expert's narrowest width, or than the narrowest widths
  of all required experts together) raises :class:`ConfigError` before anything is loaded.
Ties in hotness are broken by key order, so the plan is deterministic.
"""

from __future__ import annotations

import heapq
from typing import Collection, Hashable, Mapping, TypeVar

from lowband.errors import ConfigError

K = TypeVar("K", bound=Hashable)


def default_error(bits: int) -> float:
    """Relative mean squared error model of a b-bit uniform grid (up to a constant)."""
    return 4.0**-bits


def hebf_plan(
    hotness: Mapping[K, float],
    sizes: Mapping[K, Mapping[int, int]],
    budget: int,
    *,
    min_bits: int = 2,
    required: Collection[K] = (),
    error: Mapping[K, Mapping[int, float]] | None = None,
) -> dict[K, int]:
    """Bits per expert (0 = not resident) for every expert in ``sizes``.

    ``hotness[e] >= 0`` (missing = 0); ``sizes[e][b]`` bytes resident at width ``b`` (must
    include ``min_bits``); ``error[e][b]`` optionally replaces the ``4^-b`` error model.
    """
    keys = list(sizes)
    order = {k: i for i, k in enumerate(keys)}
    if budget < 0:
        raise ConfigError("budget", f"must be >= 0 bytes, got {budget}")
    for k in keys:
        if min_bits not in sizes[k]:
            raise ConfigError(
                "min_bits", f"expert {k!r} has no {min_bits}-bit size (has {sorted(sizes[k])})"
            )
        if hotness.get(k, 0.0) < 0:
            raise ConfigError("hotness", f"expert {k!r} has negative hotness {hotness[k]}")
    floor = {k: sizes[k][min_bits] for k in keys}
    if keys and min(floor.values()) > budget:
        raise ConfigError(
            "budget",
            f"{budget} bytes cannot hold one expert at {min_bits} bits "
            f"({min(floor.values())} bytes); raise the budget",
        )
    unknown = [k for k in required if k not in sizes]
    if unknown:
        raise ConfigError("required", f"unknown expert {unknown[0]!r}")
    need = sum(floor[k] for k in set(required))
    if need > budget:
        raise ConfigError(
            "budget",
            f"{budget} bytes cannot hold the {len(set(required))} routed "
            f"experts at {min_bits} bits ({need} bytes); raise the budget",
        )

    def heat(k: K) -> float:
        return float(hotness.get(k, 0.0))

    bits = {k: 0 for k in keys}
    left = budget
    for k in sorted(set(required), key=order.__getitem__):
        bits[k], left = min_bits, left - floor[k]
    for k in sorted(keys, key=lambda k: (-heat(k), order[k])):  # coverage, hottest first
        if bits[k] == 0 and floor[k] <= left:
            bits[k], left = min_bits, left - floor[k]

    def err(k: K, b: int) -> float:
        return error[k][b] if error is not None else default_error(b)

    def step(k: K) -> tuple[float, float, int, int] | None:
        wider = sorted(b for b in sizes[k] if b > bits[k])
        if not wider:
            return None
        nxt = wider[0]
        cost = sizes[k][nxt] - sizes[k][bits[k]]
        gain = heat(k) * (err(k, bits[k]) - err(k, nxt)) / max(cost, 1)
        # heapq is a min-heap: negate; equal gains go to the hotter expert, then to key order.
        return (-gain, -heat(k), order[k], nxt) if cost > 0 else None

    heap = [s for k in keys if bits[k] > 0 and (s := step(k)) is not None]
    heapq.heapify(heap)
    while heap:
        _, _, idx, nxt = heapq.heappop(heap)
        k = keys[idx]
        cost = sizes[k][nxt] - sizes[k][bits[k]]
        if cost > left:
            continue  # this expert stays at its width; cheaper steps of others may still fit
        bits[k], left = nxt, left - cost
        s = step(k)
        if s is not None:
            heapq.heappush(heap, s)
    return bits


def plan_bytes(plan: Mapping[K, int], sizes: Mapping[K, Mapping[int, int]]) -> int:
    """Resident bytes of a plan."""
    return sum(sizes[k][b] for k, b in plan.items() if b > 0)
