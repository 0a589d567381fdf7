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
import os
import sys
from typing import Mapping, Sequence

from lowband import __version__

# Module names, in the order their subcommands appear in --help.
COMMAND_MODULES = (
    "cli.transport",  # coordinator, keygen
    "cli.train",  # train, worker
    "cli.edge",  # edge ...
    "cli.flower",  # flower ...
    "cli.demo",  # demo
)


# How libgomp's idle workers wait, for the edge commands. The kernels and torch share libgomp's
# thread teams, and a server runs its steps on the engine's thread while the model was loaded on
# the main one: two teams on few cores, and by default libgomp's idle workers then sleep almost at
# once, so every parallel region of a decode step pays a futex wake-up. Spinning up to ~2M
# iterations (tens of milliseconds) first doubles single-stream decode on 2 cores
# (benchmarks/results/edge_speculative-gemma3-270m-omp-*.json); after that they still sleep, so
# an idle server does not hold its cores. libgomp reads these once, when torch loads it.
OPENMP_WAIT = {"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": "2000000"}


def openmp_wait(
    command: str | None, environ: Mapping[str, str], torch_loaded: bool
) -> dict[str, str]:
    """The variables to add for ``command``: :data:`OPENMP_WAIT` for ``edge`` when the user set
    neither and torch (hence libgomp) is not loaded yet; nothing otherwise (training shares its
    cores with the transport's threads and other sites, and tests call :func:`main` in-process)."""
    if command != "edge" or torch_loaded or any(k in environ for k in OPENMP_WAIT):
        return {}
    return dict(OPENMP_WAIT)


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
    os.environ.update(openmp_wait(args.command, os.environ, "torch" in sys.modules))
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
