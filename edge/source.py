"""Where a model comes from: ``resolve_model(path)`` for every ``lowband edge`` command.

A path is either a directory (an HF checkpoint, a split from ``edge split``, a quantized or a
bit-nested checkpoint) or a GGUF file, recognised by its magic bytes. The loaders
(``edge.shardio.load_shard`` and what calls it) read both as they are, with no conversion
step; this module answers the questions asked before loading: the model's config, its name in
the API and its tokenizer (for a GGUF file the one in its metadata, with its chat template).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edge.formats.gguf_arch import TOKENIZER_GGUF, is_gguf, read_config, read_tokenizer
from edge.formats.gguf_reader import open_reader
from lowband.errors import ConfigError
from lowband.models.config import ModelConfig
from lowband.models.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelSource:
    """A resolved model path: ``gguf`` tells a GGUF file from a directory."""

    path: Path
    gguf: bool
    config: ModelConfig
    reader: Any = field(default=None, compare=False, repr=False)  # gguf.GGUFReader of a file

    @property
    def name(self) -> str:
        """The default model id in the API: the file's stem or the directory's name."""
        return self.path.stem if self.gguf else self.path.resolve().name

    def tokenizer(self) -> Tokenizer:
        if self.gguf:
            return read_tokenizer(self.reader)
        cfg = self.config
        try:  # the directory's own tokenizer files first: what its owner put there
            eos = cfg.eos_token_id if isinstance(cfg.eos_token_id, int) else None
            return load_tokenizer(self.path, eos)
        except ConfigError:
            if (self.path / TOKENIZER_GGUF).exists():  # kept from the GGUF it was made from
                return read_tokenizer(_reader(self.path / TOKENIZER_GGUF))
            if cfg.vocab_size == 256:
                logger.warning("%s ships no tokenizer; using bytes (vocabulary 256)", self.path)
                return ByteTokenizer()
            raise


_PARSE_ERRORS = (ValueError, KeyError, IndexError, TypeError, ArithmeticError)


def _reader(path: Path) -> Any:
    """A GGUF reader for ``path``; a file the parser trips on is a ConfigError (the tensors'
    bounds are checked where they are loaded: :func:`edge.formats.bounds.open_gguf`)."""
    try:
        import gguf  # noqa: F401  (whether it is installed)
    except ModuleNotFoundError:
        raise ConfigError(
            "model", f"{path} is a GGUF file: reading it needs 'gguf' (pip install 'lowband[edge]')"
        ) from None
    try:
        return open_reader(str(path))
    except _PARSE_ERRORS as exc:
        raise ConfigError("model", f"{path} is not a readable GGUF file: {exc}") from None


def check_model_path(path: str | Path) -> None:
    """Refuse a path that is neither a directory nor a GGUF file (cheap: no parsing)."""
    p = Path(path)
    if not (p.is_dir() or is_gguf(p)):
        what = "does not exist" if not p.exists() else "is neither a directory nor a GGUF file"
        raise ConfigError("model_dir", f"{p} {what}")


def resolve_model(path: str | Path) -> ModelSource:
    """The model at ``path``: a GGUF file (its metadata read, tensors left mapped) or a
    directory with a ``config.json``."""
    check_model_path(path)
    p = Path(path)
    if p.is_dir():
        return ModelSource(p, False, ModelConfig.from_json(p))
    reader = _reader(p)
    try:  # strings are decoded lazily: a metadata string that is not UTF-8 fails in here
        config = read_config(reader)
    except ConfigError:
        raise
    except _PARSE_ERRORS as exc:
        raise ConfigError("model", f"{p} is not a readable GGUF file: {exc}") from None
    return ModelSource(p, True, config, reader)


__all__ = ["ModelSource", "resolve_model", "check_model_path", "is_gguf", "TOKENIZER_GGUF"]
