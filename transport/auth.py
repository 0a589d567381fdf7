"""Authentication: ZeroMQ CURVE keypairs, a shared-token check, and the ZAP handler enforcing them.

Two independent mechanisms, configured on the coordinator and on every peer:

* **Shared token** without CURVE: every socket uses ZeroMQ's PLAIN mechanism, the peer id as user
  name and the token as password. The ZAP handler of the receiving socket compares the token in
  constant time; a wrong token fails the ZeroMQ handshake, so not one message of that
  connection reaches the application (neither on the coordinator nor on a peer's data socket).
* **CURVE** (encryption + server authentication): the coordinator has a long-term keypair made by
  ``lowband keygen``; peers are given its public key. Each peer's data socket is a CURVE server
  with the peer's own keypair, and its ZAP handler admits only the public keys of peers the
  coordinator has registered. A shared token, if also set, travels inside the encrypted REGISTER
  message (PLAIN and CURVE cannot be combined on one socket) and the coordinator checks it there.
  The coordinator may additionally restrict client keys to an allow-list.

Failures are logged with the remote address and counted (``ZapHandler.rejected``).
"""

from __future__ import annotations

import hmac
import logging
import os
import secrets
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import zmq
import zmq.auth
from zmq.utils import z85
from zmq.utils.monitor import recv_monitor_message

from lowband.errors import AuthError, ConfigError
from lowband.proc import is_loopback as is_loopback  # re-exported

logger = logging.getLogger(__name__)

ZAP_ENDPOINT = "inproc://zeromq.zap.01"
COORD_DOMAIN = "lowband-coordinator"
DATA_DOMAIN = "lowband-data"
RELAY_DOMAIN = "lowband-relay"


@dataclass(frozen=True, kw_only=True)
class CurveKeys:
    """A CURVE keypair in Z85 text (40 characters each). ``secret`` is None for a public-only
    key."""

    public: bytes
    secret: bytes | None = None

    def __post_init__(self) -> None:
        for name, key in (("public", self.public), ("secret", self.secret)):
            if key is not None and (not isinstance(key, bytes) or len(key) != 40):
                raise ConfigError(f"curve.{name}", "must be a 40-character Z85 key")

    @classmethod
    def generate(cls) -> "CurveKeys":
        public, secret = zmq.curve_keypair()
        return cls(public=public, secret=secret)

    @classmethod
    def load(cls, path: str | Path) -> "CurveKeys":
        """Read a key file written by ``lowband keygen`` (ZeroMQ certificate format)."""
        try:
            public, secret = zmq.auth.load_certificate(str(path))
        except (OSError, ValueError) as exc:
            raise ConfigError("curve", f"cannot read key file {path}: {exc}") from None
        return cls(public=public, secret=secret)


def _certificate(keys: CurveKeys, *, secret: bool) -> str:
    """A key file in ZeroMQ's certificate format (what ``zmq.auth.load_certificate`` reads)."""
    kind = "Secret" if secret else "Public"
    lines = [
        f"#   ZeroMQ CURVE {kind} Certificate (lowband keygen)",
        *(["#   Keep this file private: it is this peer's identity."] if secret else []),
        "",
        "metadata",
        "curve",
        f'    public-key = "{keys.public.decode()}"',
        *([f'    secret-key = "{keys.secret.decode()}"'] if secret and keys.secret else []),
    ]
    return "\n".join(lines) + "\n"


def _write_new(path: Path, text: str, mode: int) -> None:
    """Create ``path`` with ``mode`` from the first byte on (O_EXCL: never over an existing file,
    never a moment with wider permissions than ``mode``)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    except FileExistsError:
        raise ConfigError(
            "keygen", f"{path} exists; refusing to overwrite a key (move it away first)"
        ) from None
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)


def keygen(directory: str | Path, name: str) -> tuple[Path, Path]:
    """Write ``NAME.key`` (public, 0644) and ``NAME.key_secret`` (0600) into ``directory``;
    refuses when either exists."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    public, secret = directory / f"{name}.key", directory / f"{name}.key_secret"
    for path in (public, secret):
        if path.exists():
            raise ConfigError(
                "keygen", f"{path} exists; refusing to overwrite a key (move it away first)"
            )
    keys = CurveKeys.generate()
    _write_new(secret, _certificate(keys, secret=True), 0o600)
    _write_new(public, _certificate(keys, secret=False), 0o644)
    return public, secret


def parse_public_key(text: str) -> bytes:
    """A CURVE public key given as 40 Z85 characters or as a key file (``NAME.key`` or
    ``NAME.key_secret``)."""
    if len(text) == 40 and not Path(text).exists():
        try:
            z85.decode(text.encode())
        except (ValueError, KeyError):
            raise ConfigError("curve-server-key", f"{text!r} is not a Z85 key") from None
        return text.encode()
    return CurveKeys.load(text).public


# ---- control routes: a peer's routing id at the coordinator ----------------------------------

ROUTE_SEP = b"/"
ROUTE_NONCE_HEX = 32  # 128 random bits
MAX_PEER_ID_BYTES = 255 - 1 - ROUTE_NONCE_HEX  # a ZeroMQ routing id holds at most 255 bytes


def control_route(peer_id: str) -> bytes:
    """The routing id of a peer's control connection: its id, ``/`` and 128 random bits.

    The coordinator's ROUTER hands a routing id over to the newest connection presenting it
    (so that a peer reconnecting after a pause gets its replies again). Were the routing id
    the bare peer id, anyone able to connect could take a member's replies over and have it
    declared lost; the random part, which travels inside the ZeroMQ handshake (encrypted
    under CURVE) and is told to nobody else, makes a member's route unguessable."""
    pid = peer_id.encode()
    if not pid or len(pid) > MAX_PEER_ID_BYTES:
        raise ConfigError("peer_id", f"must be 1 to {MAX_PEER_ID_BYTES} bytes, got {len(pid)}")
    return pid + ROUTE_SEP + secrets.token_hex(ROUTE_NONCE_HEX // 2).encode()


def route_peer(route: bytes) -> str:
    """The peer id a control routing id names (the whole of it when it has no random part:
    a bare id, or one ZeroMQ made up for a socket that set none)."""
    head, sep, nonce = route.rpartition(ROUTE_SEP)
    if (
        sep
        and head
        and len(nonce) == ROUTE_NONCE_HEX
        and all(c in b"0123456789abcdef" for c in nonce)
    ):
        route = head
    return route.decode(errors="replace")


# ---- exposure: who may listen where without authentication ------------------------------------

AUTH_MODES = ("none", "token", "curve")


def endpoint_host(endpoint: str) -> str | None:
    """The host of a ``tcp://HOST:PORT`` endpoint; None for ``ipc://`` and ``inproc://``,
    which never leave this machine."""
    if endpoint.startswith(("ipc://", "inproc://")):
        return None
    if not endpoint.startswith("tcp://"):
        raise ConfigError("endpoint", f"must look like tcp://HOST:PORT, got {endpoint!r}")
    return endpoint[len("tcp://") :].rsplit(":", 1)[0]


KEYGEN_HINT = (
    "make keys with 'lowband keygen --out ~/.config/lowband' (the coordinator then uses CURVE "
    "by default; give peers its public key with --curve-server-key), or pass --insecure "
    "on a lab network you trust"
)


def check_exposure(host: str | None, auth: str, insecure: bool) -> None:
    """Refuse to listen on, or send credentials to, an address beyond this machine unless the
    traffic is authenticated without giving the secret away.

    ``host``: the address bound or dialled (None: ipc/inproc). ``auth``: ``none``, ``token``
    (ZeroMQ PLAIN: the token crosses the network in clear) or ``curve``. Loopback is always
    allowed (``lowband train``, ``edge run``, tests: zero-config); CURVE is allowed anywhere;
    ``insecure`` allows the rest, and the caller warns."""
    if auth not in AUTH_MODES:
        raise ConfigError("auth", f"one of {', '.join(AUTH_MODES)}, got {auth!r}")
    if host is None or is_loopback(host) or auth == "curve" or insecure:
        return
    where = "every interface" if host in ("", "*", "0.0.0.0", "::", "[::]") else host
    if auth == "token":
        raise ConfigError(
            "auth",
            f"a token without CURVE travels in clear text (ZeroMQ PLAIN) to/from {where}; "
            f"use CURVE: {KEYGEN_HINT}",
        )
    raise ConfigError(
        "auth",
        f"refusing to expose {where} without authentication: anyone who can reach it could "
        f"join; {KEYGEN_HINT}",
    )


Decision = Callable[[str, str, list[bytes]], "str | None"]
"""``(mechanism, address, credentials) -> user id`` to admit, or None to reject."""


def token_policy(token: str) -> Decision:
    """PLAIN: user name is the claimed peer id, password must equal the token."""
    expected = token.encode()

    def decide(mechanism: str, address: str, creds: list[bytes]) -> str | None:
        if mechanism != "PLAIN" or len(creds) != 2:
            return None
        user, password = creds
        if not hmac.compare_digest(password, expected):
            return None
        return user.decode(errors="replace")

    return decide


DEFER = "\0defer"
"""Returned by a policy that cannot decide yet: the handler asks again shortly (bounded)."""


def curve_policy(
    allowed: Callable[[bytes], str | None], *, defer_unknown: bool = False
) -> Decision:
    """CURVE: admit a client whose Z85 public key ``allowed`` maps to a user id.

    With ``defer_unknown`` an unknown key is not refused at once: on a peer's data socket, a
    new member may connect a moment before this peer has processed the membership that
    lists its key; the handler holds the handshake until the key appears or time runs out."""

    def decide(mechanism: str, address: str, creds: list[bytes]) -> str | None:
        if mechanism != "CURVE" or len(creds) != 1 or len(creds[0]) != 32:
            return None
        user = allowed(z85.encode(creds[0]))
        return DEFER if user is None and defer_unknown else user

    return decide


class ZapHandler:
    """Answers ZeroMQ's ZAP requests for one context, with one policy per ZAP domain.

    A ROUTER socket (rather than the usual REP) lets it hold a request whose policy said
    ``DEFER`` while answering others; held requests are re-decided every 50 ms for up to
    ``defer_seconds`` and then refused."""

    def __init__(self, ctx: zmq.Context, defer_seconds: float = 3.0) -> None:
        self._ctx = ctx
        self._policies: dict[str, Decision] = {}
        self._sock = ctx.socket(zmq.ROUTER)
        self._sock.linger = 0
        self._sock.bind(ZAP_ENDPOINT)
        self._defer = defer_seconds
        self._held: list[tuple[float, list[bytes]]] = []
        self._stop = threading.Event()
        self.rejected = 0
        self.accepted = 0
        self._thread = threading.Thread(target=self._run, name="lowband-zap", daemon=True)
        self._thread.start()

    def set_policy(self, domain: str, decide: Decision) -> None:
        self._policies[domain] = decide

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                if poller.poll(50 if self._held else 100):
                    while True:
                        try:
                            frames = self._sock.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._handle(time.monotonic() + self._defer, frames)
                held, self._held = self._held, []
                for deadline, frames in held:
                    self._handle(deadline, frames)
        except zmq.ContextTerminated:
            pass
        finally:
            self._sock.close(0)

    def _handle(self, deadline: float, frames: list[bytes]) -> None:
        # [routing id, empty delimiter, version, request id, domain, address, identity,
        #  mechanism, credentials...]
        if len(frames) < 8 or frames[1] != b"":
            logger.warning("malformed ZAP request with %d frames", len(frames))
            return
        envelope, request = frames[:2], frames[2:]
        reply = self._answer(request, final=time.monotonic() >= deadline)
        if reply is None:
            self._held.append((deadline, frames))
        else:
            self._sock.send_multipart(envelope + reply)

    def _answer(self, request: list[bytes], final: bool) -> list[bytes] | None:
        version, request_id, domain, address, _identity, mechanism = request[:6]
        creds = request[6:]
        dom, mech, addr = domain.decode(errors="replace"), mechanism.decode(), address.decode()
        policy = self._policies.get(dom)
        user = None
        if policy is not None:
            try:
                user = policy(mech, addr, creds)
            except Exception:  # a policy bug must not kill the auth thread (rejects instead)
                logger.exception("ZAP policy for %s failed", dom)
        if user == DEFER:
            if not final:
                return None
            user = None
        if user is None:
            self.rejected += 1
            logger.warning(
                "rejected %s connection from %s on %s: bad credentials", mech, addr or "?", dom
            )
            return [version, request_id, b"400", b"authentication failed", b"", b""]
        self.accepted += 1
        return [version, request_id, b"200", b"OK", user.encode(), b""]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2.0)


def configure_server(
    sock: zmq.Socket, *, domain: str, token: str | None, curve: CurveKeys | None
) -> None:
    """Make ``sock`` (a bound socket) authenticate connecting clients through ZAP."""
    if curve is not None:
        if curve.secret is None:
            raise ConfigError("curve", "a server socket needs a secret key")
        sock.curve_server = True
        sock.curve_secretkey = curve.secret
        sock.curve_publickey = curve.public
        sock.zap_domain = domain.encode()
    elif token is not None:
        sock.plain_server = True
        sock.zap_domain = domain.encode()


def configure_client(
    sock: zmq.Socket,
    *,
    user: str,
    token: str | None,
    curve: CurveKeys | None,
    server_key: bytes | None,
) -> None:
    """Credentials for a connecting socket; ``server_key`` is the remote's CURVE public key."""
    if server_key is not None:
        if curve is None or curve.secret is None:
            raise AuthError("CURVE is enabled but this peer has no keypair")
        sock.curve_serverkey = server_key
        sock.curve_publickey = curve.public
        sock.curve_secretkey = curve.secret
    elif token is not None:
        sock.plain_username = user.encode()
        sock.plain_password = token.encode()


_HANDSHAKE_FAILURES = (
    zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)


class HandshakeWatch:
    """Counts and logs failed handshakes on a bound socket (wrong mechanism, bad credentials,
    a peer speaking something that is not ZMTP). Poll ``socket`` and call ``drain`` on POLLIN;
    both belong to the thread that owns the watched socket."""

    def __init__(self, sock: zmq.Socket, what: str) -> None:
        self.socket = sock.get_monitor_socket(_HANDSHAKE_FAILURES)
        self.what = what
        self.failures = 0

    def drain(self) -> None:
        while True:
            try:
                event = recv_monitor_message(self.socket, zmq.NOBLOCK)
            except zmq.Again:
                return
            self.failures += 1
            name = zmq.Event(event["event"]).name
            if event["event"] != zmq.EVENT_HANDSHAKE_FAILED_AUTH:  # ZAP already logged those
                logger.warning(
                    "refused a connection to %s: %s (errno %s)", self.what, name, event["value"]
                )

    def close(self) -> None:
        self.socket.close(0)
