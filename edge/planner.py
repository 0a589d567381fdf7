"""Automatic split of a dense model over heterogeneous devices: a pure planning function.

Cost model of one decoded token under tensor parallelism (``edge/tp.py``), per device i with a
share of ``m_i`` MB of every decoder layer's weights (its KV groups and FFN columns)::

    compute_i = L * (a_i + b_i * m_i)                  a_i: fixed ms per layer (norms, RoPE,
                                                       dispatch), b_i: ms per MB of weights at
                                                       decode shape (matvecs are bandwidth bound)
    stream_i  = max(0, L * m_i - M_i) / S_i            weights that do not fit in the memory
                                                       M_i are streamed by the sliding window
                                                       (edge/window.py) at storage speed S_i
    token     = max_i (compute_i + stream_i) + 2 * L * max_i rtt_i

Every layer ends in two all-reduces, and each waits for the slowest device, so the per-layer
maximum is taken over devices; the star all-reduce waits for the slowest spoke's round trip.
The master's embedding is the same for every split and left out; the LM head is split by
vocabulary rows in the proportions of the layers (``TPPlan.vocab``) and also left out.

The continuous optimum equalises ``compute_i + stream_i`` over the devices that take part
(water filling: bisection on the token time T, each device takes the largest share whose
time is <= T). The real split is discrete (whole KV groups, FFN columns in blocks), so the
weights are then refined by a small local search on the *discrete* prediction
(``tp.make_plan``), which is what the devices will actually run.

Which devices take part: adding a device adds its round trip to every all-reduce, so a slow
link or a weak device can make the cluster slower. All subsets containing the master are
scored (greedy beyond ``EXHAUSTIVE``); the smallest subset predicted within ``min_gain`` of
the best wins (the model is a measurement, not an oracle: a device must clearly help), and
every device left out gets a stated reason.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Sequence

from edge.tp import TPPlan, make_plan
from lowband.errors import ConfigError
from lowband.models.config import ModelConfig

EXHAUSTIVE = 10  # up to this many devices every subset is scored; beyond, a greedy search
DTYPE_BYTES = {"float32": 4, "fp32": 4, "float16": 2, "fp16": 2, "bfloat16": 2, "bf16": 2}


@dataclass(frozen=True, kw_only=True)
class DeviceProfile:
    """What one device measured about itself (``edge.profile.profile_device``) plus its link."""

    name: str
    layer_fixed_ms: float  # a_i: ms per decoder layer that does not depend on the share
    ms_per_mb: float  # b_i: ms per MB of layer weights at decode shape and the model's dtype
    memory_mb: float  # M_i: memory the weights may use
    storage_mb_s: float  # S_i: read speed of the weight files (sliding window)
    rtt_ms: float = 0.0  # round trip to the master (0 for the master itself)

    def __post_init__(self) -> None:
        for f in ("layer_fixed_ms", "rtt_ms"):
            if getattr(self, f) < 0:
                raise ConfigError(f, f"must be >= 0, got {getattr(self, f)}")
        for f in ("ms_per_mb", "memory_mb", "storage_mb_s"):
            if not getattr(self, f) > 0:
                raise ConfigError(f, f"must be > 0, got {getattr(self, f)}")

    def to_dict(self) -> dict[str, Any]:
        return {
            k: getattr(self, k)
            for k in ("name", "layer_fixed_ms", "ms_per_mb", "memory_mb", "storage_mb_s", "rtt_ms")
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "DeviceProfile":
        return cls(
            name=str(d["name"]),
            layer_fixed_ms=float(d["layer_fixed_ms"]),
            ms_per_mb=float(d["ms_per_mb"]),
            memory_mb=float(d["memory_mb"]),
            storage_mb_s=float(d["storage_mb_s"]),
            rtt_ms=float(d.get("rtt_ms", 0.0)),
        )


@dataclass(frozen=True)
class LayerShape:
    """MB of one decoder layer per KV group and per FFN column, in the serving dtype."""

    layers: int
    kv_groups: int
    columns: int  # FFN intermediate size
    group_mb: float  # q/k/v/o rows and columns of one KV group
    column_mb: float  # gate + up rows and down column of one FFN column

    @property
    def layer_mb(self) -> float:
        return self.kv_groups * self.group_mb + self.columns * self.column_mb

    @classmethod
    def of(cls, cfg: ModelConfig, dtype: str | None = None) -> "LayerShape":
        name = dtype or cfg.torch_dtype
        if name not in DTYPE_BYTES:
            raise ConfigError("dtype", f"unknown dtype {name!r}; one of {sorted(DTYPE_BYTES)}")
        if cfg.is_moe:
            raise ConfigError(
                "model",
                "the automatic split plans dense models; a MoE is placed "
                "by its expert budget (--expert-budget-mb)",
            )
        nb, H, D = DTYPE_BYTES[name], cfg.hidden_size, cfg.dim_per_head
        G = cfg.num_attention_heads // cfg.n_kv_heads
        group = (2 * G * D * H + 2 * D * H) * nb  # q and o: G heads each; k and v: one head
        return cls(
            layers=cfg.num_hidden_layers,
            kv_groups=cfg.n_kv_heads,
            columns=cfg.intermediate_size,
            group_mb=group / 2**20,
            column_mb=3 * H * nb / 2**20,
        )


@dataclass(frozen=True, kw_only=True)
class SplitPlan:
    """The planner's answer. ``devices`` are in slot order (the master first)."""

    devices: tuple[str, ...]
    weights: tuple[float, ...]
    memory_budget_mb: tuple[float | None, ...]  # None: the device holds its whole share
    device_ms: tuple[float, ...]  # predicted compute + streaming per token of each device
    link_ms: float  # predicted all-reduce wait per token
    predicted_ms: float
    even_ms: float  # prediction for an even split over every device offered
    left_out: dict[str, str] = field(default_factory=dict)  # name -> why

    def explain(self) -> str:
        parts = [
            f"{d}: weight {w:.3f}, {ms:.1f} ms" + (f", window within {mb:.0f} MB" if mb else "")
            for d, w, ms, mb in zip(
                self.devices, self.weights, self.device_ms, self.memory_budget_mb
            )
        ]
        out = (
            f"split over {len(self.devices)} device(s) predicted {self.predicted_ms:.1f} ms/token "
            f"(even split over all: {self.even_ms:.1f}); "
            + "; ".join(parts)
            + f"; all-reduce wait {self.link_ms:.1f} ms"
        )
        for d, why in self.left_out.items():
            out += f"; left out {d}: {why}"
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "devices": list(self.devices),
            "weights": list(self.weights),
            "memory_budget_mb": list(self.memory_budget_mb),
            "device_ms": list(self.device_ms),
            "link_ms": self.link_ms,
            "predicted_ms": self.predicted_ms,
            "even_ms": self.even_ms,
            "left_out": dict(self.left_out),
            "explanation": self.explain(),
        }


def _tp_shares(cfg: ModelConfig, shape: LayerShape, weights: Sequence[float]) -> list[float]:
    """MB of each layer every device holds under the discrete split ``make_plan`` produces."""
    plan: TPPlan = make_plan(cfg, len(weights), weights)
    return [
        (b - a) * shape.group_mb + (f1 - f0) * shape.column_mb
        for (a, b), (f0, f1) in zip(plan.kv, plan.ffn)
    ]


def _device_ms(p: DeviceProfile, shape: LayerShape, share_mb: float) -> float:
    L = shape.layers
    excess = max(0.0, L * share_mb - p.memory_mb)
    return L * (p.layer_fixed_ms + p.ms_per_mb * share_mb) + 1e3 * excess / p.storage_mb_s


def predict_ms(
    cfg: ModelConfig,
    profiles: Sequence[DeviceProfile],
    weights: Sequence[float],
    dtype: str | None = None,
) -> tuple[float, list[float], float]:
    """(token ms, per-device ms, link ms) of running the discrete split ``weights``."""
    shape = LayerShape.of(cfg, dtype)
    shares = _tp_shares(cfg, shape, weights)
    dev = [_device_ms(p, shape, m) for p, m in zip(profiles, shares)]
    link = 2 * shape.layers * max((p.rtt_ms for p in profiles[1:]), default=0.0)
    return max(dev) + link, dev, link


def _continuous(profiles: Sequence[DeviceProfile], shape: LayerShape) -> list[float]:
    """Water filling: shares (fractions of a layer) that equalise the devices' times."""
    total = shape.layer_mb

    def share_at(p: DeviceProfile, T: float) -> float:
        # largest x in [0, 1] with _device_ms(x * total) <= T (the cost is increasing in x)
        lo, hi = 0.0, 1.0
        if _device_ms(p, shape, 0.0) > T:
            return 0.0
        if _device_ms(p, shape, total) <= T:
            return 1.0
        for _ in range(50):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if _device_ms(p, shape, mid * total) <= T else (lo, mid)
        return lo

    lo, hi = 0.0, max(_device_ms(p, shape, total) for p in profiles)
    for _ in range(60):
        T = (lo + hi) / 2
        lo, hi = (T, hi) if sum(share_at(p, T) for p in profiles) < 1.0 else (lo, T)
    x = [share_at(p, hi) for p in profiles]
    return [max(v, 1e-3) for v in x]  # every device in the subset keeps a positive weight


def _refine(
    cfg: ModelConfig, profiles: Sequence[DeviceProfile], w: list[float], dtype: str | None
) -> tuple[list[float], float]:
    """Local search on the discrete prediction: nudge one weight at a time while it helps."""
    best = predict_ms(cfg, profiles, w, dtype)[0]
    for _ in range(40):
        improved = False
        for i, f in itertools.product(range(len(w)), (0.7, 0.85, 0.95, 1.05, 1.2, 1.4)):
            cand = list(w)
            cand[i] *= f
            t = predict_ms(cfg, profiles, cand, dtype)[0]
            if t < best - 1e-9:
                w, best, improved = cand, t, True
        if not improved:
            break
    s = sum(w)
    return [round(v / s, 4) for v in w], best


def _plan_subset(
    cfg: ModelConfig, profiles: Sequence[DeviceProfile], dtype: str | None
) -> tuple[list[float], float]:
    if len(profiles) == 1:
        return [1.0], predict_ms(cfg, profiles, [1.0], dtype)[0]
    w = _continuous(profiles, LayerShape.of(cfg, dtype))
    return _refine(cfg, profiles, w, dtype)


def _subsets(n: int):
    """Index sets that contain the master (0): all of them up to EXHAUSTIVE devices."""
    if n <= EXHAUSTIVE:
        for k in range(n):
            for rest in itertools.combinations(range(1, n), k):
                yield (0, *rest)
    else:
        for k in range(1, n + 1):
            yield tuple(range(k))


def plan_split(
    cfg: ModelConfig,
    profiles: Sequence[DeviceProfile],
    *,
    dtype: str | None = None,
    min_gain: float = 0.03,
) -> SplitPlan:
    """The split of ``cfg`` over ``profiles`` (``profiles[0]`` is the master, always used) that
    minimises the predicted per-token time. Pure: same inputs, same plan."""
    if not profiles:
        raise ConfigError("devices", "need at least the master's profile")
    if not 0 <= min_gain < 1:
        raise ConfigError("min_gain", f"must be in [0, 1), got {min_gain}")
    names = [p.name for p in profiles]
    if len(set(names)) != len(names):
        raise ConfigError("devices", f"device names must be unique, got {names}")
    shape = LayerShape.of(cfg, dtype)
    order = list(range(len(profiles)))
    if len(profiles) > EXHAUSTIVE:  # greedy: try the fastest workers first
        order = [0] + sorted(order[1:], key=lambda i: profiles[i].ms_per_mb + profiles[i].rtt_ms)
    scored = []
    for idx in _subsets(len(profiles)):
        sub = [profiles[order[i]] for i in idx]
        w, t = _plan_subset(cfg, sub, dtype)
        scored.append((t, [order[i] for i in idx], w))
    best_t = min(t for t, _, _ in scored)
    t, chosen, w = min(
        (s for s in scored if s[0] <= best_t * (1 + min_gain)), key=lambda s: (len(s[1]), s[0])
    )
    used = [profiles[i] for i in chosen]
    total, dev, link = predict_ms(cfg, used, w, dtype)
    shares = _tp_shares(cfg, shape, w)
    budgets = tuple(
        p.memory_mb if shape.layers * m > p.memory_mb else None for p, m in zip(used, shares)
    )
    even = predict_ms(cfg, profiles, [1.0] * len(profiles), dtype)[0]
    left_out = {}
    for i in range(len(profiles)):
        if i in chosen:
            continue
        p = profiles[i]
        with_it = (
            next(s for s in scored if sorted(s[1]) == sorted(chosen + [i]))
            if len(profiles) <= EXHAUSTIVE
            else None
        )
        alone = (
            1e3 * shape.layers * shape.layer_mb / p.storage_mb_s
            if shape.layers * shape.layer_mb > p.memory_mb
            else 0.0
        )
        why = (
            f"adding it predicts {with_it[0]:.1f} ms/token vs {total:.1f} without"
            if with_it is not None
            else "not among the fastest devices that help"
        )
        why += (
            f" (its all-reduce round trip {p.rtt_ms:.2f} ms costs {2 * shape.layers * p.rtt_ms:.1f}"
            f" ms/token; it computes {p.ms_per_mb:.3f} ms/MB"
        )
        why += (
            f", memory {p.memory_mb:.0f} MB)"
            if alone == 0.0
            else f", memory {p.memory_mb:.0f} MB forces streaming)"
        )
        left_out[p.name] = why
    return SplitPlan(
        devices=tuple(p.name for p in used),
        weights=tuple(w),
        memory_budget_mb=budgets,
        device_ms=tuple(round(d, 3) for d in dev),
        link_ms=round(link, 3),
        predicted_ms=round(total, 3),
        even_ms=round(even, 3),
        left_out=left_out,
    )


# ---- the layout: one device, tensor parallel or pipeline stages ----------------------------------
@dataclass(frozen=True, kw_only=True)
class LayoutDevice:
    """What the layout planner knows of one device (the master first)."""

    name: str
    layer_ms: float  # ms of one decoder layer at decode shape on this device (measured)
    memory_mb: float  # memory its weights may use
    rtt_ms: float = 0.0  # round trip to the master (0 for the master itself)
    # ms of one decoder layer for a step of B rows (B streams decoding together), measured
    # where the planner plans for several streams; ``layer_ms`` is B = 1. Other B: linear
    # between the measured ones (a batched step reads the weights once for all its rows)
    batch_layer_ms: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        for f in ("layer_ms", "memory_mb", "rtt_ms"):
            v = getattr(self, f)
            if not (v >= 0 and v < float("inf")):
                raise ConfigError(f, f"must be a finite number >= 0, got {v}")
        for b, ms in self.batch_layer_ms:
            if b < 1 or not (ms >= 0 and ms < float("inf")):
                raise ConfigError("batch_layer_ms", f"({b}, {ms}) is not (rows >= 1, ms >= 0)")

    def step_ms(self, rows: int) -> float:
        """ms of one decoder layer for a step of ``rows`` rows (see ``batch_layer_ms``)."""
        pts = sorted({1: self.layer_ms, **dict(self.batch_layer_ms)}.items())
        if rows <= 1:  # pts[0] is the one-row point (batch rows are >= 1)
            return pts[0][1] * rows
        for (b0, m0), (b1, m1) in zip(pts, pts[1:]):
            if rows <= b1:
                return m0 + (m1 - m0) * (rows - b0) / (b1 - b0)
        b, m = pts[-1]  # beyond the largest measured batch: its cost per row
        return m * rows / b


@dataclass(frozen=True, kw_only=True)
class LayoutPlan:
    """The layout planner's choice, its predictions (ms per token, one stream) and why."""

    layout: str  # single / tp / pipeline / replica
    devices: int
    stages: tuple[int, ...]  # layers per device (pipeline), () otherwise
    predicted_ms: dict[str, float]  # per layout considered
    reason: str
    streams: int = 1  # the concurrency planned for (1: one stream's ms/token decides)
    # aggregate tokens/s per layout at ``streams`` streams (only where streams > 1)
    predicted_tok_s: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        out = {
            "layout": self.layout,
            "devices": self.devices,
            "stages": list(self.stages),
            "predicted_ms": {k: round(v, 3) for k, v in self.predicted_ms.items()},
            "reason": self.reason,
        }
        if self.streams > 1:
            out["streams"] = self.streams
            out["predicted_tok_s"] = {k: round(v, 1) for k, v in self.predicted_tok_s.items()}
        return out


def aggregate_tok_s(
    layout: str,
    streams: int,
    stages: Sequence[int],
    devices: Sequence[LayoutDevice],
    *,
    groups: int = 3,
    hop_ms: float = 2.0,
    lanes: int = 1,
) -> float:
    """Predicted aggregate tokens/s with ``streams`` streams decoding at once (one token each
        per step), from each device's batched step cost (:meth:`LayoutDevice.step_ms`)::

            single    N / (L * t_0(N))
            pipeline  N / max(G * (max_i n_i * t_i(g) + hop), sum_i n_i * t_i(g) + links)
                      links = sum_{i>0} (rtt_i + hop)
            tp        N / (L * max_i t_i(N) / S + 2 * L * max_i rtt_i)
            replica   N / max(l * L * t_0(g) + (S - 1) * l * hop,
                              max_{i>0} max(l * L * t_i(g), L * t_i(g) + rtt_i + hop))
                      r = ceil(N / S), l = min(lanes, r), g = ceil(r / l)

    Replica (``edge.cluster.replica``): every device runs r of the streams through the whole
    model in l groups of g rows (``lanes`` per device); the master also hands each worker its
    groups and takes their answers (a hop of its own time each). A worker computes its groups
    back to back unless one group's round (its compute, the round trip and a hop) is longer
    than the cycle: with one lane it idles a round trip per step, with two its next group is
    queued while the answer travels.

        Pipeline: the streams in G groups of g = ceil(N / G) rows (``edge.cluster.pipeline``'s
        steps in flight); in steady state the busiest stage runs every group once per cycle, unless
        one group's round through every stage and link takes longer (too few groups to hide the
        links). Each group's hop also costs the busiest stage ``hop`` of its own time per cycle
        (serialising, the sockets, waking up, the master's merge of the split head): without it
        the model was 35 % above the measured 8-stream rate over Wi-Fi (295 predicted, 219
        measured tok/s, ``benchmarks/results/edge_wan-gemma3-270m-plan-streams.json``); with it,
        19 % above (287 for 241.6, ``edge_wan-gemma3-270m-wifi-final.json``). A device's t_i(B)
        is the master's curve scaled by its one-row speed."""
    N, L = streams, sum(stages) if stages else 0
    t0 = devices[0]

    def t(i: int, rows: int) -> float:
        d = devices[i]
        return t0.step_ms(rows) * (d.layer_ms / t0.layer_ms if t0.layer_ms > 0 else 1.0)

    if layout == "single":
        return 1e3 * N / max(1e-9, L * t0.step_ms(N))
    if layout == "replica":
        S = len(devices)
        r = -(-N // S)
        lanes = max(1, min(lanes, r))
        g = -(-r // lanes)
        cycle = lanes * (L * t(0, g) + (S - 1) * hop_ms)
        for i in range(1, S):
            step = L * t(i, g)
            cycle = max(cycle, lanes * step, step + devices[i].rtt_ms + hop_ms)
        return 1e3 * N / max(1e-9, cycle)
    if layout == "tp":
        S = len(devices)
        rtt = max(d.rtt_ms for d in devices[1:])
        return 1e3 * N / max(1e-9, L * max(t(i, N) for i in range(S)) / S + 2 * L * rtt)
    G = max(1, min(groups, N))
    g = -(-N // G)
    work = [n * t(i, g) for i, n in enumerate(stages)]
    links = sum(d.rtt_ms + hop_ms for d in devices[1 : len(stages)])
    return 1e3 * N / max(1e-9, G * (max(work) + hop_ms), sum(work) + links)


def busy_streams(devices: int) -> int:
    """The streams at which a one-stream plan checks what the replica layout gains: 4 per
    device."""
    return 4 * devices


def _replica_spare(
    L: int, devices: Sequence[LayoutDevice], *, hop_ms: float, min_gain: float, lanes: int
) -> str:
    """Why replica beats one device for a one-stream plan ("" where it does not): one
    stream runs on the master alone (one device's ms per token) and ``busy_streams`` streams
    spread over the devices gain by ``min_gain`` (predicted)."""
    n = busy_streams(len(devices))

    def rates(k: int) -> tuple[float, float]:
        rep = aggregate_tok_s("replica", k, (L,), devices, hop_ms=hop_ms, lanes=lanes)
        return rep, aggregate_tok_s("single", k, (L,), devices, hop_ms=hop_ms)

    rep, one = rates(n)
    if rep < one * (1 + min_gain):
        return ""
    # where splitting is predicted slower, the runner runs the streams as one step on the
    # master (``ReplicaRunner.lanes_for``, the same comparison): one device's rate there
    kept = [k for k in range(2, n + 1) if rates(k)[0] <= rates(k)[1]]
    why = (
        f"one stream runs on the master alone (one device's ms per token), {n} streams are "
        f"predicted {rep:.0f} tok/s against one device's {one:.0f}"
    )
    if not kept:
        return why
    at = ", ".join(map(str, kept))
    return f"{why}; {at} streams run as one step on the master (splitting is predicted slower)"


def plan_layout(
    layers: int,
    layer_mb: float,
    devices: Sequence[LayoutDevice],
    *,
    hop_ms: float = 2.0,
    min_gain: float = 0.1,
    streams: int = 1,
    groups: int = 3,
    lanes: int = 1,
) -> LayoutPlan:
    """Choose how to serve ``streams`` concurrent streams (default one) from measured round
    trips and device speeds.

    Predicted ms per token (L layers of ``layer_mb`` MB; t_i ms per layer on device i; a
    device holding more than its memory is not considered)::

        single    L * t_0
        pipeline  sum_i n_i * t_i + sum_{i>0} (rtt_i + hop_ms)   n_i layers, speed-weighted
        tp        L * max_i t_i / S + 2 * L * max_i rtt_i        two all-reduces per layer

    (``hop_ms``: the fixed cost of one hidden-state hop besides the round trip: serialising,
    waking the peer, the relay; 1.9-2.2 ms measured by ``benchmarks.edge_wan`` on Gemma 3 270M,
    see ``benchmarks/results/edge_wan-gemma3-270m-split-head.json``.) A layout with more
    devices must beat the best smaller one by ``min_gain`` (the model is a measurement, not an
    oracle; in the order single, replica, pipeline, tp), so the single device wins ties and
    the pipeline must beat replicas by as much. Where the model fits no single device, the pipeline
    is the layout that spreads memory.

    ``streams`` > 1: the layouts are ranked by their predicted aggregate tokens/s at that many
    streams (:func:`aggregate_tok_s`, ``groups`` micro-batches in the pipeline) instead: a
    server that is mostly busy gains from the stages even where one stream loses to one device
    by a round trip per token (the single-stream predictions stay in the plan beside them).
    Where the whole model fits every device, the replica layout is a candidate too (the
    streams spread over the devices, each running the whole model in ``lanes`` groups per
    device; one stream runs on the master alone, so its ms per token is one device's). For
    one stream it ties the single device, so it is chosen over it where it gains by
    ``min_gain`` at ``busy_streams`` streams (4 per device; a server that is sometimes
    busy). The reason also names its worst predicted ratio to one device between 2 and that
    many streams: a few streams cut into lanes of one row each run smaller batches than one
    device's, and the worker's streams pay a round trip per token.
    """
    from edge.cluster.layout import stage_ranges  # (a pure schedule beside the stages)

    if not devices:
        raise ConfigError("devices", "the layout planner needs at least the master")
    L, S = layers, len(devices)
    t = [d.layer_ms for d in devices]
    pred: dict[str, float] = {}
    fits_one = L * layer_mb <= devices[0].memory_mb
    if fits_one:
        pred["single"] = L * t[0]
    stages: tuple[int, ...] = ()
    if S > 1:
        caps = [max(1, int(d.memory_mb // max(layer_mb, 1e-9))) for d in devices]
        try:
            ranges = stage_ranges(L, [1.0 / max(x, 1e-6) for x in t], caps)
        except ConfigError:
            ranges = []
        if ranges:
            stages = tuple(r.hi - r.lo for r in ranges)
            links = sum(d.rtt_ms + hop_ms for d in devices[1:])
            pred["pipeline"] = sum(n * x for n, x in zip(stages, t)) + links
        if all(L * layer_mb / S <= d.memory_mb for d in devices):
            pred["tp"] = L * max(t) / S + 2 * L * max(d.rtt_ms for d in devices[1:])
    if not pred:
        raise ConfigError(
            "memory",
            f"the model's {L * layer_mb:.0f} MB of layers fit neither one device nor the "
            f"{S} devices together",
        )
    if streams < 1:
        raise ConfigError("streams", f"must be >= 1, got {streams}")
    if S > 1 and all(L * layer_mb <= d.memory_mb for d in devices):
        pred["replica"] = L * t[0]  # (one stream: the master alone)
    # (replica before pipeline: the same devices, and one stream never pays a link there)
    order = [k for k in ("single", "replica", "pipeline", "tp") if k in pred]
    rate: dict[str, float] = {}
    if streams > 1:  # ranked by aggregate tokens/s (higher is better): as ms per token
        for k in order:
            rate[k] = aggregate_tok_s(
                k, streams, stages if k == "pipeline" else (L,), devices,
                groups=groups, hop_ms=hop_ms, lanes=lanes,
            )  # fmt: skip
    score = {k: 1e3 / rate[k] for k in order} if rate else pred
    best = order[0]
    for k in order[1:]:
        if score[k] < score[best] * (1 - min_gain):
            best = k
    why = ", ".join(f"{k} {pred[k]:.1f} ms" for k in order)
    if rate:
        why = f"{streams} streams: " + ", ".join(f"{k} {rate[k]:.0f} tok/s" for k in order)
        why += f"; one stream: {', '.join(f'{k} {pred[k]:.1f} ms' for k in order)}"
    spare = ""
    if not rate and best == "single" and "replica" in pred:
        spare = _replica_spare(L, devices, hop_ms=hop_ms, min_gain=min_gain, lanes=lanes)
        best = "replica" if spare else best
    if spare:
        reason = f"replica: {why}; {spare}"
    elif best == "single":
        reason = f"one device is predicted fastest ({why}): the links cost more than they save"
    else:
        reason = f"{best} predicted fastest ({why})"
    if not fits_one:
        reason += "; the model does not fit the master alone"
    return LayoutPlan(
        layout=best,
        devices=1 if best == "single" else S,  # (replica, pipeline, tp: every device)
        stages=stages if best == "pipeline" else (),
        predicted_ms=pred,
        reason=reason,
        streams=streams,
        predicted_tok_s=rate,
    )
