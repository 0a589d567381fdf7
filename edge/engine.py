"""Text generation with continuous batching on top of a :class:`Runner` (one device, or the
master of a TP cluster).

One scheduler thread owns the model. Every step it runs all active sequences as one ragged
batch: each decoding sequence contributes its next token, and prompts are prefilled in chunks
that ride along in the same step (SARATHI-style piggybacking: a long prompt never stalls the
running streams, and the decodes share the chunk's weight reads). New requests are admitted
between steps, up to ``parallel`` at a time, in arrival order; a cancelled request leaves at
the next step.

Each sequence decodes in a KV-cache *slot* of the runner. Slots outlive their requests: a
finished sequence's cache stays behind (``prefix_cache`` of them, least recently used evicted
first), so a request whose prompt starts with tokens some slot already holds (a system prompt,
the chat history of a follow-up turn) reuses those keys and values instead of recomputing them.

A runner that cannot batch (only :meth:`Runner.forward`) is served one sequence at a time
through :class:`SerialRunner`, with the same prefix reuse on its one cache.

Lanes (a :class:`PipelinedRunner`, e.g. the master of a pipeline of devices): the running
sequences are cut into up to ``lanes`` groups whose steps are in flight at once. The engine
submits a group's step, then the next group's, and only then collects the oldest: it samples
that group's tokens and submits its next step while the devices still work on the other
groups, so a pipeline's stages never drain between steps (GPipe micro-batches across steps,
Flover's temporal fusion). A sequence is in at most one step in flight; results are
collected in the order submitted; anything else that touches the runner (a queued call)
waits until nothing is in flight. A runner with ``lanes_for(running)`` says, each time the
engine plans, how many of its lanes pay for that many running sequences (e.g. the replica
layout: 1 while one device's batched step is faster than splitting them).
"""

from __future__ import annotations

import atexit
import logging
import queue
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable, Generator, Literal, Protocol, Sequence

import torch

from edge.embeddings import embed_ragged
from edge.sampling import Sampler, SamplingParams, StopMatcher
from edge.speculative import (
    Draft,
    Drafter,
    DraftLength,
    PassCost,
    Speculation,
    common_prefix,
    drafting_allowed,
    verify,
)
from lowband.errors import ConfigError, LowbandError
from lowband.models.config import ModelConfig
from lowband.models.llama import KVCache, LlamaForCausalLM, Span
from lowband.models.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


# The batching defaults (edge.launch.BatchConfig reads them; the CLI's flags show the same
# numbers, kept equal by tests/cli/test_defaults.py).
PREFILL_CHUNK = 256  # the most prompt tokens per step, riding along with the decodes
DECODE_STALL = 2.0  # a step that prefills beside decodes: <= this x a decode step


class EngineError(LowbandError):
    """A generation failed (the message says why); the engine itself stays usable."""


class ClusterUnavailable(EngineError):
    """A device of the cluster is missing; requests fail until it is back."""


class Runner(Protocol):
    """Runs the model forward on one sequence; owns the KV cache."""

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


Want = Literal["none", "last", "all"]


@dataclass(frozen=True)
class Work:
    """One sequence's share of a batched step: ``ids`` at positions ``start..`` of slot
    ``slot``'s cache; ``logits``: which rows' logits the caller needs."""

    slot: int
    ids: Sequence[int]
    start: int
    logits: Want = "last"


def wanted_rows(work: Sequence[Work]) -> list[int]:
    """The rows of a step's (N, H) hidden states whose logits its items ask for."""
    rows: list[int] = []
    off = 0
    for w in work:
        n = len(w.ids)
        if w.logits == "all":
            rows.extend(range(off, off + n))
        elif w.logits == "last":
            rows.append(off + n - 1)
        off += n
    return rows


def split_logits(work: Sequence[Work], logits: torch.Tensor | None) -> list[torch.Tensor | None]:
    """Each item's share of the logits of :func:`wanted_rows` (in that order)."""
    out: list[torch.Tensor | None] = []
    r = 0
    for w in work:
        want = len(w.ids) if w.logits == "all" else int(w.logits == "last")
        if want:
            assert logits is not None
            out.append(logits[r : r + want] if w.logits == "all" else logits[r])
        else:
            out.append(None)
        r += want
    return out


class BatchRunner(Runner, Protocol):
    """A runner that holds one KV cache per slot and runs many sequences per step."""

    def forward_batch(self, work: Sequence[Work], top: int = 0) -> list[torch.Tensor | None]:
        """Run every item in one pass (distinct slots); per item its logits: (V,) of the last
        row, (T, V) of every row, or None, as ``Work.logits`` asks. ``top`` as in
        :meth:`Runner.forward`, for every item."""
        ...

    def slot_length(self, slot: int) -> int:
        """Positions slot ``slot`` holds (0 when empty or dropped)."""
        ...

    def slot_floor(self, slot: int) -> int:
        """The lowest position slot ``slot`` may restart from other than 0."""
        ...

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        """Make slot ``dst`` hold positions 0..n-1 of slot ``src`` (shared prompt prefix);
        raises ``RuntimeError`` when ``src`` no longer holds them."""
        ...

    def drop(self, slot: int) -> None:
        """Free slot ``slot``'s memory."""
        ...


class LocalRunner:
    """Everything on this device (optionally streaming weights through a sliding window).
    Slot 0 is the cache of the single-sequence :meth:`forward`."""

    def __init__(self, model: LlamaForCausalLM, on_close=None, report=None) -> None:
        self.model = model
        self.config = model.config
        self._caches: dict[int, KVCache] = {0: model.new_cache()}
        self._on_close = on_close
        self._report = report

    @property
    def cache(self) -> KVCache:
        return self._caches[0]

    def _slot(self, slot: int) -> KVCache:
        c = self._caches.get(slot)
        if c is None:
            c = self._caches[slot] = self.model.new_cache()
        return c

    def forward(self, ids: Sequence[int], start: int, top: int = 0) -> torch.Tensor:
        x = torch.tensor([list(ids)], dtype=torch.long)
        with torch.inference_mode():
            h = self.model.forward_layers(self.model.embed(x), cache=self.cache, start=start)
            return self.model.head(h[:, -1]).float()[0]

    def forward_batch(self, work: Sequence[Work], top: int = 0) -> list[torch.Tensor | None]:
        spans = [Span(self._slot(w.slot), w.start, len(w.ids)) for w in work]
        ids = torch.tensor([i for w in work for i in w.ids], dtype=torch.long)
        rows = wanted_rows(work)
        with torch.inference_mode():
            h = self.model.forward_ragged(self.model.embed(ids[None]), spans)
            logits = self.model.head(h[0, rows]).float() if rows else None
        return split_logits(work, logits)

    def embed(self, seqs: Sequence[Sequence[int]], pooling: str, chunk: int) -> torch.Tensor:
        """(B, H) pooled, L2-normalised final hidden states (:func:`edge.embeddings.embed_ragged`),
        in caches of their own: the slots are untouched."""
        return embed_ragged(self.model, seqs, pooling, chunk)

    def slot_length(self, slot: int) -> int:
        c = self._caches.get(slot)
        return 0 if c is None else c.length

    def slot_floor(self, slot: int) -> int:
        c = self._caches.get(slot)
        return 0 if c is None else c.restart_floor()

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        if src == dst:
            raise RuntimeError("a slot cannot copy from itself")
        self._slot(dst).copy_prefix(self._slot(src), n)

    def truncate(self, slot: int, n: int) -> None:
        """Forget positions n.. of slot ``slot`` (rejected draft tokens); the next forward
        there starts at n and overwrites them."""
        c = self._caches.get(slot)
        if c is not None and c.length > n:
            c.length = n

    def drop(self, slot: int) -> None:
        if slot == 0:
            self._caches[0] = self.model.new_cache()
        else:
            self._caches.pop(slot, None)

    def reset(self) -> None:
        self._caches = {0: self.model.new_cache()}

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


class SerialRunner:
    """A :class:`BatchRunner` of one slot over a runner that only has :meth:`Runner.forward`
    (the engine then runs one sequence at a time)."""

    def __init__(self, runner: Runner) -> None:
        self.inner = runner
        self.config = runner.config

    def forward_batch(self, work: Sequence[Work], top: int = 0) -> list[torch.Tensor | None]:
        out: list[torch.Tensor | None] = []
        for w in work:
            if w.slot != 0:
                raise RuntimeError("this runner has one slot")
            if w.logits == "all":  # row by row: forward returns the last row's logits only
                out.append(
                    torch.stack(
                        [self.inner.forward([t], w.start + j, top) for j, t in enumerate(w.ids)]
                    )
                )
            else:
                lg = self.inner.forward(w.ids, w.start, top)
                out.append(lg if w.logits == "last" else None)
        return out

    def slot_length(self, slot: int) -> int:
        return self.inner.cached_tokens()

    def slot_floor(self, slot: int) -> int:
        floor = getattr(self.inner, "restart_floor", None)
        return floor() if floor is not None else 0

    def copy_prefix(self, src: int, dst: int, n: int) -> None:
        raise RuntimeError("this runner has one slot")

    def drop(self, slot: int) -> None:
        self.inner.reset()


class PipelinedRunner(BatchRunner, Protocol):
    """A batch runner that keeps several steps in flight (``lanes`` of them)."""

    lanes: int

    def submit(self, work: Sequence[Work], top: int = 0) -> Any:
        """Start a step (as :meth:`BatchRunner.forward_batch`, distinct slots from every step
        in flight); returns the handle :meth:`collect` takes."""
        ...

    def collect(self, flight: Any) -> list[torch.Tensor | None]:
        """The logits of a submitted step; steps are collected in the order submitted."""
        ...


def runner_lanes(batch: BatchRunner) -> int:
    """Steps ``batch`` may keep in flight: ``lanes`` of a :class:`PipelinedRunner`, else 1."""
    lanes = getattr(batch, "lanes", 1) if hasattr(batch, "submit") else 1
    return max(1, int(lanes))


def as_batch_runner(runner: Runner) -> BatchRunner:
    """``runner`` itself when it batches, else a one-slot :class:`SerialRunner` over it."""
    if hasattr(runner, "forward_batch"):
        return runner  # type: ignore[return-value]
    return SerialRunner(runner)  # type: ignore[return-value]


@dataclass
class Event:
    """One streamed piece of a completion. With ``SamplingParams.logprobs`` set, ``logprob``
    is the chosen token's log-probability under the model (natural log, before temperature)
    and ``top_logprobs`` the ``logprobs`` most likely (token id, log-probability) pairs. With
    ``prompt_logprobs``, the first event carries one entry per prompt token (the first token
    has no logprob: None)."""

    text: str
    token: int | None = None
    finish_reason: str | None = None  # "stop" | "length" once finished
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()
    prompt_logprobs: list[tuple[int, float | None, tuple[tuple[int, float], ...]]] | None = None


@dataclass
class Metrics:
    """Counters behind ``/metrics``; latencies are kept for the last ``window`` requests/tokens."""

    window: int = 512
    requests: int = 0
    failed: int = 0
    cancelled: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    prefix_lookups: int = 0
    prefix_hits: int = 0
    prefix_tokens_reused: int = 0
    prompt_tokens_computed: int = 0
    steps: int = 0
    step_sequences: int = 0  # summed over steps: mean batch = step_sequences / steps
    step_tokens: int = 0
    running: int = 0
    waiting: int = 0
    ttft_s: deque = field(default_factory=lambda: deque(maxlen=512))
    token_s: deque = field(default_factory=lambda: deque(maxlen=512))
    wire_bytes_per_token: deque = field(default_factory=lambda: deque(maxlen=512))
    busy_s: float = 0.0
    spec_passes: int = 0  # verification passes (one per drafted sequence and step)
    spec_drafted: int = 0  # draft tokens proposed
    spec_accepted: int = 0  # draft tokens the target kept
    spec_emitted: int = 0  # tokens those passes produced (accepted + the target's own)

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
            "requests_cancelled": self.cancelled,
            "requests_running": self.running,
            "requests_waiting": self.waiting,
            "prompt_tokens_total": self.prompt_tokens,
            "completion_tokens_total": self.completion_tokens,
            "prompt_tokens_computed_total": self.prompt_tokens_computed,
            "prefix_cache_lookups_total": self.prefix_lookups,
            "prefix_cache_hits_total": self.prefix_hits,
            "prefix_cache_tokens_reused_total": self.prefix_tokens_reused,
            "steps_total": self.steps,
            "batch_sequences_mean": self.step_sequences / self.steps if self.steps else None,
            "batch_tokens_mean": self.step_tokens / self.steps if self.steps else None,
            "ttft_ms_mean": None if ttft is None else 1e3 * ttft,
            "ttft_ms_p90": None if not self.ttft_s else 1e3 * pct(self.ttft_s, 0.9),
            "token_latency_ms_mean": None if tok is None else 1e3 * tok,
            "token_latency_ms_p90": None if not self.token_s else 1e3 * pct(self.token_s, 0.9),
            "decode_tokens_per_s": None if not tok else 1.0 / tok,
            "wire_bytes_per_token": mean(self.wire_bytes_per_token),
            "busy_s": self.busy_s,
            "spec_passes_total": self.spec_passes,
            "spec_draft_tokens_total": self.spec_drafted,
            "spec_accepted_tokens_total": self.spec_accepted,
            "spec_acceptance_rate": (
                self.spec_accepted / self.spec_drafted if self.spec_drafted else None
            ),
            "spec_tokens_per_pass": (
                self.spec_emitted / self.spec_passes if self.spec_passes else None
            ),
        }


Sink = Callable[["Event | BaseException | None"], None]
"""Receives a request's events, then None when it ended, or the exception that ended it.
Called on the engine's thread: it must not block."""


class Request:
    """A submitted completion; :meth:`cancel` ends it at the next step."""

    def __init__(self, ids: list[int], params: SamplingParams, sink: Sink) -> None:
        self.ids, self.params, self.sink = ids, params, sink
        self.cancelled = False
        self.slot = -1
        self.pos = 0  # positions of this sequence whose K/V are in the slot
        self.next_in = -1  # the token to feed next once decoding
        self.out: list[int] = []
        self.shown = ""
        self.sampler = Sampler(params, ids)
        self.stops = StopMatcher(params.stop)
        self.prompt_lp: list[tuple[int, float | None, tuple[tuple[int, float], ...]]] = []
        self.t_submit = time.perf_counter()
        self.t_last = 0.0
        self.drafter: Drafter | None = None  # set at admission when speculation applies
        self.draft_len: DraftLength | None = None
        self.draft: Draft | None = None  # the tokens the step in flight verifies
        self.shadow: int | None = None  # a free drafter's guess at the plain step's token
        self.flying = False  # in a step submitted and not yet collected (lanes)

    def cancel(self) -> None:
        self.cancelled = True

    @property
    def decoding(self) -> bool:
        return self.pos >= len(self.ids)


class Pace:
    """Sizes prompt chunks so running streams keep their pace (SARATHI's token budget, from
    measurements).  A step's time is modelled as ``base + per_row * rows`` (rows: decoding
    sequences plus prompt tokens), fitted by least squares over recent steps with exponential
    forgetting, so the decode rows' own cost is not charged to the prompt tokens beside them.
    While fewer prompts wait for their first token than sequences decode, a step may carry as
    many prompt tokens as fit ``(stall - 1)`` times the predicted plain decode step of the
    running batch.  While at least as many wait as decode, the waiting requests are the
    majority and the step carries a whole chunk (as llama.cpp's server always does): a queue
    of prompts is then prefilled in efficient large batches, not a few tokens per step."""

    FIRST = 16  # the budget before anything was measured

    def __init__(self, stall: float, weight: float = 0.2) -> None:
        self.stall, self.weight = stall, weight
        self._s = [0.0] * 5  # decayed sums of w, w x, w x^2, w y, w x y (x: rows, y: seconds)

    def observe(self, n_decode: int, n_prompt: int, seconds: float) -> None:
        x, keep = float(n_decode + n_prompt), 1.0 - self.weight
        if x <= 0:
            return
        for i, v in enumerate((1.0, x, x * x, seconds, x * seconds)):
            self._s[i] = keep * self._s[i] + v

    def fit(self) -> tuple[float, float] | None:
        """(base seconds, seconds per row), or None until steps of two sizes were seen."""
        w, sx, sxx, sy, sxy = self._s
        den = w * sxx - sx * sx
        if w <= 0 or den <= 1e-9 * max(w * sxx, 1e-30):
            return None
        per_row = (w * sxy - sx * sy) / den
        if per_row <= 0:
            return None
        return max((sy - per_row * sx) / w, 0.0), per_row

    def budget(self, cap: int, decoding: int = 1, prefilling: int = 0) -> int:
        """Prompt tokens for a step that also runs ``decoding`` sequences' next tokens while
        ``prefilling`` prompts wait for theirs (at most ``cap``)."""
        if prefilling >= decoding:
            return cap
        fit = self.fit()
        if fit is None:
            return min(cap, self.FIRST)
        base, per_row = fit
        tokens = round((self.stall - 1.0) * (base + per_row * decoding) / per_row)
        return max(1, min(cap, tokens))


@dataclass
class _Flight:
    """A step the engine launched: its items, and the runner's handle (lanes) or logits."""

    work: list[tuple[Request, Work]]
    result: Any
    pending: bool  # result is a handle to collect, not the logits yet
    t0: float


@dataclass
class _Slot:
    tokens: list[int] = field(default_factory=list)  # whose K/V the runner's slot holds
    owner: Request | None = None
    used: float = 0.0  # last release time (LRU)


class Engine:
    """Tokenise, schedule, batch, sample, detokenise, stop. Thread-safe."""

    def __init__(
        self,
        runner: Runner,
        tokenizer: Tokenizer,
        *,
        model_name: str,
        prefill_chunk: int = PREFILL_CHUNK,
        parallel: int = 1,
        prefix_cache: int | None = None,
        decode_stall: float = DECODE_STALL,
        speculation: Speculation | None = None,
    ) -> None:
        """``parallel``: sequences decoded together; ``prefill_chunk``: the most prompt tokens
        per step (shared by the prompts being prefilled); ``decode_stall``: while sequences
        are decoding, a step that also prefills may take about this many times a plain decode
        step, unless as many requests wait for their first token as decode (:class:`Pace`;
        the chunk is sized from measured step times); ``prefix_cache``: finished
        sequences whose caches are kept for prefix reuse (default: ``parallel``);
        ``speculation``: draft tokens for every decoding sequence that allows it and verify
        them in the step (``edge.speculative``)."""
        if prefill_chunk < 1:
            raise ConfigError("prefill_chunk", f"must be >= 1, got {prefill_chunk}")
        if not 1.0 < decode_stall <= 1000.0:
            raise ConfigError("decode_stall", f"must be in (1, 1000], got {decode_stall}")
        if parallel < 1:
            raise ConfigError("parallel", f"must be >= 1, got {parallel}")
        if prefix_cache is not None and prefix_cache < 0:
            raise ConfigError("prefix_cache", f"must be >= 0, got {prefix_cache}")
        self.runner = runner
        self.batch = as_batch_runner(runner)
        if isinstance(self.batch, SerialRunner) and parallel > 1:
            logger.warning(
                "this runner decodes one sequence at a time: --parallel %d ignored", parallel
            )
            parallel = 1
        self.parallel = parallel
        n_cached = parallel if prefix_cache is None else prefix_cache
        if isinstance(self.batch, SerialRunner):
            n_cached = 0  # its one slot is reused by the next request anyway
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_context = runner.config.max_position_embeddings
        self.prefill_chunk = prefill_chunk
        self.pace = Pace(decode_stall)
        self.speculation = speculation
        self.pass_cost = PassCost()
        # the drafter's seconds per proposed token, as the last request measured it: a new
        # request starts from it (a draft model's cost does not depend on the request, and a
        # request that assumed it free would draft, and read its prompt, beside a busy batch)
        self.draft_s = 0.0
        self.metrics = Metrics()
        self._slots = [_Slot() for _ in range(parallel + n_cached)]
        self._last_slot = 0
        self._cv = threading.Condition()
        self._waiting: deque[Request] = deque()
        self._active: list[Request] = []
        self._calls: deque[tuple[Callable[[], Any], Future]] = deque()
        self._thread: threading.Thread | None = None
        self._closed = False
        self.lanes = runner_lanes(self.batch)
        self._flights: deque[_Flight] = deque()  # launched, not yet landed (in order)
        self._wire_mark = 0  # runner.wire_bytes() when the last step landed

    # ---- requests ------------------------------------------------------------------------------
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

    def submit(self, ids: list[int], params: SamplingParams, sink: Sink) -> Request:
        """Queue a prepared request (see :meth:`prepare`); its events go to ``sink``."""
        req = Request(ids, params, sink)
        with self._cv:
            if self._closed:
                raise EngineError("the engine is closed")
            self._waiting.append(req)
            self.metrics.waiting = len(self._waiting)
            self._start()
            self._cv.notify()
        return req

    def call(self, fn: Callable[[], Any]) -> Future:
        """Run ``fn`` on the scheduler thread, which owns the model, between two steps (one
        call per step: the running decodes go on between two calls); its result or exception
        comes back in the future. For work beside generation (embeddings)."""
        fut: Future = Future()
        with self._cv:
            if self._closed:
                raise EngineError("the engine is closed")
            self._calls.append((fn, fut))
            self._start()
            self._cv.notify()
        return fut

    def _start(self) -> None:
        """Start the scheduler thread (called with the lock held)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="edge-engine", daemon=True)
            self._thread.start()
            # stop between two steps at exit, not in the middle of one (a daemon thread
            # inside torch while the interpreter finalises can abort the process)
            atexit.register(self.close)

    def generate(
        self, prompt: str | Sequence[int], params: SamplingParams
    ) -> Generator[Event, None, None]:
        """Stream a completion. Raises :class:`ConfigError` for a bad request and
        :class:`EngineError` when the runtime fails mid-way. Closing the generator early
        cancels the request."""
        ids = self.prepare(prompt, params)
        q: queue.SimpleQueue = queue.SimpleQueue()
        req = self.submit(ids, params, q.put)
        try:
            while True:
                item = q.get()
                if item is None:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            req.cancel()
            with self._cv:
                self._cv.notify()

    def complete(self, prompt: str | Sequence[int], params: SamplingParams) -> tuple[str, str, int]:
        """Non-streaming: (text, finish_reason, completion token count)."""
        parts, reason, n = [], "length", 0
        for ev in self.generate(prompt, params):
            parts.append(ev.text)
            n += ev.token is not None
            reason = ev.finish_reason or reason
        return "".join(parts), reason, n

    def cached_prefix(self) -> list[int]:
        """The tokens held by the cache slot of the most recently finished request."""
        with self._cv:
            return list(self._slots[self._last_slot].tokens)

    def close(self) -> None:
        """Stop the scheduler; waiting and running requests end with :class:`EngineError`."""
        with self._cv:
            self._closed = True
            self._cv.notify()
        if self._thread is not None:
            atexit.unregister(self.close)
            if self._thread is not threading.current_thread():
                self._thread.join(timeout=30)

    # ---- the scheduler -------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cv:
                while not (self._closed or self._waiting or self._active or self._calls):
                    self._cv.wait()
                if self._closed:
                    pending = list(self._waiting) + self._active
                    calls = list(self._calls)
                    self._waiting.clear()
                    self._active.clear()
                    self._calls.clear()
                    break
                # (a queued call runs when nothing is in flight: it may use the runner)
                call = self._calls.popleft() if self._calls and not self._flights else None
                self._admit()
                room = len(self._flights) < self._lanes_now() and not self._calls
                work = self._plan() if room else []
            if call is not None:
                _run_call(*call)
            if work:
                flight = self._launch(work)
                if flight is not None and flight.pending:
                    self._flights.append(flight)
                elif flight is not None:
                    self._land(flight)
            elif self._flights:
                self._land(self._flights.popleft())
        for r in pending:
            r.sink(EngineError("the engine is closed"))
        for _, fut in calls:
            if fut.set_running_or_notify_cancel():
                fut.set_exception(EngineError("the engine is closed"))

    def _admit(self) -> None:
        """Move waiting requests into free slots (called with the lock held)."""
        for r in [r for r in self._active if r.cancelled and not r.flying]:
            self._finish(r, None, cancelled=True)
        while self._waiting and len(self._active) < self.parallel:
            r = self._waiting[0]
            if r.cancelled:
                self._waiting.popleft()
                self.metrics.requests += 1
                self.metrics.cancelled += 1
                r.sink(None)
                continue
            if not self._place(r):
                break
            self._waiting.popleft()
            self._active.append(r)
            spec = self.speculation
            if spec is not None and drafting_allowed(r.params):
                r.drafter = spec.new_drafter()
                r.draft_len = DraftLength(spec.config, draft_s=self.draft_s)
            m = self.metrics
            m.requests += 1
            m.prompt_tokens += len(r.ids)
        self.metrics.waiting = len(self._waiting)
        self.metrics.running = len(self._active)

    def _place(self, r: Request) -> bool:
        """Give ``r`` a slot, reusing the longest cached prefix of its prompt."""
        b = self.batch
        # at least the last prompt token is recomputed (its logits start the completion);
        # prompt logprobs need every position's logits
        limit = 0 if r.params.prompt_logprobs else len(r.ids) - 1
        best, best_p = -1, 0
        for i, s in enumerate(self._slots):
            held = b.slot_length(i)
            if held < len(s.tokens):  # the runner dropped it (a cluster regrouped)
                s.tokens = s.tokens[:held] if held else []
            p = common_prefix(s.tokens, r.ids, limit)
            if 0 < p < b.slot_floor(i):
                p = 0  # a sliding-window cache dropped keys that restarting at p needs
            # on a tie, a finished slot (reused in place) over a running one (copied from)
            if p > best_p or (p and p == best_p and s.owner is None and self._slots[best].owner):
                best, best_p = i, p
        self.metrics.prefix_lookups += 1
        free = [i for i, s in enumerate(self._slots) if s.owner is None]
        if not free:
            return False
        # reusing a finished slot in place drops what it holds past the shared prefix: when
        # that is most of it (another prompt sharing little more than BOS) and a slot is
        # empty, the prefix goes there instead and the slot keeps its prompt for its repeats
        reuse = best >= 0 and self._slots[best].owner is None
        if reuse and 2 * best_p < len(self._slots[best].tokens):
            reuse = all(self._slots[i].tokens for i in free)
        if reuse:
            target = best
        else:  # an empty slot, else the least recently used finished one
            target = min(free, key=lambda i: (bool(self._slots[i].tokens), self._slots[i].used))
            if best >= 0:  # the prefix is held by a running sequence or a kept slot: copy it
                try:
                    b.copy_prefix(best, target, best_p)
                except RuntimeError:
                    best_p = 0
            else:
                best_p = 0
        slot = self._slots[target]
        slot.tokens = list(r.ids[:best_p])
        slot.owner = r
        r.slot, r.pos = target, best_p
        if best_p:
            self.metrics.prefix_hits += 1
            self.metrics.prefix_tokens_reused += best_p
        return True

    def _lanes_now(self) -> int:
        """Lanes that pay for the running sequences: the runner's ``lanes_for`` where it has
        one (at most ``lanes``; fewer lanes than steps in flight: those land first), else
        ``lanes`` (called with the lock held)."""
        ask = getattr(self.batch, "lanes_for", None) if self.lanes > 1 else None
        return self.lanes if ask is None else max(1, min(self.lanes, int(ask(len(self._active)))))

    def _plan(self) -> list[tuple[Request, Work]]:
        """This step's batch: every decoding sequence's next token, then prompt chunks up to
        ``prefill_chunk`` tokens, oldest request first (called with the lock held)."""
        work: list[tuple[Request, Work]] = []
        active = [r for r in self._active if not r.flying]
        lanes = self._lanes_now()
        if lanes > 1:  # a lane's share of the running sequences (module docstring)
            active = active[: -(-len(self._active) // lanes)]
        for r in active:
            if r.decoding:
                work.append((r, Work(r.slot, (r.next_in,), r.pos, "last")))
        prefilling = len(active) - len(work)
        chunk = self.prefill_chunk
        budget = self.pace.budget(chunk, len(work), prefilling) if work else chunk
        for r in active:
            if r.decoding or budget <= 0:
                continue
            n = min(budget, len(r.ids) - r.pos)
            last = r.pos + n == len(r.ids)
            want: Want = "all" if r.params.prompt_logprobs else ("last" if last else "none")
            work.append((r, Work(r.slot, tuple(r.ids[r.pos : r.pos + n]), r.pos, want)))
            budget -= n
        return work

    def _drafts(self, work: list[tuple[Request, Work]]) -> list[tuple[Request, Work]]:
        """Decoding items whose request drafts become verification groups: the next token
        and k draft tokens, every row's logits wanted (outside the lock: a draft model
        runs here)."""
        out = []
        # with lanes, the sequences of the steps still in flight share the devices' cycle
        # with this one: a draft's rows cost what they add to that cycle (see _land)
        batch = sum(r.decoding for r, _ in work) + self._flying_decodes()[0]
        added = 0  # draft rows of the sequences decided so far: the next ones' rows cost more
        for r, w in work:
            if r.drafter is not None and r.draft_len is not None and r.decoding:
                room = min(r.params.max_tokens - len(r.out) - 1, self.max_context - r.pos - 1)
                k = min(r.draft_len.choose(self.pass_cost, batch, added), room)
                r.draft = r.shadow = None
                if k == 0 and room > 0 and getattr(r.drafter, "free", False):
                    # not verified: compared with the plain step's token (_emit_next)
                    guess = r.drafter.propose(r.ids + r.out, 1, r.sampler).tokens
                    r.shadow = guess[0] if guess else None
                if k > 0:
                    t0 = time.perf_counter()
                    r.draft = r.drafter.propose(r.ids + r.out, k, r.sampler)
                    fed = r.draft.fed if r.draft.fed is not None else len(r.draft.tokens)
                    took = time.perf_counter() - t0
                    r.draft_len.observe_drafting(fed, took, len(r.draft.tokens))
                    self.draft_s = r.draft_len.draft_s or self.draft_s
                if r.draft is not None and r.draft.tokens:
                    w = Work(w.slot, (r.next_in, *r.draft.tokens), w.start, "all")
                    added += len(r.draft.tokens)
                else:
                    r.draft = None
            out.append((r, w))
        return out

    def _launch(self, work: list[tuple[Request, Work]]) -> _Flight | None:
        """Start a step: submitted (lanes), else run whole; None when it failed."""
        if self.speculation is not None:
            try:
                work = self._drafts(work)
            except (LowbandError, RuntimeError) as exc:
                self._fail_all(exc)
                return None
        reqs = [r for r, _ in work]
        needs_all = any(r.params.logprobs is not None or r.params.prompt_logprobs for r in reqs)
        tops = [r.params.candidates for r in reqs]
        top = 0 if needs_all or 0 in tops else max(tops)
        t0 = time.perf_counter()
        if not self._flights:  # (the wire bytes of a token count from here: see _land)
            self._wire_mark = self.runner.wire_bytes()
        pending = self.lanes > 1
        try:
            items = [w for _, w in work]
            if pending:
                result = self.batch.submit(items, top)  # type: ignore[attr-defined]
            else:
                result = self.batch.forward_batch(items, top)
        except (LowbandError, RuntimeError) as exc:
            self._fail_all(exc)
            return None
        finally:
            self.metrics.busy_s += time.perf_counter() - t0
        for r in reqs:
            r.flying = pending
        return _Flight(work, result, pending, t0)

    def _flying_decodes(self) -> tuple[int, bool]:
        """Rows of the steps in flight (lanes) and whether they are all decodes."""
        rows, pure = 0, True
        for f in self._flights:
            for r, w in f.work:
                rows += len(w.ids)
                pure = pure and r.decoding
        return rows, pure

    def _land(self, flight: _Flight) -> None:
        """Take a step's logits (collected from the runner when in flight) and apply them."""
        work, t0 = flight.work, flight.t0
        reqs = [r for r, _ in work]
        for r in reqs:
            r.flying = False
        logits = flight.result
        if flight.pending:
            t1 = time.perf_counter()
            try:
                logits = self.batch.collect(logits)  # type: ignore[attr-defined]
            except (LowbandError, RuntimeError) as exc:
                self._fail_all(exc)
                return
            finally:
                self.metrics.busy_s += time.perf_counter() - t1
        n_decode = sum(len(w.ids) for r, w in work if r.decoding)
        elapsed = time.perf_counter() - t0
        self.pace.observe(n_decode, sum(len(w.ids) for r, w in work if not r.decoding), elapsed)
        if all(r.decoding for r in reqs):
            # A step submitted while others were in flight (lanes) lands after one cycle of
            # the devices, which ran those steps' rows too: its time is the cost of them all
            # (else a draft's rows would look nearly free beside a cycle's worth of seconds)
            others, pure = self._flying_decodes() if flight.pending else (0, True)
            if pure:
                self.pass_cost.observe(n_decode + others, elapsed)
        m = self.metrics
        m.steps += 1
        m.step_sequences += len(work)
        m.step_tokens += sum(len(w.ids) for _, w in work)
        # the wire cost of one token each: the bytes since the last step landed (with lanes,
        # those of the steps in flight beside this one too: a mean over the landings)
        b = self.runner.wire_bytes()
        if all(r.decoding and r.draft is None for r in reqs):
            m.wire_bytes_per_token.append((b - self._wire_mark) / len(work))
        self._wire_mark = b
        with self._cv:
            for (r, w), lg in zip(work, logits):
                slot = self._slots[r.slot]
                slot.tokens.extend(w.ids)
                if not r.decoding:
                    m.prompt_tokens_computed += len(w.ids)
                r.pos += len(w.ids)
                if r.cancelled:
                    continue  # leaves at the next admission pass
                try:
                    if r.draft is not None:
                        assert lg is not None
                        self._accept(r, lg)
                        continue
                    if w.logits == "all":
                        assert lg is not None
                        self._prompt_logprobs(r, w, lg)
                        lg = lg[-1]
                    if lg is not None and r.decoding:
                        self._emit_next(r, lg)
                    elif r.decoding and r.params.max_tokens == 0:
                        self._finish(r, Event("", None, "length", prompt_logprobs=r.prompt_lp))
                except (LowbandError, RuntimeError) as exc:  # e.g. a tokenizer that fails
                    self._finish(r, EngineError(f"generation failed: {exc}"), failed=True)

    def _prompt_logprobs(self, r: Request, w: Work, lg: torch.Tensor) -> None:
        """Log-probabilities of the prompt tokens predicted by rows of this chunk."""
        lp = torch.log_softmax(lg.float(), dim=-1)
        k = r.params.logprobs or 0
        if w.start == 0:
            r.prompt_lp.append((w.ids[0], None, ()))
        for j in range(len(w.ids)):  # row j predicts prompt token start + j + 1
            t = w.start + j + 1
            if t >= len(r.ids):
                break
            tok = r.ids[t]
            r.prompt_lp.append((tok, float(lp[j, tok]), _top(lp[j], k)))

    def _accept(self, r: Request, logits: torch.Tensor) -> None:
        """A verification group's result (called with the lock held): emit the accepted
        draft tokens and the target's own next token, and roll the cache back past the
        rejected ones (their K/V are overwritten by the next step)."""
        draft, r.draft = r.draft, None
        assert draft is not None and r.draft_len is not None
        toks, accepted = verify(draft, logits, r.sampler)
        back = len(draft.tokens) - accepted  # rows beyond next_in + the accepted drafts
        if back:
            r.pos -= back
            slot = self._slots[r.slot]
            del slot.tokens[len(slot.tokens) - back :]
            truncate = getattr(self.batch, "truncate", None)
            if truncate is not None:
                truncate(r.slot, r.pos)
        r.draft_len.observe(len(draft.tokens), accepted)
        m = self.metrics
        m.spec_passes += 1
        m.spec_drafted += len(draft.tokens)
        m.spec_accepted += accepted
        m.spec_emitted += len(toks)
        for j, tok in enumerate(toks):
            if not self._emit(r, tok, logits[j]):
                return

    def _emit_next(self, r: Request, logits: torch.Tensor) -> None:
        if r.params.max_tokens == 0:  # prompt logprobs only (echo)
            self._finish(r, Event("", None, "length", prompt_logprobs=r.prompt_lp))
            return
        tok = r.sampler(logits)
        if r.shadow is not None and r.draft_len is not None:
            r.draft_len.observe_shadow(tok == r.shadow)
            r.shadow = None
        self._emit(r, tok, logits)

    def _emit(self, r: Request, tok: int, logits: torch.Tensor) -> bool:
        """Emit ``tok`` (drawn from ``logits``); False when it ended the request."""
        p, m = r.params, self.metrics
        lp: float | None = None
        tops: tuple[tuple[int, float], ...] = ()
        if p.logprobs is not None:
            logp = torch.log_softmax(logits.float(), dim=-1)
            lp, tops = float(logp[tok]), _top(logp, p.logprobs)
        extra = {"prompt_logprobs": r.prompt_lp} if p.prompt_logprobs and not r.out else {}
        eos = self.tokenizer.eos_token_id
        if not p.ignore_eos and (tok == eos or tok in p.stop_token_ids or r.sampler.grammar_done):
            self._finish(r, Event(r.stops.flush(), None, "stop", lp, tops, **extra))
            return False
        now = time.perf_counter()
        if not r.out:
            m.ttft_s.append(now - r.t_submit)
        else:
            m.token_s.append(now - r.t_last)
        r.t_last = now
        r.out.append(tok)
        m.completion_tokens += 1
        text = self.tokenizer.decode(r.out)
        last = len(r.out) == p.max_tokens
        if text.endswith("\ufffd") and not last:  # an incomplete UTF-8 sequence: wait for more
            piece = ""
        else:  # (the last token shows what it has: U+FFFD for a cut sequence, as OpenAI's)
            piece, r.shown = text[len(r.shown) :], text
        visible = r.stops.feed(piece)
        if r.stops.stopped:
            self._finish(r, Event(visible, tok, "stop", lp, tops, **extra))
            return False
        if last:
            self._finish(r, Event(visible + r.stops.flush(), tok, "length", lp, tops, **extra))
            return False
        if r.sampler.ended and p.logprobs is None and not p.ignore_eos:
            # the grammar allows only an end token now: end here instead of a step to draw it
            self._finish(r, Event(visible + r.stops.flush(), tok, "stop", lp, tops, **extra))
            return False
        r.sink(Event(visible, tok, None, lp, tops, **extra))
        r.next_in = tok
        return True

    def _finish(
        self,
        r: Request,
        last: Event | BaseException | None,
        *,
        failed: bool = False,
        cancelled: bool = False,
    ) -> None:
        """End ``r`` (called with the lock held): its last event, then the end mark."""
        if r in self._active:
            self._active.remove(r)
        if r.drafter is not None:
            r.drafter.close()
            r.drafter = None
        slot = self._slots[r.slot]
        slot.owner, slot.used = None, time.perf_counter()
        self._last_slot = r.slot
        m = self.metrics
        m.failed += failed
        m.cancelled += cancelled
        m.running = len(self._active)
        if last is not None:
            r.sink(last)
        if not isinstance(last, BaseException):
            r.sink(None)

    def _fail_all(self, exc: BaseException) -> None:
        """The runtime failed mid-step: every running request fails, every cache is dropped."""
        err = exc if isinstance(exc, EngineError) else EngineError(f"generation failed: {exc}")
        if not isinstance(exc, EngineError):
            err.__cause__ = exc
        with self._cv:
            self._flights.clear()  # (the runner's reset below drops their answers)
            for r in list(self._active):
                r.flying = False
                self._finish(r, err, failed=True)
            for s in self._slots:
                s.tokens = []
        try:
            self.runner.reset()
        except (LowbandError, RuntimeError) as e:  # the next request reports it
            logger.warning("resetting the runner failed: %s", e)


def _run_call(fn: Callable[[], Any], fut: Future) -> None:
    if not fut.set_running_or_notify_cancel():
        return  # the caller gave up on it
    try:
        fut.set_result(fn())
    except Exception as exc:  # noqa: BLE001 - whatever it raised is the caller's answer
        fut.set_exception(exc)


def _top(logp: torch.Tensor, k: int) -> tuple[tuple[int, float], ...]:
    if k <= 0:
        return ()
    v, i = torch.topk(logp, min(k, logp.shape[-1]))
    return tuple(zip(i.tolist(), v.tolist()))
