"""Every request field of ``/v1/chat/completions``, ``/v1/completions`` and ``/v1/embeddings``
the server knows, and what it does with it: no field is silently ignored.

A field is one of:

- ``USED``: implemented (parsed and checked by :func:`edge.server.parse_options` and the
  handlers, a bad value a JSON 400 naming it);
- ``NO_OP``: changes nothing in the answer by definition (``user``, ``metadata``, ``store``...)
  or asks for what this server always does (``cache_prompt``): accepted;
- ``REFUSED``: would change the answer and is not implemented: a JSON 400 naming it, unless its
  value is the field's neutral one (``best_of: 1``, ``mirostat: 0``...), which asks for nothing.

A field the table does not know is accepted (clients send new ones), logged once by name and
counted (``/metrics``: ``unknown_fields_total``). The table is OpenAI's request bodies plus
llama-server's and vLLM's extensions that clients of those servers send.
"""

from __future__ import annotations

import enum
import logging
import threading
from collections import Counter
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)


class Kind(enum.Enum):
    USED = "used"
    NO_OP = "no-op"
    REFUSED = "refused"


CHAT, COMPLETIONS, EMBEDDINGS = "chat", "completions", "embeddings"
BOTH = frozenset({CHAT, COMPLETIONS})
ENDPOINTS = (CHAT, COMPLETIONS, EMBEDDINGS)


@dataclass(frozen=True)
class Field:
    """One request field: its ``kind`` on the endpoints that take it (elsewhere: 400 if sent
    with a non-neutral value), and the values that ask for nothing (``neutral``)."""

    name: str
    kind: Kind
    endpoints: frozenset[str] = BOTH
    neutral: tuple[Any, ...] = ()
    why: str = ""

    def is_neutral(self, value: Any) -> bool:
        """Null, or one of the neutral values (compared by type too: ``False`` is not ``0``)."""
        return value is None or any(type(value) is type(n) and value == n for n in self.neutral)


def _f(
    name: str, kind: Kind, endpoints: frozenset[str] = BOTH, *neutral: Any, why: str = ""
) -> Field:
    return Field(name, kind, endpoints, tuple(neutral), why)


U, N, R = Kind.USED, Kind.NO_OP, Kind.REFUSED
ONLY_CHAT, ONLY_COMPLETIONS = frozenset({CHAT}), frozenset({COMPLETIONS})
ONLY_EMBEDDINGS, ALL = frozenset({EMBEDDINGS}), frozenset(ENDPOINTS)

FIELDS: dict[str, Field] = {
    f.name: f
    for f in (
        # ---- the basics
        _f("model", U, ALL),
        _f("messages", U, ONLY_CHAT),
        _f("prompt", U, ONLY_COMPLETIONS),
        _f("stream", U),
        _f("stream_options", U),
        _f("n", U),
        _f("max_tokens", U),
        _f("max_completion_tokens", U, ONLY_CHAT),
        _f("stop", U),
        _f("temperature", U),
        _f("top_p", U),
        _f("seed", U),
        _f("logprobs", U),
        _f("top_logprobs", U, ONLY_CHAT),
        _f("echo", U, ONLY_COMPLETIONS, False),
        # ---- sampling controls (edge.sampling, llama.cpp's definitions)
        _f("top_k", U),
        _f("min_p", U),
        _f("typical_p", U),
        _f("presence_penalty", U),
        _f("frequency_penalty", U),
        _f("repeat_penalty", U),
        _f("repeat_last_n", U),
        _f("logit_bias", U),
        _f("ignore_eos", U),
        # ---- structured output (edge.structured)
        _f("response_format", U),
        _f("json_schema", U),
        _f("grammar", U),
        # ---- chat template
        _f("tools", U, ONLY_CHAT),
        _f("tool_choice", U, ONLY_CHAT),
        _f("reasoning_format", U, ONLY_CHAT),
        _f("chat_template_kwargs", U, ONLY_CHAT),
        _f("add_generation_prompt", U, ONLY_CHAT),
        _f("continue_final_message", U, ONLY_CHAT),
        # ---- embeddings (edge.embeddings)
        _f("input", U, ONLY_EMBEDDINGS),
        _f("encoding_format", U, ONLY_EMBEDDINGS),
        _f("dimensions", U, ONLY_EMBEDDINGS),
        # ---- changes nothing in the answer
        _f("user", N, ALL, why="an end-user id for abuse monitoring"),
        _f("metadata", N, why="tags for stored completions"),
        _f("store", N, why="OpenAI's stored completions; nothing is stored here"),
        _f("service_tier", N, why="a processing tier; one tier here"),
        _f("prompt_cache_key", N, why="a cache hint; the prefix cache is automatic"),
        _f("safety_identifier", N, why="an end-user id for abuse monitoring"),
        _f("cache_prompt", N, why="llama-server: the prefix cache is always on"),
        _f("id_slot", N, why="llama-server: slots are chosen by prefix here"),
        _f("n_keep", N, why="llama-server context shift: a request that overflows is refused"),
        _f("timings_per_token", N, why="llama-server: timings are in /metrics"),
        _f("penalize_nl", N, why="removed from llama.cpp; newlines are penalised like any token"),
        _f("return_tokens", N, why="llama-server's /completion field"),
        _f("parallel_tool_calls", N, ONLY_CHAT, why="the model decides how many calls"),
        # ---- would change the answer; not implemented (neutral values accepted)
        _f("best_of", R, ONLY_COMPLETIONS, 1),
        _f("suffix", R, ONLY_COMPLETIONS, ""),
        _f("functions", R, ONLY_CHAT),
        _f("function_call", R, ONLY_CHAT, "none", "auto"),
        _f("reasoning_effort", R, ONLY_CHAT),
        _f("verbosity", R, ONLY_CHAT),
        _f("modalities", R, ONLY_CHAT, ["text"]),
        _f("audio", R, ONLY_CHAT),
        _f("prediction", R, ONLY_CHAT),
        _f("web_search_options", R, ONLY_CHAT),
        _f("mirostat", R, BOTH, 0),
        _f("mirostat_tau", R),
        _f("mirostat_eta", R),
        _f("dynatemp_range", R, BOTH, 0, 0.0),
        _f("dynatemp_exponent", R, BOTH, 1, 1.0),
        _f("xtc_probability", R, BOTH, 0, 0.0),
        _f("xtc_threshold", R),
        _f("dry_multiplier", R, BOTH, 0, 0.0),
        _f("dry_base", R),
        _f("dry_allowed_length", R),
        _f("dry_penalty_last_n", R),
        _f("dry_sequence_breakers", R),
        _f("top_n_sigma", R, BOTH, -1, -1.0),
        _f("samplers", R),
        _f("min_keep", R, BOTH, 0, 1),
        _f("n_probs", R, BOTH, 0),
        _f("post_sampling_probs", R, BOTH, False),
        _f("n_indent", R, BOTH, 0),
        _f("t_max_predict_ms", R, BOTH, 0),
        _f("lora", R, BOTH, []),
        _f("chat_template", R, ONLY_CHAT),
        _f("length_penalty", R, BOTH, 1, 1.0),
        _f("repetition_penalty", R, BOTH, 1, 1.0),
        _f("embd_normalize", R, ONLY_EMBEDDINGS, 2),
    )
}


class UnknownFields:
    """Names of fields the table does not know: each logged once, all counted. Thread-safe."""

    def __init__(self, max_names: int = 256) -> None:
        self.counts: Counter[str] = Counter()
        self.total = 0
        self._max = max_names
        self._lock = threading.Lock()

    def note(self, names: list[str]) -> None:
        with self._lock:
            for name in names:
                self.total += 1
                if name in self.counts or len(self.counts) < self._max:
                    if name not in self.counts:
                        logger.warning("request field %r is unknown here: accepted, ignored", name)
                    self.counts[name] += 1


def check_fields(body: dict, endpoint: str) -> tuple[str | None, list[str]]:
    """(the first field ``body`` sends that this endpoint refuses, or None; the unknown
    fields' names). A field of the other endpoint counts as refused unless neutral."""
    unknown: list[str] = []
    for name, value in body.items():
        f = FIELDS.get(name)
        if f is None:
            unknown.append(str(name)[:64])
        elif (f.kind is Kind.REFUSED or endpoint not in f.endpoints) and not f.is_neutral(value):
            return name, unknown
    return None, unknown
