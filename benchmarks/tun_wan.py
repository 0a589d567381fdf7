"""lowband point-to-point transfers over a packet-level WAN with a real round trip (root).

    python -m benchmarks.tun_wan --size-mb 8 --rate-mbit 50 --delay-ms 50 --connections 1 4 --json

Two sites joined by the TUN emulator (:mod:`transport.links.tun`): kernel TCP in each site sees
``2 * delay_ms`` of RTT, the ``rate_mbit`` bottleneck and ``loss``, unlike ``benchmarks.transport
netns`` (tbf, no delay) and ``emulator`` (a relay that MODELS the window). For each K in
``--connections``, ``size_mb`` moves from site 1 to site 0 with the lowband transport
(:func:`transport.links.netns.measure_transfer`: each side a separate process), ``rounds`` times,
each K once per round in an order rotated by one per round; goodput median (min/max) per K. The
link's RTT is measured (TCP handshakes) on the same testbed and reported beside it.

The forwarder is single-threaded Python: ``python -m transport.links.tun --calibrate`` reports
its ceiling (a few hundred Mbit/s on a 2-core machine). Keep ``rate_mbit`` well under it.
"""

from __future__ import annotations

import argparse
import json
import statistics
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
    delay_ms: float = 50.0
    """One-way delay of each direction (RTT = 2x)."""
    loss: float = 0.0
    """Random loss per packet, each direction."""
    connections: tuple[int, ...] = (1, 4)
    """K: the lowband transport's parallel TCP connections."""
    rounds: int = 2

    def __post_init__(self) -> None:
        if self.size_mb <= 0 or self.rounds < 1 or not self.connections:
            raise ConfigError("bench", "need size_mb > 0, rounds >= 1 and some connections")


def run(cfg: TunWanBench) -> dict[str, Any]:
    from transport.links.netns import TransferConfig, measure_transfer
    from transport.links.tun.calibrate import measure_rtt
    from transport.links.tun.shape import PathConfig
    from transport.links.tun.testbed import TunConfig, TunTestbed, available

    if (reason := available()) is not None:
        raise SystemExit(f"tun benchmark unavailable: {reason}")
    path = PathConfig(delay_ms=cfg.delay_ms, rate_mbit=cfg.rate_mbit, loss=cfg.loss)
    ks = list(dict.fromkeys(cfg.connections))
    runs: dict[int, list[float]] = {k: [] for k in ks}
    with TunTestbed(TunConfig(path=path)) as bed:
        rtt = measure_rtt(bed, count=10)
        # measure_transfer reads a link's command, addrs and config.rate_mbit (typed Testbed).
        link: Any = SimpleNamespace(
            command=bed.command, addrs=bed.addrs, config=SimpleNamespace(rate_mbit=cfg.rate_mbit)
        )
        for r in range(cfg.rounds):
            for k in ks[r % len(ks) :] + ks[: r % len(ks)]:
                out = measure_transfer(
                    link, TransferConfig(size_mb=cfg.size_mb, connections=k, repeats=1)
                )
                runs[k].append(out["goodput_mbit"])
        forwarded = bed.stats()["paths"]
    rows = [
        {
            "connections": k,
            "goodput_mbit": {
                "median": round(statistics.median(g), 2),
                "min": min(g),
                "max": max(g),
            },
            "utilisation_median": round(statistics.median(g) / cfg.rate_mbit, 4),
            "all": g,
        }
        for k, g in runs.items()
    ]
    return {
        "mode": "tun",
        "link": f"REAL: kernel TCP between namespaces through the TUN forwarder, "
        f"{cfg.rate_mbit:g} Mbit/s, {cfg.delay_ms:g} ms each way, loss {cfg.loss:g}",
        "rate_mbit": cfg.rate_mbit,
        "configured_rtt_ms": 2 * cfg.delay_ms,
        "measured_rtt_ms": rtt,
        "bytes": int(cfg.size_mb * (1 << 20)),
        "rounds": cfg.rounds,
        "order": "each K once per round, rotated by one per round",
        "queue_drops": forwarded["1->0"]["queue_drops"],
        "results": rows,
    }


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.tun_wan")
    p.add_argument("--size-mb", type=float, default=8.0)
    p.add_argument("--rate-mbit", type=float, default=50.0)
    p.add_argument("--delay-ms", type=float, default=50.0)
    p.add_argument("--loss", type=float, default=0.0)
    p.add_argument("--connections", type=int, nargs="+", default=[1, 4])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--json", action="store_true", help="only the JSON line")
    args = p.parse_args(argv)
    cfg = TunWanBench(
        size_mb=args.size_mb,
        rate_mbit=args.rate_mbit,
        delay_ms=args.delay_ms,
        loss=args.loss,
        connections=tuple(args.connections),
        rounds=args.rounds,
    )
    result = run(cfg)
    if not args.json:
        for k, v in result.items():
            print(f"{k:>20}: {v}")
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
