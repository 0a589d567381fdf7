"""Smoke run of benchmarks.edge_speculative on a tiny random model (ours only)."""

from __future__ import annotations

import json

import pytest

import cli
from benchmarks import edge_speculative


@pytest.mark.timeout(300)
def test_edge_speculative_tiny(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        edge_speculative.main(
            ["--tiny", "--tokens", "12", "--repeats", "1", "--settle", "0", "--json"]
        )
        == 0
    )
    rec = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rec["benchmark"] == "edge_speculative"
    # the arms ran under the command line's OpenMP wait (in a child where this process lacked it)
    assert rec["result"]["omp_wait"] == {"policy": "cli", **cli.OPENMP_WAIT}
    for w in ("code-edit", "free-text"):
        res = rec["result"]["workloads"][w]
        assert all(res["identical"].values()) and len(res["identical"]) == 3
        assert res["lowband-tiny/draft"]["acceptance"] == 1.0  # the target drafting for itself
        assert res["lowband-tiny/off"]["tok_s"]["median"] > 0
    streams = rec["result"]["workloads"]["8-streams"]  # 8 requests decoding together
    assert streams["lowband-tiny/off"]["tok_s"]["median"] > 0
    assert streams["lowband-tiny/lookup"]["speedup"] > 0


def test_wan_pair_arms_use_the_draft_model_on_byte_prompts() -> None:
    """``--wan PROFILE --pair``: the draft model's arms replace prompt lookup, and the
    prompts go as the pair's byte ids (its GGUF files carry placeholder token names); the
    held-out prompt fits the 128 positions the pair learned."""
    import argparse

    arms = edge_speculative._wan_arms(argparse.Namespace(pair="trained"))
    assert arms == ("single/off", "single/draft", "pipeline/off", "pipeline/draft")
    assert edge_speculative._wan_arms(argparse.Namespace(pair="none")) == edge_speculative.WAN_ARMS
    ids = edge_speculative._wan_prompts(False, "trained")
    assert set(ids) == {"code-edit", "free-text", "held-out-text"}
    assert all(isinstance(t, int) and 0 <= t < 256 for p in ids.values() for t in p)
    assert len(ids["held-out-text"]) + 64 <= 128
    tiny = edge_speculative._wan_prompts(False, "tiny")
    assert all(len(p) <= 120 for p in tiny.values())
    assert edge_speculative._wan_prompts(True) == {
        w: t[:120] for w, t in edge_speculative.WORKLOADS.items()
    }
