"""OpenAI-compatible HTTP API (aiohttp) in front of an :class:`edge.engine.Engine`.

``POST /v1/completions``, ``POST /v1/chat/completions`` (both with ``"stream": true`` SSE),
``GET /v1/models``, ``GET /health`` (503 while the cluster is degraded), ``GET /metrics`` (with
``expert_store``: hit rate, mean bits, bytes read, stall seconds, when serving a nested MoE).

A chat is rendered with the model's own chat template when its tokenizer carries one
(:mod:`lowband.models.chat_template`), and generation stops on the template's end-of-turn
tokens; a model without one gets a plain ``role: content`` transcript. ``/v1/models`` says which
(``chat_template``: ``"model"`` or ``"none"``).

Concurrency: the engine decodes one sequence at a time on a single generation thread, so the
event loop never blocks on the model. Requests beyond the one running wait in FIFO order;
beyond ``max_queue`` waiting requests the server answers 429 instead of piling up memory. A
streaming client that disconnects cancels its generation at the next token.

Every error is a JSON body ``{"error": {"message", "type", "param", "code"}}`` as OpenAI's.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from functools import partial
from importlib import resources
from typing import Any, AsyncIterator, Callable

from aiohttp import web

from edge.engine import ClusterUnavailable, Engine, Event
from edge.http_guard import BadJson, CappedSite, guard, parse_json
from edge.sampling import SamplingParams
from lowband.errors import ChatTemplateError, ConfigError, LowbandError
from lowband.models.chat_template import ChatTemplate, normalize_messages

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class ServerConfig:
    """The OpenAI-compatible HTTP server: where it listens and what requests it admits."""

    host: str = "127.0.0.1"
    port: int = 8000  # 0 picks a free port
    max_queue: int = 64  # waiting requests beyond the running one; more get 429
    max_tokens_limit: int = 4096  # largest max_tokens a request may ask for
    default_max_tokens: int = 16
    max_body_bytes: int = 4 * 2**20
    """Largest request body; a larger one gets 413 with a JSON error, before it is read."""
    max_chars_per_token: float = 16.0
    """A string prompt longer than context × this many characters is refused (400) before
    tokenizing: no tokenizer's tokens are that long on average, and tokenizing megabytes just
    to count them would occupy the server for seconds."""
    insecure: bool = False
    """The cluster behind this server was started with ``--insecure`` and is reachable from
    the network without CURVE: reported by ``/health`` so that it is visible, not just logged."""

    api_key: str | None = field(default=None, repr=False)
    """When set, every path but ``/health`` and ``/`` needs ``Authorization: Bearer KEY``
    (compared in constant time); see :mod:`edge.http_guard`."""
    allowed_hosts: tuple[str, ...] = ()
    """Host names (besides loopback names, IP literals and ``host``) a request's Host or a
    cross-site Origin may carry: the names clients use to reach a server bound beyond loopback.
    Anything else is a 403 (DNS rebinding, cross-site POSTs)."""
    idle_timeout_s: float = 30.0
    """A connection idle this long, or this long into sending a request's headers, is closed."""
    body_timeout_s: float = 60.0
    """A request body not received within this long is refused (408)."""
    max_connections: int = 256
    """Open connections at a time; one more gets a 503 and is closed."""

    def __post_init__(self) -> None:
        if self.api_key is not None and not self.api_key.strip():
            raise ConfigError("api_key", "must not be empty (leave it unset for no key)")
        if min(self.idle_timeout_s, self.body_timeout_s) <= 0:
            raise ConfigError("idle_timeout_s", "timeouts must be > 0")
        if self.max_connections < 1:
            raise ConfigError("max_connections", f"must be >= 1, got {self.max_connections}")
        if not 0 <= self.port < 65536:
            raise ConfigError("port", f"must be in [0, 65535], got {self.port}")
        if self.max_queue < 0:
            raise ConfigError("max_queue", f"must be >= 0, got {self.max_queue}")
        if self.max_tokens_limit < 1 or self.default_max_tokens < 1:
            raise ConfigError("max_tokens_limit", "must be >= 1")
        if self.max_body_bytes < 1024:
            raise ConfigError("max_body_bytes", f"must be >= 1024, got {self.max_body_bytes}")
        if self.max_chars_per_token < 1:
            raise ConfigError(
                "max_chars_per_token", f"must be >= 1, got {self.max_chars_per_token}"
            )


class ApiError(LowbandError):
    """A request failed: the HTTP ``status`` and the OpenAI-style error body to answer with."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        kind: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.status, self.param, self.code, self.kind = status, param, code, kind

    def response(self) -> web.Response:
        body = {
            "error": {
                "message": str(self),
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        }
        return web.json_response(body, status=self.status)


_END = object()


def chat_prompt(messages: Any) -> str:
    """A plain role-tagged transcript ending with the assistant's turn: the prompt of a model
    that ships no chat template (a base model, or one trained here)."""
    try:
        plain = normalize_messages(messages)
    except ChatTemplateError as exc:
        raise ApiError(400, str(exc), param="messages") from None
    lines = [f"{m['role']}: {m.get('content', '')}\n" for m in plain]
    return "".join(lines) + "assistant:"


def render_chat(template: ChatTemplate, body: dict) -> str:
    """The prompt of a chat request in the model's own template, ending with the assistant's
    header; ``tools`` and ``chat_template_kwargs`` (as vLLM and llama.cpp accept them) reach
    the template. Raises :class:`ApiError` 400 for what the template or the checks refuse."""
    tools, kwargs = body.get("tools"), body.get("chat_template_kwargs") or {}
    if tools is not None and not (
        isinstance(tools, list) and all(isinstance(t, dict) for t in tools)
    ):
        raise ApiError(400, "tools must be a list of objects", param="tools")
    if not isinstance(kwargs, dict):
        raise ApiError(400, "chat_template_kwargs must be an object", param="chat_template_kwargs")
    try:
        messages = normalize_messages(body.get("messages"))
        return template.render(messages, add_generation_prompt=True, tools=tools, **kwargs)
    except ChatTemplateError as exc:
        raise ApiError(400, str(exc), param="messages", code="chat_template_error") from None


class Server:
    """Owns the aiohttp application and the generation thread."""

    def __init__(self, engine: Engine, cfg: ServerConfig) -> None:
        self.engine = engine
        self.cfg = cfg
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="edge-gen")
        self._pending = 0  # admitted requests not finished (running + waiting)
        # Parsing and tokenizing big bodies runs here, off the event loop (which must keep
        # answering /health) and off the generation thread.
        self._prep = ThreadPoolExecutor(max_workers=2, thread_name_prefix="edge-prep")
        self.app = web.Application(client_max_size=cfg.max_body_bytes)
        self.app.add_routes(
            [
                web.get("/", self.chat_page),
                web.get("/v1/models", self.models),
                web.get("/health", self.health),
                web.get("/metrics", self.metrics),
                web.post("/v1/completions", self.completions),
                web.post("/v1/chat/completions", self.chat),
            ]
        )
        self.app.middlewares.append(self._errors)
        self.app.middlewares.append(
            guard(api_key=cfg.api_key, bound=cfg.host, allowed_hosts=cfg.allowed_hosts)
        )
        self.app.on_shutdown.append(self._shutdown)

    # ---- plumbing ------------------------------------------------------------------------------
    @web.middleware
    async def _errors(self, request: web.Request, handler):
        try:
            return await handler(request)
        except ApiError as exc:
            return exc.response()
        except ChatTemplateError as exc:  # the messages' fault, wherever it surfaced
            return ApiError(400, str(exc), param="messages", code="chat_template_error").response()
        except web.HTTPException as exc:  # 404/405 from routing: still a JSON body
            return ApiError(exc.status, exc.reason, kind="invalid_request_error").response()

    async def _shutdown(self, app: web.Application) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._prep.shutdown(wait=False, cancel_futures=True)

    def _too_large(self) -> ApiError:
        return ApiError(
            413,
            f"the request body exceeds {self.cfg.max_body_bytes} bytes "
            "(ServerConfig.max_body_bytes)",
            code="request_too_large",
        )

    async def _off_loop(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self._prep, fn, *args)

    async def _body(self, request: web.Request) -> dict:
        if request.content_length is not None and request.content_length > self.cfg.max_body_bytes:
            raise self._too_large()  # refused before a byte of it is read
        try:
            raw = await asyncio.wait_for(request.read(), self.cfg.body_timeout_s)
        except web.HTTPRequestEntityTooLarge:
            raise self._too_large() from None
        except asyncio.TimeoutError:
            raise ApiError(408, "the request body did not arrive in time") from None
        try:
            body = await self._off_loop(parse_json, raw) if len(raw) > 65536 else parse_json(raw)
        except BadJson as exc:
            raise ApiError(400, str(exc)) from None
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")
        model = body.get("model", self.engine.model_name)
        if model != self.engine.model_name:
            raise ApiError(
                404,
                f"model {model!r} does not exist; this server has {self.engine.model_name!r}",
                param="model",
                code="model_not_found",
            )
        return body

    def _params(self, body: dict) -> SamplingParams:
        mt = body.get("max_tokens", body.get("max_completion_tokens", self.cfg.default_max_tokens))
        if (
            not isinstance(mt, int)
            or isinstance(mt, bool)
            or not 1 <= mt <= self.cfg.max_tokens_limit
        ):
            raise ApiError(
                400,
                f"max_tokens must be an integer in [1, {self.cfg.max_tokens_limit}]",
                param="max_tokens",
            )
        stop = body.get("stop") or ()
        stop = (stop,) if isinstance(stop, str) else stop
        if (
            not isinstance(stop, (list, tuple))
            or len(stop) > 8
            or not all(isinstance(x, str) for x in stop)
        ):
            raise ApiError(
                400, "stop must be a string or a list of at most 8 strings", param="stop"
            )
        try:
            top_k = int(body.get("top_k", 0))
            seed = None if body.get("seed") is None else int(body["seed"])
            if not 0 <= top_k < 2**31:
                raise ConfigError("top_k", f"must be in [0, 2^31), got {top_k}")
            if seed is not None and not 0 <= seed < 2**63:  # what torch's generator takes
                raise ConfigError("seed", f"must be in [0, 2^63), got {seed}")
            return SamplingParams(
                max_tokens=mt,
                temperature=float(body.get("temperature", 1.0)),
                top_p=float(body.get("top_p", 1.0)),
                top_k=top_k,
                seed=seed,
                stop=tuple(stop),
            )
        except ConfigError as exc:
            raise ApiError(400, str(exc), param=exc.field) from None
        except (TypeError, ValueError, OverflowError) as exc:
            raise ApiError(400, f"bad sampling parameter: {exc}") from None

    async def _prepare(
        self,
        prompt: Any,
        params: SamplingParams,
        encode: Callable[[str], list[int]] | None = None,
    ) -> list[int]:
        """Bound, tokenise (with ``encode``, a function of the text, when given) and admit."""
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        context = self.engine.max_context
        # Cheap bounds first: the length of a list, the characters of a string.
        if isinstance(prompt, (list, str)) and len(prompt) > context * (
            self.cfg.max_chars_per_token if isinstance(prompt, str) else 1
        ):
            raise ApiError(
                400,
                f"the prompt ({len(prompt)} "
                f"{'characters' if isinstance(prompt, str) else 'tokens'}) "
                f"cannot fit the context of {context} tokens",
                param="prompt",
                code="context_length_exceeded",
            )
        if not (
            isinstance(prompt, str)
            or (
                isinstance(prompt, list)
                and all(isinstance(i, int) and not isinstance(i, bool) for i in prompt)
            )
        ):
            raise ApiError(400, "prompt must be a string or a list of token ids", param="prompt")
        if encode is not None and isinstance(prompt, str):
            prompt = await self._off_loop(encode, prompt)
        try:
            return await self._off_loop(self.engine.prepare, prompt, params)
        except ConfigError as exc:
            code = "context_length_exceeded" if exc.field == "max_tokens" else None
            raise ApiError(400, str(exc), param=exc.field, code=code) from None

    async def _events(self, ids: list[int], params: SamplingParams) -> AsyncIterator[Event]:
        """Run the generation on the engine thread, yielding its events here."""
        if self._pending > self.cfg.max_queue:
            raise ApiError(
                429,
                f"{self._pending} requests are queued; retry later",
                kind="rate_limit_error",
                code="queue_full",
            )
        health = self.engine.runner.health()
        if not health.get("healthy"):
            raise ApiError(
                503,
                f"the cluster is not ready: {health.get('status')}",
                kind="server_error",
                code="cluster_unavailable",
            )
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        cancel = threading.Event()

        def put(item: Any) -> None:
            loop.call_soon_threadsafe(q.put_nowait, item)

        def work() -> None:
            gen = self.engine.generate(ids, params)
            try:
                for ev in gen:
                    if cancel.is_set():
                        break
                    put(ev)
                put(_END)
            except Exception as exc:  # noqa: BLE001 - handed to the request's coroutine
                put(exc)
            finally:
                gen.close()  # releases the engine lock even when cancelled mid-way

        self._pending += 1
        fut = loop.run_in_executor(self._executor, work)
        try:
            while True:
                item = await q.get()
                if item is _END:
                    return
                if isinstance(item, ClusterUnavailable):
                    raise ApiError(503, str(item), kind="server_error", code="cluster_unavailable")
                if isinstance(item, LowbandError):  # EngineError, ConfigError, CorruptWeights...
                    raise ApiError(500, str(item), kind="server_error")
                if isinstance(item, BaseException):
                    logger.exception("generation crashed", exc_info=item)
                    raise ApiError(500, f"internal error: {item}", kind="server_error")
                yield item
        finally:
            cancel.set()
            self._pending -= 1
            del fut

    # ---- endpoints -----------------------------------------------------------------------------
    async def chat_page(self, request: web.Request) -> web.Response:
        """The self-contained web chat (edge/static/chat.html, package data)."""
        page = resources.files("edge").joinpath("static/chat.html").read_text(encoding="utf-8")
        return web.Response(text=page, content_type="text/html")

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "object": "list",
                "data": [
                    {
                        "id": self.engine.model_name,
                        "object": "model",
                        "created": 0,
                        "owned_by": "lowband",
                        "context_length": self.engine.max_context,
                        "chat_template": "none" if self._template() is None else "model",
                    }
                ],
            }
        )

    async def health(self, request: web.Request) -> web.Response:
        h = self.engine.runner.health()
        body = {
            "status": "ok" if h.get("healthy") else "unavailable",
            **h,
            "queue": self._pending,
            "insecure": self.cfg.insecure,
        }
        return web.json_response(body, status=200 if h.get("healthy") else 503)

    async def metrics(self, request: web.Request) -> web.Response:
        body = {
            **self.engine.metrics.snapshot(),
            "queue": self._pending,
            "model": self.engine.model_name,
        }
        report = getattr(self.engine.runner, "store_report", None)
        if report is not None:
            # A cluster asks its workers: off the event loop (and off the generation thread,
            # so the figures arrive between two tokens, not after the running request).
            store = await asyncio.get_running_loop().run_in_executor(None, report)
            if store is not None:
                body["expert_store"] = store
        return web.json_response(body)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        params = self._params(body)
        ids = await self._prepare(body.get("prompt"), params)
        return await self._respond(request, body, ids, params, chat=False)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        params = self._params(body)
        template = self._template()
        if template is None:
            ids = await self._prepare(chat_prompt(body.get("messages")), params)
            return await self._respond(request, body, ids, params, chat=True)
        # A big conversation takes a while to render and tokenise: both off the event loop.
        text = await self._off_loop(render_chat, template, body)
        params = replace(
            params,
            stop=params.stop + tuple(s for s in template.stop_strings if s not in params.stop),
            stop_token_ids=params.stop_token_ids + template.stop_token_ids,
        )
        encode = partial(template.encode, self.engine.tokenizer.encode)
        ids = await self._prepare(text, params, encode)
        return await self._respond(request, body, ids, params, chat=True)

    def _template(self) -> ChatTemplate | None:
        return getattr(self.engine.tokenizer, "chat_template", None)

    async def _respond(
        self,
        request: web.Request,
        body: dict,
        ids: list[int],
        params: SamplingParams,
        *,
        chat: bool,
    ) -> web.StreamResponse:
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        obj = "chat.completion" if chat else "text_completion"
        events = self._events(ids, params)
        if not body.get("stream"):
            parts, reason, n = [], "length", 0
            async for ev in events:
                parts.append(ev.text)
                n += ev.token is not None
                reason = ev.finish_reason or reason
            text = "".join(parts)
            choice = (
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "finish_reason": reason,
                }
                if chat
                else {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
            )
            return web.json_response(
                {
                    "id": rid,
                    "object": obj,
                    "created": created,
                    "model": self.engine.model_name,
                    "choices": [choice],
                    "usage": {
                        "prompt_tokens": len(ids),
                        "completion_tokens": n,
                        "total_tokens": len(ids) + n,
                    },
                }
            )
        # Streaming: pull the first event before committing to a 200, so queue-full and
        # cluster-down errors still arrive as proper HTTP statuses.
        it = events.__aiter__()
        try:
            first = await it.__anext__()
        except StopAsyncIteration:
            first = Event("", None, "stop")
        resp = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await resp.prepare(request)
        obj_chunk = "chat.completion.chunk" if chat else "text_completion"

        def chunk(ev: Event, first_chunk: bool) -> bytes:
            if chat:
                delta = {"content": ev.text}
                if first_chunk:
                    delta["role"] = "assistant"
                choice = {"index": 0, "delta": delta, "finish_reason": ev.finish_reason}
            else:
                choice = {
                    "index": 0,
                    "text": ev.text,
                    "logprobs": None,
                    "finish_reason": ev.finish_reason,
                }
            data = {
                "id": rid,
                "object": obj_chunk,
                "created": created,
                "model": self.engine.model_name,
                "choices": [choice],
            }
            return b"data: " + json.dumps(data).encode() + b"\n\n"

        try:
            await resp.write(chunk(first, True))
            async for ev in it:
                await resp.write(chunk(ev, False))
        except ApiError as exc:  # failed mid-stream: the status is sent; report in-band
            err = {"error": {"message": str(exc), "type": exc.kind, "code": exc.code}}
            await resp.write(b"data: " + json.dumps(err).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


async def start(engine: Engine, cfg: ServerConfig) -> tuple[web.AppRunner, int]:
    """Start serving in the running loop; returns the runner (for cleanup) and the port."""
    server = Server(engine, cfg)
    # aiohttp's keep-alive timer also runs while a request's headers are half-sent
    runner = web.AppRunner(server.app, keepalive_timeout=cfg.idle_timeout_s)
    await runner.setup()
    site = CappedSite(runner, cfg.host, cfg.port, max_connections=cfg.max_connections)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, port


def serve_forever(engine: Engine, cfg: ServerConfig) -> None:
    """Blocking entry point for the CLI."""

    async def main() -> None:
        runner, port = await start(engine, cfg)
        print(
            f"lowband edge: serving {engine.model_name!r} on http://{cfg.host}:{port}", flush=True
        )
        try:
            await asyncio.Event().wait()
        finally:
            await runner.cleanup()

    asyncio.run(main())
