"""What the relay for sites behind NAT costs: all-reduce time, direct against relayed.

    sudo python -m benchmarks.nat_relay --size-mb 16 --repeats 5 --json      # root + iptables

On one NAT testbed (:mod:`transport.links.nat`: three public sites and one behind a MASQUERADE
router with no way in) it runs three groups of three sites, alternating, ``--repeats`` times:

* ``direct``: three public sites, every link direct (the baseline);
* ``nat``: two public sites and the NAT site, which the coordinator's dial-back finds cannot be
  dialled: the links into it go through the coordinator's relay (on the first public site),
  the rest stay direct; what a real deployment with one site behind NAT runs;
* ``relay_all``: three public sites with ``relay="always"``: every link through the relay.

Every group is fresh processes (one per site, in its namespace, CURVE on), a warm-up
all-reduce, then ``--iters`` timed all-reduces of ``--size-mb`` (float32, ring). One sample per
group: the median over its iterations of the slowest rank's time. Reported: per arm the median
with min/max over repeats, and each arm's ratio to ``direct``. Every group must end with equal
result hashes on all sites. ``--rate-mbit`` shapes every site's link with tbf (0: veth speed);
this kernel has no netem, so no propagation delay.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from typing import Any, Sequence

from lowband.errors import ConfigError
from lowband.proc import free_port
from transport.links import nat

ARMS = ("direct", "nat", "relay_all")


def _sample(reports: list[dict[str, Any]]) -> float:
    times = list(zip(*(r["times"] for r in reports)))  # per iteration, every rank's time
    return statistics.median(max(t) for t in times)


def run(args: argparse.Namespace) -> dict[str, Any]:
    if args.repeats < 1 or args.iters < 1 or args.size_mb <= 0:
        raise ConfigError("benchmark", "need repeats >= 1, iters >= 1, size_mb > 0")
    reason = nat.available()
    if reason:
        raise ConfigError("netns", f"the NAT testbed is unavailable: {reason}")
    samples: dict[str, list[float]] = {a: [] for a in ARMS}
    relayed_bytes: dict[str, list[int]] = {a: [] for a in ARMS}
    routes: dict[str, list[str]] = {}
    cfg = nat.NatConfig(public=3, nat=1, net=args.net, rate_mbit=args.rate_mbit)
    with nat.NatTestbed(cfg) as bed:
        groups = {
            "direct": (bed.public, "auto"),
            "nat": ([bed.public[0], bed.public[1], bed.nat[0]], "auto"),
            "relay_all": (bed.public, "always"),
        }
        for rep in range(args.repeats):
            order = ARMS if rep % 2 == 0 else tuple(reversed(ARMS))
            for arm in order:
                sites, mode = groups[arm]
                gcfg = nat.GroupConfig(
                    size_mb=args.size_mb,
                    repeats=args.iters,
                    connections=args.connections,
                    relay=mode,
                    timeout=args.timeout,
                )
                reports = nat.run_group(bed, gcfg, free_port(), sites=sites)
                if len({r["hash"] for r in reports}) != 1:
                    raise RuntimeError(f"{arm}: the sites' results differ")
                samples[arm].append(_sample(reports))
                relayed_bytes[arm].append(int(reports[0]["relay"]["bytes"]))
                routes[arm] = [r["route"] for r in reports]
                if not args.json:
                    print(f"repeat {rep} {arm}: {samples[arm][-1]:.3f} s", file=sys.stderr)
    result: dict[str, Any] = {"seconds": {}, "ratio_vs_direct": {}, "routes": routes}
    base = statistics.median(samples["direct"])
    for arm in ARMS:
        med = statistics.median(samples[arm])
        result["seconds"][arm] = {
            "median": round(med, 4),
            "min": round(min(samples[arm]), 4),
            "max": round(max(samples[arm]), 4),
            "all": [round(x, 4) for x in samples[arm]],
        }
        result["ratio_vs_direct"][arm] = round(med / base, 3)
        result.setdefault("relay_bytes_per_group", {})[arm] = statistics.median(relayed_bytes[arm])
    result["config"] = {
        "sites": 3,
        "size_mb": args.size_mb,
        "iters": args.iters,
        "repeats": args.repeats,
        "connections": args.connections,
        "rate_mbit": args.rate_mbit,
        "auth": "curve",
    }
    return result


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.nat_relay", description=__doc__)
    p.add_argument("--size-mb", type=float, default=16.0)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--iters", type=int, default=3, help="timed all-reduces per group")
    p.add_argument("--connections", type=int, default=4)
    p.add_argument("--rate-mbit", type=float, default=0.0, help="tbf on every link; 0: none")
    p.add_argument("--net", type=int, default=170, help="second octet of the testbed's subnets")
    p.add_argument("--timeout", type=float, default=120.0)
    p.add_argument("--json", action="store_true", help="only the JSON line")
    args = p.parse_args(argv)
    print(json.dumps(run(args)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
