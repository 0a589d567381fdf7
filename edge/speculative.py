"""Exact speculative decoding: a cheap drafter proposes k tokens, the target model scores all
k + 1 positions in one pass, and the tokens kept are exactly what the target alone would
have produced (greedy: bit for bit; sampled: the same distribution).

The rule (Leviathan et al. 2023, Chen et al. 2023, "speculative sampling"): for draft token
d_j proposed with probability q_j(d_j), accept it with probability min(1, p_j(d_j) / q_j(d_j))
where p_j is the target's distribution at that position; at the first rejection draw the
replacement from the normalised residual (p_j - q_j)+ and stop; when all k are accepted, draw
one more token from p_k (the pass computed it anyway). A deterministic drafter (prompt lookup)
has a one-hot q, so a draft token is kept with probability p_j(d_j) and a rejection draws from
p_j with d_j removed. Greedy is the special case of a one-hot p: keep d_j while it is the
argmax.

Everything here is pure (the engine owns the model, the caches and the rollback):
:func:`verify` turns a pass's logits into the tokens to emit, :class:`DraftLength` picks k from
the running acceptance rate and the measured cost of a pass (:class:`PassCost`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence

import torch

from edge.sampling import Sampler, SamplingParams
from lowband.errors import ConfigError
from lowband.models.llama import ROWWISE_ROWS

MAX_DRAFT = ROWWISE_ROWS - 1
"""The most draft tokens per pass: the verification group (k + 1 rows) stays within the rows
that compute exactly as single-token decodes do (``lowband.models.llama.ROWWISE_ROWS``)."""


@dataclass(frozen=True, kw_only=True)
class SpecConfig:
    """How many tokens a drafter may propose per target pass (k, adapted in [min, max])."""

    draft_max: int = 8
    """k_max: the most draft tokens per pass (at most ``MAX_DRAFT``)."""
    draft_min: int = 1
    """k_min: the fewest draft tokens per pass while drafting at all."""
    adaptive: bool = True
    """Choose k from the running acceptance rate α and the pass cost; False: always k_max."""

    def __post_init__(self) -> None:
        if not 1 <= self.draft_max <= MAX_DRAFT:
            raise ConfigError("draft_max", f"must be in [1, {MAX_DRAFT}], got {self.draft_max}")
        if not 1 <= self.draft_min <= self.draft_max:
            raise ConfigError(
                "draft_min", f"must be in [1, draft_max={self.draft_max}], got {self.draft_min}"
            )


@dataclass(frozen=True)
class Draft:
    """Proposed tokens and, for a drafter that samples, the distributions they were drawn
    from: q (k, V) float32; None: deterministic (one-hot q)."""

    tokens: tuple[int, ...]
    q: torch.Tensor | None = None


class Drafter(Protocol):
    """One request's drafter (it may keep state, e.g. a draft model's KV cache)."""

    def propose(self, tokens: Sequence[int], k: int, sampler: Sampler) -> Draft:
        """Up to ``k`` tokens to follow ``tokens`` (the prompt and the output so far)."""
        ...

    def close(self) -> None: ...


def drafting_allowed(params: SamplingParams) -> bool:
    """Whether a request may be drafted for. Requests whose logits go through a processor
    (repetition penalties, logit_bias, min_p, typical_p, a grammar: ``params.processed``) are
    decoded one token per pass, never verified row by row: a penalty or a grammar state at a
    position depends on the tokens accepted before it, which :func:`verify` does not model."""
    return not params.processed


def verify(draft: Draft, logits: torch.Tensor, sampler: Sampler) -> tuple[list[int], int]:
    """The tokens to emit for one verification pass and how many draft tokens were accepted.
    ``logits``: (k + 1, V), row j the target's next-token logits after draft token j - 1
    (row 0 after the sequence's last real token)."""
    k = len(draft.tokens)
    if logits.shape[0] != k + 1:
        raise ValueError(f"need {k + 1} rows of logits for {k} draft tokens, got {logits.shape}")
    out: list[int] = []
    if sampler.params.temperature == 0.0:  # greedy: keep d_j while it is the target's argmax
        for j in range(k + 1):
            t = int(torch.argmax(logits[j]).item())
            out.append(t)
            if j == k or t != draft.tokens[j]:
                return out, j
        raise AssertionError("unreachable")
    for j, d in enumerate(draft.tokens):
        p = sampler.probs(logits[j])
        q_d = 1.0 if draft.q is None else float(draft.q[j, d])
        if q_d > 0.0 and sampler.uniform() * q_d < float(p[d]):  # u < min(1, p/q)
            out.append(d)
            continue
        if draft.q is None:
            residual = p.clone()
            residual[d] = 0.0
        else:
            residual = (p - draft.q[j]).clamp_min(0.0)
        if float(residual.sum()) <= 0.0:  # p == q up to rounding: any draw from p is right
            residual = p
        out.append(sampler.draw(residual))
        return out, j
    out.append(sampler.draw(sampler.probs(logits[k])))
    return out, k


class PassCost:
    """A target pass of r rows costs about ``base + per_row * r`` seconds: fitted by least
    squares over recent passes with exponential forgetting (like ``engine.Pace``)."""

    def __init__(self, weight: float = 0.1) -> None:
        self.weight = weight
        self._s = [0.0] * 5  # decayed sums of w, w r, w r^2, w y, w r y

    def observe(self, rows: int, seconds: float) -> None:
        x, keep = float(rows), 1.0 - self.weight
        for i, v in enumerate((1.0, x, x * x, seconds, x * seconds)):
            self._s[i] = keep * self._s[i] + v

    def relative(self, rows: int) -> float:
        """Cost of a pass of ``rows`` rows over a one-row pass (1 + (rows-1) c; c = 0.05
        until passes of two sizes were seen)."""
        w, sx, sxx, sy, sxy = self._s
        den = w * sxx - sx * sx
        c = 0.05
        if w > 0 and den > 1e-9 * max(w * sxx, 1e-30):
            per_row = (w * sxy - sx * sy) / den
            base = (sy - per_row * sx) / w
            if per_row > 0 and base > 0:
                c = per_row / (base + per_row)
        return 1.0 + (rows - 1) * c


@dataclass
class DraftLength:
    """Picks k for the next pass: the k in [k_min, k_max] maximising expected tokens per
    unit cost, E[tokens | k] / cost(k + 1 rows), with E = (1 - α^(k+1)) / (1 - α) for a
    per-token acceptance rate α (Leviathan et al. eq. 1), α a running average."""

    config: SpecConfig
    alpha: float = 0.6  # prior before any pass
    weight: float = 0.1
    history: list[int] = field(default_factory=list)

    def observe(self, drafted: int, accepted: int) -> None:
        if drafted > 0:
            a = accepted / drafted
            self.alpha = (1.0 - self.weight) * self.alpha + self.weight * a

    def choose(self, cost: PassCost) -> int:
        c = self.config
        if not c.adaptive:
            return c.draft_max
        a = min(max(self.alpha, 0.0), 0.99)
        best, best_v = c.draft_min, -1.0
        for k in range(c.draft_min, c.draft_max + 1):
            v = (1.0 - a ** (k + 1)) / (1.0 - a) / cost.relative(k + 1)
            if v > best_v + 1e-9:
                best, best_v = k, v
        return best


@dataclass(frozen=True)
class Speculation:
    """What the engine needs to speculate: the draft lengths, and a drafter per request."""

    config: SpecConfig
    new_drafter: Callable[[], Drafter]
