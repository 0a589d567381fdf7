"""lowband point-to-point transfers over a packet-level WAN with a real round trip (root).

    python -m benchmarks.tun_wan --size-mb 8 --rate-mbit 50 --delay-ms 50 --connections 1 4 --json

Two sites joined by the TUN emulator (:mod:`transport.links.tun`): kernel TCP in each site sees
``2 * delay_ms`` of RTT, the ``rate_mbit`` bottleneck and ``loss``, unlike ``benchmarks.transport
netns`` (tbf, no delay) and :mod:`transport.links.emulator` (a relay that terminates TCP and
MODELS the window). For each K in
``--connections``, ``size_mb`` moves from site 1 to site 0 with the lowband transport
(:func:`transport.links.netns.measure_transfer`: each side a separate process), ``rounds`` times,
each K once per round in an order rotated by one per round; goodput median (min/max) per K. The
link's RTT is measured (TCP handshakes) on the same testbed and reported beside it.

A sweep: ``--delay-ms`` and ``--loss`` take several values, and every (delay, loss) pair is one
cell, run on the same testbed one after the other (the path is reconfigured between cells), with
the RTT measured again for each::

    python -m benchmarks.tun_wan --size-mb 16 --rate-mbit 100 --delay-ms 10 40 80 \\
        --loss 0 0.001 0.01 --connections 1 2 4 8 16 --rounds 3 --congestion bbr --json

``--congestion`` sets both sites' TCP congestion control (bbr is not slowed by random loss;
cubic, the stock Linux default, is). ``--as-rate-mbit R`` stands for a faster link than the
forwarder can carry: the sites' TCP buffer maxima become the stock kernel's times ``rate_mbit /
R`` (:func:`benchmarks.wan.tcp_buffer_sysctls`), so one flow's window covers the share of the
bandwidth-delay product that it would on a stock host at ``R``; the output labels it.

The forwarder is single-threaded Python: ``python -m transport.links.tun --calibrate`` reports
its ceiling (a few hundred Mbit/s on a 2-core machine). Keep ``rate_mbit`` well under it.

``--rtt-ladder`` measures the emulator instead of lowband: configured vs measured RTT (TCP
connect round trips) from 0.2 to 10 ms, for three ways of waking the forwarder, arms
alternating per repeat (:func:`rtt_ladder_run`), and what each costs in forwarder CPU on an idle
and on a busy path::

    python -m benchmarks.tun_wan --rtt-ladder --repeats 5 --json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Sequence

from lowband.errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class TunWanBench:
    size_mb: float = 8.0
    rate_mbit: float = 50.0
    """Bottleneck rate of each direction."""
    delays_ms: tuple[float, ...] = (50.0,)
    """One-way delay of each direction (RTT = 2x); one cell per value (and loss)."""
    losses: tuple[float, ...] = (0.0,)
    """Random loss per packet, each direction; one cell per value (and delay)."""
    connections: tuple[int, ...] = (1, 4)
    """K: the lowband transport's parallel TCP connections."""
    rounds: int = 2
    congestion: str = ""
    """Both sites' TCP congestion control; empty: the host's default."""
    as_rate_mbit: float = 0.0
    """> rate_mbit: scale the sites' TCP buffers to stand for a stock host at this rate."""
    chunk_mb: float = 1.0
    """The transport's ``chunk_bytes`` (in MiB)."""
    timeout: float = 120.0
    """Seconds one transfer may take; a slower one is reported as timed out, not measured."""

    def __post_init__(self) -> None:
        if self.size_mb <= 0 or self.rounds < 1 or not self.connections:
            raise ConfigError("bench", "need size_mb > 0, rounds >= 1 and some connections")
        if not self.delays_ms or not self.losses:
            raise ConfigError("bench", "need at least one delay and one loss value")
        if self.as_rate_mbit and self.as_rate_mbit < self.rate_mbit:
            raise ConfigError("as_rate_mbit", "must be 0 or at least rate_mbit")


def _cell(bed: Any, cfg: TunWanBench, delay_ms: float, loss: float) -> dict[str, Any]:
    from benchmarks.diloco_wan import spread
    from transport.links.netns import TransferConfig, measure_transfer
    from transport.links.tun.calibrate import measure_rtt
    from transport.links.tun.shape import PathConfig

    path = PathConfig(delay_ms=delay_ms, rate_mbit=cfg.rate_mbit, loss=loss)
    for src, dst in ((0, 1), (1, 0)):
        bed.set_path(src, dst, path)
    before = bed.stats()["paths"]["1->0"]
    rtt = measure_rtt(bed, count=10)
    # measure_transfer reads a link's command, addrs and config.rate_mbit (typed Testbed).
    link: Any = SimpleNamespace(
        command=bed.command, addrs=bed.addrs, config=SimpleNamespace(rate_mbit=cfg.rate_mbit)
    )
    ks = list(dict.fromkeys(cfg.connections))
    runs: dict[int, list[float]] = {k: [] for k in ks}
    timed_out: dict[int, int] = {k: 0 for k in ks}
    for r in range(cfg.rounds):
        for k in ks[r % len(ks) :] + ks[: r % len(ks)]:
            xfer = TransferConfig(
                size_mb=cfg.size_mb,
                chunk_mb=cfg.chunk_mb,
                repeats=1,
                connections=k,
                timeout=cfg.timeout,
            )
            try:
                out = measure_transfer(link, xfer)
            except (RuntimeError, subprocess.TimeoutExpired):  # slower than size_mb per timeout
                timed_out[k] += 1
                continue
            runs[k].append(out["goodput_mbit"])
    after = bed.stats()["paths"]["1->0"]
    rows = []
    for k in ks:
        g = runs[k]
        row: dict[str, Any] = {"connections": k, "timed_out": timed_out[k]}
        if g:
            row["goodput_mbit"] = spread(g, 2)
            row["utilisation_median"] = round(statistics.median(g) / cfg.rate_mbit, 4)
            row["all"] = g
        rows.append(row)
    measured = {r["connections"]: r["goodput_mbit"]["median"] for r in rows if "goodput_mbit" in r}
    best = max(measured, key=lambda k: measured[k]) if measured else None
    return {
        "delay_ms": delay_ms,
        "configured_rtt_ms": 2 * delay_ms,
        "loss": loss,
        "measured_rtt_ms": rtt,
        "forwarder_lost": after["lost"] - before["lost"],
        "queue_drops": after["queue_drops"] - before["queue_drops"],
        "best_k": best,
        "best_vs_k1": (
            round(measured[best] / measured[ks[0]], 3)
            if best is not None and ks[0] == 1 and 1 in measured
            else None
        ),
        "results": rows,
    }


def run(cfg: TunWanBench) -> dict[str, Any]:
    from benchmarks.wan import tcp_buffer_sysctls
    from transport.links.tun.shape import PathConfig
    from transport.links.tun.testbed import TunConfig, TunTestbed, available

    if (reason := available()) is not None:
        raise SystemExit(f"tun benchmark unavailable: {reason}")
    scaled = bool(cfg.as_rate_mbit) and cfg.as_rate_mbit > cfg.rate_mbit
    sysctls = tcp_buffer_sysctls(cfg.rate_mbit / cfg.as_rate_mbit) if scaled else ()
    tun = TunConfig(
        path=PathConfig(delay_ms=cfg.delays_ms[0], rate_mbit=cfg.rate_mbit),
        congestion=cfg.congestion,
        sysctls=sysctls,
    )
    with TunTestbed(tun) as bed:
        cells = [_cell(bed, cfg, d, loss) for d in cfg.delays_ms for loss in cfg.losses]
    label = f"{cfg.rate_mbit:g} Mbit/s"
    if scaled:
        label = (
            f"a {cfg.as_rate_mbit:g} Mbit/s link on a stock host, run at {cfg.rate_mbit:g} "
            f"Mbit/s with the TCP buffers scaled by {cfg.rate_mbit / cfg.as_rate_mbit:g}"
        )
    return {
        "mode": "tun",
        "link": f"REAL: kernel TCP between namespaces through the TUN forwarder, {label}",
        "rate_mbit": cfg.rate_mbit,
        "as_rate_mbit": cfg.as_rate_mbit if scaled else None,
        "tcp_buffers": dict(sysctls) or "the kernel's",
        "congestion": cfg.congestion or "the host's default",
        "bytes": int(cfg.size_mb * (1 << 20)),
        "chunk_bytes": int(cfg.chunk_mb * (1 << 20)),
        "rounds": cfg.rounds,
        "order": "each K once per round, rotated by one per round; cells one after the other",
        "cells": cells,
    }


LADDER_ARMS: dict[str, dict[str, Any]] = {
    "timerfd+spin": {},  # the testbed's defaults
    "timerfd+spin+realtime": {"realtime": True},
    "timerfd": {"spin_us": 0.0},
    "epoll-ms": {"spin_us": 0.0, "timer": False},  # the forwarder before sub-ms paths
}


@dataclass(frozen=True, kw_only=True)
class RttLadderBench:
    rtts_ms: tuple[float, ...] = (0.2, 0.3, 0.5, 1.0, 2.0, 4.0, 10.0)
    """Configured round trips (each direction half)."""
    repeats: int = 5
    """Passes over the arms (rotated by one per pass) and, inside each, the rungs."""
    count: int = 20
    """TCP connects per measurement (their median is one repeat's figure)."""
    busy_s: float = 2.0
    """Length of the busy-path CPU probe per arm and repeat (0: none): one TCP flow at
    ``busy_rate_mbit`` over a 1 ms RTT."""
    busy_rate_mbit: float = 50.0
    realtime_probe: bool = True
    """Run the connecting end at real-time priority: the figure is the path's, not the delay
    of waking that process on a loaded host (:func:`transport.links.tun.calibrate.measure_rtt`)."""

    def __post_init__(self) -> None:
        if not self.rtts_ms or any(not 0 <= r <= 1000 for r in self.rtts_ms):
            raise ConfigError("rtts_ms", "need RTTs in [0, 1000] ms")
        if self.repeats < 1 or self.count < 1 or self.busy_s < 0:
            raise ConfigError("bench", "need repeats >= 1, count >= 1, busy_s >= 0")


def _ladder_pass(bed: Any, cfg: RttLadderBench, turn: int) -> tuple[dict[float, float], float]:
    """One repeat on one arm: each rung once (order rotated by ``turn``), and the forwarder CPU
    seconds per second of wall time it took (an idle path: only handshakes)."""
    import time

    from transport.links.tun.calibrate import measure_rtt, set_rtt

    order = list(cfg.rtts_ms)
    order = order[turn % len(order) :] + order[: turn % len(order)]
    cpu0, t0 = bed.forwarder_cpu_s(), time.monotonic()
    got = {}
    for rtt in order:
        set_rtt(bed, rtt)
        got[rtt] = measure_rtt(bed, count=cfg.count, realtime=cfg.realtime_probe)["median_ms"]
    return got, (bed.forwarder_cpu_s() - cpu0) / (time.monotonic() - t0)


def _busy_cpu(bed: Any, cfg: RttLadderBench) -> dict[str, float]:
    """Forwarder CPU seconds per second while one TCP flow fills ``busy_rate_mbit`` at 1 ms."""
    import time

    from transport.links.tun.calibrate import measure_goodput
    from transport.links.tun.shape import PathConfig

    for a, b in ((0, 1), (1, 0)):
        bed.set_path(a, b, PathConfig(delay_ms=0.5, rate_mbit=cfg.busy_rate_mbit))
    cpu0, t0 = bed.forwarder_cpu_s(), time.monotonic()
    flow = measure_goodput(bed, cfg.busy_s, warmup=0.0, port=5330)
    return {
        "cpu_per_s": round((bed.forwarder_cpu_s() - cpu0) / (time.monotonic() - t0), 3),
        "goodput_mbit": flow["goodput_mbit"],
    }


def rtt_ladder_run(cfg: RttLadderBench) -> dict[str, Any]:
    """Every arm a testbed of its own (all up at once), used in turn: per repeat each arm once,
    the arms' order rotated by one per repeat."""
    from contextlib import ExitStack

    from benchmarks.diloco_wan import spread
    from transport.links.tun.calibrate import rtt_tolerance_ms
    from transport.links.tun.testbed import TunConfig, TunTestbed, available

    if (reason := available()) is not None:
        raise SystemExit(f"tun benchmark unavailable: {reason}")
    arms = list(LADDER_ARMS)
    rtt: dict[str, dict[float, list[float]]] = {a: {r: [] for r in cfg.rtts_ms} for a in arms}
    idle: dict[str, list[float]] = {a: [] for a in arms}
    busy: dict[str, list[dict[str, float]]] = {a: [] for a in arms}
    with ExitStack() as stack:
        beds = {
            a: stack.enter_context(TunTestbed(TunConfig(net=231 + i, **LADDER_ARMS[a])))
            for i, a in enumerate(arms)
        }
        for rep in range(cfg.repeats):
            for arm in arms[rep % len(arms) :] + arms[: rep % len(arms)]:
                got, cpu = _ladder_pass(beds[arm], cfg, rep)
                for r, ms in got.items():
                    rtt[arm][r].append(ms)
                idle[arm].append(cpu)
                if cfg.busy_s:
                    busy[arm].append(_busy_cpu(beds[arm], cfg))
    out: dict[str, Any] = {"rungs": [], "forwarder_cpu": {}}
    for r in cfg.rtts_ms:
        row: dict[str, Any] = {"configured_rtt_ms": r, "tolerance_ms": rtt_tolerance_ms(r)}
        for arm in arms:
            s = spread(rtt[arm][r])
            row[arm] = {**s, "within_tolerance": abs(s["median"] - r) <= rtt_tolerance_ms(r)}
        out["rungs"].append(row)
    for arm in arms:
        fc: dict[str, Any] = {"idle_path_cpu_per_s": spread(idle[arm])}
        if busy[arm]:
            fc["busy_path_cpu_per_s"] = spread([b["cpu_per_s"] for b in busy[arm]])
            fc["busy_path_goodput_mbit"] = spread([b["goodput_mbit"] for b in busy[arm]], 2)
        out["forwarder_cpu"][arm] = fc
    return {
        "mode": "rtt-ladder",
        "link": "REAL: TCP connects between two namespaces through the TUN forwarder",
        "arms": {a: LADDER_ARMS[a] or "testbed defaults" for a in arms},
        "repeats": cfg.repeats,
        "connects_per_measure": cfg.count,
        "probe": "real-time priority (chrt -f 10)" if cfg.realtime_probe else "normal priority",
        "order": "arms rotated by one per repeat; rungs rotated by one per repeat",
        "tolerance": "10 % + 0.05 ms of the configured RTT",
        "busy_path": f"one TCP flow, {cfg.busy_rate_mbit:g} Mbit/s, 1 ms RTT, {cfg.busy_s:g} s",
        **out,
    }


def _ladder_main(args: argparse.Namespace) -> dict[str, Any]:
    cfg = RttLadderBench(
        rtts_ms=tuple(args.ladder_ms),
        repeats=args.repeats,
        count=args.count,
        busy_s=args.busy_s,
        realtime_probe=not args.normal_priority_probe,
    )
    result = rtt_ladder_run(cfg)
    if not args.json:
        for row in result["rungs"]:
            med = {a: row[a]["median"] for a in LADDER_ARMS}
            print(f"RTT {row['configured_rtt_ms']:g} ms: measured {med}")
    return result


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.tun_wan")
    p.add_argument("--size-mb", type=float, default=8.0)
    p.add_argument("--rate-mbit", type=float, default=50.0)
    p.add_argument("--delay-ms", type=float, nargs="+", default=[50.0], help="one-way, each")
    p.add_argument("--loss", type=float, nargs="+", default=[0.0], help="per packet, each")
    p.add_argument("--connections", type=int, nargs="+", default=[1, 4])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--congestion", default="", help="both sites' TCP congestion control")
    p.add_argument(
        "--as-rate-mbit",
        type=float,
        default=0.0,
        help="stand for this rate: TCP buffers scaled by rate-mbit / this",
    )
    p.add_argument("--chunk-mb", type=float, default=1.0)
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per transfer")
    p.add_argument("--json", action="store_true", help="only the JSON line")
    p.add_argument("--rtt-ladder", action="store_true", help="measure the emulator's RTTs")
    p.add_argument("--ladder-ms", type=float, nargs="+", default=list(RttLadderBench().rtts_ms))
    p.add_argument("--repeats", type=int, default=5, help="rtt-ladder: passes over the arms")
    p.add_argument("--count", type=int, default=20, help="rtt-ladder: connects per measure")
    p.add_argument("--busy-s", type=float, default=2.0, help="rtt-ladder: busy CPU probe (0: off)")
    p.add_argument(
        "--normal-priority-probe",
        action="store_true",
        help="rtt-ladder: the connecting end at normal priority (host load then adds)",
    )
    args = p.parse_args(argv)
    if args.rtt_ladder:
        try:
            ladder = _ladder_main(args)
        except ConfigError as e:
            p.error(str(e))
        print(json.dumps(ladder), flush=True)
        return 0
    kw = vars(args)
    same = ("size_mb", "rate_mbit", "rounds", "congestion", "as_rate_mbit", "chunk_mb", "timeout")
    try:
        cfg = TunWanBench(
            delays_ms=tuple(kw["delay_ms"]),
            losses=tuple(kw["loss"]),
            connections=tuple(kw["connections"]),
            **{k: kw[k] for k in same},
        )
    except ConfigError as e:
        p.error(str(e))
    result = run(cfg)
    if not args.json:
        for cell in result["cells"]:
            mbit = {
                r["connections"]: r.get("goodput_mbit", {}).get("median") for r in cell["results"]
            }
            print(f"RTT {cell['configured_rtt_ms']:g} ms loss {cell['loss']:g}: {mbit} Mbit/s")
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
