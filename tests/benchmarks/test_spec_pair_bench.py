"""Smoke run of the trained target/draft pair (benchmarks.spec_pair) through
benchmarks.edge_speculative's ``--pair`` arms, on the seconds-long ``tiny-pair`` recipe."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import edge_speculative, spec_pair


def test_recipe_key_names_the_recipe(monkeypatch: pytest.MonkeyPatch) -> None:
    key = spec_pair.recipe_key("tiny-pair")
    assert key.startswith("tiny-pair-") and key == spec_pair.recipe_key("tiny-pair")
    changed = {**spec_pair.RECIPES["tiny-pair"], "seed": 1}
    monkeypatch.setitem(spec_pair.RECIPES, "tiny-pair", changed)
    assert spec_pair.recipe_key("tiny-pair") != key  # another recipe, another cache folder


@pytest.mark.timeout(600)
def test_edge_speculative_trained_pair(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--pair", "tiny", "--pair-only", "--pair-cache", str(tmp_path), "--no-llama-server"]
    argv += ["--streams", "2", "--stream-tokens", "8", "--tokens", "10", "--repeats", "1"]
    argv += ["--settle", "0", "--json"]
    assert edge_speculative.main(argv) == 0
    rec = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    pair = rec["result"]["pair"]
    assert pair["recipe"] == spec_pair.recipe_key("tiny-pair")
    assert pair["target"]["params"] > 2 * pair["draft"]["params"]
    assert pair["target"]["heldout_loss"] < 5.55  # trained: below ln(256), a uniform guess
    for w in ("code-edit", "free-text"):
        res = rec["result"]["workloads"][w]
        assert set(res) == {"lowband-pair-f32/off", "lowband-pair-f32/draft", "identical"}
        assert res["identical"] == {"lowband-pair-f32/off": True, "lowband-pair-f32/draft": True}
        assert 0 <= res["lowband-pair-f32/draft"]["acceptance"] <= 1  # k fixed: drafts verified
    both = rec["result"]["workloads"]["2-streams"]  # the pair at 2 streams, off and drafting
    assert set(both) == {"lowband-pair-f32/off", "lowband-pair-f32/draft", "identical"}
    assert 0 <= both["lowband-pair-f32/draft"]["acceptance"] <= 1
    # built once: a second build finds the files by the recipe's key and trains nothing
    root = tmp_path / spec_pair.recipe_key("tiny-pair")
    mtime = (root / "target-f32.gguf").stat().st_mtime_ns
    again = spec_pair.build_pair("tiny-pair", tmp_path)
    assert again["target"]["f32"] == str(root / "target-f32.gguf")
    assert (root / "target-f32.gguf").stat().st_mtime_ns == mtime
