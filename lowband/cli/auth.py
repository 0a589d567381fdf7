"""Authentication flags every networked command shares, and where their secrets come from.

Secrets never need argv: ``--token-file FILE`` or the ``LOWBAND_TOKEN`` environment variable
(``--token`` still works but warns, since any user of the machine sees it in ``ps``). CURVE
keys come from ``--curve-key`` / ``--curve-server-key`` or, when present, from the default key
directory ``$XDG_CONFIG_HOME/lowband`` (``~/.config/lowband``): ``lowband.key_secret`` is this
peer's keypair (the coordinator's, on the coordinator), ``coordinator.key`` the coordinator's
public key on a peer. Only this module reads the environment; the library gets the values.

Whether a command may listen on or dial an address is decided by
:func:`transport.auth.check_exposure`, called here for every such address.
"""

from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Mapping

from lowband.errors import ConfigError

if TYPE_CHECKING:  # transport (and ZeroMQ) load inside the handlers: a fast --help
    from transport.auth import CurveKeys

logger = logging.getLogger(__name__)

TOKEN_ENV = "LOWBAND_TOKEN"
KEYPAIR_FILE = "lowband.key_secret"  # this peer's keypair in the default key directory
SERVER_KEY_FILE = "coordinator.key"  # the coordinator's public key, on a peer


def default_key_dir(env: Mapping[str, str]) -> Path | None:
    """``$XDG_CONFIG_HOME/lowband``, else ``$HOME/.config/lowband``; None without either."""
    if env.get("XDG_CONFIG_HOME"):
        return Path(env["XDG_CONFIG_HOME"]) / "lowband"
    if env.get("HOME"):
        return Path(env["HOME"]) / ".config" / "lowband"
    return None


@dataclass(frozen=True, kw_only=True)
class Auth:
    """What a command authenticates with, resolved from flags, files and the environment."""

    token: str | None = None
    curve: CurveKeys | None = None  # this peer's keypair
    server_key: bytes | None = None  # the coordinator's public key (a connecting peer)
    insecure: bool = False  # --insecure: expose without authentication (a lab network)
    mode: str = "none"  # "curve", "token" (ZeroMQ PLAIN) or "none"

    def check(self, *hosts: str | None, what: str) -> bool:
        """Refuse (ConfigError) to listen on / dial ``hosts`` unprotected; with --insecure warn
        instead. True when this command runs exposed without CURVE (shown as insecure)."""
        from transport.auth import check_exposure, is_loopback

        exposed = False
        for host in hosts:
            check_exposure(host, self.mode, self.insecure)
            if host is not None and not is_loopback(host) and self.mode != "curve":
                exposed = True
        if exposed:
            msg = (
                f"--insecure: {what} is reachable from the network with auth {self.mode}; "
                "anyone who can reach it can join (or read the token)"
            )
            logger.warning("%s", msg)
            print(f"lowband: WARNING: {msg}", file=sys.stderr, flush=True)
        return exposed


def add_auth(
    p: argparse.ArgumentParser, *, client: bool, server: bool, curve_secret_alias: bool = False
) -> None:
    """The authentication flags of a command that connects to (``client``) and/or runs
    (``server``) a coordinator."""
    g = p.add_argument_group("authentication (see docs/security.md)")
    g.add_argument(
        "--token",
        help="shared secret (visible to other users in ps: prefer --token-file or "
        f"${TOKEN_ENV}); without CURVE only allowed on loopback or with --insecure",
    )
    g.add_argument("--token-file", help="read the shared secret from this file")
    names = ["--curve-key", "--curve-secret"] if curve_secret_alias else ["--curve-key"]
    g.add_argument(
        *names,
        dest="curve_key",
        metavar="FILE",
        help="this peer's CURVE keypair (NAME.key_secret written by lowband keygen; "
        f"default: ~/.config/lowband/{KEYPAIR_FILE} if it exists)"
        + ("; enables CURVE" if server else ""),
    )
    if client:
        g.add_argument(
            "--curve-server-key",
            metavar="FILE|Z85",
            help="the coordinator's CURVE public key (its NAME.key file or the 40 "
            f"characters it prints); enables CURVE (default: ~/.config/lowband/"
            f"{SERVER_KEY_FILE} if it exists)",
        )
    g.add_argument(
        "--insecure",
        action="store_true",
        help="allow listening on / dialling a non-loopback address without CURVE "
        "(no authentication, or a token in clear): a lab network you trust only",
    )


def _token(args: argparse.Namespace, env: Mapping[str, str]) -> str | None:
    if args.token and args.token_file:
        raise ConfigError("token", "give --token or --token-file, not both")
    if args.token_file:
        try:
            text = Path(args.token_file).read_text().strip()
        except OSError as exc:
            raise ConfigError("token-file", f"cannot read {args.token_file}: {exc}") from None
        if not text:
            raise ConfigError("token-file", f"{args.token_file} is empty")
        return text
    if args.token:
        print(
            "lowband: WARNING: --token is visible to every user of this machine (ps, "
            f"/proc); use --token-file FILE or {TOKEN_ENV}",
            file=sys.stderr,
            flush=True,
        )
        return str(args.token)
    return env.get(TOKEN_ENV) or None


def _default(env: Mapping[str, str], name: str) -> Path | None:
    d = default_key_dir(env)
    return d / name if d is not None and (d / name).is_file() else None


def resolve_auth(
    args: argparse.Namespace, env: Mapping[str, str], *, client: bool, server: bool
) -> Auth:
    """:class:`Auth` from the flags of :func:`add_auth`, the key directory and ``env``.

    A server (coordinator, edge master) uses CURVE when it has a keypair; a client when it
    knows the coordinator's public key."""
    from transport.auth import CurveKeys, parse_public_key

    token = _token(args, env)
    key_file = args.curve_key or _default(env, KEYPAIR_FILE)
    curve = CurveKeys.load(key_file) if key_file else None
    if curve is not None and curve.secret is None:
        raise ConfigError(
            "curve-key",
            f"{key_file} holds no secret key (pass the NAME.key_secret file written by "
            "lowband keygen)",
        )
    server_key = None
    if client:
        given = getattr(args, "curve_server_key", None)
        source = given or _default(env, SERVER_KEY_FILE)
        server_key = parse_public_key(str(source)) if source else None
        if args.curve_key and server_key is None and not server:
            raise ConfigError(
                "curve-key", "a peer's --curve-key needs --curve-server-key (the coordinator's)"
            )
    curve_on = curve is not None if server else server_key is not None
    mode = "curve" if curve_on else ("token" if token else "none")
    return Auth(
        token=token,
        curve=curve if curve_on else None,
        server_key=server_key,
        insecure=bool(args.insecure),
        mode=mode,
    )
