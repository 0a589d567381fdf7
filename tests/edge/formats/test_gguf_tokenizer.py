"""The tokenizer inside a GGUF file: llama.cpp's token ids on llama.cpp's own test vectors, plus
the metadata handling (special tokens, BOS/EOS, refusals) on small files written here."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import pytest
from tokenizers import pre_tokenizers

from edge.formats.gguf_reader import open_reader
from edge.formats.gguf_tokenizer import GGUFTokenizer, tokenizer_from_gguf
from lowband.errors import ConfigError

# Every llama.cpp test vocabulary of a family lowband supports (gpt2 byte-level BPE with a known
# pre-tokenizer, llama SentencePiece BPE). Not covered: bert-bge (WordPiece), gemma-4 (its own
# model type), nomic-bert-moe (t5 Unigram), aquila/baichuan/gpt-neox (no .inp/.out).
VOCABS = [
    "llama-bpe",
    "qwen2",
    "gpt-2",
    "deepseek-llm",
    "llama-spm",
    "phi-3",
    "starcoder",
    "falcon",
    "command-r",
    "deepseek-coder",
    "refact",
    "mpt",
    "qwen35",
]
SEP = "\n__ggml_vocab_test__\n"
SPECIAL_VECTORS = Path(__file__).with_name("gguf_special_vectors.json")


def read_vectors(d: Path, name: str) -> list[tuple[str, list[int]]]:
    """(text, ids) pairs as llama.cpp's tests/test-tokenizer-0.cpp reads them: the .inp is split
    on the separator line, the .out has one line of space-separated ids per text."""
    raw = (d / f"ggml-vocab-{name}.gguf.inp").read_bytes().decode("utf-8")
    texts: list[str] = []
    pos = 0
    while pos < len(raw):
        nxt = raw.find(SEP, pos)
        texts.append(raw[pos:] if nxt < 0 else raw[pos:nxt])
        if nxt < 0:
            break
        pos = nxt + len(SEP)
    lines = (d / f"ggml-vocab-{name}.gguf.out").read_text().split("\n")
    assert len(lines) >= len(texts) and not any(lines[len(texts) :]), name
    return [(t, [int(x) for x in line.split()]) for t, line in zip(texts, lines)]


@pytest.mark.timeout(1200)  # the first test downloads the 76 MB release
@pytest.mark.parametrize("name", VOCABS)
def test_llamacpp_vectors(llamacpp_vocab_dir: Path, name: str) -> None:
    tok = tokenizer_from_gguf(open_reader(llamacpp_vocab_dir / f"ggml-vocab-{name}.gguf"))
    vectors = read_vectors(llamacpp_vocab_dir, name)
    assert len(vectors) >= 40
    # test-tokenizer-0 tokenizes with add_special=false, parse_special=false.
    bad = [
        (text, ids, got)
        for text, ids in vectors
        if (got := tok.encode(text, add_special=False, parse_special=False)) != ids
    ]
    assert not bad, f"{name}: {len(bad)}/{len(vectors)} differ from llama.cpp, e.g. {bad[:3]}"
    # Decoding llama.cpp's ids gives the text back; SentencePiece keeps the space it prefixed.
    prefix = " " if tok.vocab.model == "llama" and tok.vocab.add_space_prefix else ""
    wrong = [
        (text, d) for text, ids in vectors if (d := tok.decode(ids)) != (text and prefix + text)
    ]
    assert not wrong, f"{name}: {len(wrong)} texts decode differently, e.g. {wrong[:3]}"
    # BOS/EOS and special tokens in the text, as a prompt is tokenized: llama.cpp's ids recorded
    # by make_gguf_special_vectors.py.
    special = json.loads(SPECIAL_VECTORS.read_text(encoding="utf-8"))
    assert special["modes"] == [[True, True], [False, True], [True, False]]
    bad = [
        (text, mode, want, got)
        for text, *ids in special["vectors"][name]
        for mode, want in zip(special["modes"], ids)
        if (got := tok.encode(text, add_special=mode[0], parse_special=mode[1])) != want
    ]
    assert not bad, f"{name}: {len(bad)} special-token texts differ from llama.cpp: {bad[:3]}"


# ---- small files written here ---------------------------------------------------------------
def write_vocab(path: Path, model: str, tokens: list[str], types: list[int], **kv) -> Path:
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model(model)
    if "pre" in kv:
        w.add_tokenizer_pre(kv.pop("pre"))
    w.add_token_list(tokens)
    w.add_token_types(types)
    if "merges" in kv:
        w.add_token_merges(kv.pop("merges"))
    if "scores" in kv:
        w.add_token_scores(kv.pop("scores"))
    for key, value in kv.items():
        getattr(w, f"add_{key}")(value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


N, CONTROL, USER = gguf.TokenType.NORMAL, gguf.TokenType.CONTROL, gguf.TokenType.USER_DEFINED


def gpt2_vocab(tmp_path: Path, **kv) -> Path:
    """Byte-level: the 256 byte characters, "hello" and "Ġhello" by merges, two specials."""
    tokens = sorted(pre_tokenizers.ByteLevel.alphabet())
    merges = ["h e", "l l", "he ll", "hell o", "Ġ hello"]
    tokens += ["he", "ll", "hell", "hello", "Ġhello", "<|eot|>", "<tool>"]
    types = [N] * (len(tokens) - 2) + [CONTROL, USER]
    kv.setdefault("pre", "gpt-2")
    return write_vocab(tmp_path / "bpe.gguf", "gpt2", tokens, types, merges=merges, **kv)


def test_gpt2_special_tokens_bos_and_decode(tmp_path: Path) -> None:
    eot = 256 + 5
    tok = tokenizer_from_gguf(gpt2_vocab(tmp_path, bos_token_id=eot, add_bos_token=True))
    hello, ghello, tool = tok.hf.token_to_id("hello"), tok.hf.token_to_id("Ġhello"), eot + 1
    assert (tok.vocab_size, tok.bos_token_id, tok.eos_token_id) == (eot + 2, eot, None)
    assert tok.encode("hello hello", add_special=False) == [hello, ghello]
    assert tok.encode("hello") == [eot, hello]  # add_bos_token from the file
    # Control tokens in text are parsed only when asked; user-defined tokens always are.
    assert tok.encode("hello<|eot|><tool>", add_special=False) == [hello, eot, tool]
    plain = tok.encode("hello<|eot|><tool>", add_special=False, parse_special=False)
    assert plain == [hello] + [tok.hf.token_to_id(c) for c in "<|eot|>"] + [tool]
    assert tok.decode([hello, eot, tool, ghello]) == "hello<tool> hello"
    assert tok.decode([hello, eot], skip_special=False) == "hello<|eot|>"
    assert tok.special_tokens == {"<|eot|>": eot, "<tool>": tool}
    with pytest.raises(ConfigError, match="outside the vocabulary"):
        tok.decode([eot + 2])


def test_gpt2_llama3_pre_adds_bos_by_default(tmp_path: Path) -> None:
    tok = tokenizer_from_gguf(gpt2_vocab(tmp_path, pre="llama-bpe", bos_token_id=256 + 5))
    assert tok.encode("hello")[0] == 256 + 5
    tok = tokenizer_from_gguf(gpt2_vocab(tmp_path, pre="qwen2", bos_token_id=256 + 5))
    assert tok.encode("hello") == [tok.hf.token_to_id("hello")]


def spm_vocab(tmp_path: Path, **kv) -> Path:
    """SentencePiece: <unk> <s> </s>, the 256 byte tokens, then pieces with their scores."""
    pieces = {"▁": -4.0, "h": -5.0, "i": -6.0, "▁h": -3.0, "hi": -2.0, "▁hi": -1.0, "<t>": 0.0}
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + list(pieces)
    types = [gguf.TokenType.UNKNOWN, CONTROL, CONTROL] + [gguf.TokenType.BYTE] * 256
    types += [N] * (len(pieces) - 1) + [USER]
    scores = [0.0] * 259 + list(pieces.values())
    return write_vocab(tmp_path / "spm.gguf", "llama", tokens, types, scores=scores, **kv)


def test_spm_space_prefix_byte_fallback_and_specials(tmp_path: Path) -> None:
    tok = tokenizer_from_gguf(spm_vocab(tmp_path))
    ids = {t: tok.hf.token_to_id(t) for t in ("▁", "▁hi", "hi", "<t>")}
    assert tok.encode("hi hi") == [1, ids["▁hi"], ids["▁hi"]]  # SPM adds BOS by default
    # A space prefix after each special token, as llama.cpp's is_prev_special.
    assert tok.encode("hi<s>hi<t>hi", add_special=False) == [ids["▁hi"], 1, ids["▁hi"]] + [
        ids["<t>"],
        ids["▁hi"],
    ]
    # No "é" piece: its UTF-8 bytes.
    assert tok.encode("é", add_special=False) == [ids["▁"], 3 + 0xC3, 3 + 0xA9]
    assert tok.decode([1, ids["▁hi"], 3 + 0xC3, 3 + 0xA9, ids["hi"], 2]) == " hiéhi"
    tok = tokenizer_from_gguf(spm_vocab(tmp_path, add_space_prefix=False, add_bos_token=False))
    assert tok.encode("hi hi") == [ids["hi"], ids["▁hi"]]


def test_llamacpp_overrides_end_of_turn_types_and_phi3_rstrip(tmp_path: Path) -> None:
    # "<|im_end|>" typed user-defined: llama.cpp makes it a control token and an EOG token.
    tokens = sorted(pre_tokenizers.ByteLevel.alphabet()) + ["<|im_end|>", "<x>"]
    types = [N] * 256 + [USER, USER]
    path = write_vocab(
        tmp_path / "eog.gguf", "gpt2", tokens, types, pre="qwen2", merges=["a b"], eos_token_id=0
    )
    tok = tokenizer_from_gguf(path)
    assert tok.vocab.eog_token_ids == (0, 256)
    assert tok.encode("<|im_end|><x>") == [256, 257]
    assert len(tok.encode("<|im_end|><x>", parse_special=False)) == len("<|im_end|>") + 1
    assert tok.decode([256, 257]) == "<x>"
    # Phi-3: whitespace after a special token is dropped, the space prefix comes back.
    ids = tokenizer_from_gguf(spm_vocab(tmp_path)).encode("<t>  hi", add_special=False)
    assert len(ids) == 4  # <t> ▁ ▁ ▁hi
    phi3 = tokenizer_from_gguf(spm_vocab(tmp_path, name="Phi3"))
    assert phi3.encode("<t>  hi", add_special=False) == [ids[0], ids[-1]]


def test_refuses_unknown_model_and_pre(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="tokenizer.ggml.model: 'bert' is not supported"):
        tokenizer_from_gguf(write_vocab(tmp_path / "a.gguf", "bert", ["a"], [N]))
    with pytest.raises(ConfigError, match="tokenizer.ggml.pre: 'klingon' is not supported"):
        tokenizer_from_gguf(gpt2_vocab(tmp_path, pre="klingon"))
    path = write_vocab(tmp_path / "b.gguf", "gpt2", ["a"], [N], merges=["a a"])
    with pytest.raises(ConfigError, match="tokenizer.ggml.pre: is missing") as e:
        tokenizer_from_gguf(path)
    assert e.value.field == "tokenizer.ggml.pre"


def test_is_a_lowband_tokenizer(tmp_path: Path) -> None:
    from lowband.models.tokenizer import Tokenizer

    tok: Tokenizer = tokenizer_from_gguf(spm_vocab(tmp_path))
    assert isinstance(tok, GGUFTokenizer) and tok.eos_token_id == 2 and tok.vocab_size == 266
