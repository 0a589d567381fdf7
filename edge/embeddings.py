"""``/v1/embeddings``: one vector per input, pooled from the model's final hidden states.

A decoder's embedding of a text is its last layer's hidden states after the final norm (what
llama.cpp pools, ``t_embd``), computed with the model's own causal attention, pooled over the
input's tokens and L2-normalised (llama-server's default ``embd_normalize: 2``):

- ``mean``: the average of every token's row (llama-server's ``--pooling mean``);
- ``last``: the last token's row (``--pooling last``: what decoder embedding models such as
  Qwen3-Embedding are trained for);
- ``cls``: the first token's row (``--pooling cls``; for a decoder the BOS token's row, which
  with causal attention has seen nothing else: useful only for encoder-style models).

Several inputs run in one ragged forward (:func:`embed_ragged`, each in its own throw-away KV
cache, a long one in chunks, so attention never holds more than ``chunk`` x input rows), and a
request is split into such batches of at most :attr:`EmbeddingConfig.batch_tokens` tokens
(:func:`batches`) that the engine runs between its decode steps.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import torch

from lowband.errors import ConfigError
from lowband.models.llama import LlamaForCausalLM, Span

POOLINGS = ("mean", "last", "cls")
ENCODINGS = ("float", "base64")


@dataclass(frozen=True, kw_only=True)
class EmbeddingConfig:
    """What ``/v1/embeddings`` computes and admits."""

    pooling: str = "mean"
    """``mean``, ``last`` or ``cls`` (llama-server's ``--pooling``)."""
    max_inputs: int = 256
    """Inputs in one request; more is a 400 before anything is tokenised."""
    max_input_tokens: int = 8192
    """Tokens of one input (OpenAI's limit; never more than the model's context)."""
    max_tokens: int = 65536
    """Tokens of one request, all inputs together."""
    batch_tokens: int = 512
    """Tokens per forward pass: inputs are batched up to this many, a longer input runs alone
    in chunks of this size; the engine's decode steps run between two passes."""

    def __post_init__(self) -> None:
        if self.pooling not in POOLINGS:
            raise ConfigError("pooling", f"must be one of {', '.join(POOLINGS)}")
        for name in ("max_inputs", "max_input_tokens", "max_tokens", "batch_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(name, f"must be >= 1, got {getattr(self, name)}")


class InputError(ValueError):
    """A bad ``/v1/embeddings`` field: ``param`` names it, ``status`` is 400 or 413."""

    def __init__(self, message: str, param: str = "input", status: int = 400) -> None:
        super().__init__(message)
        self.param, self.status = param, status


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(i, int) and not isinstance(i, bool) for i in value
    )


def parse_input(value: Any, cfg: EmbeddingConfig) -> list[str | list[int]]:
    """OpenAI's ``input``: a string, a list of strings, a list of token ids, or a list of
    token-id lists. Bounded by count (and token lists by length) before anything else."""
    if isinstance(value, str):
        items: list = [value]
    elif isinstance(value, list) and value and _is_ids(value):
        items = [value]
    elif isinstance(value, list) and value:
        if len(value) > cfg.max_inputs:
            raise InputError(f"input has {len(value)} items; at most {cfg.max_inputs}")
        if not (all(isinstance(v, str) for v in value) or all(_is_ids(v) for v in value)):
            raise InputError(
                "input must be a string, a list of strings, a list of token ids or a list "
                "of token-id lists"
            )
        items = list(value)
    else:
        raise InputError("input must be a non-empty string or list")
    for i, item in enumerate(items):
        if len(item) == 0:
            raise InputError(f"input {i} is empty")
        if isinstance(item, list) and len(item) > cfg.max_input_tokens:
            raise InputError(
                f"input {i} has {len(item)} tokens; at most {cfg.max_input_tokens}",
                status=413,
            )
    return items


def check_tokens(seqs: Sequence[Sequence[int]], vocab: int, cfg: EmbeddingConfig) -> int:
    """The request's token count, after checking every input's ids and length and the total."""
    total = 0
    for i, ids in enumerate(seqs):
        if not ids:
            raise InputError(f"input {i} has no tokens")
        if len(ids) > cfg.max_input_tokens:
            raise InputError(
                f"input {i} has {len(ids)} tokens; at most {cfg.max_input_tokens}", status=413
            )
        if min(ids) < 0 or max(ids) >= vocab:
            raise InputError(f"input {i}: token ids must be in [0, {vocab})")
        total += len(ids)
    if total > cfg.max_tokens:
        raise InputError(f"the inputs have {total} tokens; at most {cfg.max_tokens}", status=413)
    return total


def parse_format(body: dict, dim: int) -> str:
    """``encoding_format`` (default float); ``dimensions`` must be the model's own (no
    truncation: a decoder's hidden state is not trained to be cut, as Matryoshka models are)."""
    fmt = body.get("encoding_format")
    fmt = "float" if fmt is None else fmt
    if fmt not in ENCODINGS:
        raise InputError("encoding_format must be 'float' or 'base64'", param="encoding_format")
    d = body.get("dimensions")
    if d is not None and (isinstance(d, bool) or d != dim):
        raise InputError(
            f"dimensions must be this model's {dim} (shorter vectors are not supported)",
            param="dimensions",
        )
    return fmt


def batches(lengths: Sequence[int], batch_tokens: int) -> list[list[int]]:
    """Consecutive input indices grouped so that each group holds at most ``batch_tokens``
    tokens (a longer input forms a group of its own)."""
    out: list[list[int]] = []
    cur: list[int] = []
    n = 0
    for i, k in enumerate(lengths):
        if cur and n + k > batch_tokens:
            out.append(cur)
            cur, n = [], 0
        cur.append(i)
        n += k
    if cur:
        out.append(cur)
    return out


RaggedPass = Callable[[Sequence[tuple[int, int, Sequence[int]]]], torch.Tensor]
"""One ragged pass over items (sequence index, start, token ids), each appended to that
sequence's own throw-away cache: the hidden states (N, H) before the final norm, N the items'
tokens back to back. A cluster's runner passes one that runs every rank or stage."""


def local_pass(model: LlamaForCausalLM, n_seqs: int) -> RaggedPass:
    """The :data:`RaggedPass` of a model on this device (a fresh cache per sequence)."""
    caches = [model.new_cache() for _ in range(n_seqs)]

    def run(items: Sequence[tuple[int, int, Sequence[int]]]) -> torch.Tensor:
        ids = torch.tensor([t for _, _, toks in items for t in toks])
        spans = [Span(caches[i], p, len(toks)) for i, p, toks in items]
        return model.forward_ragged(model.embed(ids[None]), spans)[0]

    return run


def embed_ragged(
    model: LlamaForCausalLM,
    seqs: Sequence[Sequence[int]],
    pooling: str,
    chunk: int = 512,
    forward: RaggedPass | None = None,
) -> torch.Tensor:
    """(B, H) float32, L2-normalised: each sequence's final hidden states after the final
    norm, pooled. Every step runs up to ``chunk`` tokens of the sequences together (ragged,
    each in its own fresh cache, so nothing of the engine's slots is touched); ``forward``
    runs a step (default :func:`local_pass`), ``model`` gives the final norm."""
    if pooling not in POOLINGS:
        raise ValueError(f"pooling must be one of {POOLINGS}")
    B, H = len(seqs), model.config.hidden_size
    acc = torch.zeros(B, H, dtype=torch.float32)
    step = forward if forward is not None else local_pass(model, B)
    pos = [0] * B
    with torch.inference_mode():
        while True:
            items, budget = [], chunk
            for i, s in enumerate(seqs):
                if pos[i] < len(s) and budget > 0:
                    n = min(budget, len(s) - pos[i])
                    items.append((i, pos[i], n))
                    budget -= n
            if not items:
                break
            h = step([(i, p, seqs[i][p : p + n]) for i, p, n in items])
            h = model.model.norm(h).float()  # (N, H)
            off = 0
            for i, p, n in items:
                rows = h[off : off + n]
                if pooling == "mean":
                    acc[i] += rows.sum(0)
                elif pooling == "cls" and p == 0:
                    acc[i] = rows[0]
                elif pooling == "last" and p + n == len(seqs[i]):
                    acc[i] = rows[-1]
                pos[i] += n
                off += n
    if pooling == "mean":
        acc /= torch.tensor([len(s) for s in seqs], dtype=torch.float32)[:, None]
    return torch.nn.functional.normalize(acc, dim=-1)


def encode(vec: torch.Tensor, fmt: str) -> list[float] | str:
    """One vector as OpenAI sends it: a list of floats, or base64 of float32 little-endian."""
    if fmt == "base64":
        return base64.b64encode(vec.numpy().astype("<f4").tobytes()).decode("ascii")
    return vec.tolist()


def response(vectors: Sequence[torch.Tensor], fmt: str, model: str, tokens: int) -> dict:
    return {
        "object": "list",
        "data": [
            {"object": "embedding", "index": i, "embedding": encode(v, fmt)}
            for i, v in enumerate(vectors)
        ],
        "model": model,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }


def decode_base64(text: str) -> np.ndarray:
    """The inverse of :func:`encode` with ``base64`` (for clients and tests)."""
    return np.frombuffer(base64.b64decode(text), dtype="<f4")
