"""What the HTTP API checks before a request reaches an endpoint (issue 25).

* **API key** (``ServerConfig.api_key``): every path but ``/health`` and the static chat page
  needs ``Authorization: Bearer KEY``, compared in constant time (``hmac.compare_digest``).
* **Host and Origin**: a browser can be made to send requests to the server from any web page.
  DNS rebinding points a page's own name at this machine, so its requests carry ``Host:
  evil.example``; a cross-site ``text/plain`` POST needs no CORS preflight but carries
  ``Origin: https://evil.example``. So the Host must name this server (a loopback name, an IP
  literal, which a rebinding page cannot produce, the bound host, or one of
  ``ServerConfig.allowed_hosts``), and an Origin, when present, must be this server itself (same
  scheme-less host:port as the Host) or an allowed host. Either failing is a 403.
* **Connections**: at most ``max_connections`` at a time, counted as each is accepted
  (:class:`CappedSite`; beyond it a new connection gets a 503 and is closed), and aiohttp's
  keep-alive timer (``idle_timeout_s``) closes a connection that is idle or that has sent
  half a request's headers for that long.
* **Bodies**: :func:`parse_json` refuses NaN/Infinity, non-finite numbers (``1e999``) and
  nesting deeper than ``MAX_JSON_DEPTH`` as a 400, so no handler sees a value that would make
  ``int()`` or a recursive walk raise.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import math
from functools import partial
from typing import Any, Awaitable, Callable
from urllib.parse import urlsplit

from aiohttp import web

MAX_JSON_DEPTH = 64  # arrays/objects inside each other; an OpenAI request needs < 10
OPEN_PATHS = frozenset({"/health", "/"})  # a liveness probe, the static chat page
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class BadJson(ValueError):
    """A request body that is not the JSON the API accepts (the message says why)."""


def error_response(
    status: int, message: str, *, kind: str, code: str | None = None
) -> web.Response:
    """An OpenAI-style error body (``edge.server.ApiError`` writes the same shape)."""
    body = {"error": {"message": message, "type": kind, "param": None, "code": code}}
    return web.json_response(body, status=status)


def _constant(name: str) -> Any:
    raise BadJson(f"{name} is not a JSON number")


def _finite(text: str) -> float:
    x = float(text)
    if not math.isfinite(x):
        raise BadJson(f"the number {text[:32]} is out of range")
    return x


def _depth(doc: Any) -> int:
    """How deeply arrays and objects nest in ``doc`` (iterative: no recursion to exhaust)."""
    deepest, stack = 0, [(doc, 1)]
    while stack:
        x, d = stack.pop()
        if isinstance(x, (list, dict)):
            deepest = max(deepest, d)
            if d > MAX_JSON_DEPTH:
                break
            stack.extend((v, d + 1) for v in (x.values() if isinstance(x, dict) else x))
    return deepest


def parse_json(raw: bytes) -> Any:
    """``json.loads`` for untrusted bodies; BadJson for anything the API does not take."""
    try:
        doc = json.loads(raw, parse_constant=_constant, parse_float=_finite)
    except RecursionError:
        raise BadJson(f"the request body nests deeper than {MAX_JSON_DEPTH} levels") from None
    except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError, BadJson
        raise BadJson(f"the request body is not valid JSON: {exc}") from None
    if _depth(doc) > MAX_JSON_DEPTH:
        raise BadJson(f"the request body nests deeper than {MAX_JSON_DEPTH} levels")
    return doc


def _hostname(netloc: str) -> str:
    try:
        name = urlsplit("//" + netloc).hostname
    except ValueError:
        return ""
    return (name or "").lower()


def host_allowed(host: str, bound: str, allowed: tuple[str, ...]) -> bool:
    """Whether a request's ``Host`` names this server (see the module docstring)."""
    name = _hostname(host)
    if not name:
        return False
    if name in LOOPBACK_NAMES or name == bound.lower() or name in allowed:
        return True
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def origin_allowed(origin: str, host: str, allowed: tuple[str, ...]) -> bool:
    """Whether a request's ``Origin`` is this server itself or an allowed host."""
    parts = urlsplit(origin)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        return False  # "null" (sandboxed pages, file://) and garbage
    return parts.netloc.lower() == host.lower() or (parts.hostname or "") in allowed


def guard(*, api_key: str | None, bound: str, allowed_hosts: tuple[str, ...]) -> Any:
    """The aiohttp middleware enforcing the API key and the Host/Origin rules."""
    allowed = tuple(h.lower() for h in allowed_hosts)
    key = None if api_key is None else api_key.encode()

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        host = request.headers.get("Host", "")
        if not host_allowed(host, bound, allowed):
            return error_response(
                403,
                f"Host {host[:64]!r} does not name this server; add it to the allowed hosts",
                kind="permission_error",
                code="host_not_allowed",
            )
        origin = request.headers.get("Origin")
        if origin is not None and not origin_allowed(origin, host, allowed):
            return error_response(
                403,
                f"cross-site request from {origin[:64]!r} refused",
                kind="permission_error",
                code="origin_not_allowed",
            )
        if key is not None and request.path not in OPEN_PATHS:
            scheme, _, token = request.headers.get("Authorization", "").partition(" ")
            if not (
                scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key)
            ):
                resp = error_response(
                    401,
                    "a valid API key is required (Authorization: Bearer KEY)",
                    kind="authentication_error",
                    code="invalid_api_key",
                )
                resp.headers["WWW-Authenticate"] = "Bearer"
                return resp
        return await handler(request)

    return middleware


class _Busy(asyncio.Protocol):
    """A connection beyond the cap: one 503 and the connection is closed."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        body = json.dumps(
            {
                "error": {
                    "message": "too many connections; retry later",
                    "type": "rate_limit_error",
                    "param": None,
                    "code": "too_many_connections",
                }
            }
        ).encode()
        head = (
            "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
        ).encode()
        if isinstance(transport, asyncio.WriteTransport):
            transport.write(head + body)
        transport.close()


def _admit(server: web.Server, cap: int) -> asyncio.Protocol:
    if len(server.connections) >= cap:
        return _Busy()
    return server()


class CappedSite(web.TCPSite):
    """A TCP site admitting at most ``max_connections`` open connections at a time."""

    def __init__(self, runner: web.BaseRunner, host: str, port: int, *, max_connections: int):
        super().__init__(runner, host, port)
        self._max_connections = max_connections

    async def start(self) -> None:
        await web.BaseSite.start(self)  # registers the site with its runner (for cleanup)
        server = self._runner.server
        assert server is not None
        self._server = await asyncio.get_running_loop().create_server(
            partial(_admit, server, self._max_connections),
            self._host,
            self._port,
            backlog=self._backlog,
            reuse_address=self._reuse_address,
            reuse_port=self._reuse_port,
        )


__all__ = [
    "BadJson",
    "CappedSite",
    "MAX_JSON_DEPTH",
    "guard",
    "host_allowed",
    "origin_allowed",
    "parse_json",
]
