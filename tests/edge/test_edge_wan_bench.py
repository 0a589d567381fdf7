"""``python -m benchmarks.edge_wan``: a smoke run on a tiny random model (root + iproute2 + TUN):
every arm starts, answers, and the auto arm reports the layout it chose and why."""

from __future__ import annotations

import pytest

from tests.conftest import run_json_module
from transport.links.tun.testbed import available

needs_tun = pytest.mark.skipif(available() is not None, reason=f"tun: {available()}")


@pytest.mark.slow
@pytest.mark.netns
@pytest.mark.timeout(400)
@needs_tun
def test_every_arm_decodes_over_the_emulated_link():
    args = ["--tiny", "--profiles", "ethernet", "--repeats", "1", "--tokens", "6"]
    out = run_json_module("benchmarks.edge_wan", *args, "--streams", "2", "--json", timeout=390)
    (p,) = out["profiles"]
    assert p["errors"] == {}
    for arm in ("single", "tp", "pipeline", "auto"):
        assert p["ms_per_token"][arm]["median"] > 0
        assert p["aggregate_tokens_per_s"][arm]["median"] > 0
    plan = p["auto_health"]["plan"]
    assert plan["layout"] in ("single", "tp", "pipeline") and plan["reason"]
    assert p["measured_rtt"]["median_ms"] > 0
