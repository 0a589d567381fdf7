"""Liveness flags shared by every command that runs a coordinator or joins one.

A deadline is a property of a deployment (a LAN demo: seconds; phones on cellular or WAN sites
under load: tens of seconds), so every launcher takes the same three flags and parses them into
one :class:`transport.coordinator.Liveness`. Joining commands take only ``--register-timeout``:
the heartbeat deadlines are the coordinator's, and a peer learns them when it registers.
"""

from __future__ import annotations

import argparse


def add_liveness(p: argparse.ArgumentParser, default_heartbeat: float) -> None:
    g = p.add_argument_group("liveness (how fast a silent peer is declared lost)")
    g.add_argument(
        "--heartbeat",
        type=float,
        metavar="S",
        help=f"heartbeat interval in seconds (default {default_heartbeat:g}); peers "
        "send three per interval",
    )
    g.add_argument(
        "--dead-after",
        type=float,
        metavar="S",
        help="seconds of silence, with its connection gone too, before a peer is "
        "lost (default 2 x --heartbeat)",
    )
    g.add_argument(
        "--unresponsive-after",
        type=float,
        metavar="S",
        help="seconds a silent peer whose connection still answers (a hung process) "
        "is kept (default 60)",
    )


def liveness(args: argparse.Namespace, default_heartbeat: float):
    """The :class:`~transport.coordinator.Liveness` the flags describe (ConfigError naming the
    field when they do not fit together)."""
    from transport.coordinator import Liveness

    kw: dict[str, float] = {
        "heartbeat_interval": default_heartbeat if args.heartbeat is None else args.heartbeat
    }
    if args.dead_after is not None:
        kw["dead_after"] = args.dead_after
    if args.unresponsive_after is not None:
        kw["unresponsive_after"] = args.unresponsive_after
    return Liveness(**kw)


def add_register_timeout(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--register-timeout",
        type=float,
        default=30.0,
        metavar="S",
        help="seconds to wait for the coordinator to answer at join (default %(default)s); "
        "the heartbeat deadlines are the coordinator's",
    )
