"""Token sampling (greedy, temperature, top-k, top-p, seed) and stop-sequence matching.

Masks are pure functions of the logits so they can be tested on their own; :class:`Sampler`
owns the random generator so a fixed ``seed`` reproduces a completion exactly.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from lowband.errors import ConfigError

MAX_LOGPROBS = 20  # alternatives per token, as OpenAI allows


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

    @property
    def candidates(self) -> int:
        """How many of the largest logits :class:`Sampler` can pick from: 1 when greedy, top_k
        when set (top_p then renormalises over those k), 0 (any token) otherwise."""
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


class Sampler:
    """Draws tokens for one completion."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self._gen = torch.Generator()
        if params.seed is not None:
            self._gen.manual_seed(params.seed)
        else:
            self._gen.seed()

    def __call__(self, logits: torch.Tensor) -> int:
        """logits: (V,) for the next position."""
        if self.params.temperature == 0.0:
            return int(torch.argmax(logits).item())
        return self.draw(self.probs(logits))

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """The distribution (V,) float32 this sampler draws from: one-hot at the argmax when
        greedy, else softmax(logits / T) after top-k and top-p (speculative rejection uses it
        as the target's p and a draft model's q)."""
        p = self.params
        if p.temperature == 0.0:
            out = torch.zeros(logits.shape[-1], dtype=torch.float32)
            out[int(torch.argmax(logits).item())] = 1.0
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
