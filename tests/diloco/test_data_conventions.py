"""The model's data conventions: BOS at the start of every window when the tokenizer adds one,
EOS between the documents of a JSONL corpus, and the step-0 evaluation of the starting model."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, processors

from diloco.config import DataConfig
from diloco.data import Specials, eval_batches, load_corpus, tokenizer_specials, train_batch

WORDS = ["<pad>", "<bos>", "<eos>", "<unk>"] + [f"w{i}" for i in range(60)]


def _tokenizer(tmp: Path, *, bos: bool) -> Path:
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    if bos:  # what Gemma's and Llama's tokenizer.json do
        tok.post_processor = processors.TemplateProcessing(
            single="<bos> $A", special_tokens=[("<bos>", 1)]
        )
    d = tmp / ("bos" if bos else "plain")
    d.mkdir()
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))
    return d


def _jsonl(tmp: Path, docs: list[list[int]]) -> Path:
    path = tmp / "docs.jsonl"
    lines = [json.dumps({"text": " ".join(f"w{i}" for i in d)}) for d in docs]
    path.write_text("\n".join(lines) + "\n")
    return path


DOCS = [list(range(k, k + 12)) for k in range(0, 48, 12)] * 4  # 16 documents of 12 words


@pytest.mark.parametrize("bos", [True, False])
def test_documents_are_packed_with_the_tokenizers_specials(tmp_path: Path, bos: bool) -> None:
    tok = _tokenizer(tmp_path, bos=bos)
    cfg = DataConfig(kind="jsonl", path=str(_jsonl(tmp_path, DOCS)), tokenizer=str(tok), seq_len=8)
    corpus = load_corpus(cfg, vocab_size=len(WORDS))
    assert corpus.specials == Specials(bos=1 if bos else None, eos=2)
    stream = np.concatenate([corpus.train, corpus.validation])
    per_doc = 12 + 1 + (1 if bos else 0)
    first = stream[:per_doc].tolist()
    words = [w + 4 for w in DOCS[0]]
    assert first == ([1] if bos else []) + words + [2]
    assert (stream == 1).sum() == (len(DOCS) if bos else 0)
    assert (stream == 2).sum() == len(DOCS)


@pytest.mark.parametrize("bos", [True, False])
def test_every_window_starts_with_bos_when_the_tokenizer_adds_one(
    tmp_path: Path, bos: bool
) -> None:
    tok = _tokenizer(tmp_path, bos=bos)
    cfg = DataConfig(kind="jsonl", path=str(_jsonl(tmp_path, DOCS)), tokenizer=str(tok), seq_len=8)
    corpus = load_corpus(cfg, vocab_size=len(WORDS))
    b = corpus.specials.bos
    batches = [train_batch(corpus.train, 8, 16, seed=0, slot=0, step=s, bos=b) for s in range(4)]
    batches += eval_batches(corpus.eval, 8, 4, 2, b)
    for batch in batches:
        assert batch.shape[1] == 9
        if bos:
            assert (batch[:, 0] == 1).all()
            assert (batch[:, 1:] == 1).sum() < batch.shape[0]  # BOS only where a document starts
        else:
            assert not (batch == 1).any()
    # Without a BOS the windows are the stream as it is; with one, BOS and then T stream tokens.
    plain = train_batch(corpus.train, 8, 16, seed=0, slot=0, step=0)
    if bos:
        with_bos = batches[0]
        shifted = plain[:, 0] != 1
        assert (with_bos[shifted, 1:] == plain[shifted, :-1]).all()
        assert (with_bos[~shifted] == plain[~shifted]).all()
    else:
        assert (batches[0] == plain).all()


def test_byte_corpus_has_no_specials() -> None:
    corpus = load_corpus(DataConfig(seq_len=16), vocab_size=256)
    assert corpus.specials == Specials()


def test_specials_of_a_tokenizer_object(tmp_path: Path) -> None:
    tok = Tokenizer.from_file(str(_tokenizer(tmp_path, bos=True) / "tokenizer.json"))
    assert tokenizer_specials(tok) == Specials(bos=1, eos=2)
    assert tokenizer_specials(tok, "<pad>") == Specials(bos=1, eos=0)


@pytest.mark.parametrize("mode", ["diloco", "ddp"])
def test_the_first_eval_is_the_starting_model_at_step_0(mode: str) -> None:
    from diloco.config import DDPConfig
    from diloco.launch import run_threads
    from tests.diloco.configs import small_lm

    over = {"mode": DDPConfig()} if mode == "ddp" else {}
    results = run_threads(small_lm(steps=6, **over))
    lead = next(r for r in results if r.rank == 0)
    assert [e["step"] for e in lead.evals] == [0, 6]
    assert lead.evals[0]["bytes_sent"] < lead.evals[1]["bytes_sent"]
    assert lead.evals[0]["loss"] == pytest.approx(np.log(256), abs=0.3)  # random init, bytes
