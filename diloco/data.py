"""Token streams and batches.

Corpora: the embedded Shakespeare sample, a UTF-8 text file (or directory of ``*.txt``) read as
bytes (the byte tokenizer: token = byte, vocabulary 256), or pre-tokenized little-endian uint16
shards (``*.bin``, memory-mapped). The last ``eval_fraction`` of the tokens is held out.

Batches are a pure function of ``(seed, slot, step)``: a worker's batch at inner step t never
depends on what it drew before, so resuming a run or handing a worker's place to a newcomer
needs no data-loader state, only the step counter.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from diloco.config import DataConfig
from lowband.errors import ConfigError
from lowband import SAMPLE_TEXT

EMBEDDED = SAMPLE_TEXT


@dataclass(frozen=True)
class Corpus:
    """Token ids split into a training prefix and a held-out suffix (1-D integer arrays)."""

    train: np.ndarray
    eval: np.ndarray

    @property
    def max_token(self) -> int:
        return int(max(self.train.max(initial=0), self.eval.max(initial=0)))


def _files(path: Path, suffix: str) -> list[Path]:
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix == suffix and p.is_file())
        if not files:
            raise ConfigError("data.path", f"directory {path} has no *{suffix} files")
        return files
    if not path.exists():
        raise ConfigError("data.path", f"{path} does not exist")
    return [path]


def _read_tokens(cfg: DataConfig) -> np.ndarray:
    if cfg.kind == "embedded":
        return np.frombuffer(EMBEDDED.read_bytes(), dtype=np.uint8)
    path = Path(cfg.path or "")
    if cfg.kind == "text":
        return np.frombuffer(b"".join(f.read_bytes() for f in _files(path, ".txt")), dtype=np.uint8)
    parts = []
    for f in _files(path, ".bin"):
        if f.stat().st_size % 2:
            raise ConfigError("data.path", f"{f} has an odd size: not a uint16 token shard")
        if f.stat().st_size:
            parts.append(np.memmap(f, dtype="<u2", mode="r"))
    return np.concatenate(parts) if len(parts) > 1 else (parts[0] if parts else np.zeros(0, np.uint16))


def load_corpus(cfg: DataConfig, vocab_size: int) -> Corpus:
    """Read the corpus and split it; raises ConfigError for an empty or too short corpus."""
    tokens = _read_tokens(cfg)
    need = 2 * (cfg.seq_len + 1)
    if tokens.size == 0:
        raise ConfigError("data.path", f"the {cfg.kind} corpus {cfg.path or ''} is empty")
    if tokens.size * cfg.eval_fraction < cfg.seq_len + 1 or tokens.size < need:
        raise ConfigError("data.path", f"the corpus has {tokens.size} tokens: too few for "
                          f"seq_len={cfg.seq_len} with eval_fraction={cfg.eval_fraction}")
    cut = int(tokens.size * (1 - cfg.eval_fraction))
    corpus = Corpus(train=tokens[:cut], eval=tokens[cut:])
    if corpus.max_token >= vocab_size:
        raise ConfigError("data.path", f"token id {corpus.max_token} >= model vocab_size "
                          f"{vocab_size}")
    return corpus


def train_batch(tokens: np.ndarray, seq_len: int, batch_size: int, *, seed: int, slot: int,
                step: int) -> torch.Tensor:
    """(B, T+1) int64 windows drawn uniformly from ``tokens``; a pure function of the key."""
    rng = np.random.default_rng([seed, slot, step])
    starts = rng.integers(0, tokens.size - seq_len, size=batch_size)
    idx = starts[:, None] + np.arange(seq_len + 1)[None, :]
    return torch.from_numpy(np.asarray(tokens[idx], dtype=np.int64))


def eval_batches(tokens: np.ndarray, seq_len: int, batch_size: int, n_batches: int
                 ) -> list[torch.Tensor]:
    """``n_batches`` fixed (B, T+1) batches of evenly spaced windows over the held-out tokens."""
    n = batch_size * n_batches
    starts = np.linspace(0, tokens.size - seq_len - 1, num=n).astype(np.int64)
    idx = starts[:, None] + np.arange(seq_len + 1)[None, :]
    windows = torch.from_numpy(np.asarray(tokens[idx], dtype=np.int64))
    return list(windows.split(batch_size))
