"""The tokenizer inside a GGUF file, rebuilt on HF ``tokenizers`` to give llama.cpp's token ids.

A GGUF file carries its tokenizer as metadata (``tokenizer.ggml.*``): the token strings, their
types, BPE merges or SentencePiece scores, the BOS/EOS ids and whether to add them. Two families
are supported, as llama.cpp (``src/llama-vocab.cpp``) reads them:

* ``tokenizer.ggml.model = "gpt2"``: byte-level BPE. Text is split by the regexes of the
  pre-tokenizer named in ``tokenizer.ggml.pre``, each split applied in turn to the pieces of the
  one before (llama.cpp's ``unicode_regex_split``), then byte-encoded and merged by rank.
* ``tokenizer.ggml.model = "llama"``: SentencePiece-style BPE. Spaces become ``▁`` and a space
  is put before the text and after every special token (llama.cpp's ``add_space_prefix``); the
  whole text is one word whose adjacent symbols merge best-score first; a character with no token
  falls back to its ``<0xXX>`` byte tokens. HF expresses "best score first" as BPE merges ranked
  by the score of the merged token (what ``LlamaTokenizerFast`` does with a SentencePiece model).

Control and unknown tokens become special added tokens and user-defined tokens plain added tokens,
so both are matched whole in text before the model runs, as llama.cpp's
``tokenizer_st_partition`` does; ``parse_special=False`` leaves control tokens as text (llama.cpp
matches user-defined tokens either way). llama.cpp's load-time fixes are applied too: end-of-turn
and FIM texts (``<|im_end|>``, ``</s>``, ...) are control tokens whatever the file says, and
Phi-3's special tokens eat the whitespace after them. Anything else is refused with
:class:`ConfigError` rather than tokenized differently from llama.cpp.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors

from edge.formats.gguf_reader import open_reader
from lowband.errors import ConfigError

logger = logging.getLogger(__name__)

# GGUF token types (gguf.TokenType, llama.cpp's LLAMA_TOKEN_TYPE_*).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# ---- pre-tokenizers (llama.cpp src/llama-vocab.cpp, llm_tokenizer_bpe) ----------------------
# Each entry is a list of regexes applied one after the other; a regex splits every piece left by
# the previous one into its matches and the text between them (HF's Split "isolated").
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# DeepSeek LLM lists its letters explicitly (the cased letters of the Unicode version it used).
_DEEPSEEK_LETTERS = (
    "A-Za-zµÀ-ÖØ-öø-ƺƼ-ƿǄ-ʓʕ-ʯͰ-ͳͶͷͻ-ͽͿΆΈ-ΊΌ"
    "Ύ-ΡΣ-ϵϷ-ҁҊ-ԯԱ-ՖႠ-ჅᎠ-Ᏽᏸ-ᏽᲐ-ᲺᲽ-Ჿᴀ-ᴫᵫ-ᵷᵹ-ᶚ"
    "Ḁ-ἕἘ-Ἕἠ-ὅὈ-Ὅὐ-ὗὙὛὝὟ-ώᾀ-ᾴᾶ-ᾼιῂ-ῄῆ-ῌῐ-ΐῖ-Ί"
    "ῠ-Ῥῲ-ῴῶ-ῼℂℇℊ-ℓℕℙ-ℝℤΩℨK-ℭℯ-ℴℹℼ-ℿⅅ-ⅉⅎↃↄⰀ-ⱻ"
    "Ȿ-ⳤⳫ-ⳮⳲⳳꙀ-ꙭꚀ-ꚛꜢ-ꝯꝱ-ꞇꞋ-ꞎꭰ-ꮿﬀ-ﬆﬓ-ﬗＡ-Ｚａ-ｚ"
    "𐐀-𐑏𐒰-𐓓𐓘-𐓻𐲀-𐲲𐳀-𐳲𑢠-𑣟𞤀-𞥃"
)
_CJK = "[一-龥ࠀ-一가-퟿]+"

_LLAMA3_PRE = ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "lfm2")
_STARCODER_PRE = ("starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva")


@dataclass(frozen=True)
class _Pre:
    """One ``tokenizer.ggml.pre`` family: its regexes, llama.cpp's ``ignore_merges`` (a piece
    that is itself a token is emitted whole, without merging) and its default for adding BOS
    when the file has no ``tokenizer.ggml.add_bos_token``."""

    regexes: tuple[str, ...]
    ignore_merges: bool = False
    add_bos: bool = False


PRE_TOKENIZERS: dict[str, _Pre] = {
    **{name: _Pre((_LLAMA3,), ignore_merges=True, add_bos=True) for name in _LLAMA3_PRE},
    "dbrx": _Pre((_LLAMA3,)),
    "smaug-bpe": _Pre((_LLAMA3,)),
    "qwen2": _Pre((_QWEN2,)),
    "deepseek-r1-qwen": _Pre((_QWEN2,)),
    "stablelm2": _Pre((_QWEN2,)),
    "qwen35": _Pre((_QWEN35,)),
    **{name: _Pre((r"\p{N}", _GPT2)) for name in _STARCODER_PRE},
    **{name: _Pre((_GPT2,)) for name in ("gpt-2", "phi-2", "mpt", "olmo", "jais")},
    "falcon": _Pre((r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]")),
    "deepseek-llm": _Pre(
        (
            r"[\r\n]",
            r"\s?[" + _DEEPSEEK_LETTERS + r"]+",
            r"\s?[!-/:-~！-／：-～‘-‟　-。]+",
            r"\s+\z",  # llama.cpp's "\s+$": the end of the piece (std::regex, not multiline)
            _CJK,
            r"\p{N}+",
        )
    ),
    "deepseek-coder": _Pre((r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK, r"\p{N}")),
}
MODELS = ("gpt2", "llama")

# llama.cpp (llama_vocab::impl::load) makes these texts control tokens whatever their type says,
# and stops generation on the EOG ones (end of turn/text, FIM pad/repo/file separator).
_EOG_TEXTS = frozenset(
    "<|eot_id|> <|im_end|> <|end|> <|return|> <|call|> <|flush|> <|calls|> <end_of_turn> "
    "<|endoftext|> </s> <|eom_id|> <EOT> _<EOT> [EOT] [EOS] <|end_of_text|> <end_of_utterance> "
    "<eos> <turn|> <|tool_response> <｜end▁of▁sentence｜> [e~[ "
    "<|fim_pad|> <fim-pad> <fim_pad> <PAD> [PAD] "
    "<|fim_repo|> <|repo_name|> <fim-repo> <REPO> <reponame> <|file_sep|>".split()
)
_FIM_TEXTS = frozenset(
    "<|fim_prefix|> <fim-prefix> <fim_prefix> <｜fim▁begin｜> <PRE> ▁<PRE> <|code_prefix|> "
    "<|prefix|> <|fim_suffix|> <fim-suffix> <fim_suffix> <｜fim▁hole｜> <SUF> ▁<SUF> "
    "<|code_suffix|> <|suffix|> <|fim_middle|> <fim-middle> <fim_middle> <｜fim▁end｜> <MID> "
    "▁<MID> <|code_middle|> <|middle|>".split()
)
# Phi-3's special tokens eat the whitespace after them (rstrip in its tokenizer.json); llama.cpp
# does it for files whose general.name says Phi-3, except for these.
_PHI3_NAMES = ("phi-3", "phi3")
_PHI3_NO_RSTRIP = frozenset(("<unk>", "<s>", "<|endoftext|>"))


@dataclass(frozen=True, kw_only=True)
class GGUFVocab:
    """The ``tokenizer.ggml.*`` metadata of one GGUF file."""

    model: str  # tokenizer.ggml.model: "gpt2" (byte-level BPE) or "llama" (SentencePiece BPE)
    pre: str | None  # tokenizer.ggml.pre: the pre-tokenizer of a "gpt2" model
    tokens: list[str]
    # NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE as llama.cpp uses them: the file's
    # types, with the end-of-generation and FIM texts made CONTROL.
    token_types: list[int]
    scores: list[float] | None  # SentencePiece scores: higher merges first
    merges: list[str]  # "left right", best first
    bos_token_id: int | None
    eos_token_id: int | None
    unk_token_id: int | None
    add_bos: bool
    add_eos: bool
    add_space_prefix: bool
    eog_token_ids: tuple[int, ...]  # generation ends on these: EOS, EOT, EOM, EOG texts
    rstrip_special: bool  # special tokens strip the whitespace after them (Phi-3)


def _field(reader: Any, key: str) -> Any:
    """A scalar field's value, or an array field's values as a list; ``None`` when absent.

    Arrays are read straight from the reader's parts (``ReaderField.contents`` converts element
    by element and takes seconds on a 150k-token vocabulary)."""
    f = reader.fields.get(key)
    if f is None:
        return None
    if len(f.types) > 1:  # an array: f.data indexes one part per element
        if f.types[1].name == "STRING":
            try:
                return [bytes(f.parts[i]).decode("utf-8") for i in f.data]
            except UnicodeDecodeError as exc:
                raise ConfigError(key, f"holds a string that is not UTF-8: {exc}") from None
        return [f.parts[i][0].item() for i in f.data]
    return f.contents()


def _model_and_pre(reader: Any) -> tuple[str, str | None]:
    model = _field(reader, "tokenizer.ggml.model")
    if model not in MODELS:
        raise ConfigError(
            "tokenizer.ggml.model", f"{model!r} is not supported (supported: {', '.join(MODELS)})"
        )
    pre = _field(reader, "tokenizer.ggml.pre")
    if model == "gpt2" and pre is None:
        raise ConfigError(
            "tokenizer.ggml.pre",
            "is missing: llama.cpp would fall back to a generic pre-tokenizer that degrades "
            "quality; convert the model again with a current llama.cpp convert_hf_to_gguf.py",
        )
    if model == "gpt2" and pre not in PRE_TOKENIZERS:
        raise ConfigError(
            "tokenizer.ggml.pre",
            f"{pre!r} is not supported for a gpt2 (byte-level BPE) vocabulary "
            f"(supported: {', '.join(sorted(PRE_TOKENIZERS))})",
        )
    return model, pre


def _token_id(reader: Any, key: str, n: int, default: int | None) -> int | None:
    v = _field(reader, f"tokenizer.ggml.{key}")
    if v is None:
        return default
    if not 0 <= int(v) < n:
        raise ConfigError(f"tokenizer.ggml.{key}", f"{v} is outside the vocabulary of {n}")
    return int(v)


def _llamacpp_types(tokens: list[str], types: list[Any]) -> list[int]:
    out = [int(t) for t in types]
    for i, t in enumerate(tokens):
        if (t in _EOG_TEXTS or t in _FIM_TEXTS) and out[i] in (NORMAL, USER_DEFINED):
            out[i] = CONTROL
    return out


def _eog_ids(reader: Any, tokens: list[str], n: int) -> tuple[int, ...]:
    ids = [_token_id(reader, k, n, None) for k in ("eos_token_id", "eot_token_id", "eom_token_id")]
    ids += [i for i, t in enumerate(tokens) if t in _EOG_TEXTS]
    return tuple(dict.fromkeys(i for i in ids if i is not None))


def read_vocab(reader: Any) -> GGUFVocab:
    """Read (and check) the tokenizer metadata of an open ``gguf.GGUFReader``."""
    model, pre = _model_and_pre(reader)
    tokens = _field(reader, "tokenizer.ggml.tokens")
    if not tokens:
        raise ConfigError("tokenizer.ggml.tokens", "is missing or empty")
    n = len(tokens)
    types = _field(reader, "tokenizer.ggml.token_type") or [NORMAL] * n
    scores = _field(reader, "tokenizer.ggml.scores")
    for key, values in (("token_type", types), ("scores", scores)):
        if values is not None and len(values) < n:
            raise ConfigError(f"tokenizer.ggml.{key}", f"has {len(values)} entries for {n} tokens")
    merges = _field(reader, "tokenizer.ggml.merges") or []
    if model == "gpt2" and not merges:
        raise ConfigError("tokenizer.ggml.merges", "is missing: a gpt2 vocabulary needs merges")
    types = _llamacpp_types(tokens, types[:n])
    spm = model == "llama"
    # llama.cpp's defaults where the file is silent: SentencePiece <unk> <s> </s> = 0 1 2 and
    # adds BOS and a space prefix; Llama 3's pre-tokenizer adds BOS.
    add_bos = _field(reader, "tokenizer.ggml.add_bos_token")
    prefix = _field(reader, "tokenizer.ggml.add_space_prefix")
    vocab = GGUFVocab(
        model=model,
        pre=pre,
        tokens=tokens,
        token_types=types,
        scores=None if scores is None else [float(s) for s in scores[:n]],
        merges=merges,
        bos_token_id=_token_id(reader, "bos_token_id", n, 1 if spm else None),
        eos_token_id=_token_id(reader, "eos_token_id", n, 2 if spm else None),
        unk_token_id=_token_id(reader, "unknown_token_id", n, 0 if spm else None),
        add_bos=bool((spm or PRE_TOKENIZERS[pre or ""].add_bos) if add_bos is None else add_bos),
        add_eos=bool(_field(reader, "tokenizer.ggml.add_eos_token")),
        add_space_prefix=spm if prefix is None else bool(prefix),
        eog_token_ids=_eog_ids(reader, tokens, n),
        rstrip_special=any(k in str(_field(reader, "general.name")).lower() for k in _PHI3_NAMES),
    )
    if vocab.add_bos and vocab.bos_token_id is None:
        raise ConfigError("tokenizer.ggml.add_bos_token", "is true but there is no bos_token_id")
    if vocab.add_eos and vocab.eos_token_id is None:
        raise ConfigError("tokenizer.ggml.add_eos_token", "is true but there is no eos_token_id")
    if spm and vocab.scores is None:
        raise ConfigError("tokenizer.ggml.scores", "is missing: a llama vocabulary needs scores")
    return vocab


# ---- building the HF tokenizer ------------------------------------------------------------
def _vocab_dict(vocab: GGUFVocab) -> dict[str, int]:
    # A text listed twice keeps its last id, as llama.cpp's token_to_id does.
    return {t: i for i, t in enumerate(vocab.tokens)}


def _bpe_merges(vocab: GGUFVocab, ids: dict[str, int]) -> list[tuple[str, str]]:
    """``tokenizer.ggml.merges`` as pairs, split at the first space after the first character
    (llama.cpp's ``word.find(' ', 1)``). HF refuses a merge whose parts or result are not
    tokens; llama.cpp could never emit such a result as one token either, so those are dropped."""
    out: list[tuple[str, str]] = []
    dropped = 0
    for m in vocab.merges:
        i = m.find(" ", 1)
        a, b = (m[:i], m[i + 1 :]) if i >= 0 else ("", "")
        if a in ids and b in ids and a + b in ids:
            out.append((a, b))
        else:
            dropped += 1
    if dropped:
        logger.warning("GGUF vocabulary: %d merges name texts that are not tokens", dropped)
    return out


def _spm_merges(vocab: GGUFVocab, ids: dict[str, int]) -> list[tuple[str, str]]:
    """SentencePiece merges from scores: every way to write a token as two tokens, ranked by
    the merged token's score, best first (llama.cpp's ``llm_tokenizer_spm`` merges the adjacent
    pair whose concatenation is the highest-scoring token; HF's ``SentencePieceExtractor``)."""
    assert vocab.scores is not None  # checked by read_vocab
    ranked: list[tuple[float, int, int, str, str]] = []
    for text, tid in ids.items():
        for k in range(1, len(text)):
            a, b = text[:k], text[k:]
            if a in ids and b in ids:
                ranked.append((-vocab.scores[tid], tid, k, a, b))
    ranked.sort()
    return [(a, b) for _, _, _, a, b in ranked]


def _added_tokens(vocab: GGUFVocab) -> list[AddedToken]:
    """Tokens llama.cpp matches whole in text before tokenizing (its special-token cache):
    control and unknown ones only when parsing specials (HF: ``special=True``), user-defined
    ones always. Longer texts first, as llama.cpp tries them."""
    kinds = {CONTROL: True, UNKNOWN: True, USER_DEFINED: False}
    found = [(t, kinds[k]) for t, k in zip(vocab.tokens, vocab.token_types) if k in kinds]
    found.sort(key=lambda x: -len(x[0].encode("utf-8")))
    return [
        AddedToken(
            t,
            special=s,
            normalized=False,
            rstrip=vocab.rstrip_special and t not in _PHI3_NO_RSTRIP,
        )
        for t, s in found
    ]


def _post_processor(vocab: GGUFVocab) -> Any:
    single = ["$A"]
    specials: list[tuple[str, int]] = []
    if vocab.add_bos:
        assert vocab.bos_token_id is not None  # checked by read_vocab
        single.insert(0, vocab.tokens[vocab.bos_token_id])
        specials.append((single[0], vocab.bos_token_id))
    if vocab.add_eos:
        assert vocab.eos_token_id is not None
        single.append(vocab.tokens[vocab.eos_token_id])
        specials.append((single[-1], vocab.eos_token_id))
    if not specials:
        return None
    return processors.TemplateProcessing(single=single, special_tokens=list(dict(specials).items()))


def build_hf_tokenizer(vocab: GGUFVocab) -> tokenizers.Tokenizer:
    """A HF ``tokenizers.Tokenizer`` that encodes as llama.cpp does for this vocabulary."""
    ids = _vocab_dict(vocab)
    if vocab.model == "gpt2":
        pre = PRE_TOKENIZERS[vocab.pre or ""]
        bpe = models.BPE(ids, _bpe_merges(vocab, ids), ignore_merges=pre.ignore_merges)
        tok = tokenizers.Tokenizer(bpe)
        splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in pre.regexes]
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tok.pre_tokenizer = pre_tokenizers.Sequence([*splits, byte_level])
        tok.decoder = decoders.ByteLevel()
    else:
        unk = None if vocab.unk_token_id is None else vocab.tokens[vocab.unk_token_id]
        bpe = models.BPE(ids, _spm_merges(vocab, ids), unk_token=unk, byte_fallback=True)
        tok = tokenizers.Tokenizer(bpe)
        prefix = [normalizers.Prepend("▁")] if vocab.add_space_prefix else []
        # HF normalizes each stretch of text between added tokens, so the prefix lands at the
        # start and after every special token: where llama.cpp puts it.
        tok.normalizer = normalizers.Sequence([*prefix, normalizers.Replace(" ", "▁")])
        tok.decoder = decoders.Sequence(
            [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
        )
    tok.add_tokens(_added_tokens(vocab))
    post = _post_processor(vocab)
    if post is not None:
        tok.post_processor = post
    return tok


# ---- the lowband Tokenizer ----------------------------------------------------------------
class GGUFTokenizer:
    """A :class:`lowband.models.tokenizer.Tokenizer` read from a GGUF file's metadata.

    ``encode(text)`` behaves as llama.cpp's ``llama_tokenize(..., add_special=True,
    parse_special=True)`` (what llama-server does with a prompt): BOS/EOS as the file says,
    control tokens written in the text become those tokens. ``decode`` joins the pieces of
    llama.cpp's ``token_to_piece`` as llama-server streams them: control, unknown and unused
    tokens give nothing unless ``skip_special=False``, user-defined tokens give their text as it
    is, and a SentencePiece text keeps its leading space (the completion of a prompt continues
    it; ``llama_detokenize`` would strip it)."""

    def __init__(self, vocab: GGUFVocab, hf: tokenizers.Tokenizer | None = None) -> None:
        self.vocab = vocab
        self.hf = hf if hf is not None else build_hf_tokenizer(vocab)
        self.vocab_size = len(vocab.tokens)
        self.bos_token_id = vocab.bos_token_id
        self.eos_token_id = vocab.eos_token_id
        self.eog_token_ids = vocab.eog_token_ids  # llama.cpp stops generating on any of these
        self._lock = threading.Lock()  # encode_special_tokens is state on the shared HF object
        # The file's tokenizer.chat_template, set by whoever reads the rest of the file (the
        # Tokenizer protocol's optional attribute); see lowband.models.chat_template.
        self.chat_template: Any = None

    @property
    def special_tokens(self) -> dict[str, int]:
        """Control, unknown and user-defined tokens by text: those matched whole in text."""
        kinds = (CONTROL, UNKNOWN, USER_DEFINED)
        pairs = zip(self.vocab.tokens, self.vocab.token_types)
        return {t: i for i, (t, k) in enumerate(pairs) if k in kinds}

    def encode(
        self, text: str, *, add_special: bool = True, parse_special: bool = True
    ) -> list[int]:
        with self._lock:
            self.hf.encode_special_tokens = not parse_special
            return self.hf.encode(text, add_special_tokens=add_special).ids

    def decode(self, ids: Sequence[int], *, skip_special: bool = True) -> str:
        types, tokens = self.vocab.token_types, self.vocab.tokens
        out: list[str] = []
        run: list[int] = []  # model tokens whose bytes the HF decoder joins
        for i in (int(i) for i in ids):
            if not 0 <= i < self.vocab_size:
                raise ConfigError("ids", f"{i} is outside the vocabulary of {self.vocab_size}")
            kind = types[i]
            if kind in (NORMAL, BYTE):
                run.append(i)
                continue
            if kind == USER_DEFINED or (kind in (CONTROL, UNKNOWN) and not skip_special):
                out.append(self.hf.decode(run, skip_special_tokens=False) if run else "")
                out.append(tokens[i])
                run = []
        if run:
            out.append(self.hf.decode(run, skip_special_tokens=False))
        return "".join(out)


def tokenizer_from_gguf(path_or_reader: str | Path | Any) -> GGUFTokenizer:
    """The tokenizer of a GGUF file, from its path or an open ``gguf.GGUFReader`` (pass the
    reader when the weights are read too: parsing a 150k-token vocabulary takes seconds)."""
    if isinstance(path_or_reader, (str, Path)):
        path_or_reader = open_reader(path_or_reader)
    return GGUFTokenizer(read_vocab(path_or_reader))
