"""What the trainers need from "a model and its data": the :class:`Task` Protocol.

The trainers (``diloco.trainer``, ``diloco.ddp``) are written against this Protocol so that any
``nn.Module`` can be trained; :class:`LMTask` is the default, a Llama-family byte-level language
model from ``lowband.models.llama`` on a token corpus.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import nn

from diloco.config import TrainConfig
from diloco.corpus_task import CorpusTask
from diloco.data import Corpus, load_corpus
from lowband.errors import ConfigError
from lowband.models.llama import LlamaForCausalLM, init_weights


class Task(Protocol):
    def build_model(self) -> nn.Module:
        """A fresh model; identical (bit for bit) on every worker of a run."""
        ...

    def train_batch(self, slot: int, step: int) -> Any:
        """The batch of data slot ``slot`` (a worker's rank) at inner step ``step``. Pure."""
        ...

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        """Scalar training loss (mean over the batch) with a graph for backward."""
        ...

    def evaluate(self, model: nn.Module) -> float:
        """Held-out loss of ``model`` (no grad; deterministic)."""
        ...

    def tokens_per_batch(self) -> int: ...


class LMTask(CorpusTask):
    """Next-token prediction with :class:`lowband.models.llama.LlamaForCausalLM` (HF parameter
    names)."""

    def __init__(self, cfg: TrainConfig, corpus: Corpus) -> None:
        if cfg.model is None:
            raise ConfigError("model", "the language-model task needs a ModelConfig")
        super().__init__(cfg, corpus)
        self.model_cfg = cfg.model

    def build_model(self) -> LlamaForCausalLM:
        model = LlamaForCausalLM(self.model_cfg)
        init_weights(model, seed=self.cfg.seed)
        return model


def lm_task(cfg: TrainConfig) -> Task:
    """The default task: the configured corpus (ConfigError if missing or empty) and model —
    lowband's Llama, or a Hugging Face causal LM when ``cfg.hf_model`` is set."""
    if cfg.hf_model is not None:
        from diloco.hf import hf_task

        return hf_task(cfg)
    if cfg.model is None:
        raise ConfigError("model", "the language-model task needs a ModelConfig (use a preset)")
    return LMTask(cfg, load_corpus(cfg.data, cfg.model.vocab_size))
