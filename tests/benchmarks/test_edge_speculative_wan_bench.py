"""Smoke run of ``benchmarks.edge_speculative --wan`` on a tiny random model (root + iproute2 +
TUN): one device and pipeline-2, speculation off and ``--lookup``, every arm decodes the same
greedy text over the emulated link, the link's round trip and the pipeline's steps recorded;
and the same arms with the tiny trained pair's draft model (``--pair tiny``: ``--draft FILE``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import run_json_module
from transport.links.tun.testbed import available

needs_tun = pytest.mark.skipif(available() is not None, reason=f"tun: {available()}")


@pytest.mark.slow
@pytest.mark.netns
@pytest.mark.timeout(400)
@needs_tun
def test_speculation_across_devices_over_the_emulated_link() -> None:
    args = ["--wan", "ethernet", "--tiny", "--repeats", "1", "--tokens", "8", "--streams", "2"]
    args += ["--settle", "0"]
    rec = run_json_module("benchmarks.edge_speculative", *args, "--json", timeout=390)
    wan = rec["result"]["wan"]
    assert wan["measured_rtt"]["median_ms"] > 0
    arms = ("single/off", "single/lookup", "pipeline/off", "pipeline/lookup")
    for w in ("code-edit", "free-text"):
        res = wan["workloads"][w]
        assert res["identical"] == dict.fromkeys(arms, True)
        assert all(res[a]["tok_s"]["median"] > 0 for a in arms)
    assert all(wan["workloads"]["2-streams"][a]["tok_s"]["median"] > 0 for a in arms)
    # the pipeline masters stepped (their time per step is recorded)
    assert wan["master_cycle"]["pipeline/lookup"]["steps"] > 0


@pytest.mark.slow
@pytest.mark.netns
@pytest.mark.timeout(400)
@needs_tun
def test_draft_model_across_devices_over_the_emulated_link(tmp_path: Path) -> None:
    args = ["--wan", "ethernet", "--pair", "tiny", "--pair-cache", str(tmp_path)]
    args += ["--repeats", "1", "--tokens", "8", "--streams", "0", "--settle", "0"]
    rec = run_json_module("benchmarks.edge_speculative", *args, "--json", timeout=390)
    result = rec["result"]
    assert result["model"].endswith("target-f32.gguf")
    assert result["draft"].endswith("draft-f32.gguf")
    arms = ("single/off", "single/draft", "pipeline/off", "pipeline/draft")
    for w in ("code-edit", "free-text"):
        res = result["wan"]["workloads"][w]
        assert res["identical"] == dict.fromkeys(arms, True)
        assert all(res[a]["tok_s"]["median"] > 0 for a in arms)
    # the pipeline carried verification groups through both stages (k is adaptive: a pass
    # that costs the link's round trip makes a draft worth it, one device's tiny pass may not)
    got = [result["wan"]["workloads"][w]["pipeline/draft"] for w in ("code-edit", "free-text")]
    assert any(r["acceptance"] is not None for r in got)
    assert all(0 <= r["acceptance"] <= 1 for r in got if r["acceptance"] is not None)
    assert result["wan"]["master_cycle"]["pipeline/draft"]["steps"] > 0
