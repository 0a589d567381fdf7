"""One pipeline stage: a contiguous range of decoder layers ``[lo, hi)`` and their KV caches.

A stage computes each of its layers whole, with the very modules and kernels one device uses,
and picks between them as one device does (``LlamaForCausalLM.forward_ragged`` over the
stage's range): the compiled step (``edge.fastpath.FastDecode`` over the range) wherever it
takes the step, single tokens and prompt spans alike, else the eager ``DecoderLayer.forward``.
So chaining the stages of a plan gives the same bytes as one device running every layer
(``tests/edge/test_pipeline.py`` checks the logits bit for bit). Only the
hidden state (1, N, H) crosses from one stage to the next.

The stage's layers are renumbered ``0..hi-lo-1`` for the cache, so its KV caches hold only
its own layers (``KVCache(hi - lo)``): copying a prefix, dropping, the sliding-window floor,
all work on a stage's cache as on a whole model's.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn

from edge import fastpath
from edge.shardio import LoadedShard, WindowConfig, load_shard
from edge.window import release
from lowband.errors import ConfigError
from lowband.models.llama import KVCache, LlamaForCausalLM, Span

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LayerRange:
    """Decoder layers ``lo..hi-1`` of a model of ``layers`` layers."""

    lo: int
    hi: int
    layers: int

    def __post_init__(self) -> None:
        if not 0 <= self.lo < self.hi <= self.layers:
            raise ConfigError(
                "layers", f"a stage needs 0 <= lo < hi <= {self.layers}, got [{self.lo}, {self.hi})"
            )

    @property
    def first(self) -> bool:
        return self.lo == 0

    @property
    def last(self) -> bool:
        return self.hi == self.layers


def keep_layers(model: LlamaForCausalLM, rng: LayerRange, fast: bool = True) -> str | None:
    """Free every decoder layer outside ``rng``, renumber the kept ones for a stage cache and
    (``fast``) install the compiled step over the range; returns why it stays eager (None:
    compiled, or ``fast`` off).

    (The weights of the others were loaded first: a loader that reads only a range of layers is
    future work; the peak is one whole model, the steady state the stage's layers.)"""
    if model.config.num_hidden_layers != rng.layers:
        raise ConfigError(
            "layers", f"the model has {model.config.num_hidden_layers} layers, not {rng.layers}"
        )
    fastpath.uninstall(model)  # (a step over every layer would point at the freed ones)
    for i in range(rng.layers):
        if not rng.lo <= i < rng.hi:
            model.model.layers[i] = nn.Identity()
        else:
            model.model.layers[i].self_attn.layer_idx = i - rng.lo
    return fastpath.install(model, (rng.lo, rng.hi)) if fast else None


def run_layers(
    model: LlamaForCausalLM, rng: LayerRange, x: torch.Tensor, spans: Sequence[Span]
) -> torch.Tensor:
    """The layers of ``rng`` over a ragged batch: x (1, N, H) holds each span's tokens back to
    back; returns (1, N, H). Each span appends to its own (stage) cache: one device's
    ``LlamaForCausalLM.forward_ragged`` (its routing and kernels) over the range."""
    return model.forward_ragged(x, spans, layers=(rng.lo, rng.hi))


class Stage:
    """A stage's model (only its layers kept); its KV caches (one per sequence id of the
    engine) are made by :meth:`new_cache` and kept by whoever drives the stage."""

    def __init__(self, shard: LoadedShard, rng: LayerRange, fast: bool = True) -> None:
        why = keep_layers(shard.model, rng, fast)
        if why is not None:
            logger.info("stage layers %d..%d run eager: %s", rng.lo, rng.hi - 1, why)
        self.shard = shard
        self.model = shard.model
        self.range = rng
        self.head: fastpath.HeadRows | None = None  # its rows of a split LM head
        self.whole_head = False  # the replica layout: the model's own whole head (keep_head)
        self.repacked = 0  # bytes :meth:`repack` added

    def repack(self, mode: str) -> None:
        """K-quant weights also in the batch GEMM's layout (:meth:`LoadedShard.repack`), after
        the other layers are freed; a head cut later follows."""
        self.repacked = self.shard.repack(mode)

    def cut_head(self, a: int, b: int) -> None:
        """Keep a view of the LM head's vocabulary rows ``a..b-1`` (:meth:`top_logits`)."""
        self.head = fastpath.HeadRows(self.model, a, b)
        if self.repacked:
            self.head.repack()

    def keep_head(self) -> None:
        """Hold the whole LM head (a stage over every layer: the replica layout); its logits
        are the model's own head's, the very kernels one device runs."""
        if not (self.range.first and self.range.last):
            raise ConfigError("layers", "only a stage over every layer holds the whole head")
        self.whole_head = True

    def release_embedding(self) -> int:
        """A stage after the first never embeds: give back the pages of its token embedding
        outside the head rows it holds (all of them when the head is not tied), so it holds
        the bytes a memory budget counts (``edge.cluster.layout.stage_weight_bytes``).
        Returns the bytes released."""
        if self.range.first:
            raise RuntimeError("the first stage embeds the tokens: it keeps the whole table")
        emb = self.model.model.embed_tokens
        keep = (
            self.head.rows
            if self.head is not None and self.model.config.tie_word_embeddings
            else (0, 0)
        )
        out = 0
        for t in (*emb.parameters(recurse=False), *emb.buffers(recurse=False)):
            if t.dim() != 2 or t.is_meta or not t.is_contiguous():
                continue
            row = t.shape[1] * t.element_size()
            out += release(t, 0, keep[0] * row) + release(t, keep[1] * row, t.shape[0] * row)
        return out

    def top_logits(self, h: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``k`` largest logits of this stage's head rows for each row of ``h`` (R, H):
        values (R, k) and absolute token ids (R, k) as float32 (exact below 2^24)."""
        if self.whole_head:
            with torch.inference_mode():
                logits = self.model.head(h).float()
            lo = 0
        elif self.head is not None:
            with torch.inference_mode():
                logits = self.head(h).float()
            lo = self.head.rows[0]
        else:
            raise RuntimeError("this stage holds no rows of the LM head")
        v, i = torch.topk(logits, k, dim=-1)
        return v.contiguous(), (i + lo).to(torch.float32).contiguous()

    def new_cache(self) -> KVCache:
        return KVCache(self.range.hi - self.range.lo, window=self.model.config.cache_window)

    def run(self, x: torch.Tensor, spans: Sequence[Span]) -> torch.Tensor:
        with torch.inference_mode():
            return run_layers(self.model, self.range, x, spans)

    def close(self) -> None:
        self.shard.close()


def load_stage(
    model_dir: str,
    rng: LayerRange,
    dtype: str | None,
    repack: str = "off",
    fast: bool = True,
    head_lo: int = 0,
    window: WindowConfig | None = None,
    whole_head: bool = False,
) -> Stage:
    """Stage ``rng`` of the model at ``model_dir``; ``repack``: its K-quant weights also in the
    batch GEMM's layout (:meth:`Stage.repack`); ``head_lo`` > 0: it also holds the LM head's
    rows ``head_lo..V-1`` (:meth:`Stage.cut_head`); ``window``: its layers streamed through
    the sliding window from a GGUF file (eager where the window really streams; a stage after
    the first then also gives back the embedding rows it does not hold,
    :meth:`Stage.release_embedding`); ``whole_head``: a stage over every layer that also
    keeps the whole LM head (:meth:`Stage.keep_head`, the replica layout)."""
    rows = (rng.lo, rng.hi) if window is not None else None
    shard = load_shard(model_dir, dtype=dtype, fast=False, window=window, layers=rows)
    sched = shard.scheduler
    try:
        stage = Stage(shard, rng, fast and (sched is None or not sched.streams))
        stage.repack(repack)
        if head_lo > 0:
            stage.cut_head(head_lo, shard.model.config.vocab_size)
        if whole_head:
            stage.keep_head()
        if window is not None and not rng.first:  # (a memory budget: edge.cluster.pipeline)
            freed = stage.release_embedding()
            logger.info(
                "stage %d..%d: %.1f MiB of the embedding given back",
                rng.lo,
                rng.hi - 1,
                freed / 2**20,
            )
    except BaseException:
        shard.close()
        raise
    return stage
