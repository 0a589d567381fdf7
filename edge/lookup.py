"""Prompt-lookup drafting: the continuation of the most recent earlier occurrence of the
sequence's last n tokens (n from ``ngram_max`` down to ``ngram_min``), searched in the prompt
and the output so far. Free (no model), strong where the output repeats its input: code
edits, summaries quoting their source, templated text.

An index maps every n-gram to the position that followed its latest occurrence; it grows
with the sequence (tokens are only appended: the engine never hands back a token it emitted),
so a proposal costs O(ngram_max) dictionary lookups.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from edge.sampling import Sampler
from edge.speculative import Draft
from lowband.errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class LookupConfig:
    ngram_max: int = 3
    """The longest suffix matched (longer matches first: fewer false continuations)."""
    ngram_min: int = 1
    """The shortest suffix matched."""

    def __post_init__(self) -> None:
        if not 1 <= self.ngram_min <= self.ngram_max <= 16:
            raise ConfigError(
                "ngram",
                f"need 1 <= ngram_min <= ngram_max <= 16, got {self.ngram_min}, {self.ngram_max}",
            )


class LookupDrafter:
    """One sequence's n-gram index (a :class:`edge.speculative.Drafter`)."""

    free = True
    """A proposal costs next to nothing: the engine asks for one while not drafting, to keep
    the acceptance known (``DraftLength.observe_shadow``)."""

    def __init__(self, config: LookupConfig | None = None) -> None:
        self.config = config or LookupConfig()
        self._tokens: list[int] = []
        self._next: dict[tuple[int, ...], int] = {}  # n-gram -> index of the token after it

    def _extend(self, tokens: Sequence[int]) -> None:
        if len(tokens) < len(self._tokens) or list(tokens[: len(self._tokens)]) != self._tokens:
            self._tokens, self._next = [], {}  # not a continuation: index afresh
        lo, hi = self.config.ngram_min, self.config.ngram_max
        for i in range(len(self._tokens), len(tokens)):
            self._tokens.append(int(tokens[i]))
            for n in range(lo, min(hi, i) + 1):  # the n-gram ending just before token i
                self._next[tuple(self._tokens[i - n : i])] = i

    def propose(self, tokens: Sequence[int], k: int, sampler: Sampler | None = None) -> Draft:
        self._extend(tokens)
        t = self._tokens
        for n in range(min(self.config.ngram_max, len(t)), self.config.ngram_min - 1, -1):
            i = self._next.get(tuple(t[len(t) - n :]))
            if i is not None:
                return Draft(tuple(t[i : i + k]))
        return Draft(())

    def close(self) -> None:
        self._tokens, self._next = [], {}
