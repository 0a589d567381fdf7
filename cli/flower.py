"""``lowband flower ...``: write a Flower app directory, or run a whole local federation.

``lowband flower local`` saves the real work of a Flower deployment on one machine: it writes
the app, starts a SuperLink and N SuperNodes (own process groups, private FLWR_HOME, free
ports), submits ``flwr run --stream``, tears everything down and prints the per-round table.
For machines of your own, ``lowband flower new DIR`` writes the app and you run the Flower
processes yourself (see examples/flower_diloco/README.md).
"""

from __future__ import annotations

import argparse
import signal
import sys
from pathlib import Path
from typing import Any


def _value(text: str) -> Any:
    """``true``/``false``, an int, a float, a quoted string, or else the text as a string."""
    if text in ("true", "false"):
        return text == "true"
    for conv in (int, float):
        try:
            return conv(text)
        except ValueError:
            pass
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "\"'":
        return text[1:-1]
    return text


def _settings(pairs: list[str]) -> dict[str, Any]:
    from lowband.errors import ConfigError

    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ConfigError("--set", f"expected KEY=VALUE, got {pair!r}")
        out[key.strip()] = _value(value.strip())
    return out


def _add_set(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a run-config value (repeatable), e.g. --set alpha=0.5 --set codec=nf4; "
        "keys and defaults: `lowband flower keys`",
    )


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "flower",
        help="federated Streaming DiLoCo on Flower (rounds = outer steps)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    fsub = p.add_subparsers(dest="flower_command", metavar="ACTION", required=True)

    new = fsub.add_parser("new", help="write a Flower app directory for `flwr run DIR`")
    new.add_argument("directory", type=Path)
    _add_set(new)
    new.set_defaults(func=_new)

    keys = fsub.add_parser("keys", help="list the app's run-config keys and defaults")
    keys.set_defaults(func=_keys)

    local = fsub.add_parser("local", help="SuperLink + N SuperNodes here, `flwr run`, tear down")
    local.add_argument("--supernodes", type=int, default=2, help="SuperNodes to start (default 2)")
    local.add_argument("--rounds", type=int, help="R: Flower rounds = fragment outer steps")
    local.add_argument("-H", "--inner-steps", type=int, help="H: inner steps per fragment sync")
    local.add_argument("-P", "--fragments", type=int, help="P: fragments (one synced per round)")
    local.add_argument("--codec", help="uplink codec: fp32 fp16 bf16 int8 fp4 nf4 e3m0")
    local.add_argument("--preset", help="model/data preset: tiny (default) | shakespeare")
    local.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads per ServerApp/ClientApp process (default 1: the "
        "processes share this machine's cores)",
    )
    local.add_argument("--app", type=Path, help="an app directory (default: the built-in app)")
    local.add_argument(
        "--out",
        type=Path,
        default=Path("flower-run"),
        help="metrics.jsonl, summary.json, checkpoint/ (default ./flower-run)",
    )
    local.add_argument("--timeout", type=float, default=3600.0, help="seconds for the whole run")
    local.add_argument("--quiet", action="store_true", help="do not stream the Flower run log")
    _add_set(local)
    local.set_defaults(func=_local)

    run = fsub.add_parser(
        "run",
        help="run the app on a running SuperLink (`flwr run` without writing FLWR_HOME by hand)",
    )
    run.add_argument("--superlink", required=True, help="HOST:PORT of the SuperLink")
    run.add_argument("--app", type=Path, help="an app directory (default: the built-in app)")
    run.add_argument(
        "--out",
        help="out-dir on the SuperLink's machine (ServerApp writes "
        "metrics, summary, checkpoint there); printed here when visible",
    )
    run.add_argument(
        "--root-certificates",
        help="CA bundle of a TLS SuperLink (needed beyond loopback unless --insecure)",
    )
    run.add_argument(
        "--insecure",
        action="store_true",
        help="talk to a SuperLink beyond loopback without TLS: a network you trust only",
    )
    run.add_argument("--timeout", type=float, default=24 * 3600.0, help="seconds")
    run.add_argument("--quiet", action="store_true", help="do not stream the Flower run log")
    _add_set(run)
    run.set_defaults(func=_run)


def _fail(exc: Exception) -> int:
    print(f"lowband: error: {exc}", file=sys.stderr)
    return 2


def _new(args: argparse.Namespace) -> int:
    from diloco.flower.app import write_app
    from diloco.flower.config import APP_CONFIG_DEFAULTS, from_run_config
    from lowband.errors import ConfigError

    try:
        settings = _settings(args.set)
        from_run_config({**APP_CONFIG_DEFAULTS, **settings})
        write_app(args.directory, settings)
    except ConfigError as exc:
        return _fail(exc)
    print(f"wrote {args.directory}: flwr run {args.directory} <superlink> --stream")
    return 0


def _keys(args: argparse.Namespace) -> int:
    from diloco.flower.app import toml_value
    from diloco.flower.config import APP_CONFIG

    for k, (v, doc) in APP_CONFIG.items():
        print(f"{k:<20} {toml_value(v):<12} {doc}")
    return 0


def local_config(args: argparse.Namespace):
    """The parsed command line as a :class:`diloco.flower.federation.LocalRunConfig`."""
    from diloco.flower.federation import LocalRunConfig

    flags = {
        "num-server-rounds": args.rounds,
        "inner-steps": args.inner_steps,
        "fragments": args.fragments,
        "codec": args.codec,
        "preset": args.preset,
        "threads": args.threads,
    }
    rc = {k: v for k, v in flags.items() if v is not None}
    rc.update(_settings(args.set))
    return LocalRunConfig(
        supernodes=args.supernodes,
        run_config=rc,
        out_dir=str(args.out),
        app_dir=str(args.app) if args.app else None,
        timeout=args.timeout,
    )


def _local(args: argparse.Namespace) -> int:
    from diloco.flower.federation import FlowerRunFailed, run_local, summary_table
    from lowband.errors import ConfigError

    try:
        cfg = local_config(args)
    except ConfigError as exc:
        return _fail(exc)
    # The Flower processes live in their own process groups (so that one kill reaches their
    # children); turn SIGTERM into an exception so that the teardown still runs.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    try:
        summary = run_local(cfg, echo=None if args.quiet else sys.stdout)
    except FlowerRunFailed as exc:
        return _fail(exc)
    print(summary_table(args.out))
    red = summary.get("uplink_reduction")
    print(
        f"eval loss {summary['initial_eval']:.3f} -> {summary['final_eval']:.3f}; uplink "
        f"{summary['bytes_up'] / 2**20:.2f} MiB ({summary['codec']}"
        + (f", {red:.2f}x less than fp32" if red else "")
        + f"); downlink "
        f"{summary['bytes_down'] / 2**20:.2f} MiB; results in {args.out}"
    )
    return 0


def submit_config(args: argparse.Namespace):
    """The parsed command line as a :class:`diloco.flower.federation.SubmitConfig`."""
    from diloco.flower.federation import SubmitConfig

    rc = _settings(args.set)
    if args.out:
        rc["out-dir"] = args.out
    return SubmitConfig(
        superlink=args.superlink,
        run_config=rc,
        app_dir=str(args.app) if args.app else None,
        root_certificates=args.root_certificates,
        timeout=args.timeout,
        insecure=args.insecure,
    )


def _run(args: argparse.Namespace) -> int:
    from diloco.flower.federation import FlowerRunFailed, submit, summary_table
    from lowband.errors import ConfigError

    try:
        cfg = submit_config(args)
        submit(cfg, echo=None if args.quiet else sys.stdout)
    except (ConfigError, FlowerRunFailed) as exc:
        return _fail(exc)
    if args.out and (Path(args.out) / "metrics.jsonl").exists():
        print(summary_table(Path(args.out)))
    return 0
