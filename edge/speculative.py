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

import bisect
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
    fed: int | None = None
    """Positions a draft model ran to propose them (catching up on the tokens it had not
    seen, then one per proposed token but the last); None: ``len(tokens)``."""


class Drafter(Protocol):
    """One request's drafter (it may keep state, e.g. a draft model's KV cache)."""

    def propose(self, tokens: Sequence[int], k: int, sampler: Sampler) -> Draft:
        """Up to ``k`` tokens to follow ``tokens`` (the prompt and the output so far)."""
        ...

    def close(self) -> None: ...


def common_prefix(a: Sequence[int], b: Sequence[int], limit: int | None = None) -> int:
    """How many leading tokens ``a`` and ``b`` share (at most ``limit``): what a kept KV cache
    of ``a`` can serve a sequence ``b`` (the engine's slots, a draft model's caches)."""
    n, m = 0, min(len(a), len(b), len(a) if limit is None else limit)
    while n < m and a[n] == b[n]:
        n += 1
    return n


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
        best = logits.argmax(dim=-1).tolist()  # one call for every row
        for j in range(k + 1):
            out.append(best[j])
            if j == k or best[j] != draft.tokens[j]:
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
    """What a target pass of R rows costs, in seconds: a running average per row count seen
    (the cost need not be linear in R: an fp32 head's row tiles stop fitting the cache past a
    few rows), else ``base + per_row * R`` fitted by least squares over recent passes with
    exponential forgetting (like ``engine.Pace``); the last well-conditioned fit is kept
    while recent passes all had one size (a stream that stopped drafting runs one-row passes
    only)."""

    PRIOR = 0.05
    HORIZON = 48
    """Passes after which a row count's mean no longer describes the machine: left out, the
    costs there come from the counts seen since (a plain pass of a batch where every step
    drafts is never measured again, and its first, slow mean would stay)."""
    """Per-row cost over a one-row pass assumed until passes of two sizes were seen."""

    def __init__(self, weight: float = 0.1) -> None:
        self.weight = weight
        self._s = [0.0] * 5  # decayed sums of w, w r, w r^2, w y, w r y
        self._fit: tuple[float, float] | None = None  # (base, per_row) seconds
        self._by_rows: dict[int, float] = {}  # R -> running mean seconds
        self._table: tuple[list[int], list[float]] | None = None  # seconds()'s, per observe
        self._passes = 0
        self._seen: dict[int, int] = {}  # R -> the pass that last had R rows
        self._memo: dict[tuple[int, int, int], list[float]] = {}  # relatives(), per observe

    def observe(self, rows: int, seconds: float) -> None:
        x, keep = float(rows), 1.0 - self.weight
        for i, v in enumerate((1.0, x, x * x, seconds, x * seconds)):
            self._s[i] = keep * self._s[i] + v
        w, sx, sxx, sy, sxy = self._s
        den = w * sxx - sx * sx
        if w > 0 and den > 1e-6 * max(w * sxx, 1e-30):
            per_row = (w * sxy - sx * sy) / den
            base = (sy - per_row * sx) / w
            if per_row > 0 and base > 0:
                self._fit = (base, per_row)
        old = self._by_rows.get(rows)
        self._by_rows[rows] = seconds if old is None else _toward(old, seconds)
        self._passes += 1
        self._seen[rows] = self._passes
        self._table = None
        self._memo = {}

    def seconds(self, rows: int) -> float | None:
        """Expected seconds of a pass of ``rows`` rows (None before any pass): the running
        means of the row counts seen in the last ``HORIZON`` passes, made non-decreasing in
        R (a pass of more rows never costs less: the least-squares non-decreasing fit,
        adjacent means out of order pooled) and interpolated linearly between them; past the
        largest (or below the smallest) the fit's per-row slope continues from the nearest
        one (without a fit, ``PRIOR`` of that count's mean per row, per row). Never the fit's
        own value beside a measured mean: the two disagree by more than a row's cost, and a
        difference of the two would make a row look free or dear by that much."""
        if not self._by_rows:
            return None
        if self._table is None:  # (a draft length's choice asks for dozens of these)
            recent = self._passes - self.HORIZON
            pts = sorted((r, t) for r, t in self._by_rows.items() if self._seen[r] > recent)
            self._table = [r for r, _ in pts], _non_decreasing([t for _, t in pts])
        xs, ys = self._table
        if rows >= xs[-1] or rows <= xs[0]:
            i = -1 if rows >= xs[-1] else 0
            slope = self._fit[1] if self._fit is not None else self.PRIOR * ys[i] / xs[i]
            return max(ys[i] + slope * (rows - xs[i]), ys[i] * min(rows / xs[i], 1.0))
        j = bisect.bisect_left(xs, rows)
        if xs[j] == rows:
            return ys[j]
        f = (rows - xs[j - 1]) / (xs[j] - xs[j - 1])
        return ys[j - 1] + f * (ys[j] - ys[j - 1])

    def relatives(self, most: int, batch: int = 1, added: int = 0) -> list[float]:
        """``[relative(k + 1, batch, added) for k in range(most + 1)]``, computed once per
        measurement: a step asks it for every sequence, and beside a batch of eight the
        same list dozens of times (a Python loop over the table that would cost the step
        more than a tenth of a millisecond each time)."""
        key = (most, batch, added)
        memo = self._memo
        got = memo.get(key)
        if got is None:
            got = [self.relative(k + 1, batch, added) for k in range(most + 1)]
            memo[key] = got
        return got

    def largest(self) -> int | None:
        """The most rows of a pass measured lately (in the last ``HORIZON`` passes)."""
        if not self._by_rows:
            return None
        recent = self._passes - self.HORIZON
        return max(r for r in self._by_rows if self._seen[r] > recent)

    def share_s(self, batch: int = 1) -> float | None:
        """Seconds of one sequence's one-row share of a pass of ``batch`` sequences."""
        t = self.seconds(max(batch, 1))
        return None if t is None else t / max(batch, 1)

    def relative(self, rows: int, batch: int = 1, added: int = 0) -> float:
        """Cost of one sequence's share of a pass when it contributes ``rows`` rows instead
        of one beside ``batch - 1`` one-row sequences and ``added`` draft rows that others
        already put in this pass: 1 + (T(batch + added + rows - 1) - T(batch + added)) /
        (T(batch) / batch), the marginal cost of its extra rows in the pass as it stands, in
        units of a sequence's share of a plain pass (the pass's fixed cost split over its
        sequences). Once the batch is compute-bound a row costs about a share, and no
        acceptance below 1 makes a draft pay."""
        batch = max(batch, 1)
        if self._fit is None and len(self._by_rows) < 2:
            return 1.0 + (rows - 1) * self.PRIOR
        share = self.seconds(batch)
        base, more = self.seconds(batch + added), self.seconds(batch + added + rows - 1)
        if share is None or base is None or more is None or share <= 0:
            return 1.0 + (rows - 1) * self.PRIOR
        return 1.0 + max(more - base, 0.0) / (share / batch)


def _toward(mean: float, seconds: float) -> float:
    """A running mean of timings moved toward a new one: by half when it is faster, by a tenth
    when slower. Noise on a shared machine only ever adds time (another process's turn on
    the core, a page fault), so one slow pass must not make a row count, which may not be
    measured again for a while, look dear (a draft length that is never chosen keeps its
    cost), while a machine that got faster is believed at once."""
    return mean + (0.5 if seconds < mean else 0.1) * (seconds - mean)


def _non_decreasing(ys: list[float]) -> list[float]:
    """The non-decreasing sequence nearest ``ys`` in least squares (pool adjacent
    violators: a run of values out of order is replaced by its mean)."""
    blocks: list[list[float]] = []  # [sum, count]
    for y in ys:
        blocks.append([y, 1.0])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            s, n = blocks.pop()
            blocks[-1][0] += s
            blocks[-1][1] += n
    out: list[float] = []
    for s, n in blocks:
        out += [s / n] * int(n)
    return out


@dataclass
class DraftLength:
    """Picks k for the next pass: the k maximising expected tokens per unit cost,
    E[tokens | k] / (cost(k + 1 rows) + k draft tokens' drafting), with
    E = (1 - α^(k+1)) / (1 - α) for a per-token acceptance rate α (Leviathan et al. eq. 1)
    and the costs in plain one-row passes (:class:`PassCost`); k = 0, a plain pass (value 1),
    when no k in [k_min, k_max] is expected to beat it by ``gain``. α is estimated from the
    draft tokens actually put to the test (every accepted one, plus the first rejected one:
    the rest of a rejected draft says nothing), with exponential forgetting. The cost of a
    draft's rows is their marginal cost in the pass as it stands (:meth:`PassCost.relative`),
    so in a batch that is compute-bound (a row costs about a sequence's share of the pass)
    no draft is made. While k = 0, a free drafter (prompt lookup) is still asked for one
    token, which is compared with the token the plain pass then emits
    (:meth:`observe_shadow`): the acceptance stays known at no cost to the target; a drafter
    that costs time (a draft model) instead gets a k_min draft every ``probe`` passes, so a
    stream whose text turns repetitive starts drafting again, but only where a draft could
    pay at all (at ``ALPHA_MAX``): beside a busy batch a probe would learn nothing."""

    config: SpecConfig
    alpha: float = 0.6  # prior before any pass
    weight: float = 0.1  # forgetting per tested draft token
    prior: float = 2.0
    """The prior's weight, in tested tokens: the t-th token a request tests moves α by
    max(weight, 1 / (prior + t)), so a new request's first drafts tell it its acceptance
    (a mean over what it has seen) instead of leaving it near the prior for dozens of tokens;
    past ``1 / weight - prior`` tokens α forgets at ``weight`` per token."""
    gain: float = 1.03  # a draft must promise this many tokens per plain pass's cost
    probe: int = 16
    draft_s: float = 0.0  # seconds the drafter takes per proposed token (running average)
    _idle: int = field(default=0, repr=False)  # plain passes since the last draft
    _tested: int = field(default=0, repr=False)  # draft tokens put to the test so far
    _proposed: bool = field(default=False, repr=False)

    def observe_drafting(self, tokens: int, seconds: float, proposed: int | None = None) -> None:
        """What a proposal of ``proposed`` tokens (None: ``tokens``) cost that ran a draft
        model over ``tokens`` positions (``Draft.fed``; a lookup's dictionary probes are next
        to free): seconds per proposed token, one draft forward each. Counted only while the
        drafter keeps up (it caught up on at most two tokens: the target's own and an
        accepted draft's last): a request's first proposal reads the whole prompt, and one
        after plain passes the tokens it missed, in one forward whose cost says nothing of a
        draft token's (spread over its positions, it made drafting look many times cheaper
        than it is)."""
        if not self._proposed:
            self._proposed = True
            return
        k = tokens if proposed is None else proposed
        if k > 0 and tokens <= k + 1:
            per = seconds / k
            self.draft_s = per if self.draft_s == 0.0 else _toward(self.draft_s, per)

    def observe(self, drafted: int, accepted: int) -> None:
        if drafted <= 0:
            return
        trials = accepted + (accepted < drafted)
        keep = 1.0
        for _ in range(trials):
            keep *= 1.0 - self._step()
        self.alpha = keep * self.alpha + (1.0 - keep) * (accepted / trials)

    def _step(self) -> float:
        """The weight of the next tested token (see ``prior``)."""
        self._tested += 1
        return max(self.weight, 1.0 / (self.prior + self._tested))

    def observe_shadow(self, accepted: bool) -> None:
        """A one-token proposal not sent for verification, compared with the token the
        target emitted instead (a one-hot draft d is kept with probability p(d), the chance
        the target's own draw is d: greedy or sampled, the same test); a probe is not needed
        while these come."""
        self._idle = 0
        w = self._step()
        self.alpha = (1.0 - w) * self.alpha + w * float(accepted)

    def choose(self, cost: PassCost, batch: int = 1, added: int = 0) -> int:
        """k for the next pass of a sequence decoding in a pass of ``batch`` sequences, to
        which the sequences decided before it added ``added`` draft rows."""
        c = self.config
        if not c.adaptive:
            return c.draft_max
        share = cost.share_s(batch)
        drafting = self.draft_s / share if share else 0.0  # per draft token, in plain passes
        rel = cost.relatives(c.draft_max, batch, added)
        costs = [r + k * drafting for k, r in enumerate(rel)]
        # a pass at most EXPLORE rows larger than any measured lately: past them the cost is
        # extrapolated, and a batch's rows can cost far more than the line through smaller
        # passes says (the kernels' row tiles), so k grows as the passes it needs are timed
        largest = cost.largest()
        room = (batch if largest is None else largest) + self.EXPLORE - batch - added
        costs = costs[: max(room, 0) + 1]
        best = self._best(min(max(self.alpha, 0.0), self.ALPHA_MAX), costs)
        if best == 0:
            # a probe only where some acceptance would make a draft pay: else what it would
            # learn cannot change the choice (e.g. a draft model beside a busy batch)
            if self._best(self.ALPHA_MAX, costs) == 0:
                self._idle = 0
                return 0
            self._idle += 1
            if self._idle >= self.probe:
                self._idle = 0
                return c.draft_min
        else:
            self._idle = 0
        return best

    ALPHA_MAX = 0.99
    """The highest acceptance rate the choice assumes (a draft is never sure)."""
    EXPLORE = 2
    """Rows a pass may have beyond the largest measured lately (see :meth:`choose`)."""

    def _best(self, a: float, costs: list[float]) -> int:
        """The k in [k_min, k_max] of the most expected tokens per cost (``costs[k]``, in
        plain passes), 0 when none beats a plain pass by ``gain``."""
        best, best_v = 0, self.gain
        for k in range(self.config.draft_min, min(self.config.draft_max, len(costs) - 1) + 1):
            v = (1.0 - a ** (k + 1)) / (1.0 - a) / costs[k]
            if v > best_v + 1e-9:
                best, best_v = k, v
        return best


@dataclass(frozen=True)
class Speculation:
    """What the engine needs to speculate: the draft lengths, and a drafter per request."""

    config: SpecConfig
    new_drafter: Callable[[], Drafter]
