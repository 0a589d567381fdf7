"""The ``lowband`` command line: the composition root that wires transport to algorithms.

Each group of subcommands lives in its own ``cli.*`` module listed in
``COMMAND_MODULES`` (``transport``: coordinator, keygen; ``train``: train, worker; ``edge``, which
also registers ``edge_moe``; ``flower``; ``demo``, whose launcher is ``diloco.demo_launch``), each
exposing ``register(subparsers)``. A module adds parsers whose ``func(args) -> int`` parses the
arguments into a config dataclass and calls the library; ``liveness`` holds the deadline flags
they share.
Heavy imports happen inside ``func`` so that ``lowband --help`` stays fast on a Raspberry Pi.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from typing import Sequence

from lowband import __version__

# Module names, in the order their subcommands appear in --help.
COMMAND_MODULES = (
    "cli.transport",  # coordinator, keygen
    "cli.train",  # train, worker
    "cli.edge",  # edge ...
    "cli.flower",  # flower ...
    "cli.demo",  # demo
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lowband",
        description="Train and serve language models where the network is the bottleneck.",
    )
    parser.add_argument("--version", action="version", version=f"lowband {__version__}")
    parser.add_argument(
        "-v", "--verbose", action="count", default=0, help="more logging (-v info, -vv debug)"
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:  # a real missing dependency inside the module: surface it
                raise
            continue  # this subcommand group is not part of this build
        module.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    level = [logging.WARNING, logging.INFO, logging.DEBUG][min(args.verbose, 2)]
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
