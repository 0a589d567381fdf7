"""Text generation on top of a :class:`Runner` (one device, or the master of a TP cluster).

The engine serves one sequence at a time (a device this small is memory-bound: a second
sequence would cost a second KV cache for little throughput); the HTTP server queues requests
in front of it. It keeps the tokens behind the KV cache, so a follow-up request that extends
the previous prompt (a chat turn) only prefills the new tokens.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Generator, Iterator, Protocol, Sequence

import torch

from edge.sampling import Sampler, SamplingParams, StopMatcher
from lowband.errors import ConfigError, LowbandError
from lowband.models.config import ModelConfig
from lowband.models.llama import KVCache, LlamaForCausalLM
from lowband.models.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


class EngineError(LowbandError):
    """A generation failed (the message says why); the engine itself stays usable."""


class ClusterUnavailable(EngineError):
    """A device of the cluster is missing; requests fail until it is back."""


class Runner(Protocol):
    """Runs the model forward; owns the KV cache."""

    config: ModelConfig

    def forward(self, ids: Sequence[int], start: int, top: int = 0) -> torch.Tensor:
        """Append ``ids`` at positions ``start..`` to the cache; logits (V,) of the last one.
        ``top`` > 0: the caller picks only among the ``top`` largest logits, so a runner may
        return -inf for every other token (a vocabulary-parallel head then moves only those
        candidates to the master); 0: all logits must be exact."""
        ...

    def reset(self) -> None: ...

    def cached_tokens(self) -> int:
        """Positions held by the KV cache now (0 after the runner dropped it, e.g. a cluster
        that regrouped between two requests)."""
        ...

    def restart_floor(self) -> int:
        """The lowest position a forward may restart from other than 0 (a sliding-window
        cache drops old keys); optional, 0 when absent."""
        ...

    def wire_bytes(self) -> int:
        """Cumulative bytes this device put on and took off the network."""
        ...

    def health(self) -> dict:
        """``{"healthy": bool, ...}``."""
        ...

    def store_report(self) -> dict | None:
        """Expert-store statistics of a nested MoE (``ExpertCache.report``), None otherwise."""
        ...

    def close(self) -> None: ...


class LocalRunner:
    """Everything on this device (optionally streaming weights through a sliding window)."""

    def __init__(self, model: LlamaForCausalLM, on_close=None, report=None) -> None:
        self.model = model
        self.config = model.config
        self.cache: KVCache = model.new_cache()
        self._on_close = on_close
        self._report = report

    def forward(self, ids: Sequence[int], start: int, top: int = 0) -> torch.Tensor:
        x = torch.tensor([list(ids)], dtype=torch.long)
        with torch.inference_mode():
            h = self.model.forward_layers(self.model.embed(x), cache=self.cache, start=start)
            return self.model.head(h[:, -1]).float()[0]

    def reset(self) -> None:
        self.cache = self.model.new_cache()

    def cached_tokens(self) -> int:
        return self.cache.length

    def restart_floor(self) -> int:
        return self.cache.restart_floor()

    def wire_bytes(self) -> int:
        return 0

    def health(self) -> dict:
        return {"healthy": True, "devices": 1}

    def store_report(self) -> dict | None:
        return self._report() if self._report is not None else None

    def close(self) -> None:
        if self._on_close is not None:
            self._on_close()


@dataclass
class Event:
    """One streamed piece of a completion."""

    text: str
    token: int | None = None
    finish_reason: str | None = None  # "stop" | "length" once finished


@dataclass
class Metrics:
    """Counters behind ``/metrics``; latencies are kept for the last ``window`` requests/tokens."""

    window: int = 512
    requests: int = 0
    failed: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    ttft_s: deque = field(default_factory=lambda: deque(maxlen=512))
    token_s: deque = field(default_factory=lambda: deque(maxlen=512))
    wire_bytes_per_token: deque = field(default_factory=lambda: deque(maxlen=512))
    busy_s: float = 0.0

    def snapshot(self) -> dict:
        def mean(d: deque) -> float | None:
            return sum(d) / len(d) if d else None

        def pct(d: deque, q: float) -> float:  # d is not empty (the callers check)
            s = sorted(d)
            return s[min(len(s) - 1, int(q * len(s)))]

        tok, ttft = mean(self.token_s), mean(self.ttft_s)
        return {
            "requests_total": self.requests,
            "requests_failed": self.failed,
            "prompt_tokens_total": self.prompt_tokens,
            "completion_tokens_total": self.completion_tokens,
            "ttft_ms_mean": None if ttft is None else 1e3 * ttft,
            "ttft_ms_p90": None if not self.ttft_s else 1e3 * pct(self.ttft_s, 0.9),
            "token_latency_ms_mean": None if tok is None else 1e3 * tok,
            "token_latency_ms_p90": None if not self.token_s else 1e3 * pct(self.token_s, 0.9),
            "decode_tokens_per_s": None if not tok else 1.0 / tok,
            "wire_bytes_per_token": mean(self.wire_bytes_per_token),
            "busy_s": self.busy_s,
        }


class Engine:
    """Tokenise, prefill, decode, sample, detokenise, stop. Thread-safe (one at a time)."""

    def __init__(
        self, runner: Runner, tokenizer: Tokenizer, *, model_name: str, prefill_chunk: int = 256
    ) -> None:
        if prefill_chunk < 1:
            raise ConfigError("prefill_chunk", f"must be >= 1, got {prefill_chunk}")
        self.runner = runner
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_context = runner.config.max_position_embeddings
        self.prefill_chunk = prefill_chunk
        self.metrics = Metrics()
        self.lock = threading.Lock()
        self._cached: list[int] = []  # tokens whose K/V are in the runner's cache

    def _prefill(self, ids: list[int], top: int = 0) -> torch.Tensor:
        # Reuse the longest cached prefix, but recompute at least the last prompt token. The
        # runner may have dropped its cache since (a cluster regrouped or re-planned while
        # idle): then nothing is cached, whatever this engine remembers.
        if self.runner.cached_tokens() != len(self._cached):
            self._cached = []
        p = 0
        limit = min(len(self._cached), len(ids) - 1)
        while p < limit and self._cached[p] == ids[p]:
            p += 1
        floor = getattr(self.runner, "restart_floor", None)
        if p > 0 and floor is not None and p < floor():
            p = 0  # a sliding-window cache dropped keys that restarting at p would need
        self._cached = self._cached[:p]
        logits = None
        for a in range(p, len(ids), self.prefill_chunk):
            chunk = ids[a : a + self.prefill_chunk]
            logits = self.runner.forward(chunk, a, top)
            self._cached.extend(chunk)
        assert logits is not None  # ids is never empty (checked by generate)
        return logits

    def prepare(self, prompt: str | Sequence[int], params: SamplingParams) -> list[int]:
        """Tokenise and check that the request fits the context; raises :class:`ConfigError`."""
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else [int(i) for i in prompt]
        if not ids:
            raise ConfigError("prompt", "is empty")
        vocab = self.runner.config.vocab_size
        if any(not 0 <= i < vocab for i in ids):
            raise ConfigError("prompt", f"token ids must be in [0, {vocab})")
        if len(ids) + params.max_tokens > self.max_context:
            raise ConfigError(
                "max_tokens",
                f"prompt ({len(ids)} tokens) + max_tokens "
                f"({params.max_tokens}) exceeds the context of {self.max_context}",
            )
        return ids

    def generate(
        self, prompt: str | Sequence[int], params: SamplingParams
    ) -> Generator[Event, None, None]:
        """Stream a completion. Raises :class:`ConfigError` for a bad request and
        :class:`EngineError` when the runtime fails mid-way."""
        ids = self.prepare(prompt, params)
        with self.lock:
            yield from self._generate_locked(ids, params)

    def _generate_locked(self, ids: list[int], params: SamplingParams) -> Iterator[Event]:
        m = self.metrics
        m.requests += 1
        m.prompt_tokens += len(ids)
        sampler, stops = Sampler(params), StopMatcher(params.stop)
        eos = self.tokenizer.eos_token_id
        out: list[int] = []
        shown = ""
        t0 = time.perf_counter()
        try:
            top = params.candidates
            logits = self._prefill(ids, top)
            for i in range(params.max_tokens):
                tok = sampler(logits)
                if tok == eos or tok in params.stop_token_ids:
                    yield Event(stops.flush(), None, "stop")
                    return
                out.append(tok)
                now = time.perf_counter()
                if i == 0:
                    m.ttft_s.append(now - t0)
                m.completion_tokens += 1
                text = self.tokenizer.decode(out)
                if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for more
                    piece = ""
                else:
                    piece, shown = text[len(shown) :], text
                visible = stops.feed(piece)
                if stops.stopped:
                    yield Event(visible, tok, "stop")
                    return
                if i == params.max_tokens - 1:
                    yield Event(visible + stops.flush(), tok, "length")
                    return
                yield Event(visible, tok)
                b0, t1 = self.runner.wire_bytes(), time.perf_counter()
                logits = self.runner.forward([tok], len(self._cached), top)
                self._cached.append(tok)
                m.token_s.append(time.perf_counter() - t1)
                m.wire_bytes_per_token.append(self.runner.wire_bytes() - b0)
        except (LowbandError, RuntimeError) as exc:
            m.failed += 1
            self._cached = []
            self.runner.reset()
            if isinstance(exc, EngineError):
                raise
            raise EngineError(f"generation failed: {exc}") from exc
        finally:
            m.busy_s += time.perf_counter() - t0

    def complete(self, prompt: str | Sequence[int], params: SamplingParams) -> tuple[str, str, int]:
        """Non-streaming: (text, finish_reason, completion token count)."""
        parts, reason, n = [], "length", 0
        for ev in self.generate(prompt, params):
            parts.append(ev.text)
            n += ev.token is not None
            reason = ev.finish_reason or reason
        return "".join(parts), reason, n
