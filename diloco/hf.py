"""Any Hugging Face causal LM as a :class:`diloco.task.Task` (the optional ``[hf]`` extra).

``TrainConfig.hf_model`` names either a ``config.json`` (or a directory holding only one): a
fresh model, randomly initialised under ``torch.manual_seed(cfg.seed)`` so every site builds the
same bits; or a checkpoint directory with weights (continued pre-training). The model comes from
``transformers.AutoModelForCausalLM``, so Llama, Qwen2, Mistral, GPT-2 ... all work; fragments
follow the HF block names (``model.layers.N.``, ``transformer.h.N.`` is split per tensor).

:func:`export_hf` writes ``save_pretrained`` output (plus the run's tokenizer, if any), which
``transformers`` loads back with identical logits.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from diloco.config import TrainConfig
from diloco.data import Corpus, eval_batches, load_corpus, load_tokenizer, slot_slice, train_batch
from diloco.device import model_device
from lowband.errors import ConfigError

logger = logging.getLogger(__name__)

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")


def _transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise ConfigError("hf_model", "Hugging Face models need `transformers`: "
                          "pip install 'lowband[hf]'") from None
    return transformers


def _source(spec: str) -> tuple[Path, bool]:
    """(directory or config file, has weights)."""
    path = Path(spec)
    if path.is_file() and path.name.endswith(".json"):
        return path, False
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ConfigError("hf_model", f"{spec} has no config.json")
        return path, any((path / w).exists() for w in WEIGHT_FILES)
    raise ConfigError("hf_model", f"{spec}: neither a config.json nor a model directory")


def build_hf_model(spec: str, seed: int) -> nn.Module:
    """The model, in float32 (master weights), bit-identical on every site for one seed."""
    tf = _transformers()
    path, has_weights = _source(spec)
    if has_weights:
        model = tf.AutoModelForCausalLM.from_pretrained(str(path), torch_dtype=torch.float32)
    else:
        config = tf.AutoConfig.from_pretrained(str(path))
        # from_config draws the initial weights from torch's global generator: seed it.
        state = torch.random.get_rng_state()
        torch.manual_seed(seed)
        try:
            model = tf.AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
        finally:
            torch.random.set_rng_state(state)
    model.config.use_cache = False  # training: no KV cache outputs
    return model


class HFTask:
    """Next-token prediction with a ``transformers`` causal LM on the configured corpus."""

    def __init__(self, cfg: TrainConfig, corpus: Corpus, vocab_size: int) -> None:
        if cfg.hf_model is None:
            raise ConfigError("hf_model", "HFTask needs TrainConfig.hf_model")
        self.cfg, self.corpus, self.vocab_size = cfg, corpus, vocab_size
        d = cfg.data
        self._eval = eval_batches(corpus.eval, d.seq_len, d.batch_size, d.eval_batches)

    def build_model(self) -> nn.Module:
        return build_hf_model(str(self.cfg.hf_model), self.cfg.seed)

    def train_batch(self, slot: int, step: int) -> torch.Tensor:
        d = self.cfg.data
        return train_batch(slot_slice(self.corpus.train, slot, d.slices), d.seq_len,
                           d.batch_size, seed=self.cfg.seed, slot=slot, step=step)

    def loss(self, model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        logits = model(input_ids=batch[:, :-1]).logits  # (B, T, V)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                               batch[:, 1:].reshape(-1))

    @torch.no_grad()
    def evaluate(self, model: nn.Module) -> float:
        device = model_device(model)
        was_training = model.training
        model.eval()
        losses = [float(self.loss(model, b.to(device))) for b in self._eval]
        model.train(was_training)
        return sum(losses) / len(losses)

    def tokens_per_batch(self) -> int:
        return self.cfg.data.batch_size * self.cfg.data.seq_len


def hf_task(cfg: TrainConfig) -> HFTask:
    tf = _transformers()
    path, _ = _source(str(cfg.hf_model))
    config = tf.AutoConfig.from_pretrained(str(path))
    max_pos = getattr(config, "max_position_embeddings", None)
    if max_pos is not None and cfg.data.seq_len > max_pos:
        raise ConfigError("data.seq_len", f"{cfg.data.seq_len} exceeds the model's "
                          f"max_position_embeddings {max_pos}")
    return HFTask(cfg, load_corpus(cfg.data, config.vocab_size), config.vocab_size)


def export_hf(model: nn.Module, out_dir: Path, tokenizer: str | None = None) -> Path:
    """``save_pretrained`` (safetensors) + ``tokenizer.json`` when the run used one."""
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    if tokenizer is not None:
        load_tokenizer(tokenizer).save(str(out_dir / "tokenizer.json"))
    return out_dir
