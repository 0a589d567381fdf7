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
from diloco.data import Corpus, Specials, load_corpus
from lowband.errors import ConfigError
from lowband.models.config import ModelConfig
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


class Pretrained(Protocol):
    """Reads a pretrained model file (``TrainConfig.gguf_model``). The trainer does not parse
    model files itself: the composition root (the CLI) hands it the reader, e.g.
    ``edge.formats.gguf_train.GGUFPretrained``."""

    def config(self, path: str) -> ModelConfig:
        """The model's shape, read without its weights."""
        ...

    def model(self, path: str) -> LlamaForCausalLM:
        """The model in float32, trainable (every parameter a float tensor with grad)."""
        ...

    def tokenizer(self, path: str) -> tuple[Any, int | None, int | None]:
        """The file's ``tokenizers.Tokenizer``, the BOS id it adds (None: none) and its EOS id."""
        ...


class PretrainedTask(CorpusTask):
    """Fine-tuning: the model and (unless ``data.tokenizer`` names another) the tokenizer of a
    pretrained file; identical on every worker since they read the same file."""

    def __init__(self, cfg: TrainConfig, pretrained: Pretrained) -> None:
        path = str(cfg.gguf_model)
        self.model_cfg = pretrained.config(path)
        if cfg.data.seq_len > self.model_cfg.max_position_embeddings:
            raise ConfigError(
                "data.seq_len",
                f"{cfg.data.seq_len} exceeds the model's max_position_embeddings "
                f"{self.model_cfg.max_position_embeddings}",
            )
        tok, specials = None, None
        if cfg.data.tokenizer is None and cfg.data.kind != "tokens":
            tok, bos, eos = pretrained.tokenizer(path)
            specials = Specials(bos=bos, eos=eos)
        super().__init__(cfg, load_corpus(cfg.data, self.model_cfg.vocab_size, tok, specials))
        self.pretrained = pretrained

    def build_model(self) -> LlamaForCausalLM:
        return self.pretrained.model(str(self.cfg.gguf_model))


def lm_task(cfg: TrainConfig, pretrained: Pretrained | None = None) -> Task:
    """The default task: the configured corpus (ConfigError if missing or empty) and model —
    lowband's Llama, a Hugging Face causal LM when ``cfg.hf_model`` is set, or the pretrained
    file ``cfg.gguf_model`` read by ``pretrained``."""
    if cfg.hf_model is not None:
        from diloco.hf import hf_task

        return hf_task(cfg)
    if cfg.gguf_model is not None:
        if pretrained is None:
            raise ConfigError("gguf_model", "a GGUF model needs a reader (the CLI passes one)")
        return PretrainedTask(cfg, pretrained)
    if cfg.model is None:
        raise ConfigError("model", "the language-model task needs a ModelConfig (use a preset)")
    return LMTask(cfg, load_corpus(cfg.data, cfg.model.vocab_size))
