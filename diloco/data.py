"""Token streams and batches.

Corpora: the embedded Shakespeare sample, UTF-8 text files or JSONL documents — read as bytes
(token = byte, vocabulary 256) or through a Hugging Face ``tokenizers`` tokenizer — or
pre-tokenized shards (``*.bin`` raw uint16/uint32, ``*.npy``; memory-mapped). The corpus is cut
``[train | validation | test]`` in order (see ``DataConfig``).

Batches are a pure function of ``(seed, slot, step)``: a worker's batch at inner step t never
depends on what it drew before, so resuming a run or handing a worker's place to a newcomer
needs no data-loader state, only the step counter. With ``DataConfig.slices`` each slot draws
only from its own disjoint slice of the training split (``slot_slice``).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from diloco.config import DataConfig
from lowband import SAMPLE_TEXT
from lowband.errors import ConfigError

EMBEDDED = SAMPLE_TEXT
# A second packaged public-domain text, by another author: Milton's Paradise Lost (1667), the
# text the bench reports on that no setting was tuned on (lowband/data/README.md says where it
# comes from). Read it as ``DataConfig(kind="text", path=str(PARADISE_LOST))``.
PARADISE_LOST = SAMPLE_TEXT.with_name("paradise_lost.txt")
PACKAGED_TEXTS = {"shakespeare": EMBEDDED, "paradise_lost": PARADISE_LOST}


@dataclass(frozen=True)
class Corpus:
    """Token ids split into training, validation and test parts (1-D integer arrays, in corpus
    order); ``eval`` is the split the run's evaluations report (``DataConfig.eval_split``)."""

    train: np.ndarray
    eval: np.ndarray
    test: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    validation: np.ndarray | None = None

    @property
    def max_token(self) -> int:
        return int(max(a.max(initial=0) for a in (self.train, self.eval, self.test)))


def _files(path: Path, *suffixes: str) -> list[Path]:
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix in suffixes and p.is_file())
        if not files:
            wanted = " or ".join(f"*{s}" for s in suffixes)
            raise ConfigError("data.path", f"directory {path} has no {wanted} files")
        return files
    if not path.exists():
        raise ConfigError("data.path", f"{path} does not exist")
    return [path]


BPE_SAMPLE_FRACTION = 0.8  # the embedded sample's training split under val = test = 0.1


@functools.lru_cache(maxsize=4)
def corpus_tokenizer(spec: str) -> Any:
    """The tokenizer that turns a training corpus into ids (``DataConfig.tokenizer``; a checkpoint's
    own tokenizer is ``lowband.models.tokenizer.load_tokenizer``).

    A ``tokenizers.Tokenizer``: from a ``tokenizer.json`` path, or ``bpe:N`` — a byte-level
    BPE of N tokens trained here on the first 80 % of the embedded sample (deterministic: the
    same merges on every site, so no tokenizer file has to be shipped around)."""
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    except ImportError:
        raise ConfigError(
            "data.tokenizer",
            "a tokenizer needs the `tokenizers` package: pip install 'lowband[hf]'",
        ) from None
    if not spec.startswith("bpe:"):
        path = Path(spec)
        if path.is_dir():
            path = path / "tokenizer.json"
        if not path.is_file():
            raise ConfigError("data.tokenizer", f"no tokenizer.json at {spec}")
        return Tokenizer.from_file(str(path))
    text = EMBEDDED.read_text(encoding="utf-8")
    text = text[: int(len(text) * BPE_SAMPLE_FRACTION)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=int(spec[4:]),
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|endoftext|>"],
    )
    tok.train_from_iterator(text.splitlines(keepends=True), trainer=trainer)
    return tok


def _tokenize(texts: list[str], spec: str | None) -> np.ndarray:
    if spec is None:  # bytes: token = byte
        return np.frombuffer("".join(texts).encode("utf-8"), dtype=np.uint8)
    tok = corpus_tokenizer(spec)
    ids = [np.asarray(e.ids, dtype=np.int32) for e in tok.encode_batch(texts)]
    return np.concatenate(ids) if ids else np.zeros(0, np.int32)


def _jsonl_texts(files: list[Path]) -> list[str]:
    texts = []
    for f in files:
        for i, line in enumerate(f.read_text(encoding="utf-8").splitlines()):
            if not line.strip():
                continue
            try:
                texts.append(str(json.loads(line)["text"]))
            except (ValueError, KeyError, TypeError):
                raise ConfigError(
                    "data.path", f'{f}:{i + 1}: not a JSON object with a "text" field'
                ) from None
    return texts


def _shard(f: Path, dtype: str) -> np.ndarray:
    if f.suffix == ".npy":
        arr = np.load(f, mmap_mode="r")
        if arr.ndim != 1 or arr.dtype.kind not in "ui":
            raise ConfigError(
                "data.path",
                f"{f}: a token shard is a 1-D integer array, got {arr.dtype} of shape {arr.shape}",
            )
        return arr
    width = np.dtype(dtype).itemsize
    if f.stat().st_size % width:
        raise ConfigError(
            "data.path",
            f"{f} size is not a multiple of {width}: not a {dtype} "
            "token shard (set data.token_dtype)",
        )
    return np.memmap(f, dtype=np.dtype(dtype).newbyteorder("<"), mode="r")


def _read_tokens(cfg: DataConfig) -> np.ndarray:
    if cfg.kind == "embedded":
        if cfg.tokenizer is None:
            return np.frombuffer(EMBEDDED.read_bytes(), dtype=np.uint8)
        return _tokenize([EMBEDDED.read_text(encoding="utf-8")], cfg.tokenizer)
    path = Path(cfg.path or "")
    if cfg.kind == "text":
        files = _files(path, ".txt") if path.is_dir() else _files(path)
        if cfg.tokenizer is None:
            return np.frombuffer(b"".join(f.read_bytes() for f in files), dtype=np.uint8)
        return _tokenize([f.read_text(encoding="utf-8") for f in files], cfg.tokenizer)
    if cfg.kind == "jsonl":
        return _tokenize(_jsonl_texts(_files(path, ".jsonl")), cfg.tokenizer)
    parts = [
        a for a in (_shard(f, cfg.token_dtype) for f in _files(path, ".bin", ".npy")) if a.size
    ]
    return (
        np.concatenate(parts) if len(parts) > 1 else (parts[0] if parts else np.zeros(0, np.uint16))
    )


def load_corpus(cfg: DataConfig, vocab_size: int) -> Corpus:
    """Read the corpus and split it ``[train | validation | test]``; raises ConfigError for an
    empty or too short corpus."""
    tokens = _read_tokens(cfg)
    need = 2 * (cfg.seq_len + 1)
    if tokens.size == 0:
        raise ConfigError("data.path", f"the {cfg.kind} corpus {cfg.path or ''} is empty")
    held = [f for f in (cfg.eval_fraction, cfg.test_fraction) if f > 0]
    if tokens.size < need or any(tokens.size * f < cfg.seq_len + 1 for f in held):
        raise ConfigError(
            "data.path",
            f"the corpus has {tokens.size} tokens: too few for "
            f"seq_len={cfg.seq_len} with eval_fraction={cfg.eval_fraction}, "
            f"test_fraction={cfg.test_fraction}",
        )
    end_val = tokens.size - int(tokens.size * cfg.test_fraction)
    cut = end_val - int(tokens.size * cfg.eval_fraction)
    if cfg.test_fraction == 0:  # the historical split (keeps old runs bit-identical)
        cut, end_val = int(tokens.size * (1 - cfg.eval_fraction)), tokens.size
    train, val, test = tokens[:cut], tokens[cut:end_val], tokens[end_val:]
    corpus = Corpus(
        train=train, eval=test if cfg.eval_split == "test" else val, test=test, validation=val
    )
    if corpus.max_token >= vocab_size:
        raise ConfigError(
            "data.path", f"token id {corpus.max_token} >= model vocab_size {vocab_size}"
        )
    return corpus


def slot_slice(tokens: np.ndarray, slot: int, slices: int) -> np.ndarray:
    """The disjoint part of the training tokens data slot ``slot`` reads (slice slot mod
    ``slices``; 0 slices: all of them)."""
    if slices <= 0:
        return tokens
    n = tokens.size // slices
    s = slot % slices
    return tokens[s * n : (s + 1) * n]


def train_batch(
    tokens: np.ndarray, seq_len: int, batch_size: int, *, seed: int, slot: int, step: int
) -> torch.Tensor:
    """(B, T+1) int64 windows drawn uniformly from ``tokens``; a pure function of the key."""
    rng = np.random.default_rng([seed, slot, step])
    starts = rng.integers(0, tokens.size - seq_len, size=batch_size)
    idx = starts[:, None] + np.arange(seq_len + 1)[None, :]
    return torch.from_numpy(np.asarray(tokens[idx], dtype=np.int64))


def eval_batches(
    tokens: np.ndarray, seq_len: int, batch_size: int, n_batches: int
) -> list[torch.Tensor]:
    """``n_batches`` fixed (B, T+1) batches of evenly spaced windows over the held-out tokens."""
    n = batch_size * n_batches
    starts = np.linspace(0, tokens.size - seq_len - 1, num=n).astype(np.int64)
    idx = starts[:, None] + np.arange(seq_len + 1)[None, :]
    windows = torch.from_numpy(np.asarray(tokens[idx], dtype=np.int64))
    return list(windows.split(batch_size))
