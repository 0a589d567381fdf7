"""Authentication flags every networked command shares, and where their secrets come from.

Secrets never come from argv, which every user of the machine sees in ``ps``: the token from
``--token-file FILE`` or the ``LOWBAND_TOKEN`` environment variable, the HTTP API key from
``--api-key-file FILE`` or ``LOWBAND_API_KEY``. ``--token VALUE`` and ``--api-key VALUE`` are
still parsed (hidden from ``--help``) only to refuse them with that advice. A secret file that
other users may read or write is refused, as ssh refuses such a private key. CURVE
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
import os
import stat
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Mapping

from lowband.errors import ConfigError

if TYPE_CHECKING:  # transport (and ZeroMQ) load inside the handlers: a fast --help
    from transport.auth import CurveKeys

logger = logging.getLogger(__name__)

TOKEN_ENV = "LOWBAND_TOKEN"
API_KEY_ENV = "LOWBAND_API_KEY"
MAX_SECRET_BYTES = 4096  # a token or an API key; a larger file is not one
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
    # --token VALUE is parsed only to be refused with advice: argv is public (ps, /proc).
    g.add_argument("--token", help=argparse.SUPPRESS)
    g.add_argument(
        "--token-file",
        help=f"read the shared secret from this file (mode 0600), or set ${TOKEN_ENV}; "
        "without CURVE a token is only allowed on loopback or with --insecure",
    )
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


def add_curve_authorized(p: argparse.ArgumentParser, *, who: str) -> None:
    """``--curve-authorized``: the CURVE allow-list of a command that runs a coordinator."""
    p.add_argument(
        "--curve-authorized",
        nargs="*",
        metavar="KEY",
        help=f"only admit {who} with these CURVE public keys (NAME.key files or directories "
        "of them); without it anyone who has the coordinator's public key may join",
    )


def authorized_keys(paths: list[str]) -> tuple[bytes, ...]:
    """Public keys from key files and/or directories of ``*.key`` files."""
    from transport.auth import CurveKeys

    keys: list[bytes] = []
    for p in map(Path, paths):
        files = sorted(p.glob("*.key")) if p.is_dir() else [p]
        if not files:
            raise ConfigError("curve-authorized", f"no *.key files in {p}")
        keys.extend(CurveKeys.load(f).public for f in files)
    return tuple(keys)


def read_secret_file(path: str, flag: str) -> str:
    """The secret held in ``path`` (surrounding whitespace stripped).

    Refused (ConfigError naming ``flag``): a regular file that group or others may read or
    write (``chmod 600`` it), an empty one, one over :data:`MAX_SECRET_BYTES`, or one that
    is not UTF-8. The mode is taken from the opened file, so the file checked is the file
    read; a pipe (``--token-file <(pass show x)``) has no such mode and is read as it is.
    The secret itself is never part of a message."""
    try:
        with open(path, "rb") as f:
            mode = os.fstat(f.fileno()).st_mode
            if stat.S_ISREG(mode) and mode & 0o077:
                raise ConfigError(
                    flag,
                    f"{path} may be read or written by other users (mode "
                    f"{stat.S_IMODE(mode):04o}); a secret file must be private: chmod 600 {path}",
                )
            data = f.read(MAX_SECRET_BYTES + 1)
    except OSError as exc:
        raise ConfigError(flag, f"cannot read {path}: {exc.strerror or exc}") from None
    if len(data) > MAX_SECRET_BYTES:
        raise ConfigError(flag, f"{path} is over {MAX_SECRET_BYTES} bytes: not a secret")
    try:
        text = data.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise ConfigError(flag, f"{path} is not UTF-8 text") from None
    if not text:
        raise ConfigError(flag, f"{path} is empty")
    return text


def _secret(
    given: str | None, file: str | None, env: Mapping[str, str], *, flag: str, var: str
) -> str | None:
    """A secret from ``--FLAG-file``, else the environment variable ``var``; None when
    neither is set. A value given as ``--FLAG VALUE`` is refused (ConfigError, without the
    value): every user of the machine can read a command line."""
    if given is not None:
        raise ConfigError(
            flag,
            f"a secret on the command line is visible to every user of this machine (ps, "
            f"/proc): put it in a file only you can read and pass --{flag}-file FILE, or set "
            f"{var}",
        )
    if file:
        return read_secret_file(file, f"{flag}-file")
    return env.get(var) or None


def _token(args: argparse.Namespace, env: Mapping[str, str]) -> str | None:
    return _secret(args.token, args.token_file, env, flag="token", var=TOKEN_ENV)


def add_api_key(p: argparse.ArgumentParser) -> None:
    """The HTTP API key flags of a command that serves the API."""
    g = p.add_argument_group("HTTP API key (see docs/security.md)")
    g.add_argument(
        "--api-key-file",
        metavar="FILE",
        help="require 'Authorization: Bearer KEY' on the API, KEY read from this file "
        f"(mode 0600); or set ${API_KEY_ENV}",
    )
    # --api-key VALUE is parsed only to be refused with advice, as --token is.
    g.add_argument("--api-key", help=argparse.SUPPRESS)


def resolve_api_key(args: argparse.Namespace, env: Mapping[str, str]) -> str | None:
    """The HTTP API key from the flags of :func:`add_api_key` or ``LOWBAND_API_KEY``."""
    key = _secret(args.api_key, args.api_key_file, env, flag="api-key", var=API_KEY_ENV)
    if key is not None and not key.strip():
        raise ConfigError("api-key", "must not be blank")
    return key


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
