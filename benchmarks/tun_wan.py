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
    args = p.parse_args(argv)
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
