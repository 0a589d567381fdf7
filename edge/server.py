"""OpenAI-compatible HTTP API (aiohttp) in front of an :class:`edge.engine.Engine`.

``POST /v1/completions``, ``POST /v1/chat/completions`` (both with ``"stream": true`` SSE),
``POST /v1/embeddings`` (:mod:`edge.embeddings`), ``GET /v1/models``, ``GET /health`` (503
while the cluster is degraded), ``GET /metrics`` (JSON; the Prometheus text format when the
client asks for it: ``Accept: text/plain`` or OpenMetrics without ``application/json``, or
``?format=prometheus``), and vLLM's ``POST /tokenize``,
``POST /detokenize``, ``GET /tokenizer_info`` (what lm-evaluation-harness's ``local-completions``
tokenises with when it finds them). ``/chat/completions`` and ``/models`` also answer without
``/v1``, as llama-server's do (its ``/completions`` and ``/embeddings`` are its own API).

Request fields beyond the basics, shaped as OpenAI's: ``n`` choices (with a ``seed``, choice
``i`` draws with ``seed + i``), ``logprobs`` (completions: the k most likely alternatives per
token, ``{tokens, token_logprobs, top_logprobs, text_offset}``; chat: ``logprobs: true`` with
``top_logprobs: k``, ``{content: [{token, logprob, bytes, top_logprobs}]}``), ``echo`` on
completions (the prompt prepended, with its tokens' logprobs, the first one null: what
evaluation harnesses score with; ``max_tokens: 0`` only then), ``stop`` strings (matched
across token boundaries by the engine), ``ignore_eos`` (as vLLM and llama.cpp take it),
``stream_options.include_usage`` (a last chunk with ``choices: []`` and the usage). A
completions ``prompt`` may be a batch (a list of strings or of token-id lists): choice
``p * n + i`` is the ``i``-th of prompt ``p``.

A chat is rendered with the model's own chat template when its tokenizer carries one
(:mod:`lowband.models.chat_template`), and generation stops on the template's end-of-turn
tokens; a model without one gets a plain ``role: content`` transcript. ``/v1/models`` says which
(``chat_template``: ``"model"`` or ``"none"``).

Concurrency: every choice is one request to the engine's scheduler thread (``Engine.submit``),
which decodes up to ``engine.parallel`` of them together; their events come back to the event
loop, which never blocks on the model. Beyond the running ones, ``max_queue`` requests may wait;
more get 429. A client that disconnects, streaming or not, cancels its requests: they leave the
batch at the next step.

Every error is a JSON body ``{"error": {"message", "type", "param", "code"}}`` as OpenAI's.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import math
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from functools import partial
from importlib import resources
from typing import Any, AsyncIterator, Callable, Sequence

from aiohttp import web

from edge import embeddings as emb
from edge.api_fields import (
    CHAT,
    COMPLETIONS,
    EMBEDDINGS,
    FIELDS,
    Kind,
    UnknownFields,
    check_fields,
)
from edge.engine import ClusterUnavailable, Engine, EngineError, Event, Request
from edge.http_guard import BadJson, CappedSite, guard, parse_json
from edge.sampling import BAN, MAX_LOGIT_BIAS, MAX_LOGPROBS, SamplingParams
from edge.tool_calls import (
    GENERIC,
    REASONING_FORMATS,
    THINK_OPEN,
    ReasoningStream,
    call_schema,
    check_tools,
    parse_tool_calls,
    split_reasoning,
    template_takes_tools,
    tool_format,
    with_tools_in_system,
)
from lowband.errors import ChatTemplateError, ConfigError, LowbandError
from lowband.models.chat_template import TOOL_USE_NAME, ChatTemplate, normalize_messages
from lowband.models.tokenizer import ByteTokenizer

logger = logging.getLogger(__name__)

MAX_N = 16  # choices per prompt (``n``)
MAX_STOP = 16  # stop strings per request
PROMETHEUS_TYPE = "text/plain; version=0.0.4; charset=utf-8"
PIECE_CONTEXT = 4  # tokens before one whose text is wanted: a leading space or a whole
# character often shows only in context (SentencePiece's "▁", multi-byte characters)


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
    embeddings: emb.EmbeddingConfig = field(default_factory=emb.EmbeddingConfig)
    """``/v1/embeddings``: the pooling (``--pooling``) and the bounds on a request."""

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


# ---- request fields -----------------------------------------------------------------------------
def _opt_int(body: dict, name: str, default: int | None, lo: int, hi: int) -> int | None:
    """``body[name]``: an integer in [lo, hi], or ``default`` when absent or null."""
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise ApiError(400, f"{name} must be an integer in [{lo}, {hi}], got {v!r}", param=name)
    return v


def _opt_float(body: dict, name: str, default: float) -> float:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        raise ApiError(400, f"{name} must be a number, got {v!r}", param=name)
    return float(v)


def _opt_bool(body: dict, name: str, default: bool = False) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise ApiError(400, f"{name} must be true or false, got {v!r}", param=name)
    return v


@dataclass(frozen=True)
class Options:
    """What one request asks for beyond its prompt."""

    params: SamplingParams  # the first choice's (others differ in their seed)
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    echo: bool = False
    logprobs: int | None = None  # alternatives per token to report; None: no logprobs
    grammar: tuple[str, str, Any] | None = None  # (field, kind, source) to constrain with
    tools: tuple[dict, ...] = ()  # chat: function tools offered to the model
    tool_choice: Any = "none"  # chat: "none", "auto", "required" or {"function": {"name"}}
    tool_format: str = GENERIC  # chat: how the model writes a call (edge.tool_calls)
    reasoning_format: str = "auto"  # chat: llama-server's choices for <think> blocks
    reasoning_opened: bool = False  # chat: the rendered prompt ends inside a <think> block

    @property
    def calls_tools(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"

    def choice_params(self, index: int) -> SamplingParams:
        """Choice ``index``'s sampling: with a seed, ``seed + index`` (so choices differ)."""
        seed = self.params.seed
        if seed is None or index == 0:
            return self.params
        return replace(self.params, seed=(seed + index) % 2**63)


def refuse_fields(body: dict, endpoint: str) -> None:
    """A JSON 400 naming the first field :mod:`edge.api_fields` refuses on ``endpoint``."""
    refused, _ = check_fields(body, endpoint)
    if refused is not None:
        f = FIELDS[refused]
        where = "this endpoint" if f.kind is not Kind.REFUSED else "this server"
        raise ApiError(
            400,
            f"{refused} is not supported by {where}"
            + (f" (accepted only as {f.neutral[0]!r})" if f.neutral else ""),
            param=refused,
            code="unsupported_parameter",
        )


def parse_options(
    body: dict, *, chat: bool, cfg: ServerConfig, vocab: int | None = None
) -> Options:
    """The request's fields, checked: :class:`ApiError` 400 naming the bad ``param``; a field
    :mod:`edge.api_fields` refuses is a 400 naming it. ``vocab``: the vocabulary size (token ids
    beyond it are refused)."""
    refuse_fields(body, CHAT if chat else COMPLETIONS)
    stream = _opt_bool(body, "stream")
    include_usage = False
    so = body.get("stream_options")
    if so is not None:
        if not isinstance(so, dict):
            raise ApiError(400, "stream_options must be an object", param="stream_options")
        if not stream:
            raise ApiError(
                400, "stream_options is only allowed with stream: true", param="stream_options"
            )
        if not isinstance(so.get("include_usage", False), bool):
            raise ApiError(
                400,
                "stream_options.include_usage must be true or false",
                param="stream_options.include_usage",
            )
        include_usage = bool(so.get("include_usage", False))
    n = _opt_int(body, "n", 1, 1, MAX_N)
    assert n is not None
    if chat:
        echo = False
        want = _opt_bool(body, "logprobs")
        k = _opt_int(body, "top_logprobs", None, 0, MAX_LOGPROBS)
        if k is not None and not want:
            raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        logprobs = (k or 0) if want else None
    else:
        echo = _opt_bool(body, "echo")
        logprobs = _opt_int(body, "logprobs", None, 0, MAX_LOGPROBS)
    # chat's max_completion_tokens supersedes max_tokens; either given is checked
    lo = 0 if echo else 1
    max_tokens = _opt_int(body, "max_tokens", cfg.default_max_tokens, lo, cfg.max_tokens_limit)
    max_tokens = _opt_int(body, "max_completion_tokens", max_tokens, lo, cfg.max_tokens_limit)
    assert max_tokens is not None
    stop = body.get("stop")
    stop = () if stop is None else (stop,) if isinstance(stop, str) else stop
    if (
        not isinstance(stop, list | tuple)
        or len(stop) > MAX_STOP
        or not all(isinstance(x, str) and x for x in stop)
    ):
        raise ApiError(
            400,
            f"stop must be a string or a list of at most {MAX_STOP} non-empty strings",
            param="stop",
        )
    try:
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=_opt_float(body, "temperature", 1.0),
            top_p=_opt_float(body, "top_p", 1.0),
            top_k=_opt_int(body, "top_k", 0, 0, 2**31 - 1) or 0,
            seed=_opt_int(body, "seed", None, 0, 2**63 - 1),  # what torch's generator takes
            stop=tuple(stop),
            logprobs=logprobs,
            # echo with max_tokens 0 runs the prompt only: the prompt-logprob path does that
            prompt_logprobs=echo and (logprobs is not None or max_tokens == 0),
            ignore_eos=_opt_bool(body, "ignore_eos"),
            presence_penalty=_opt_float(body, "presence_penalty", 0.0),
            frequency_penalty=_opt_float(body, "frequency_penalty", 0.0),
            repeat_penalty=_opt_float(body, "repeat_penalty", 1.0),
            repeat_last_n=_opt_int(body, "repeat_last_n", 64, -1, 2**31 - 1) or 0,
            min_p=_opt_float(body, "min_p", 0.0),
            typical_p=_opt_float(body, "typical_p", 1.0),
            logit_bias=_logit_bias(body, vocab),
        )
    except ConfigError as exc:
        raise ApiError(400, str(exc), param=exc.field) from None
    tools: list[dict] = []
    tool_choice: Any = "none"
    reasoning_format = "auto"
    if chat:
        try:
            tools, tool_choice = check_tools(body.get("tools"), body.get("tool_choice"))
        except ConfigError as exc:
            raise ApiError(400, str(exc), param=exc.field) from None
        reasoning_format = body.get("reasoning_format") or "auto"
        if reasoning_format not in REASONING_FORMATS:
            raise ApiError(
                400,
                f"reasoning_format must be one of {', '.join(REASONING_FORMATS)}",
                param="reasoning_format",
            )
    grammar = grammar_of(body)
    if tool_choice == "required" or isinstance(tool_choice, dict):
        if grammar is not None:
            raise ApiError(
                400, f"tool_choice {tool_choice!r} cannot go with {grammar[0]}", param=grammar[0]
            )
        grammar = ("tool_choice", "tool_call", None)  # its schema needs the template's format
    return Options(
        params,
        n,
        stream,
        include_usage,
        echo,
        logprobs,
        grammar,
        tuple(tools),
        tool_choice,
        GENERIC,
        reasoning_format,
    )


def grammar_of(body: dict) -> tuple[str, str, Any] | None:
    """The grammar a request asks for, as (field, kind, source) for
    :meth:`edge.structured.Grammars.compile`: OpenAI's ``response_format`` (``json_object``,
    with llama-server's optional ``schema``; ``json_schema`` with ``json_schema.schema``), or
    llama-server's ``json_schema`` (a schema) or ``grammar`` (GBNF text). At most one."""
    asked: list[tuple[str, str, Any]] = []
    rf = body.get("response_format")
    if rf is not None:
        kind = rf.get("type") if isinstance(rf, dict) else None
        if kind == "json_object":
            schema = rf.get("schema")
            asked.append(
                ("response_format", "json_object" if schema is None else "json_schema", schema)
            )
        elif kind == "json_schema" and isinstance(rf.get("json_schema"), dict):
            schema = rf["json_schema"].get("schema", {"type": "object"})
            asked.append(("response_format", "json_schema", schema))
        elif kind != "text":
            raise ApiError(
                400,
                'response_format must be {"type": "text"}, {"type": "json_object"} or '
                '{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}',
                param="response_format",
            )
    if body.get("json_schema") is not None:
        asked.append(("json_schema", "json_schema", body["json_schema"]))
    if body.get("grammar") not in (None, ""):
        asked.append(("grammar", "gbnf", body["grammar"]))
    if len(asked) > 1:
        raise ApiError(
            400,
            "send one of response_format, json_schema and grammar",
            param=asked[1][0],
        )
    return asked[0] if asked else None


def _logit_bias(body: dict, vocab: int | None) -> tuple[tuple[int, float], ...]:
    """OpenAI's ``{"token id": bias}`` or llama-server's ``[[id, bias], ...]`` (a bias of
    ``false`` bans the token), each bias in [-100, 100]."""
    v = body.get("logit_bias")
    if v is None:
        return ()
    pairs = list(v.items()) if isinstance(v, dict) else v
    bad = ApiError(
        400,
        'logit_bias must be {"token id": bias} or [[token id, bias], ...] with biases in '
        "[-100, 100] (false bans)" + (f" and ids in [0, {vocab})" if vocab else ""),
        param="logit_bias",
    )
    if not isinstance(pairs, list) or len(pairs) > MAX_LOGIT_BIAS:
        raise bad
    out: list[tuple[int, float]] = []
    for pair in pairs:
        if not isinstance(pair, list | tuple) or len(pair) != 2:
            raise bad
        tok, bias = pair
        if isinstance(tok, str) and tok.strip().lstrip("-").isdigit():
            tok = int(tok)
        if bias is False:
            bias = BAN
        if (
            not isinstance(tok, int)
            or isinstance(tok, bool)
            or tok < 0
            or (vocab is not None and tok >= vocab)
            or not isinstance(bias, int | float)
            or isinstance(bias, bool)
            or not -100.0 <= bias <= 100.0
        ):
            raise bad
        out.append((tok, float(bias)))
    return tuple(out)


def completion_prompts(prompt: Any) -> list[str | list[int]]:
    """A completions ``prompt``: one string or token-id list, or a batch of either."""
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if all(isinstance(i, int) and not isinstance(i, bool) for i in prompt):
            return [prompt]
        if all(isinstance(p, str) for p in prompt):
            return list(prompt)
        if all(
            isinstance(p, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in p)
            for p in prompt
        ):
            return list(prompt)
    raise ApiError(
        400,
        "prompt must be a string, a list of token ids, or a non-empty list of either",
        param="prompt",
    )


# ---- token texts for logprobs -------------------------------------------------------------------
class Pieces:
    """The text and bytes of single tokens in their context, for logprobs.

    A token's text is what decoding it adds after the ``PIECE_CONTEXT`` tokens before it (so
    a SentencePiece word keeps its leading space); a token that is part of a multi-byte
    character decodes to U+FFFD. Its ``bytes`` are exact for a byte tokenizer (a
    tokenizer's ``token_bytes(id)`` when it has one), else the UTF-8 of its text."""

    def __init__(self, tokenizer: Any) -> None:
        self.tok = tokenizer
        self._bytes = getattr(tokenizer, "token_bytes", None)
        self._is_bytes = isinstance(tokenizer, ByteTokenizer)

    def text(self, before: Sequence[int], tok: int) -> str:
        ctx = list(before[-PIECE_CONTEXT:])
        if ctx:
            head = self.tok.decode(ctx)
            full = self.tok.decode(ctx + [tok])
            if full.startswith(head) and not head.endswith("\ufffd"):
                return full[len(head) :]
        return self.tok.decode([tok])

    def bytes(self, tok: int, text: str) -> list[int]:
        if self._bytes is not None:
            return list(self._bytes(tok))
        if self._is_bytes:
            return [tok & 0xFF]
        return list(text.encode("utf-8"))


def eos_token_of(ev: Event, tokenizer: Any, params: SamplingParams) -> int | None:
    """The token that ended a completion with ``finish_reason`` "stop" and no ``Event.token``
    (EOS or an end-of-turn id), whose logprob the event carries: the one of those ids among
    its top logprobs with the same log-probability, else the tokenizer's EOS."""
    ends = [t for t in (getattr(tokenizer, "eos_token_id", None),) if t is not None]
    ends += list(params.stop_token_ids)
    for t, lp in ev.top_logprobs:
        if t in ends and lp == ev.logprob:
            return t
    return ends[0] if ends else None


def _completion_logprobs(
    entries: Sequence[tuple[int, float | None, Sequence[tuple[int, float]]]],
    before: list[int],
    pieces: Pieces,
    offset: int,
) -> tuple[dict, int]:
    """OpenAI's legacy ``logprobs`` object for ``entries`` (token, logprob, top), each decoded
    after ``before`` (extended in place); returns it and the text offset after the last."""
    out: dict[str, list] = {
        "tokens": [],
        "token_logprobs": [],
        "top_logprobs": [],
        "text_offset": [],
    }
    for tok, lp, top in entries:
        piece = pieces.text(before, tok)
        alts: dict[str, float] | None = None
        if lp is not None:
            alts = {}
            for t, v in top:
                alts.setdefault(pieces.text(before, t), v)
        out["tokens"].append(piece)
        out["token_logprobs"].append(lp)
        out["top_logprobs"].append(alts)
        out["text_offset"].append(offset)
        offset += len(piece)
        before.append(tok)
    return out, offset


def _chat_logprobs(
    entries: Sequence[tuple[int, float | None, Sequence[tuple[int, float]]]],
    before: list[int],
    pieces: Pieces,
) -> list[dict]:
    """Chat ``logprobs.content`` items for ``entries``."""
    content = []
    for tok, lp, top in entries:
        piece = pieces.text(before, tok)
        alts = []
        for t, v in top:
            s = pieces.text(before, t)
            alts.append({"token": s, "logprob": v, "bytes": pieces.bytes(t, s)})
        content.append(
            {"token": piece, "logprob": lp, "bytes": pieces.bytes(tok, piece), "top_logprobs": alts}
        )
        before.append(tok)
    return content


# ---- Prometheus ---------------------------------------------------------------------------------
# (snapshot key, metric name, type, help, scale); keys not listed are exported generically
_PROM: tuple[tuple[str, str, str, str, float], ...] = (
    ("requests_total", "requests_total", "counter", "Requests admitted by the engine", 1),
    ("requests_failed", "requests_failed_total", "counter", "Requests that failed", 1),
    ("requests_cancelled", "requests_cancelled_total", "counter", "Requests cancelled", 1),
    ("requests_running", "requests_running", "gauge", "Sequences in the running batch", 1),
    ("requests_waiting", "requests_waiting", "gauge", "Requests waiting for a slot", 1),
    ("prompt_tokens_total", "prompt_tokens_total", "counter", "Prompt tokens admitted", 1),
    ("completion_tokens_total", "completion_tokens_total", "counter", "Tokens generated", 1),
    (
        "prompt_tokens_computed_total",
        "prompt_tokens_computed_total",
        "counter",
        "Prompt tokens run through the model (the rest came from the prefix cache)",
        1,
    ),
    (
        "prefix_cache_lookups_total",
        "prefix_cache_lookups_total",
        "counter",
        "Prefix cache lookups",
        1,
    ),
    ("prefix_cache_hits_total", "prefix_cache_hits_total", "counter", "Prefix cache hits", 1),
    (
        "prefix_cache_tokens_reused_total",
        "prefix_cache_tokens_reused_total",
        "counter",
        "Prompt tokens whose keys and values were reused from the prefix cache",
        1,
    ),
    ("steps_total", "steps_total", "counter", "Batched model steps", 1),
    ("batch_sequences_mean", "batch_sequences_mean", "gauge", "Mean sequences per step", 1),
    ("batch_tokens_mean", "batch_tokens_mean", "gauge", "Mean tokens per step", 1),
    (
        "ttft_ms_mean",
        "time_to_first_token_seconds_mean",
        "gauge",
        "Mean time to first token (recent requests)",
        1e-3,
    ),
    (
        "ttft_ms_p90",
        "time_to_first_token_seconds_p90",
        "gauge",
        "90th percentile time to first token (recent requests)",
        1e-3,
    ),
    (
        "token_latency_ms_mean",
        "inter_token_latency_seconds_mean",
        "gauge",
        "Mean time between two tokens of a stream (recent tokens)",
        1e-3,
    ),
    (
        "token_latency_ms_p90",
        "inter_token_latency_seconds_p90",
        "gauge",
        "90th percentile time between two tokens of a stream (recent tokens)",
        1e-3,
    ),
    (
        "decode_tokens_per_s",
        "decode_tokens_per_second",
        "gauge",
        "Tokens per second of one stream (from the mean inter-token latency)",
        1,
    ),
    (
        "wire_bytes_per_token",
        "wire_bytes_per_token",
        "gauge",
        "Network bytes per decoded token on this device (a cluster)",
        1,
    ),
    ("busy_s", "busy_seconds_total", "counter", "Seconds the model spent in steps", 1),
)
_PROM_KEYS = {k for k, *_ in _PROM}


def _prom_value(v: float | None) -> str:
    if v is None:
        return "NaN"
    v = float(v)
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(v) if not v.is_integer() else str(int(v))


def _prom_name(key: str) -> str:
    return "".join(c if c.isalnum() or c == "_" else "_" for c in key).lower()


def _prom_label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def prometheus_text(snapshot: dict, extra: dict[str, tuple[str, str, float]], model: str) -> str:
    """``snapshot`` (``Metrics.snapshot()``) and ``extra`` (name: (type, help, value)) in the
    Prometheus text exposition format 0.0.4, every name prefixed ``lowband_``."""
    lines: list[str] = []

    def metric(name: str, kind: str, help_: str, value: float | None, labels: str = "") -> None:
        full = "lowband_" + name
        lines.append(f"# HELP {full} {help_}")
        lines.append(f"# TYPE {full} {kind}")
        lines.append(f"{full}{labels} {_prom_value(value)}")

    metric("model_info", "gauge", "The model served", 1, f'{{model="{_prom_label(model)}"}}')
    for key, name, kind, help_, scale in _PROM:
        if key in snapshot:
            v = snapshot[key]
            metric(name, kind, help_, None if v is None else v * scale)
    for key, v in snapshot.items():  # figures the table does not know yet
        if key in _PROM_KEYS or isinstance(v, bool) or not isinstance(v, int | float | None):
            continue
        name = _prom_name(key)
        metric(name, "counter" if name.endswith("_total") else "gauge", key, v)
    for name, (kind, help_, v) in extra.items():
        metric(_prom_name(name), kind, help_, v)
    return "\n".join(lines) + "\n"


def wants_prometheus(request: web.Request) -> bool:
    """``?format=prometheus`` (``json`` forces JSON), else an Accept header asking for text or
    OpenMetrics and not for JSON (a Prometheus scraper's)."""
    fmt = request.query.get("format")
    if fmt is not None:
        return fmt.lower() in ("prometheus", "text", "openmetrics")
    accept = request.headers.get("Accept", "").lower()
    if "application/json" in accept:
        return False
    return "text/plain" in accept or "openmetrics" in accept


def _prompt_end(body: dict) -> tuple[bool, bool]:
    """``(continue_final_message, add_generation_prompt)`` of a chat request: how its prompt
    ends (the last assistant message left open, or the assistant's header); both true is a 400."""
    go_on = _opt_bool(body, "continue_final_message")
    header = _opt_bool(body, "add_generation_prompt", default=not go_on)
    if go_on and header:
        raise ApiError(
            400,
            "continue_final_message and add_generation_prompt cannot both be true",
            param="continue_final_message",
        )
    return go_on, header


def chat_prompt(messages: Any, body: dict | None = None) -> str:
    """A plain role-tagged transcript ending with the assistant's turn: the prompt of a model
    that ships no chat template (a base model, or one trained here). ``body``'s
    ``continue_final_message`` leaves the last (assistant) line open instead, and
    ``add_generation_prompt: false`` leaves the assistant's tag out."""
    body = body or {}
    go_on, header = _prompt_end(body)
    try:
        plain = normalize_messages(messages)
    except ChatTemplateError as exc:
        raise ApiError(400, str(exc), param="messages") from None
    lines = [f"{m['role']}: {m.get('content', '')}\n" for m in plain]
    if go_on:
        if plain[-1]["role"] != "assistant":
            raise ApiError(
                400,
                "continue_final_message needs a last assistant message",
                param="continue_final_message",
            )
        return "".join(lines)[:-1]
    return "".join(lines) + ("assistant:" if header else "")


def render_chat(template: ChatTemplate, body: dict) -> str:
    """The prompt of a chat request in the model's own template, ending with the assistant's
    header (``add_generation_prompt``, default true) or, with ``continue_final_message``, with
    the last (assistant) message left open for the model to continue, as vLLM and transformers
    take them; ``tools`` and ``chat_template_kwargs`` (as vLLM and llama.cpp accept them) reach
    the template. Raises :class:`ApiError` 400 for what the template or the checks refuse."""
    tools, kwargs = body.get("tools"), body.get("chat_template_kwargs") or {}
    if tools is not None and not (
        isinstance(tools, list) and all(isinstance(t, dict) for t in tools)
    ):
        raise ApiError(400, "tools must be a list of objects", param="tools")
    if not isinstance(kwargs, dict):
        raise ApiError(400, "chat_template_kwargs must be an object", param="chat_template_kwargs")
    go_on, header = _prompt_end(body)
    try:
        messages = normalize_messages(body.get("messages"))
        source = template.named.get(TOOL_USE_NAME, template.source)
        if tools and not template_takes_tools(source):  # else the model never sees them
            given = messages
            messages = with_tools_in_system(given, tools)
            try:
                text = template.render(
                    messages, add_generation_prompt=header, tools=tools, **kwargs
                )
            except ChatTemplateError:  # one that refuses a system message (Gemma 2's)
                if given and given[0].get("role") == "system":
                    raise
                messages = with_tools_in_system(given, tools, role="user")
                text = template.render(
                    messages, add_generation_prompt=header, tools=tools, **kwargs
                )
        else:
            text = template.render(messages, add_generation_prompt=header, tools=tools, **kwargs)
    except ChatTemplateError as exc:
        raise ApiError(400, str(exc), param="messages", code="chat_template_error") from None
    if go_on:  # the last message left open, as transformers' continue_final_message cuts it
        last = messages[-1].get("content")
        final = last.strip() if isinstance(last, str) else ""
        at = text.rfind(final) if final else -1
        if messages[-1].get("role") != "assistant" or at < 0:
            raise ApiError(
                400,
                "continue_final_message needs a last assistant message with text",
                param="continue_final_message",
            )
        text = text[: at + len(final)]
    return text


def _engine_error(item: BaseException) -> ApiError:
    if isinstance(item, ClusterUnavailable):
        return ApiError(503, str(item), kind="server_error", code="cluster_unavailable")
    if isinstance(item, LowbandError):  # EngineError, ConfigError, CorruptWeights...
        return ApiError(500, str(item), kind="server_error")
    logger.error("generation crashed", exc_info=item)
    return ApiError(500, f"internal error: {item}", kind="server_error")


class _Run:
    """The engine requests behind one HTTP request (one per choice). Their sinks run on the
    engine's thread and hand each item to the event loop; ``server.in_flight`` counts every
    request until its end mark arrives there."""

    def __init__(self, server: Server) -> None:
        self.server = server
        self.loop = asyncio.get_running_loop()
        self.q: asyncio.Queue[tuple[int, Event | BaseException | None]] = asyncio.Queue()
        self.reqs: dict[int, Request] = {}
        self.open: set[int] = set()  # choices whose end mark has not arrived

    def submit(self, index: int, ids: list[int], params: SamplingParams) -> None:
        try:
            req = self.server.engine.submit(ids, params, self._sink(index))
        except EngineError as exc:  # closed: shutting down
            raise ApiError(503, str(exc), kind="server_error", code="shutting_down") from None
        self.reqs[index] = req
        self.open.add(index)
        self.server.in_flight += 1

    def _sink(self, index: int) -> Callable[[Event | BaseException | None], None]:
        def sink(item: Event | BaseException | None) -> None:  # on the engine's thread
            try:
                self.loop.call_soon_threadsafe(self._deliver, index, item)
            except RuntimeError:  # the loop is closed: nobody waits for this any more
                pass

        return sink

    def _deliver(self, index: int, item: Event | BaseException | None) -> None:
        if (item is None or isinstance(item, BaseException)) and index in self.open:
            self.open.discard(index)
            self.server.in_flight -= 1
        self.q.put_nowait((index, item))

    async def events(self) -> AsyncIterator[tuple[int, Event]]:
        """(choice, event) until every choice ended; the first failure raises ApiError."""
        left = len(self.reqs)
        while left:
            index, item = await self.q.get()
            if item is None:
                left -= 1
            elif isinstance(item, BaseException):
                raise _engine_error(item)
            else:
                yield index, item

    def cancel(self) -> None:
        """Cancel every choice still running or waiting (the client left, or one failed)."""
        for i in self.open:
            self.reqs[i].cancel()


@dataclass
class _Choice:
    """What one choice has produced so far."""

    before: list[int]  # tokens decoded before the next one (for token texts)
    text: list[str] = field(default_factory=list)
    entries: list[tuple[int, float | None, Sequence[tuple[int, float]]]] = field(
        default_factory=list
    )
    tokens: int = 0
    finish: str = "length"
    prompt_lp: list | None = None
    started: bool = False
    offset: int = 0  # characters streamed so far (completions' text_offset)
    reasoning: ReasoningStream | None = None  # chat, streamed: splits out <think> blocks


class Server:
    """Owns the aiohttp application; generation runs on the engine's scheduler thread."""

    def __init__(self, engine: Engine, cfg: ServerConfig) -> None:
        self.engine = engine
        self.cfg = cfg
        self.in_flight = 0  # engine requests of this server not ended (running + waiting)
        self.pieces = Pieces(engine.tokenizer)
        self.unknown_fields = UnknownFields()  # request fields edge.api_fields does not know
        self._grammars: Any = None  # edge.structured.Grammars, made on first use
        # Parsing and tokenizing big bodies runs here, off the event loop (which must keep
        # answering /health) and off the engine's thread.
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
                web.post("/v1/embeddings", self.embeddings),
                # the same without /v1, as llama-server serves them (clients given the bare host
                # as their base URL); its /completions and /embeddings are its own API instead
                web.get("/models", self.models),
                web.post("/chat/completions", self.chat),
                web.post("/tokenize", self.tokenize),
                web.post("/detokenize", self.detokenize),
                web.get("/tokenizer_info", self.tokenizer_info),
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

    async def _json(self, request: web.Request) -> dict:
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
        return body

    async def _body(self, request: web.Request) -> dict:
        body = await self._json(request)
        model = body.get("model", self.engine.model_name)
        if model != self.engine.model_name:
            raise ApiError(
                404,
                f"model {model!r} does not exist; this server has {self.engine.model_name!r}",
                param="model",
                code="model_not_found",
            )
        return body

    def _check_text(self, text: str, param: str) -> None:
        """Cheap bound before tokenizing: no tokenizer's tokens are this long on average."""
        context = self.engine.max_context
        if len(text) > context * self.cfg.max_chars_per_token:
            raise ApiError(
                400,
                f"the {param} ({len(text)} characters) cannot fit the context of {context} tokens",
                param=param,
                code="context_length_exceeded",
            )

    async def _prepare(
        self,
        prompt: Any,
        params: SamplingParams,
        encode: Callable[[str], list[int]] | None = None,
    ) -> list[int]:
        """Bound, tokenise (with ``encode``, a function of the text, when given) and check
        that the request fits the context."""
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        context = self.engine.max_context
        # Cheap bounds first: the length of a list, the characters of a string.
        if isinstance(prompt, str):
            self._check_text(prompt, "prompt")
        elif isinstance(prompt, list) and len(prompt) > context:
            raise ApiError(
                400,
                f"the prompt ({len(prompt)} tokens) cannot fit the context of {context} tokens",
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

    def _admit(self, k: int, param: str) -> None:
        """Refuse ``k`` more engine requests when the queue is full (429), or when they could
        never fit at once (400), or when the cluster is down (503)."""
        cap = self.engine.parallel + self.cfg.max_queue
        if k > cap:
            raise ApiError(
                400,
                f"{k} choices cannot be served at once: this server runs "
                f"{self.engine.parallel} and queues {self.cfg.max_queue}",
                param=param,
            )
        if self.in_flight + k > cap:
            raise ApiError(
                429,
                f"{max(0, self.in_flight - self.engine.parallel)} requests are queued; retry later",
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
            "queue": self.in_flight,
            "insecure": self.cfg.insecure,
        }
        return web.json_response(body, status=200 if h.get("healthy") else 503)

    async def metrics(self, request: web.Request) -> web.Response:
        snap = self.engine.metrics.snapshot()
        store = None
        report = getattr(self.engine.runner, "store_report", None)
        if report is not None:
            # A cluster asks its workers: off the event loop (and off the engine's thread,
            # so the figures arrive between two steps, not after the running batch).
            store = await asyncio.get_running_loop().run_in_executor(None, report)
        if wants_prometheus(request):
            extra: dict[str, tuple[str, str, float]] = {
                "server_requests_in_flight": (
                    "gauge",
                    "Engine requests of this server running or waiting",
                    self.in_flight,
                ),
                "parallel": ("gauge", "Sequences decoded together at most", self.engine.parallel),
                "server_max_queue": (
                    "gauge",
                    "Requests that may wait beyond the running ones",
                    self.cfg.max_queue,
                ),
                "server_unknown_fields_total": (
                    "counter",
                    "Request fields sent that this server does not know (accepted, ignored)",
                    self.unknown_fields.total,
                ),
            }
            for k, v in (store or {}).items():
                if isinstance(v, int | float) and not isinstance(v, bool):
                    extra[f"expert_store_{k}"] = ("gauge", f"Expert store: {k}", v)
            text = prometheus_text(snap, extra, self.engine.model_name)
            return web.Response(body=text.encode(), headers={"Content-Type": PROMETHEUS_TYPE})
        body = {
            **snap,
            "queue": self.in_flight,
            "model": self.engine.model_name,
            "unknown_fields_total": self.unknown_fields.total,
            "unknown_fields": dict(self.unknown_fields.counts),
        }
        if store is not None:
            body["expert_store"] = store
        return web.json_response(body)

    async def tokenize(self, request: web.Request) -> web.Response:
        """vLLM's ``/tokenize``: ``{"prompt", "add_special_tokens"}`` -> ``{"tokens", "count",
        "max_model_len"}``."""
        body = await self._json(request)
        text = body.get("prompt")
        if not isinstance(text, str):
            raise ApiError(400, "prompt must be a string", param="prompt")
        self._check_text(text, "prompt")
        special = _opt_bool(body, "add_special_tokens", True)
        ids = await self._off_loop(_encode, self.engine.tokenizer, text, special)
        return web.json_response(
            {"tokens": ids, "count": len(ids), "max_model_len": self.engine.max_context}
        )

    async def detokenize(self, request: web.Request) -> web.Response:
        """vLLM's ``/detokenize``: ``{"tokens"}`` -> ``{"prompt"}``."""
        body = await self._json(request)
        ids = body.get("tokens")
        vocab = self.engine.runner.config.vocab_size
        if not (
            isinstance(ids, list)
            and len(ids) <= self.engine.max_context * 16
            and all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab for i in ids)
        ):
            raise ApiError(400, f"tokens must be a list of ids in [0, {vocab})", param="tokens")
        text = await self._off_loop(self.engine.tokenizer.decode, ids)
        return web.json_response({"prompt": text})

    async def tokenizer_info(self, request: web.Request) -> web.Response:
        """vLLM's ``/tokenizer_info``: the special tokens' texts and the chat template."""
        tok = self.engine.tokenizer

        def text_of(name: str) -> str | None:
            i = getattr(tok, name, None)
            return None if i is None else tok.decode([i]) or None

        template = self._template()
        return web.json_response(
            {
                "tokenizer_class": type(tok).__name__,
                "eos_token": text_of("eos_token_id"),
                "bos_token": text_of("bos_token_id"),
                "pad_token": None,
                "vocab_size": getattr(tok, "vocab_size", None),
                "model_max_length": self.engine.max_context,
                "chat_template": getattr(template, "source", None),
            }
        )

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        opts = await self._options(body, chat=False)
        prompts = completion_prompts(body.get("prompt"))
        self._admit(len(prompts) * opts.n, "n" if opts.n > 1 else "prompt")
        ids = [await self._prepare(p, opts.params) for p in prompts]
        echo = (
            [
                p if isinstance(p, str) else await self._off_loop(self.engine.tokenizer.decode, i)
                for p, i in zip(prompts, ids)
            ]
            if opts.echo
            else None
        )
        return await self._respond(request, opts, ids, chat=False, echo=echo)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        opts = await self._options(body, chat=True)
        self._admit(opts.n, "n")
        template = self._template()
        if template is None:
            messages = body.get("messages")
            if (
                opts.calls_tools
                and isinstance(messages, list)
                and all(isinstance(m, dict) for m in messages)
            ):  # else the model never sees them
                messages = with_tools_in_system(messages, list(opts.tools))
            ids = await self._prepare(chat_prompt(messages, body), opts.params)
            return await self._respond(request, opts, [ids], chat=True)
        # A big conversation takes a while to render and tokenise: both off the event loop.
        if body.get("tools") is not None and not opts.calls_tools:
            body = {k: v for k, v in body.items() if k != "tools"}  # tool_choice "none"
        text = await self._off_loop(render_chat, template, body)
        p = opts.params
        opts = replace(
            opts,
            reasoning_opened=text.rstrip().endswith(THINK_OPEN),
            params=replace(
                p,
                stop=p.stop + tuple(s for s in template.stop_strings if s not in p.stop),
                stop_token_ids=p.stop_token_ids + template.stop_token_ids,
            ),
        )
        encode = partial(template.encode, self.engine.tokenizer.encode)
        ids = await self._prepare(text, opts.params, encode)
        return await self._respond(request, opts, [ids], chat=True)

    async def embeddings(self, request: web.Request) -> web.Response:
        """OpenAI's ``/v1/embeddings``: bounded and checked before any allocation, tokenised
        off the event loop, computed on the engine's thread in batches of
        ``EmbeddingConfig.batch_tokens`` tokens between its decode steps."""
        body = await self._body(request)
        refuse_fields(body, EMBEDDINGS)
        _, unknown = check_fields(body, EMBEDDINGS)
        if unknown:
            self.unknown_fields.note(unknown)
        cfg = self.cfg.embeddings
        embed = getattr(self.engine.runner, "embed", None)
        if embed is None:
            raise ApiError(
                501,
                "this runner computes no embeddings (it has no final hidden states to pool)",
                kind="not_supported_error",
                code="embeddings_unsupported",
            )
        config = self.engine.runner.config
        limit = min(cfg.max_input_tokens, self.engine.max_context)
        try:
            fmt = emb.parse_format(body, config.hidden_size)
            items = emb.parse_input(body.get("input"), replace(cfg, max_input_tokens=limit))
            for i, item in enumerate(items):
                if isinstance(item, str):
                    self._check_text(item, "input")
            seqs = await self._off_loop(self._embed_tokens, items)
            total = emb.check_tokens(seqs, config.vocab_size, replace(cfg, max_input_tokens=limit))
        except emb.InputError as exc:
            code = "context_length_exceeded" if exc.status == 413 else None
            raise ApiError(exc.status, str(exc), param=exc.param, code=code) from None
        vectors: list = [None] * len(seqs)
        for group in emb.batches([len(s) for s in seqs], cfg.batch_tokens):
            call = partial(embed, [seqs[i] for i in group], cfg.pooling, cfg.batch_tokens)
            try:
                out = await asyncio.wrap_future(self.engine.call(call))
            except (LowbandError, RuntimeError) as exc:
                raise _engine_error(exc) from None
            for i, v in zip(group, out):
                vectors[i] = v
        return web.json_response(emb.response(vectors, fmt, self.engine.model_name, total))

    def _embed_tokens(self, items: list[str | list[int]]) -> list[list[int]]:
        tok = self.engine.tokenizer
        return [tok.encode(x) if isinstance(x, str) else [int(i) for i in x] for x in items]

    async def _options(self, body: dict, *, chat: bool) -> Options:
        opts = parse_options(
            body, chat=chat, cfg=self.cfg, vocab=self.engine.runner.config.vocab_size
        )
        _, unknown = check_fields(body, CHAT if chat else COMPLETIONS)
        if unknown:
            self.unknown_fields.note(unknown)
        template = self._template() if chat else None
        if opts.calls_tools:
            opts = replace(opts, tool_format=tool_format(getattr(template, "source", None)))
        if opts.grammar is not None:
            name, kind, source = opts.grammar
            if kind == "tool_call":  # the call the model must make, in its own format
                kind = "json_schema"
                source = call_schema(list(opts.tools), opts.tool_choice, opts.tool_format)
            ends = template.stop_token_ids if template is not None else ()
            try:  # the first one builds the vocabulary's view: seconds, off the event loop
                constraint = await self._off_loop(
                    self._grammar_engine().compile, kind, source, ends
                )
            except (LowbandError, ValueError) as exc:  # GrammarError, ConfigError
                raise ApiError(400, f"{name}: {exc}", param=name) from None
            opts = replace(opts, params=replace(opts.params, constraint=constraint))
        return opts

    def _grammar_engine(self) -> Any:
        """The grammar compiler (edge.structured needs the ``structured`` extra: llguidance)."""
        if self._grammars is None:
            try:
                from edge.structured import Grammars
            except ImportError as exc:
                raise ApiError(
                    400,
                    "structured output needs llguidance: "
                    f"pip install 'lowband[structured]' ({exc})",
                    param="response_format",
                ) from None
            self._grammars = Grammars(self.engine.tokenizer, self.engine.runner.config.vocab_size)
        return self._grammars

    def _template(self) -> ChatTemplate | None:
        return getattr(self.engine.tokenizer, "chat_template", None)

    # ---- answers -------------------------------------------------------------------------------
    async def _respond(
        self,
        request: web.Request,
        opts: Options,
        prompts: list[list[int]],
        *,
        chat: bool,
        echo: list[str] | None = None,
    ) -> web.StreamResponse:
        self._admit(len(prompts) * opts.n, "n")  # again: others were admitted meanwhile
        run = _Run(self)
        choices: list[_Choice] = []
        try:
            for p, ids in enumerate(prompts):
                for j in range(opts.n):
                    i = p * opts.n + j
                    choices.append(_Choice(before=list(ids[-PIECE_CONTEXT:])))
                    run.submit(i, ids, opts.choice_params(i))
            head = {
                "id": ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24],
                "created": int(time.time()),
                "model": self.engine.model_name,
            }
            usage = {"prompt_tokens": sum(len(ids) for ids in prompts)}
            if opts.stream:
                return await self._stream(request, run, opts, choices, head, usage, chat, echo)
            async for i, ev in run.events():
                self._take(choices[i], ev, opts, chat)
            return web.json_response(self._final(opts, prompts, choices, head, usage, chat, echo))
        finally:
            run.cancel()  # a disconnect (handler cancelled), a failure: the rest stop

    def _take(self, c: _Choice, ev: Event, opts: Options, chat: bool) -> list:
        """Record ``ev`` in ``c``; returns its logprob entries (token, logprob, top). A
        completion that ended on EOS also scores that token (one entry per generated position,
        as evaluators expect); a chat reply does not show its end of turn (as OpenAI's)."""
        c.text.append(ev.text)
        c.finish = ev.finish_reason or c.finish
        if ev.prompt_logprobs is not None and c.prompt_lp is None:
            c.prompt_lp = ev.prompt_logprobs
        new: list = []
        if ev.token is not None:
            c.tokens += 1
            if ev.logprob is not None:
                new.append((ev.token, ev.logprob, ev.top_logprobs))
        elif ev.logprob is not None and ev.finish_reason == "stop" and not chat:
            end = eos_token_of(ev, self.engine.tokenizer, opts.params)
            if end is not None:  # the end-of-sequence token scored (what evaluators expect)
                new.append((end, ev.logprob, ev.top_logprobs))
        c.entries.extend(new)
        return new

    def _final(
        self,
        opts: Options,
        prompts: list[list[int]],
        choices: list[_Choice],
        head: dict,
        usage: dict,
        chat: bool,
        echo: list[str] | None,
    ) -> dict:
        out = []
        for i, c in enumerate(choices):
            text = "".join(c.text)
            ids = prompts[i // opts.n]
            if chat:
                lp = None
                if opts.logprobs is not None:
                    content = _chat_logprobs(c.entries, list(ids[-PIECE_CONTEXT:]), self.pieces)
                    lp = {"content": content, "refusal": None}
                message, finish = self._message(opts, text, c.finish)
                out.append(
                    {"index": i, "message": message, "logprobs": lp, "finish_reason": finish}
                )
                continue
            entries: list = []
            offset = 0
            before: list[int] = []
            if echo is not None:
                if opts.logprobs is not None:
                    entries = list(c.prompt_lp or [])
                else:
                    offset = len(echo[i // opts.n])
                text = echo[i // opts.n] + text
            if opts.logprobs is not None:
                if echo is None:
                    before = list(ids[-PIECE_CONTEXT:])
                lp, _ = _completion_logprobs(entries + c.entries, before, self.pieces, offset)
            out.append(
                {
                    "index": i,
                    "text": text,
                    "logprobs": lp if opts.logprobs is not None else None,
                    "finish_reason": c.finish,
                }
            )
        n = sum(c.tokens for c in choices)
        return {
            **head,
            "object": "chat.completion" if chat else "text_completion",
            "choices": out,
            "usage": {**usage, "completion_tokens": n, "total_tokens": usage["prompt_tokens"] + n},
        }

    def _message(self, opts: Options, text: str, finish: str) -> tuple[dict, str]:
        """A chat reply's message (reasoning and tool calls split out) and finish reason."""
        reasoning, content = split_reasoning(text, opts.reasoning_format, opts.reasoning_opened)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if reasoning is not None:
            message["reasoning_content"] = reasoning
        if opts.calls_tools:
            rest, calls = parse_tool_calls(content, list(opts.tools), opts.tool_format)
            if calls:
                message.update(content=rest, tool_calls=calls)
                finish = "tool_calls" if finish == "stop" else finish
        return message, finish

    async def _stream(
        self,
        request: web.Request,
        run: _Run,
        opts: Options,
        choices: list[_Choice],
        head: dict,
        usage: dict,
        chat: bool,
        echo: list[str] | None,
    ) -> web.StreamResponse:
        obj = "chat.completion.chunk" if chat else "text_completion"
        extra = {"usage": None} if opts.include_usage else {}

        def data(choice: dict) -> bytes:
            body = {**head, "object": obj, "choices": [choice], **extra}
            return b"data: " + json.dumps(body).encode() + b"\n\n"

        def chunks(i: int, ev: Event) -> list[bytes]:
            c = choices[i]
            first = not c.started
            c.started = True
            new = self._take(c, ev, opts, chat)
            out: list[bytes] = []
            if chat and opts.calls_tools:  # a call is known only whole: sent at the end
                if ev.finish_reason is None:
                    return out
                message, finish = self._message(opts, "".join(c.text), ev.finish_reason)
                out.append(
                    data(
                        {
                            "index": i,
                            "delta": {"role": "assistant"},
                            "logprobs": None,
                            "finish_reason": None,
                        }
                    )
                )
                for k, call in enumerate(message.get("tool_calls", [])):
                    fn = call["function"]
                    head_d = {
                        "index": k,
                        "id": call["id"],
                        "type": "function",
                        "function": {"name": fn["name"], "arguments": ""},
                    }
                    arg_d = {"index": k, "function": {"arguments": fn["arguments"]}}
                    for d in (head_d, arg_d):
                        out.append(
                            data(
                                {
                                    "index": i,
                                    "delta": {"tool_calls": [d]},
                                    "logprobs": None,
                                    "finish_reason": None,
                                }
                            )
                        )
                rest = {k: message[k] for k in ("reasoning_content", "content") if message.get(k)}
                out.append(
                    data({"index": i, "delta": rest, "logprobs": None, "finish_reason": finish})
                )
                return out
            if chat:
                if c.reasoning is None:
                    c.reasoning = ReasoningStream(opts.reasoning_format, opts.reasoning_opened)
                thought, said = c.reasoning.feed(ev.text, final=ev.finish_reason is not None)
                # the role in a chunk of its own, then only non-empty text: what OpenAI and
                # llama-server send (clients that join the deltas assert they are not empty)
                if first:
                    role = {"role": "assistant", "content": None}
                    none: dict | None = (
                        None if opts.logprobs is None else {"content": [], "refusal": None}
                    )
                    out.append(
                        data({"index": i, "delta": role, "logprobs": none, "finish_reason": None})
                    )
                delta: dict[str, Any] = {"reasoning_content": thought} if thought else {}
                if said:
                    delta["content"] = said
                lp = None
                if opts.logprobs is not None:
                    lp = {"content": _chat_logprobs(new, c.before, self.pieces), "refusal": None}
                    del c.before[:-PIECE_CONTEXT]
                if delta or lp is not None or ev.finish_reason is not None:
                    choice = {"index": i, "delta": delta, "logprobs": lp}
                    out.append(data({**choice, "finish_reason": ev.finish_reason}))
                return out
            if first and echo is not None:
                prompt = echo[i // opts.n]
                lp = None
                if opts.logprobs is not None:
                    lp, c.offset = _completion_logprobs(c.prompt_lp or [], [], self.pieces, 0)
                else:
                    c.offset = len(prompt)
                out.append(
                    data({"index": i, "text": prompt, "logprobs": lp, "finish_reason": None})
                )
            lp = None
            if opts.logprobs is not None:
                lp, c.offset = _completion_logprobs(new, c.before, self.pieces, c.offset)
                del c.before[:-PIECE_CONTEXT]
            out.append(
                data(
                    {"index": i, "text": ev.text, "logprobs": lp, "finish_reason": ev.finish_reason}
                )
            )
            return out

        # Pull the first event before committing to a 200, so a failure at the first step
        # still arrives as a proper HTTP status.
        it = run.events().__aiter__()
        try:
            first: tuple[int, Event] | None = await it.__anext__()
        except StopAsyncIteration:
            first = None
        resp = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await resp.prepare(request)
        try:
            if first is not None:
                for b in chunks(*first):
                    await resp.write(b)
                async for i, ev in it:
                    for b in chunks(i, ev):
                        await resp.write(b)
            if opts.include_usage:
                n = sum(c.tokens for c in choices)
                u = {**usage, "completion_tokens": n, "total_tokens": usage["prompt_tokens"] + n}
                body = {**head, "object": obj, "choices": [], "usage": u}
                await resp.write(b"data: " + json.dumps(body).encode() + b"\n\n")
        except ApiError as exc:  # failed mid-stream: the status is sent; report in-band
            err = {"error": {"message": str(exc), "type": exc.kind, "code": exc.code}}
            await resp.write(b"data: " + json.dumps(err).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


def _encode(tokenizer: Any, text: str, special: bool) -> list[int]:
    """``tokenizer.encode``, told whether to add special tokens when it takes that flag
    (a GGUF file's tokenizer does: ``add_special``)."""
    try:
        sig = inspect.signature(tokenizer.encode)
    except (TypeError, ValueError):
        return tokenizer.encode(text)
    if "add_special" in sig.parameters:
        return tokenizer.encode(text, add_special=special)
    return tokenizer.encode(text)


async def start(engine: Engine, cfg: ServerConfig) -> tuple[web.AppRunner, int]:
    """Start serving in the running loop; returns the runner (for cleanup) and the port. The
    engine stays the caller's: cleanup leaves it running (see :func:`serve_forever`)."""
    server = Server(engine, cfg)
    # aiohttp's keep-alive timer also runs while a request's headers are half-sent; a client
    # that disconnects cancels its handler, which cancels its engine requests
    runner = web.AppRunner(
        server.app, keepalive_timeout=cfg.idle_timeout_s, handler_cancellation=True
    )
    await runner.setup()
    site = CappedSite(runner, cfg.host, cfg.port, max_connections=cfg.max_connections)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, port


def serve_forever(engine: Engine, cfg: ServerConfig) -> None:
    """Blocking entry point for the CLI. The engine stays the caller's to close (``edge.launch``
    closes it, then its runner)."""

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
