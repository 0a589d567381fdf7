"""Structured output: a grammar that constrains sampling (JSON schema, any JSON object,
llama-server's GBNF, Lark), through llguidance.

Why llguidance (measured on the Gemma 3 vocabulary of 262,144 tokens, one CPU core shared,
``docs/edge-serving.md``): its token mask costs ~0.02-0.04 ms per token, about what xgrammar's
precomputed masks cost, but a new grammar compiles in ~1 ms where xgrammar spends 130-300 ms
compiling each JSON schema (and 300 ms for "any JSON"): every request with its own schema or
tool list pays that before its first token. outlines-core compiles a schema to a regex index
over the whole vocabulary (seconds at 262k) and has no context-free grammars (no GBNF, no
recursive schemas). llguidance also reads llama.cpp's GBNF as it is (``grammar_from("gbnf")``).

:class:`Grammars` builds llguidance's view of the vocabulary once per tokenizer (the bytes of
every token), then compiles each request's grammar (:meth:`Grammars.compile`) into a
:class:`GrammarConstraint`: a factory for one completion's :class:`Matcher`, which
:class:`edge.sampling.Sampler` asks for a mask before each token and tells the token drawn.
"""

from __future__ import annotations

import json
import math
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Sequence

import llguidance
import numpy as np
import torch

from lowband.errors import ConfigError, LowbandError

# what a JSON grammar lets the model write between items: one space after , and : (how
# models saw JSON written), no free whitespace (a small model can emit newlines for ever)
JSON_OPTIONS = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}
MAX_GRAMMAR_CHARS = 256 * 1024


class GrammarError(LowbandError):
    """A grammar (or schema) that does not compile, or a completion that left it."""


def _byte_level_table() -> dict[str, int]:
    """GPT-2's byte-level alphabet: printable bytes stand for themselves, the others are
    shifted to code points from 256 up, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table, extra = {chr(b): b for b in printable}, 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + extra)] = b
            extra += 1
    return table


def vocab_bytes(tokenizer: Any) -> tuple[list[bytes], list[int]]:
    """(bytes of each token id, the ids of special tokens). A special token's bytes are its
    text after ``0xFF`` (how llguidance tells them from text). Knows lowband's GGUF tokenizers
    (SentencePiece and byte-level BPE) and byte tokenizers."""
    vocab = getattr(tokenizer, "vocab", None)
    if vocab is not None and hasattr(vocab, "token_types"):
        from edge.formats.gguf_tokenizer import BYTE, NORMAL, USER_DEFINED

        table = _byte_level_table() if vocab.model == "gpt2" else None
        out: list[bytes] = []
        special: list[int] = []
        for i, (piece, kind) in enumerate(zip(vocab.tokens, vocab.token_types)):
            if kind == BYTE and piece.startswith("<0x"):
                out.append(bytes([int(piece[3:5], 16)]))
            elif kind == NORMAL and table is not None:
                out.append(bytes(table.get(c, 0x3F) for c in piece))
            elif kind == NORMAL:
                out.append(piece.replace("\u2581", " ").encode())
            elif kind == USER_DEFINED:
                out.append(piece.encode())
            else:
                special.append(i)
                out.append(b"\xff" + piece.encode())
        return out, special
    size = getattr(tokenizer, "vocab_size", None)
    if size == 256:  # a byte tokenizer
        eos = getattr(tokenizer, "eos_token_id", None)
        return (
            [b"\xff<eos>" if i == eos else bytes([i]) for i in range(256)],
            [] if eos is None else [eos],
        )
    raise ConfigError(
        "tokenizer",
        f"structured output needs a GGUF or byte tokenizer, not {type(tokenizer).__name__}",
    )


class _Vocab:
    """What llguidance's ``TokenizerWrapper`` reads from a tokenizer."""

    def __init__(self, tokenizer: Any, n_vocab: int, end_ids: Sequence[int]) -> None:
        tokens, special = vocab_bytes(tokenizer)
        self.tokens = tokens + [b"\xff<pad>"] * max(0, n_vocab - len(tokens))
        self.special_token_ids = special + list(range(len(tokens), n_vocab))
        self.eos_token_id = end_ids[0]
        self.bos_token_id = getattr(tokenizer, "bos_token_id", None)
        self._tok = tokenizer

    def __call__(self, text: str) -> list[int]:
        encode = self._tok.encode
        try:
            return list(encode(text, add_special=False))
        except TypeError:  # a tokenizer without that keyword adds nothing anyway
            return list(encode(text))


class Matcher:
    """One completion's place in its grammar.

    Most draws need no mask at all: :class:`edge.sampling.Sampler` draws from the
    unconstrained logits and asks :meth:`allows`, llguidance's test of that one token
    (~1-15 us), and asks for the whole :meth:`mask` only when the grammar rejects it. A mask
    costs up to ~2 ms on Gemma 3's 262,144 tokens (a GBNF ``[a-z ]+`` state allows ~88k
    tokens; a JSON string state a few dozen, ~0.04 ms), per stream per step, so eight streams
    that each computed one paid ~10 ms a step beside the model's.

    When a mask is needed, it depends only on the tokens drawn so far, not on the logits, so
    it is computed on the grammar thread (llguidance releases the GIL) while the model runs
    the step that produces those logits: at creation (while the prompt is prefilled), after
    a draw the grammar rejected (rejections come in runs: forced text the model would not
    write), and at every step for a sampler that cannot check first (``check_first`` False,
    or top-k/top-p/min-p sampling). :meth:`mask` then only waits for it and applies it in
    place: sparsely (keep the allowed ids' logits) when few tokens are allowed, densely (one
    ``putmask`` with the forbidden set unpacked on the grammar thread) otherwise.
    """

    SPARSE = 16  # at most 1/SPARSE of the vocabulary allowed: keep those ids, not a mask

    def __init__(
        self,
        tokenizer: llguidance.LLTokenizer,
        grammar: str | llguidance.LLMatcher,
        ends: Sequence[int],
        pool: ThreadPoolExecutor | None = None,
        check_first: bool = True,
    ):
        # a matcher at the grammar's start is copied (~0.01 ms) instead of parsing the
        # grammar again (~0.5 ms on the thread that admits the request)
        self._m = (
            grammar.deep_copy()
            if isinstance(grammar, llguidance.LLMatcher)
            else llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        )
        self._end_set = frozenset(int(e) for e in ends)
        self._vocab = tokenizer.vocab_size
        self._ends = np.array(sorted(e for e in self._end_set if e < self._vocab), dtype=np.int64)
        self._bits = np.zeros((self._vocab + 31) // 32, dtype=np.int32)
        self._pool = pool
        self._next: Future | None = None
        self._ready: tuple[np.ndarray | None, np.ndarray | None] | None = None
        self._masked = False  # the draw at this position needed the mask: compute the next ahead
        self.check_first = check_first
        self.done = False
        self.stopped = False  # complete, and nothing more may follow: only an end token
        self._schedule()

    def _schedule(self) -> None:
        self._next = self._pool.submit(self._compute) if self._pool is not None else None

    def _compute(self) -> tuple[np.ndarray | None, np.ndarray | None]:
        """(the allowed ids when they are few, else None; the forbidden set as a bool array
        when they are many, else None): what the grammar allows now, ends included when it is
        complete. Runs on the grammar thread; nothing here touches the logits."""
        m = self._m
        if m.is_error():
            raise GrammarError(f"the grammar failed: {m.get_error()}")
        m.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        allowed = np.unpackbits(self._bits.view(np.uint8), bitorder="little")[: self._vocab]
        if m.is_accepting() and len(self._ends):
            allowed[self._ends] = 1
        n = int(np.count_nonzero(allowed))
        if n == 0:
            raise GrammarError("the grammar allows no token here")
        if n * self.SPARSE <= self._vocab:
            return np.flatnonzero(allowed), None
        return None, np.logical_not(allowed.view(np.bool_))  # unpackbits gives 0/1 bytes

    def _wait(self) -> tuple[np.ndarray | None, np.ndarray | None] | None:
        """The mask computed ahead for this position, once it is done (None if none was)."""
        if self._next is not None:
            fut, self._next = self._next, None
            self._ready = fut.result()
        return self._ready

    def _current(self) -> tuple[np.ndarray | None, np.ndarray | None]:
        """This position's mask: the one computed ahead, else computed now (once)."""
        ready = self._wait()
        if ready is None:
            ready = self._ready = self._compute()
        return ready

    def allows(self, token: int) -> bool:
        """Whether the grammar accepts ``token`` next: exactly the tokens :meth:`mask` keeps
        (from that mask when it was computed ahead; llguidance's matcher is not asked while
        the grammar thread uses it)."""
        tok = int(token)
        if self._wait() is not None:
            return self._mask_allows(tok)
        if not 0 <= tok < self._vocab:
            return False
        if tok in self._end_set:
            return self._m.is_accepting()
        if self._m.validate_tokens([tok]) != 1:
            return False
        # forced tokens: the mask keeps the canonical one only (a mask there costs ~0.01 ms);
        # forced bytes that no whole token covers (one space before a free [a-z ]+) keep every
        # token that fits, as the test above said, and their dense mask would cost ~2 ms
        if self._m.compute_ff_tokens():
            return self._mask_allows(tok)
        return True

    def _mask_allows(self, tok: int) -> bool:
        """Whether the mask (computed now if it was not ahead) keeps ``tok``."""
        ids, forbidden = self._current()
        if ids is not None:
            i = int(np.searchsorted(ids, tok))
            return i < len(ids) and int(ids[i]) == tok
        assert forbidden is not None
        return 0 <= tok < self._vocab and not bool(forbidden[tok])

    def sparse(self) -> np.ndarray | None:
        """The ids the grammar allows now, ascending, when they are few (then a greedy
        sampler takes the best of them without masking the whole vocabulary), else None."""
        self._masked = True
        return self._current()[0]

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` (V,) float with what the grammar forbids now at -inf (in place when it is
        a contiguous float32 tensor: :class:`edge.sampling.Sampler` passes its own copy); the
        end tokens stay allowed exactly when the grammar is complete."""
        self._masked = True
        ids, forbidden = self._current()
        x = logits.float().contiguous()
        n = min(x.shape[-1], self._vocab)
        if ids is not None:
            idx = torch.from_numpy(ids[ids < n])
            keep = x[idx]
            x.fill_(-math.inf)
            x[idx] = keep
            return x
        assert forbidden is not None
        xs = x.numpy()
        np.putmask(xs[:n], forbidden[:n], -np.inf)
        xs[n:] = -np.inf
        return x

    def advance(self, token: int) -> None:
        if self.done:
            return
        if self._next is not None:  # a mask not asked for: the matcher is free once it is done
            fut, self._next = self._next, None
            fut.exception()
        self._ready = None
        ahead, self._masked = self._masked or not self.check_first, False
        if self._m.is_accepting() and int(token) in self._end_set:
            self.done = True  # the completion ends here; llguidance need not see the id
            return
        if not self._m.consume_token(int(token)):
            raise GrammarError(f"token {token} left the grammar: {self._m.get_error()}")
        self.stopped = self._m.is_stopped()
        if ahead and not self.stopped:
            self._schedule()  # the next mask, while the model computes the next logits


class GrammarConstraint:
    """A compiled grammar: each call is a fresh :class:`Matcher` (one per completion)."""

    def __init__(self, grammars: Grammars, grammar: str, ends: Sequence[int]) -> None:
        self.grammars, self.grammar, self.ends = grammars, grammar, tuple(ends)
        self._start: llguidance.LLMatcher | None = None  # parsed once, copied per completion
        self._lock = threading.Lock()

    def __call__(self) -> Matcher:
        g = self.grammars
        with self._lock:
            if self._start is None:
                self._start = llguidance.LLMatcher(g.tokenizer(), self.grammar, log_level=0)
            return Matcher(g.tokenizer(), self._start, self.ends, g.pool(), g.check_first)


class Grammars:
    """Compiles request grammars against one tokenizer (its llguidance view built once, on
    first use: ~1 s per 100k tokens). Thread-safe. ``check_first``: the samplers may test
    their unconstrained draw before asking for a mask (:class:`Matcher`); False computes every
    mask (the benchmark's peer)."""

    CACHED = 64  # compiled grammars kept (least recently used dropped first)

    def __init__(self, tokenizer: Any, n_vocab: int, *, check_first: bool = True) -> None:
        self._tok, self._n, self.check_first = tokenizer, n_vocab, check_first
        self._cache: OrderedDict[tuple, GrammarConstraint] = OrderedDict()
        eos = getattr(tokenizer, "eos_token_id", None)
        eog = tuple(getattr(tokenizer, "eog_token_ids", ()) or ())
        self.end_ids = tuple(dict.fromkeys(([] if eos is None else [eos]) + list(eog)))
        self._ll: llguidance.LLTokenizer | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def pool(self) -> ThreadPoolExecutor:
        """The grammar thread: every matcher's masks are computed there, beside the model's
        step (one thread: the model's own threads keep the other cores)."""
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="edge-grammar")
            return self._pool

    def close(self) -> None:
        """Stop the grammar thread (a matcher made later starts it again)."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)

    def tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._ll is None:
                if not self.end_ids:
                    raise ConfigError(
                        "tokenizer", "structured output needs an end-of-sequence token"
                    )
                wrap = llguidance.TokenizerWrapper(_Vocab(self._tok, self._n, self.end_ids))
                self._ll = llguidance.LLTokenizer(
                    wrap, n_vocab=self._n, eos_token=list(self.end_ids)
                )
            return self._ll

    def compile(self, kind: str, source: Any, ends: Sequence[int] = ()) -> GrammarConstraint:
        """``kind``: "json_schema" (a schema object), "json_object" (any JSON object),
        "gbnf" (llama.cpp's grammar text, or Lark), "lark", "regex". ``ends``: more tokens that
        may end the completion once the grammar is complete (a chat template's end of turn).
        Raises :class:`GrammarError` for a grammar that does not compile.

        The last :attr:`CACHED` grammars compiled are kept and handed out again for the same
        grammar and ends (clients send the same schema or tool list with every request): the
        grammar is not parsed again (~3 ms at 262k tokens) and its lexer keeps the states
        built by earlier completions (the first dense mask of a fresh copy costs ~10-20 ms,
        later ones ~2 ms)."""
        if kind == "json_object":
            kind, source = "json_schema", {"type": "object"}
        try:
            if kind == "json_schema":
                if not isinstance(source, dict | bool):
                    raise GrammarError("a JSON schema must be an object")
                text = json.dumps(source)
                grammar = llguidance.LLMatcher.grammar_from_json_schema(
                    text,
                    defaults=JSON_OPTIONS,  # type: ignore[arg-type]
                )
            elif kind in ("gbnf", "lark", "regex"):
                if not isinstance(source, str) or not source.strip():
                    raise GrammarError(f"a {kind} grammar must be a non-empty string")
                text = source
                grammar = llguidance.grammar_from(kind, source)  # type: ignore[arg-type]
            else:
                raise GrammarError(f"unknown grammar kind {kind!r}")
        except ValueError as exc:
            raise GrammarError(str(exc)) from None
        if len(text) > MAX_GRAMMAR_CHARS:
            raise GrammarError(f"the grammar is longer than {MAX_GRAMMAR_CHARS} characters")
        key = (grammar, tuple(ends))
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        err = llguidance.LLMatcher.validate_grammar(grammar, self.tokenizer())
        if err:
            raise GrammarError(err.splitlines()[0][:500])
        constraint = GrammarConstraint(self, grammar, tuple(self.end_ids) + tuple(ends))
        with self._lock:
            constraint = self._cache.setdefault(key, constraint)
            self._cache.move_to_end(key)
            while len(self._cache) > self.CACHED:
                self._cache.popitem(last=False)
        return constraint
