"""The corpus side shared by every language-model task: batches of the configured corpus (this
site's slice), the loss, the held-out evaluation. :class:`diloco.task.LMTask` (lowband's Llama)
and :class:`diloco.hf.HFTask` (any ``transformers`` causal LM) differ only in the model."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from diloco.config import TrainConfig
from diloco.data import Corpus, eval_batches, slot_slice, train_batch
from diloco.device import model_device


class CorpusTask:
    """Next-token prediction on the configured corpus; subclasses build the model and say how
    it maps token ids (B, T) to logits (B, T, V)."""

    def __init__(self, cfg: TrainConfig, corpus: Corpus) -> None:
        self.cfg = cfg
        self.corpus = corpus
        d = cfg.data
        self._eval = eval_batches(
            corpus.eval, d.seq_len, d.batch_size, d.eval_batches, corpus.specials.bos
        )

    def logits(self, model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        return model(ids)

    def train_batch(self, slot: int, step: int) -> torch.Tensor:
        d = self.cfg.data
        return train_batch(
            slot_slice(self.corpus.train, slot, d.slices),
            d.seq_len,
            d.batch_size,
            seed=self.cfg.seed,
            slot=slot,
            step=step,
            bos=self.corpus.specials.bos,
        )

    def loss(self, model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        logits = self.logits(model, batch[:, :-1])  # (B, T, V)
        return F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]).float(), batch[:, 1:].reshape(-1)
        )

    @torch.no_grad()
    def evaluate(self, model: nn.Module) -> float:
        """Mean loss over the fixed held-out batches, in fp32 on the model's device."""
        device = model_device(model)
        was_training = model.training
        model.eval()
        losses = [float(self.loss(model, b.to(device))) for b in self._eval]
        model.train(was_training)
        return sum(losses) / len(losses)

    def tokens_per_batch(self) -> int:
        return self.cfg.data.batch_size * self.cfg.data.seq_len
