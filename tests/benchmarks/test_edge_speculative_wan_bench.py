"""Smoke run of ``benchmarks.edge_speculative --wan`` on a tiny random model (root + iproute2 +
TUN): one device and pipeline-2, speculation off and ``--lookup``, every arm decodes the same
greedy text over the emulated link, the link's round trip and the pipeline's steps recorded.
(A draft model across devices: tests/edge/test_speculative_cluster.py; the ``--pair`` arms'
plumbing: tests/benchmarks/test_edge_speculative_bench.py.)"""

from __future__ import annotations

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
