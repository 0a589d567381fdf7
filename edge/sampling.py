"""Token sampling (greedy, temperature, top-k, top-p, seed), llama.cpp's logit processors
(repetition, frequency and presence penalties, logit bias, min-p, locally typical sampling), an
optional grammar constraint, and stop-sequence matching.

Masks are pure functions of the logits so they can be tested on their own; :class:`Sampler`
owns the random generator so a fixed ``seed`` reproduces a completion exactly.

Order, as llama.cpp's default sampler chain (``common_sampler_init``): logit bias, penalties,
grammar, then (llama.cpp's ``typ_p``, ``min_p``) on the untempered logits, then temperature,
top-k and top-p as before. A request that sets none of the processors takes the plain path
(no copy of the logits, and the runner may still return only its top candidates).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

import numpy as np
import torch

from lowband.errors import ConfigError

MAX_LOGPROBS = 20  # alternatives per token, as OpenAI allows
MAX_LOGIT_BIAS = 1024  # entries of logit_bias (OpenAI allows 300)
BAN = -100.0  # a logit bias this low bans the token (OpenAI's "-100 should ban")


class Constraint(Protocol):
    """One completion's grammar state. ``stopped``: the grammar is complete and allows nothing
    more, so only an end token could be drawn next. ``done``: one of its end tokens was drawn
    (the completion ends with it). ``check_first``: :class:`Sampler` may draw from the
    unconstrained logits first and ask :meth:`allows` (a cheap test of one token) before asking
    for the whole :meth:`mask` (see ``Sampler.__call__`` for when that is exact)."""

    stopped: bool
    done: bool
    check_first: bool

    def allows(self, token: int) -> bool:
        """Whether the grammar accepts ``token`` next: exactly the tokens :meth:`mask` keeps."""
        ...

    def sparse(self) -> Any:
        """The allowed ids (an ascending int array) when they are few, else None."""
        ...

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` (V,) float with every token the grammar forbids now set to -inf; the end
        tokens are allowed exactly when the grammar may end here."""
        ...

    def advance(self, token: int) -> None:
        """Consume the token drawn (an end token ends the grammar)."""
        ...


class ConstraintFactory(Protocol):
    def __call__(self) -> Constraint: ...


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How one completion is drawn. ``temperature == 0`` is greedy (top-k/top-p ignored)."""

    max_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1.0: off
    seed: int | None = None
    stop: tuple[str, ...] = field(default=())
    stop_token_ids: tuple[int, ...] = field(default=())
    """Tokens that end the completion like EOS (a chat template's end of turn, e.g.
    ``<|eot_id|>``: a special token that decodes to no text, so no stop string can see it)."""
    logprobs: int | None = None
    """None: no log-probabilities; k >= 0: each generated token's log-probability and the k
    most likely alternatives (at most ``MAX_LOGPROBS``)."""
    prompt_logprobs: bool = False
    """Also the log-probability of every prompt token (``echo`` with ``logprobs``: what
    evaluation harnesses score with); the prompt is then computed in full, not reused."""
    ignore_eos: bool = False
    """Keep generating past the end-of-sequence token (benchmarks: a fixed output length)."""
    repeat_penalty: float = 1.0
    """llama.cpp's repetition penalty (CTRL, with the negative-logit fix): a token seen in the
    last ``repeat_last_n`` tokens has a positive logit divided by it, a negative one multiplied."""
    repeat_last_n: int = 64
    """The window of the three penalties, in tokens of prompt and completion (llama.cpp's
    ``penalty_last_n``): 0 disables them, -1 is the whole sequence."""
    frequency_penalty: float = 0.0
    """Subtracted from a token's logit once per occurrence in the window (OpenAI, llama.cpp)."""
    presence_penalty: float = 0.0
    """Subtracted from a token's logit when it occurs in the window at all."""
    min_p: float = 0.0
    """Drop tokens whose probability is below ``min_p`` times the most likely one's."""
    typical_p: float = 1.0
    """Locally typical sampling (Meister et al. 2022) as llama.cpp's ``typ_p``; 1.0: off."""
    logit_bias: tuple[tuple[int, float], ...] = field(default=())
    """(token id, bias) added to the logits before anything else; -100 or less bans it."""
    constraint: Any = field(default=None, compare=False)
    """A :class:`ConstraintFactory` (a compiled grammar), or None: each completion asks it
    for a fresh :class:`Constraint` that masks the logits to what the grammar allows."""

    def __post_init__(self) -> None:
        if self.max_tokens < 0 or (self.max_tokens == 0 and not self.prompt_logprobs):
            raise ConfigError(
                "max_tokens", f"must be >= 1 (0 only with prompt logprobs), got {self.max_tokens}"
            )
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ConfigError("logprobs", f"must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if not 0.0 <= self.temperature <= 100.0:
            raise ConfigError("temperature", f"must be in [0, 100], got {self.temperature}")
        if self.top_k < 0:
            raise ConfigError("top_k", f"must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError("top_p", f"must be in (0, 1], got {self.top_p}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ConfigError("stop", "stop sequences must be non-empty strings")
        if not 0.0 < self.repeat_penalty <= 10.0:
            raise ConfigError("repeat_penalty", f"must be in (0, 10], got {self.repeat_penalty}")
        if self.repeat_last_n < -1:
            raise ConfigError("repeat_last_n", f"must be >= -1, got {self.repeat_last_n}")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ConfigError(name, f"must be in [-2, 2], got {getattr(self, name)}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ConfigError("min_p", f"must be in [0, 1], got {self.min_p}")
        if not 0.0 < self.typical_p <= 1.0:
            raise ConfigError("typical_p", f"must be in (0, 1], got {self.typical_p}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise ConfigError("logit_bias", f"at most {MAX_LOGIT_BIAS} entries")
        for tok, bias in self.logit_bias:
            if not -100.0 <= bias <= 100.0 or tok < 0:
                raise ConfigError("logit_bias", f"bias {bias} of token {tok} outside [-100, 100]")

    @property
    def penalised(self) -> bool:
        """Whether any of the three penalties changes a logit."""
        return self.repeat_last_n != 0 and (
            self.repeat_penalty != 1.0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
        )

    @property
    def processed(self) -> bool:
        """Whether the logits go through a processor before temperature (then every logit must
        be exact: no top-candidate shortcut)."""
        return (
            self.penalised
            or bool(self.logit_bias)
            or self.min_p > 0.0
            or self.typical_p < 1.0
            or self.constraint is not None
        )

    @property
    def candidates(self) -> int:
        """How many of the largest logits :class:`Sampler` can pick from: 1 when greedy, top_k
        when set (top_p then renormalises over those k), 0 (any token) otherwise or when a
        processor needs every logit."""
        if self.processed:
            return 0
        return 1 if self.temperature == 0.0 else self.top_k


def top_k_mask(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Logits with everything below the k-th largest set to -inf (ties at the k-th kept)."""
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_mask(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Nucleus: keep the smallest set of most likely tokens whose probability reaches ``p``."""
    if p >= 1.0:
        return logits
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    probs = torch.softmax(sorted_logits.float(), dim=-1)
    before = probs.cumsum(-1) - probs  # mass strictly before each token
    drop_sorted = before >= p  # the first token always survives (before == 0)
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def _view(x: torch.Tensor) -> np.ndarray | None:
    """``x`` as a NumPy array sharing its memory (a CPU float tensor without grad), else None.
    A sampler's per-token work on a (V,) row is a few small gathers and scatters plus one
    reduction; NumPy does each in ~1-25 us where a torch op costs its dispatch (a few us each)
    and ``torch.argmax`` over 262144 floats measured 140-290 us against ``np.argmax``'s ~25 us
    on the 2-core test machine."""
    if x.device.type != "cpu" or x.requires_grad or x.dtype not in (torch.float32, torch.float64):
        return None
    return x.numpy()


def argmax(x: torch.Tensor) -> int:
    """The index of the first largest value of ``x`` (V,), NaN counting as the largest, as
    ``torch.argmax`` does (and ``np.argmax``, used when ``x`` has a NumPy view)."""
    xn = _view(x)
    return int(np.argmax(xn)) if xn is not None else int(torch.argmax(x).item())


def apply_logit_bias(logits: torch.Tensor, bias: Sequence[tuple[int, float]]) -> torch.Tensor:
    """``logits`` (V,) plus each (token, bias); a bias <= ``BAN`` bans the token (-inf), as
    OpenAI documents -100. Tokens outside the vocabulary are ignored (as llama.cpp does)."""
    v = logits.shape[-1]
    xn = _view(logits)
    for tok, b in bias:
        if 0 <= tok < v:
            if xn is not None:  # a scalar write to the view: no torch dispatch per entry
                xn[tok] = -np.inf if b <= BAN else xn[tok] + b
            else:
                logits[tok] = float("-inf") if b <= BAN else logits[tok] + b
    return logits


def apply_penalties(
    logits: torch.Tensor,
    history: Sequence[int],
    *,
    last_n: int,
    repeat: float,
    frequency: float,
    presence: float,
) -> torch.Tensor:
    """llama.cpp's penalties sampler on ``logits`` (V,), in place: for each token seen ``c``
    times in the last ``last_n`` of ``history`` (-1: all of it), its logit ``l`` becomes
    ``(l * repeat if l <= 0 else l / repeat) - c * frequency - presence``. Sparse: a gather
    and a scatter over the distinct ids of the window, nothing over the vocabulary."""
    if last_n == 0 or not history:
        return logits
    window = history if last_n < 0 else history[-last_n:]
    v = logits.shape[-1]
    counts = Counter(t for t in window if 0 <= t < v)
    if not counts:
        return logits
    xn = _view(logits)
    if xn is None:
        toks = torch.tensor(list(counts), dtype=torch.long)
        c = torch.tensor(list(counts.values()), dtype=logits.dtype)
        x = logits[toks]
        x = torch.where(x <= 0, x * repeat, x / repeat)
        logits[toks] = x - c * frequency - presence
        return logits
    ids = np.fromiter(counts, np.int64, len(counts))
    cn = np.fromiter(counts.values(), xn.dtype, len(counts))
    xs = xn[ids]
    xn[ids] = np.where(xs <= 0, xs * repeat, xs / repeat) - cn * frequency - presence
    return logits


def min_p_mask(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Drop every token whose probability is below ``p`` times the largest: ``l < max + ln p``."""
    if p <= 0.0:
        return logits
    floor = logits.max() + math.log(p)
    return logits.masked_fill(logits < floor, float("-inf"))


def typical_mask(logits: torch.Tensor, p: float, min_keep: int = 1) -> torch.Tensor:
    """llama.cpp's locally typical sampling: sort tokens by ``|-log p_i - H|`` (H the entropy)
    and keep the first ones until their probability sum exceeds ``p`` (at least ``min_keep``)."""
    if p >= 1.0:
        return logits
    logp = torch.log_softmax(logits.float(), dim=-1)
    probs = logp.exp()
    entropy = -torch.nansum(probs * logp)
    shifted = (-logp - entropy).abs()
    order = torch.argsort(shifted, stable=True)
    cum = probs[order].cumsum(-1)
    over = torch.nonzero(cum > p)
    keep = int(over[0].item()) + 1 if over.numel() else order.numel()
    keep = max(keep, min_keep)
    drop = torch.ones_like(logits, dtype=torch.bool)
    drop[order[:keep]] = False
    return logits.masked_fill(drop, float("-inf"))


class Sampler:
    """Draws tokens for one completion. ``prompt``: the tokens before it, which the penalties
    see (as llama-server feeds the prompt to its penalties sampler)."""

    def __init__(self, params: SamplingParams, prompt: Sequence[int] = ()) -> None:
        self.params = params
        self._gen = torch.Generator()
        if params.seed is not None:
            self._gen.manual_seed(params.seed)
        else:
            self._gen.seed()
        self.history: list[int] | None = list(prompt) if params.penalised else None
        self._buf: torch.Tensor | None = None  # the processed logits (see _adjust)
        self._below: np.ndarray | None = None  # min-p's mask of them (see _truncate)
        self.constraint: Constraint | None = (
            params.constraint() if params.constraint is not None else None
        )
        # Draw first, mask only if the draw is rejected: exact when greedy (an allowed argmax is
        # the masked argmax; typical-p could drop it, min-p never does) and when sampling
        # without truncation (rejection sampling: an allowed token t is kept with p(t), and a
        # rejection, probability 1 - p(A), redraws from p restricted to the allowed set A, so
        # P(t) = p(t) + (1 - p(A)) p(t) / p(A) = p(t) / p(A), the masked distribution). Top-k,
        # top-p and min-p cut relative to the masked distribution, so they mask first.
        greedy = params.temperature == 0.0
        untruncated = params.top_k == 0 and params.top_p == 1.0 and params.min_p == 0.0
        self._check_first = (
            self.constraint is not None
            and self.constraint.check_first
            and params.typical_p == 1.0
            and (greedy or untruncated)
        )

    def process(self, logits: torch.Tensor, drawing: bool = False) -> torch.Tensor:
        """The logits after bias, penalties, grammar, typical-p and min-p (a float copy, in this
        sampler's buffer until its next call); ``logits`` itself is left as the model gave it
        (logprobs report those). ``drawing``: see :meth:`_truncate`."""
        x = self._adjust(logits)
        if self.constraint is not None:
            x = self.constraint.mask(x)
        return self._truncate(x, drawing)

    def _adjust(self, logits: torch.Tensor) -> torch.Tensor:
        """A float copy of ``logits`` after logit bias and penalties (in this sampler's own
        buffer, valid until the next call: a fresh 1 MB tensor per token at 262k tokens
        costs its page faults every time, ~0.5 ms measured, per stream per step)."""
        p = self.params
        src = logits.float()
        if self._buf is None or self._buf.shape != src.shape:
            self._buf = torch.empty_like(src)
        x = self._buf.copy_(src)
        if p.logit_bias:
            apply_logit_bias(x, p.logit_bias)
        if self.history is not None:
            apply_penalties(
                x,
                self.history,
                last_n=p.repeat_last_n,
                repeat=p.repeat_penalty,
                frequency=p.frequency_penalty,
                presence=p.presence_penalty,
            )
        return x

    def _truncate(self, x: torch.Tensor, drawing: bool = False) -> torch.Tensor:
        """Typical-p, then min-p: in place when ``x`` is this sampler's buffer, and not at all
        when ``drawing`` greedily (only the argmax is taken from the result, and min-p never
        drops the largest logit: a full-vocabulary pass that cannot change the token)."""
        p = self.params
        x = typical_mask(x, p.typical_p)
        if p.min_p <= 0.0 or (drawing and p.temperature == 0.0):
            return x
        xn = _view(x) if x is self._buf else None
        if xn is None:
            return min_p_mask(x, p.min_p)
        if self._below is None or self._below.shape != xn.shape:
            self._below = np.empty(xn.shape, dtype=bool)
        np.less(xn, xn.max() + math.log(p.min_p), out=self._below)  # as min_p_mask
        np.putmask(xn, self._below, -np.inf)
        return x

    def __call__(self, logits: torch.Tensor) -> int:
        """logits: (V,) for the next position."""
        p = self.params
        if p.processed:
            c = self.constraint
            if c is not None and self._check_first:
                # no copy to draw from when nothing but the grammar changes the logits
                adjusted = bool(p.logit_bias) or self.history is not None
                x = self._adjust(logits) if adjusted else logits
                tok = self._draw(self._truncate(x, drawing=True))
                if not c.allows(tok):
                    tok = self._redraw(c, logits, x if adjusted else None)
            else:
                tok = self._draw(self.process(logits, drawing=True))
            if self.history is not None:
                self.history.append(tok)
            if self.constraint is not None:
                self.constraint.advance(tok)
            return tok
        return self._draw(logits)

    def _redraw(self, c: Constraint, logits: torch.Tensor, x: torch.Tensor | None) -> int:
        """The draw from the masked logits after the grammar rejected the unconstrained one
        (``x``: the adjusted logits, None when nothing but the grammar changes them). Greedy
        over few allowed ids (forced text, a JSON string's next character): the best of them,
        the first of equal maxima as argmax over the masked vector takes; else the mask, in
        place on a copy (drawn from already)."""
        ids = c.sparse() if self.params.temperature == 0.0 else None
        if ids is not None:
            src = logits.float() if x is None else x
            idx = torch.from_numpy(ids[ids < src.shape[-1]])
            return int(idx[int(torch.argmax(src[idx]))])
        x = self._adjust(logits) if x is None else x
        return self._draw(self._truncate(c.mask(x), drawing=True))

    @property
    def grammar_done(self) -> bool:
        """The grammar took one of its end tokens (an end of turn the request's own stop list
        may not name): nothing after it would be constrained, so the completion ends there."""
        return self.constraint is not None and self.constraint.done

    @property
    def ended(self) -> bool:
        """The grammar is complete and allows nothing more: the completion can end without
        another step (whose only possible draw is an end token)."""
        return self.constraint is not None and self.constraint.stopped

    def _draw(self, logits: torch.Tensor) -> int:
        if self.params.temperature == 0.0:
            return argmax(logits)
        return self.draw(self.probs(logits))

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """The distribution (V,) float32 this sampler draws from: one-hot at the argmax when
        greedy, else softmax(logits / T) after top-k and top-p (speculative rejection uses it
        as the target's p and a draft model's q; requests whose logits are processed, see
        ``SamplingParams.processed``, are not drafted for)."""
        p = self.params
        if p.temperature == 0.0:
            out = torch.zeros(logits.shape[-1], dtype=torch.float32)
            out[argmax(logits)] = 1.0
            return out
        x = logits.float() / p.temperature
        return torch.softmax(top_p_mask(top_k_mask(x, p.top_k), p.top_p), dim=-1)

    def draw(self, probs: torch.Tensor) -> int:
        """One token from ``probs`` (non-negative, not necessarily normalised)."""
        return int(torch.multinomial(probs, 1, generator=self._gen).item())

    def uniform(self) -> float:
        """U(0, 1) from this sampler's generator (the accept test of speculative decoding)."""
        return float(torch.rand((), generator=self._gen).item())


class StopMatcher:
    """Streams text while hiding any stop sequence: text that might be the start of a stop
    sequence is held back until it is known not to be one."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = stops
        self._pending = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        """Add newly decoded text; return what may be shown now. Sets ``stopped`` on a match."""
        if self.stopped:
            return ""
        buf = self._pending + text
        hits = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped = True
            self._pending = ""
            return buf[: min(hits)]
        hold = 0
        for s in self.stops:  # longest suffix of buf that is a proper prefix of a stop string
            for n in range(min(len(s) - 1, len(buf)), hold, -1):
                if buf.endswith(s[:n]):
                    hold = n
                    break
        self._pending = buf[len(buf) - hold :] if hold else ""
        return buf[: len(buf) - hold]

    def flush(self) -> str:
        """Text held back when generation ends without a match."""
        out, self._pending = self._pending, ""
        return "" if self.stopped else out
