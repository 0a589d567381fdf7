"""Draft-model drafting: a smaller model with the target's vocabulary proposes the tokens
(llama-server's ``-md``). It runs on the master, next to the sampler, one KV cache per
request; its tokenizer is checked against the target's at load, since a draft whose token
ids mean other strings would be verified against the wrong tokens (nothing would break,
every draft would simply be rejected).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Sequence

import torch

from edge.quant import kernel as qkernel
from edge.sampling import Sampler
from edge.speculative import Draft, common_prefix
from lowband.errors import ConfigError
from lowband.models.llama import KVCache, LlamaForCausalLM, Span
from lowband.models.tokenizer import Tokenizer

SERIAL_BYTES = 8 << 20
"""A draft model whose weights take at most this many bytes runs its kernels on the engine's
thread alone (``edge.quant.kernel.serial``): measured on 2 cores, a 1.4 M-parameter F32 draft
took 0.17 ms a token on a thread of its own with the kernels' two threads and 0.10 ms with one,
its matrices too small for a second thread to pay for its wake-up."""

PROBE_TEXT = "def f(x):\n    return x * 2  # Speculative décodage, 2024 → ok"


class IncompatibleDraft(ConfigError):
    """The draft model's vocabulary or tokenizer differs from the target's."""

    def __init__(self, reason: str) -> None:
        super().__init__(
            "draft",
            f"the draft model cannot draft for this target: {reason} "
            "(use a draft of the same model family, converted with the same tokenizer)",
        )


def check_compatible(
    target_vocab: int, target_tok: Tokenizer, draft_vocab: int, draft_tok: Tokenizer
) -> None:
    """Raise :class:`IncompatibleDraft` unless both models share one vocabulary: the same
    logit width, end-of-sequence token, encoding of a probe text, and text of every 64th id."""
    if target_vocab != draft_vocab:
        raise IncompatibleDraft(f"vocabulary of {draft_vocab} tokens, target has {target_vocab}")
    if target_tok.eos_token_id != draft_tok.eos_token_id:
        raise IncompatibleDraft(
            f"end-of-sequence token {draft_tok.eos_token_id}, target's {target_tok.eos_token_id}"
        )
    if target_tok.encode(PROBE_TEXT) != draft_tok.encode(PROBE_TEXT):
        raise IncompatibleDraft("the tokenizers split the same text differently")
    n = min(target_tok.vocab_size, draft_tok.vocab_size)
    for i in range(0, n, 64):
        if target_tok.decode([i]) != draft_tok.decode([i]):
            raise IncompatibleDraft(f"token {i} is a different string")


class DraftModel:
    """A loaded draft model; :meth:`drafter` makes one request's :class:`ModelDrafter`.

    It keeps the KV caches of the last ``keep`` finished requests (their tokens beside them):
    a new request whose tokens begin the same way (the same system prompt, a retried or
    continued conversation, a benchmark's repeated prompt) starts from the cache that shares
    the longest prefix with it instead of reading its whole prompt into the draft model again,
    as the target's own prefix cache does."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        tokenizer: Tokenizer,
        keep: int = 4,
        serial: bool | None = None,
    ) -> None:
        if keep < 0:
            raise ConfigError("draft.keep", f"must be >= 0, got {keep}")
        self.model = model
        self.tokenizer = tokenizer
        self.keep = keep
        if serial is None:  # by size: see SERIAL_BYTES
            serial = weight_bytes(model) <= SERIAL_BYTES
        self.serial = serial
        self._pool: list[tuple[list[int], KVCache]] = []  # oldest first
        self._lock = threading.Lock()

    def check(self, target_vocab: int, target_tok: Tokenizer) -> None:
        check_compatible(target_vocab, target_tok, self.model.config.vocab_size, self.tokenizer)

    def drafter(self) -> "ModelDrafter":
        return ModelDrafter(self.model, self)

    def take(self, tokens: Sequence[int]) -> tuple[list[int], KVCache] | None:
        """The kept cache sharing the longest prefix with ``tokens`` (removed from the pool:
        its new owner writes into it), or None where none shares a token."""
        with self._lock:
            best, best_n = -1, 0
            for i, (held, _) in enumerate(self._pool):
                n = common_prefix(held, tokens)
                if n > best_n:
                    best, best_n = i, n
            return self._pool.pop(best) if best >= 0 else None

    def give(self, held: list[int], cache: KVCache) -> None:
        """Keep a finished request's cache (the oldest kept one leaves beyond ``keep``)."""
        if self.keep == 0 or not held:
            return
        with self._lock:
            self._pool.append((held, cache))
            del self._pool[: max(0, len(self._pool) - self.keep)]


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's parameters and buffers as loaded (packed blocks count as stored)."""
    seen: set[int] = set()
    n = 0
    for t in [*model.parameters(), *model.buffers()]:
        if id(t) not in seen and not t.is_meta:
            seen.add(id(t))
            n += t.numel() * t.element_size()
    return n


class ModelDrafter:
    """Proposes k tokens by decoding the draft model k times from the sequence so far. Its
    cache keeps what it computed: the next proposal recomputes only the tokens after the
    longest common prefix (the target's own token after a rejection, usually one). The first
    proposal starts from the :class:`DraftModel`'s kept cache that shares the most of the
    request's tokens, if any; :meth:`close` hands the cache back to be kept."""

    def __init__(self, model: LlamaForCausalLM, owner: DraftModel | None = None) -> None:
        self.model = model
        self.owner = owner
        self.cache: KVCache | None = None
        self._held: list[int] = []  # tokens whose K/V the cache holds
        self._closed = False
        self._sound = True  # False while a forward runs: a failed one leaves the cache unknown

    def _forward(self, ids: Sequence[int], start: int) -> torch.Tensor:
        assert self.cache is not None
        m = self.model
        self._sound = False
        x = m.embed(torch.tensor([list(ids)], dtype=torch.long))
        h = m.forward_ragged(x, [Span(self.cache, start, len(ids))])
        self._held = self._held[:start] + list(ids)
        self._sound = True
        return m.head(h[0, -1:]).float()[0]

    def propose(self, tokens: Sequence[int], k: int, sampler: Sampler) -> Draft:
        if self._closed:
            raise RuntimeError("this drafter is closed")
        if self.cache is None:
            kept = self.owner.take(tokens) if self.owner is not None else None
            self._held, self.cache = kept if kept is not None else ([], self.model.new_cache())
        n = common_prefix(self._held, tokens, len(tokens) - 1)  # at least the last token is fed
        if 0 < n < self.cache.restart_floor():
            n = 0  # a sliding-window draft cache dropped what restarting at n needs
        out: list[int] = []
        qs: list[torch.Tensor] = []
        greedy = sampler.params.temperature == 0.0
        fed = len(tokens) - n
        alone = self.owner is not None and self.owner.serial
        with torch.inference_mode(), qkernel.serial() if alone else contextlib.nullcontext():
            logits = self._forward(tokens[n:], n)
            pos = len(tokens)
            for _ in range(k):
                if greedy:  # a one-hot q: no distribution to keep
                    t = int(torch.argmax(logits).item())
                else:
                    q = sampler.probs(logits)
                    t = sampler.draw(q)
                    qs.append(q)
                out.append(t)
                if len(out) == k:
                    break
                logits = self._forward([t], pos)
                pos += 1
                fed += 1
        return Draft(tuple(out), None if greedy or not qs else torch.stack(qs), fed)

    def close(self) -> None:
        cache, held = self.cache, self._held
        self.cache, self._held, self._closed = None, [], True
        if self.owner is not None and cache is not None and self._sound:
            self.owner.give(held[: cache.length], cache)
