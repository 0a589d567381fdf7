"""Token streams and batches.

Corpora: the embedded Shakespeare sample, UTF-8 text files or JSONL documents — read as bytes
(token = byte, vocabulary 256) or through a Hugging Face ``tokenizers`` tokenizer — or
pre-tokenized shards (``*.bin`` raw uint16/uint32, ``*.npy``; memory-mapped). The corpus is cut
``[train | validation | test]`` in order (see ``DataConfig``).

Batches are a pure function of ``(seed, slot, step)``: a worker's batch at inner step t never
depends on what it drew before, so resuming a run or handing a worker's place to a newcomer
needs no data-loader state, only the step counter. With ``DataConfig.slices`` each slot draws
only from its own disjoint slice of the training split (``slot_slice``).

The model's conventions (:class:`Specials`): a tokenizer that adds a BOS token (Gemma, Llama)
gets one at the start of every document and of every training and evaluation window, since
such a model is trained to see BOS first (Gemma 3 270M: loss 8.0 without it, 5.2 with it on
the same windows); documents of a many-document corpus (JSONL lines, files of a directory) end
with EOS, as torchtitan's loaders pack them. Bytes and the ``bpe:N`` tokenizer have no BOS.
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
class Specials:
    """The special tokens the corpus is packed with: ``bos`` starts every document and every
    window (None: the tokenizer adds none), ``eos`` ends every document of a corpus of many
    (None: none known)."""

    bos: int | None = None
    eos: int | None = None


# End-of-text names, in the order tried, when no tokenizer_config.json names the EOS token.
EOS_NAMES = ("<eos>", "</s>", "<|endoftext|>", "<|end_of_text|>", "<|im_end|>")


def tokenizer_specials(tok: Any, eos_token: str | None = None) -> Specials:
    """BOS: what ``tok`` puts before a text when asked to add special tokens (its
    post-processor, as ``transformers`` encodes); EOS: ``eos_token`` or the first of
    :data:`EOS_NAMES` in the vocabulary."""
    with_special = tok.encode("a", add_special_tokens=True).ids
    plain = tok.encode("a", add_special_tokens=False).ids
    bos = None
    if len(with_special) > len(plain) and with_special[-len(plain) :] == plain:
        bos = int(with_special[0])
    names = (eos_token,) if eos_token is not None else EOS_NAMES
    eos = next((i for i in (tok.token_to_id(n) for n in names if n) if i is not None), None)
    return Specials(bos=bos, eos=None if eos is None else int(eos))


def _config_eos(spec: str) -> str | None:
    """The EOS token a Hugging Face tokenizer directory names in tokenizer_config.json."""
    path = Path(spec)
    cfg = (path if path.is_dir() else path.parent) / "tokenizer_config.json"
    if not cfg.is_file():
        return None
    try:
        value = json.loads(cfg.read_text(encoding="utf-8")).get("eos_token")
    except (ValueError, AttributeError):
        return None
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def spec_specials(spec: str | None) -> Specials:
    """The :class:`Specials` of ``DataConfig.tokenizer`` (bytes: none)."""
    if spec is None:
        return Specials()
    if spec.startswith("bpe:"):  # trained here without a BOS; <|endoftext|> separates documents
        return tokenizer_specials(corpus_tokenizer(spec))
    return tokenizer_specials(corpus_tokenizer(spec), _config_eos(spec))


@dataclass(frozen=True)
class Corpus:
    """Token ids split into training, validation and test parts (1-D integer arrays, in corpus
    order); ``eval`` is the split the run's evaluations report (``DataConfig.eval_split``)."""

    train: np.ndarray
    eval: np.ndarray
    test: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    validation: np.ndarray | None = None
    specials: Specials = field(default_factory=Specials)

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


def _tokenize(texts: list[str], tok: Any, specials: Specials, *, documents: bool) -> np.ndarray:
    """Each text as ``[BOS] ids [EOS]``: BOS when the tokenizer adds one, EOS after each
    document when the corpus is many ``documents`` (a single text needs no separator)."""
    if tok is None:  # bytes: token = byte
        return np.frombuffer("".join(texts).encode("utf-8"), dtype=np.uint8)
    head = [] if specials.bos is None else [specials.bos]
    tail = [specials.eos] if documents and specials.eos is not None else []
    ids = [
        np.asarray(head + e.ids + tail, dtype=np.int32)
        for e in tok.encode_batch(texts, add_special_tokens=False)
    ]
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


def _read_tokens(cfg: DataConfig, tok: Any, specials: Specials) -> np.ndarray:
    if cfg.kind == "embedded":
        if tok is None:
            return np.frombuffer(EMBEDDED.read_bytes(), dtype=np.uint8)
        return _tokenize([EMBEDDED.read_text(encoding="utf-8")], tok, specials, documents=False)
    path = Path(cfg.path or "")
    if cfg.kind == "text":
        files = _files(path, ".txt") if path.is_dir() else _files(path)
        if tok is None:
            return np.frombuffer(b"".join(f.read_bytes() for f in files), dtype=np.uint8)
        texts = [f.read_text(encoding="utf-8") for f in files]
        return _tokenize(texts, tok, specials, documents=len(texts) > 1)
    if cfg.kind == "jsonl":
        return _tokenize(_jsonl_texts(_files(path, ".jsonl")), tok, specials, documents=True)
    parts = [
        a for a in (_shard(f, cfg.token_dtype) for f in _files(path, ".bin", ".npy")) if a.size
    ]
    return (
        np.concatenate(parts) if len(parts) > 1 else (parts[0] if parts else np.zeros(0, np.uint16))
    )


def load_corpus(
    cfg: DataConfig, vocab_size: int, tokenizer: Any = None, specials: Specials | None = None
) -> Corpus:
    """Read the corpus and split it ``[train | validation | test]``; raises ConfigError for an
    empty or too short corpus. ``tokenizer`` (a ``tokenizers.Tokenizer``, with its ``specials``):
    the model file's own, used when ``cfg.tokenizer`` names none."""
    if cfg.tokenizer is not None or tokenizer is None:
        tokenizer = None if cfg.tokenizer is None else corpus_tokenizer(cfg.tokenizer)
        specials = spec_specials(cfg.tokenizer)
    elif specials is None:
        specials = tokenizer_specials(tokenizer)
    if cfg.kind == "tokens":  # pre-tokenized shards: packed by whoever wrote them
        tokenizer, specials = None, Specials()
    tokens = _read_tokens(cfg, tokenizer, specials)
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
        train=train,
        eval=test if cfg.eval_split == "test" else val,
        test=test,
        validation=val,
        specials=specials,
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


def windows(tokens: np.ndarray, starts: np.ndarray, seq_len: int, bos: int | None) -> torch.Tensor:
    """(B, T+1) int64 windows at ``starts``. With a ``bos`` every window begins with it: a
    window whose first token is not BOS is BOS followed by T tokens of the stream (T targets
    either way), one that starts on a document's own BOS is taken as it is."""
    idx = starts[:, None] + np.arange(seq_len + 1)[None, :]
    out = np.asarray(tokens[idx], dtype=np.int64)
    if bos is not None:
        shift = out[:, 0] != bos
        out[shift, 1:] = out[shift, :-1]
        out[shift, 0] = bos
    return torch.from_numpy(out)


def train_batch(
    tokens: np.ndarray,
    seq_len: int,
    batch_size: int,
    *,
    seed: int,
    slot: int,
    step: int,
    bos: int | None = None,
) -> torch.Tensor:
    """(B, T+1) int64 windows drawn uniformly from ``tokens``; a pure function of the key."""
    rng = np.random.default_rng([seed, slot, step])
    starts = rng.integers(0, tokens.size - seq_len, size=batch_size)
    return windows(tokens, starts, seq_len, bos)


def eval_batches(
    tokens: np.ndarray, seq_len: int, batch_size: int, n_batches: int, bos: int | None = None
) -> list[torch.Tensor]:
    """``n_batches`` fixed (B, T+1) batches of evenly spaced windows over the held-out tokens."""
    n = batch_size * n_batches
    starts = np.linspace(0, tokens.size - seq_len - 1, num=n).astype(np.int64)
    return list(windows(tokens, starts, seq_len, bos).split(batch_size))
