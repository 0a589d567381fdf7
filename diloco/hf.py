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
from typing import Any, Protocol

import torch
from torch import nn

from diloco.config import TrainConfig
from diloco.corpus_task import CorpusTask
from diloco.data import Corpus, corpus_tokenizer, load_corpus
from lowband.errors import ConfigError

logger = logging.getLogger(__name__)

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")


def _transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise ConfigError(
            "hf_model", "Hugging Face models need `transformers`: pip install 'lowband[hf]'"
        ) from None
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


class HFTask(CorpusTask):
    """Next-token prediction with a ``transformers`` causal LM on the configured corpus."""

    def __init__(self, cfg: TrainConfig, corpus: Corpus, vocab_size: int) -> None:
        if cfg.hf_model is None:
            raise ConfigError("hf_model", "HFTask needs TrainConfig.hf_model")
        super().__init__(cfg, corpus)
        self.vocab_size = vocab_size

    def build_model(self) -> nn.Module:
        return build_hf_model(str(self.cfg.hf_model), self.cfg.seed)

    def logits(self, model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        return model(input_ids=ids).logits


def hf_task(cfg: TrainConfig) -> HFTask:
    tf = _transformers()
    path, _ = _source(str(cfg.hf_model))
    config = tf.AutoConfig.from_pretrained(str(path))
    max_pos = getattr(config, "max_position_embeddings", None)
    if max_pos is not None and cfg.data.seq_len > max_pos:
        raise ConfigError(
            "data.seq_len",
            f"{cfg.data.seq_len} exceeds the model's max_position_embeddings {max_pos}",
        )
    return HFTask(cfg, load_corpus(cfg.data, config.vocab_size), config.vocab_size)


class SavesPretrained(Protocol):
    """What :func:`export_hf` needs of a ``transformers.PreTrainedModel``."""

    def save_pretrained(self, save_directory: str, *, safe_serialization: bool) -> Any: ...


def export_hf(model: SavesPretrained, out_dir: Path, tokenizer: str | None = None) -> Path:
    """``save_pretrained`` (safetensors) + ``tokenizer.json`` when the run used one."""
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    if tokenizer is not None:
        corpus_tokenizer(tokenizer).save(str(out_dir / "tokenizer.json"))
    return out_dir
