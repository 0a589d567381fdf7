"""Corpora a real run uses: token shards (.bin uint16/uint32, .npy), text and JSONL through a
Hugging Face tokenizer, train / validation / test splits, disjoint per-site slices, and exact
resume on shards."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from diloco.config import DataConfig, DilocoConfig, tiny
from diloco.data import corpus_tokenizer, load_corpus, slot_slice
from diloco.launch import run_threads
from diloco.task import lm_task
from lowband import SAMPLE_TEXT
from lowband.errors import ConfigError
from tests.diloco.configs import small_model

pytestmark = pytest.mark.timeout(120)


def write_shards(tmp_path, dtype: str, n: int = 6000, vocab: int = 200):
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, vocab, size=n).astype(dtype)
    d = tmp_path / f"shards-{dtype}"
    d.mkdir()
    half = n // 2
    if dtype == "uint32":
        np.save(d / "a.npy", tokens[:half])
        tokens[half:].astype("<u4").tofile(d / "b.bin")
    else:
        tokens[:half].astype("<u2").tofile(d / "a.bin")
        np.save(d / "b.npy", tokens[half:])
    return d, tokens


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_shards_load_in_order(tmp_path, dtype):
    d, tokens = write_shards(tmp_path, dtype)
    cfg = DataConfig(kind="tokens", path=str(d), token_dtype=dtype, seq_len=16)  # type: ignore[arg-type]
    c = load_corpus(cfg, vocab_size=256)
    assert np.array_equal(np.concatenate([c.train, c.eval]), tokens)
    with pytest.raises(ConfigError, match="vocab_size"):
        load_corpus(cfg, vocab_size=100)


def test_odd_sized_shard_is_refused(tmp_path):
    (tmp_path / "x.bin").write_bytes(b"\x01\x02\x03\x04\x05\x06")
    with pytest.raises(ConfigError, match="uint32"):
        load_corpus(
            DataConfig(
                kind="tokens", path=str(tmp_path / "x.bin"), token_dtype="uint32", seq_len=1
            ),
            256,
        )


def test_three_way_split_is_disjoint_and_ordered():
    cfg = DataConfig(seq_len=32, eval_fraction=0.1, test_fraction=0.1, eval_split="test")
    c = load_corpus(cfg, 256)
    n = c.train.size + c.validation.size + c.test.size
    assert n == SAMPLE_TEXT.stat().st_size
    assert c.eval is c.test and c.test.size >= 65536  # ≥ 64 k reported tokens
    assert abs(c.validation.size - n * 0.1) <= 1
    with pytest.raises(ConfigError, match="test_fraction"):
        DataConfig(eval_split="test")  # no test split to report on
    # the historical two-way split is unchanged
    old = load_corpus(DataConfig(seq_len=32), 256)
    assert old.train.size == int(n * 0.9) and old.test.size == 0


def test_slices_are_disjoint():
    t = np.arange(1000)
    parts = [slot_slice(t, s, 4) for s in range(4)]
    assert sum(p.size for p in parts) == 1000
    assert len(set(np.concatenate(parts).tolist())) == 1000
    assert np.array_equal(slot_slice(t, 5, 4), parts[1])  # a newcomer's slot wraps
    assert slot_slice(t, 3, 0) is t


def test_bpe_tokenizer_is_deterministic_and_round_trips():
    a, b = corpus_tokenizer.__wrapped__("bpe:512"), corpus_tokenizer.__wrapped__("bpe:512")
    text = "ROMEO: But soft, what light through yonder window breaks?"
    assert a.encode(text).ids == b.encode(text).ids
    assert a.get_vocab_size() == 512
    assert a.decode(a.encode(text).ids) == text
    assert len(a.encode(text).ids) < 0.75 * len(text.encode())  # it compresses


def test_jsonl_and_text_through_a_tokenizer(tmp_path):
    tok = corpus_tokenizer("bpe:512")
    tok.save(str(tmp_path / "tokenizer.json"))
    text = SAMPLE_TEXT.read_text()[:20000]
    docs = [text[i : i + 2000] for i in range(0, len(text), 2000)]
    (tmp_path / "c.jsonl").write_text("\n".join(json.dumps({"text": d}) for d in docs))
    (tmp_path / "c.txt").write_text(text)
    j = load_corpus(
        DataConfig(
            kind="jsonl", path=str(tmp_path / "c.jsonl"), tokenizer=str(tmp_path), seq_len=16
        ),
        512,
    )
    t = load_corpus(
        DataConfig(
            kind="text",
            path=str(tmp_path / "c.txt"),
            tokenizer=str(tmp_path / "tokenizer.json"),
            seq_len=16,
        ),
        512,
    )
    ids = np.concatenate([j.train, j.eval])
    assert ids.max() < 512 and ids.size < 0.75 * len(text)
    assert abs(ids.size - (t.train.size + t.eval.size)) < len(docs) * 2
    (tmp_path / "bad.jsonl").write_text('{"txt": 1}\n')
    with pytest.raises(ConfigError, match="bad.jsonl:1"):
        load_corpus(DataConfig(kind="jsonl", path=str(tmp_path / "bad.jsonl")), 512)


def test_shard_run_resumes_exactly(tmp_path):
    d, _ = write_shards(tmp_path, "uint32", n=20000, vocab=256)
    base = tiny()
    cfg = dataclasses.replace(
        base,
        model=small_model(),
        steps=16,
        checkpoint_every=8,
        eval_every=0,
        workers=2,
        data=DataConfig(
            kind="tokens",
            path=str(d),
            token_dtype="uint32",
            seq_len=16,
            batch_size=4,
            eval_batches=2,
            slices=2,
        ),
        mode=DilocoConfig(inner_steps=4, n_fragments=2, tau=1, codec="int8", error_feedback=True),
    )
    task = lm_task(cfg)
    # each slot reads its own half of the training split
    b0, b1 = task.train_batch(0, 3), task.train_batch(1, 3)
    half = task.corpus.train.size // 2
    assert set(b0.flatten().tolist()) <= set(task.corpus.train[:half].tolist())
    assert set(b1.flatten().tolist()) <= set(task.corpus.train[half:].tolist())
    full = run_threads(cfg, task=task, out_dir=tmp_path / "a")
    ckpt = tmp_path / "a" / "checkpoints" / "step-000009"  # step 8 had a sync in flight
    resumed = run_threads(cfg, task=task, resume=ckpt)
    for a, b in zip(full, resumed):
        assert b.start_step == 9
        assert [b.losses[s] for s in range(10, 17)] == [a.losses[s] for s in range(10, 17)]
        assert a.state_hash == b.state_hash
