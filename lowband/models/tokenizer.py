"""Tokenizers: lowband's byte tokenizer for models trained here, HF ``tokenizer.json`` otherwise.

A checkpoint directory says which one it uses: ``tokenizer.json`` (HF ``tokenizers``) wins;
otherwise ``lowband_tokenizer.json`` with ``{"type": "bytes"}`` selects :class:`ByteTokenizer`.
A tokenizer loaded from a directory carries the chat template the directory ships, if any
(``chat_template``, as a HF tokenizer does); a server renders chats with it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Protocol, Sequence

from lowband.errors import ConfigError
from lowband.models.chat_template import ChatTemplate, load_chat_template

TOKENIZER_MARKER = "lowband_tokenizer.json"


class Tokenizer(Protocol):
    """What the engine needs. A tokenizer may also carry ``chat_template`` (a
    :class:`ChatTemplate` or None); readers look it up with ``getattr``."""

    vocab_size: int
    eos_token_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes are the tokens (vocabulary 256). No special tokens; generation stops on
    ``max_tokens`` or a stop sequence."""

    vocab_size = 256
    eos_token_id: int | None = None
    chat_template: ChatTemplate | None = None

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(int(i) & 0xFF for i in ids).decode("utf-8", errors="replace")

    def save(self, model_dir: str | Path) -> None:
        (Path(model_dir) / TOKENIZER_MARKER).write_text(json.dumps({"type": "bytes"}))


class HFTokenizer:
    """Wraps a HF ``tokenizers.Tokenizer`` loaded from ``tokenizer.json``."""

    def __init__(self, path: Path, eos_token_id: int | None) -> None:
        try:
            from tokenizers import Tokenizer as _Tok
        except ImportError:  # pragma: no cover - depends on the install
            raise ConfigError(
                "tokenizer", f"{path} needs the 'tokenizers' package: pip install tokenizers"
            ) from None
        self._tok = _Tok.from_file(str(path))
        self.vocab_size = self._tok.get_vocab_size()
        self.eos_token_id = eos_token_id
        self.chat_template: ChatTemplate | None = None

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids))


def load_tokenizer(model_dir: str | Path, eos_token_id: int | None = None) -> Tokenizer:
    d = Path(model_dir)
    tok: HFTokenizer | ByteTokenizer
    if (d / "tokenizer.json").exists():
        tok = HFTokenizer(d / "tokenizer.json", eos_token_id)
    elif (marker := d / TOKENIZER_MARKER).exists():
        kind = json.loads(marker.read_text()).get("type")
        if kind != "bytes":
            raise ConfigError("tokenizer", f"{marker}: unknown tokenizer type {kind!r}")
        tok = ByteTokenizer()
    else:
        raise ConfigError("tokenizer", f"{d} has neither tokenizer.json nor {TOKENIZER_MARKER}")
    tok.chat_template = load_chat_template(d)
    return tok
