"""The MoE trainer's corpus is a parameter: a clone trains on the packaged sample unless told
otherwise, and no library module reads a machine path."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from edge.moe.train import bench_preset, main, tiny_preset
from lowband import SAMPLE_TEXT
from lowband.errors import ConfigError

pytestmark = pytest.mark.timeout(60)

REPO = Path(__file__).resolve().parents[3]


def test_presets_default_to_the_packaged_sample_and_take_a_corpus(tmp_path) -> None:
    assert SAMPLE_TEXT.is_file() and SAMPLE_TEXT.is_relative_to(REPO / "lowband")
    assert bench_preset(tmp_path).data == SAMPLE_TEXT
    assert tiny_preset(tmp_path).data == SAMPLE_TEXT
    other = tmp_path / "corpus.txt"
    assert bench_preset(tmp_path, other).data == other


def test_cli_passes_its_data_flag(tmp_path) -> None:
    missing = tmp_path / "none.txt"
    with pytest.raises(ConfigError, match="no text file at .*none.txt"):
        main(
            [
                "--out",
                str(tmp_path / "m"),
                "--preset",
                "tiny",
                "--steps",
                "1",
                "--data",
                str(missing),
            ]
        )


def test_no_library_module_reads_a_machine_path() -> None:
    pattern = re.compile(r"""["'](/work|/home|/Users)/""")
    hits = [
        f"{p.relative_to(REPO)}:{i}"
        for pkg in ("lowband", "transport", "diloco", "edge")
        for p in sorted((REPO / pkg).rglob("*.py"))
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert hits == []
