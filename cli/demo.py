"""``lowband demo``: the multi-site DiLoCo-vs-DDP demo on this machine (see
:mod:`diloco.demo_launch`).

Thin: the training flags are those of ``lowband train`` (the same parser function and the same
preset + overrides logic); they are parsed into a :class:`diloco.demo_launch.DemoConfig`,
validated before any process starts, and handed to ``diloco.demo_launch.main``.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from pathlib import Path


def _demo(args: argparse.Namespace) -> int:
    from cli.train import _fail, _train_config
    from diloco.demo_launch import DemoConfig, DemoFailed, demo_train_config, main, summary_table
    from lowband.errors import ConfigError

    try:
        if args.sites < 2:  # before the preset is built with workers=sites
            raise ConfigError("sites", f"a multi-site demo needs >= 2 sites, got {args.sites}")
        cfg = DemoConfig(
            train=_train_config(args, base=demo_train_config(args.sites), workers=args.sites),
            out_dir=args.out,
            sites=args.sites,
            rate_mbit=args.rate_mbit,
            delay_ms=args.delay_ms,
            link=args.link,
            ddp_inner_lr=args.ddp_lr,
            threads=args.threads,
            timeout=args.timeout,
            progress=not args.quiet,
        )
    except ConfigError as exc:
        return _fail(exc)
    # SIGTERM unwinds like Ctrl-C: the library's finally blocks kill the sites and delete the
    # namespaces instead of leaving them behind.
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(143))
    try:
        summary = main(cfg)
    except ConfigError as exc:
        return _fail(exc)
    except DemoFailed as exc:
        print(f"lowband demo: {exc}", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGTERM, previous)
    print(summary_table(summary))
    print(f"plot: {summary['plot']}\nsummary: {cfg.out_dir / 'summary.json'}")
    if args.json:
        print(json.dumps(summary))
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    from cli.train import _add_run_options

    p = sub.add_parser(
        "demo",
        help="multi-site Streaming DiLoCo vs DDP over shaped links, on this machine",
        description="A coordinator and N site processes (real `lowband worker`s) train the same "
        "model on the same data and token budget with Streaming DiLoCo and then with DDP, each "
        "site behind a WAN-like link: its own network namespace with tc tbf shaping when root "
        "(delay added in user space: no netem here), else a user-space link emulator. Prints "
        "the comparison and writes OUT/summary.json and OUT/eval_vs_bytes.png. Default model: "
        "the shakespeare preset shortened to 300 steps (~1-3 minutes on 2 cores).",
    )
    p.add_argument("--sites", type=int, default=3, help="M: site processes (default 3)")
    p.add_argument(
        "--rate-mbit",
        type=float,
        default=50.0,
        help="each site's link bandwidth, Mbit/s (default 50)",
    )
    p.add_argument(
        "--delay-ms",
        type=float,
        default=40.0,
        help="one-way delay in front of each site, ms (default 40)",
    )
    p.add_argument(
        "--link",
        default="auto",
        choices=["auto", "netns", "emulator", "tun", "none"],
        help="auto (default): netns when root, else emulator; tun: namespaces joined through "
        "TUN devices, delay and rate per packet (root); none: unshaped",
    )
    p.add_argument("--out", type=Path, default=Path("lowband-demo"), help="output directory")
    p.add_argument("--threads", type=int, default=1, help="torch threads per site (default 1)")
    p.add_argument(
        "--ddp-lr", type=float, help="DDP's peak AdamW lr (default: the same as DiLoCo's inner lr)"
    )
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds one run may take")
    p.add_argument("--quiet", action="store_true", help="no progress messages")
    p.add_argument("--json", action="store_true", help="also print the summary as one JSON line")
    _add_run_options(p)
    # No preset named: the demo's own default (demo_train_config); --preset/--config replace it.
    p.set_defaults(func=_demo, preset=None)


if __name__ == "__main__":  # pragma: no cover
    from cli import main as cli_main

    sys.exit(cli_main(["demo", *sys.argv[1:]]))
