"""The second packaged corpus (Milton's Paradise Lost): shipped as package data, the bare
public-domain text, and long enough for a ≥ 64 k-token test split."""

from __future__ import annotations

import pytest

from diloco.config import DataConfig
from diloco.data import EMBEDDED, PACKAGED_TEXTS, PARADISE_LOST, load_corpus

pytestmark = pytest.mark.timeout(60)


def test_paradise_lost_is_the_bare_text_within_the_size_budget():
    raw = PARADISE_LOST.read_bytes()
    text = raw.decode("ascii")  # the 1992 etext is plain ASCII
    assert 400_000 < len(raw) <= 1_000_000
    assert text.startswith("Paradise Lost\n") and text.rstrip().endswith("[The End]")
    assert "Gutenberg" not in text and "\r" not in text  # header removed, LF line ends
    assert text.count("\nBook ") == 12  # all twelve books
    assert PACKAGED_TEXTS == {"shakespeare": EMBEDDED, "paradise_lost": PARADISE_LOST}


def test_paradise_lost_splits_with_a_64k_test_split():
    cfg = DataConfig(
        kind="text",
        path=str(PARADISE_LOST),
        eval_fraction=0.1,
        test_fraction=0.15,
        eval_split="test",
    )
    c = load_corpus(cfg, vocab_size=256)
    n = PARADISE_LOST.stat().st_size
    assert c.test.size == int(n * 0.15) >= 65536
    assert c.validation is not None and c.validation.size == int(n * 0.1)
    assert c.train.size + c.validation.size + c.test.size == n
    assert c.eval is c.test
