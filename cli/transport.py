"""``lowband coordinator`` and ``lowband keygen`` (benchmarks: ``python -m benchmarks.transport``).

Thin: parse into config dataclasses and call :mod:`transport`. Heavy imports happen inside the
handlers so ``lowband --help`` stays fast on a Raspberry Pi.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import sys

from cli.auth import add_auth, add_curve_authorized, authorized_keys, resolve_auth
from cli.liveness import add_liveness, liveness
from lowband.errors import ConfigError


def _coordinator(args: argparse.Namespace) -> int:
    try:
        return _coordinator_checked(args)
    except ConfigError as exc:
        print(f"lowband coordinator: {exc}", file=sys.stderr)
        return 2


def _coordinator_checked(args: argparse.Namespace) -> int:
    from transport.auth import endpoint_host
    from transport.coordinator import Coordinator

    auth = resolve_auth(args, os.environ, client=False, server=True)
    exposed = auth.check(endpoint_host(args.bind), what=f"the coordinator on {args.bind}")
    curve = auth.curve
    cfg = liveness(args, default_heartbeat=1.0).coordinator(
        bind=args.bind,
        token=auth.token,
        curve=curve,
        curve_authorized=authorized_keys(args.curve_authorized or []),
    )
    cfg = dataclasses.replace(cfg, relay=not args.no_relay, relay_bind=args.relay_bind)
    coord = Coordinator(cfg).start()

    def stop(signum: int, frame: object) -> None:
        coord.stop()

    # Before the address is printed: whoever reads it may stop us at once, and must get a
    # clean exit rather than the default SIGTERM death.
    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    print(f"lowband coordinator listening on {coord.address}", flush=True)
    print(f"auth: {auth.mode}" + (", insecure: true" if exposed else ""), flush=True)
    if coord.relay_address:
        print(f"relay for peers behind NAT on {coord.relay_address}", flush=True)
    if curve is not None:
        print(f"CURVE public key (give it to peers): {curve.public.decode()}", flush=True)
    coord.wait()
    return 0


def _keygen(args: argparse.Namespace) -> int:
    from transport.auth import CurveKeys, keygen

    try:
        public, secret = keygen(args.out, args.name)
    except ConfigError as exc:
        print(f"lowband keygen: {exc}", file=sys.stderr)
        return 2
    print(f"public key file: {public}")
    print(f"secret key file: {secret}  (keep it private)")
    print(f"public key: {CurveKeys.load(public).public.decode()}")
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("coordinator", help="run the membership coordinator of a lowband group")
    p.add_argument(
        "--bind",
        default="tcp://0.0.0.0:29500",
        help="ZeroMQ endpoint to listen on (default tcp://0.0.0.0:29500)",
    )
    add_liveness(p, default_heartbeat=1.0)
    p.add_argument(
        "--relay-bind",
        help="endpoint of the relay for workers behind NAT, e.g. tcp://0.0.0.0:29501 where a "
        "firewall must let it in (default: the --bind host, a free port; workers learn it)",
    )
    p.add_argument(
        "--no-relay", action="store_true", help="run no relay: every worker must be dialable"
    )
    add_auth(p, client=False, server=True, curve_secret_alias=True)
    add_curve_authorized(p, who="peers")
    p.set_defaults(func=_coordinator)

    p = sub.add_parser("keygen", help="write a CURVE keypair (NAME.key, NAME.key_secret)")
    p.add_argument("--out", required=True, help="directory for the key files")
    p.add_argument("--name", default="lowband", help="file name stem (default lowband)")
    p.set_defaults(func=_keygen)
