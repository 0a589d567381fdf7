"""Real rate limiting between network namespaces with tc tbf (tier 3). Needs root + iproute2."""

from __future__ import annotations

import subprocess

import pytest

from transport.links.netns import NetnsConfig, Testbed, TransferConfig, available, measure_transfer

pytestmark = [
    pytest.mark.netns,
    pytest.mark.timeout(120),
    pytest.mark.skipif(available() is not None, reason=f"netns: {available()}"),
]


def _namespaces() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


def test_tbf_link_is_shaped_and_nearly_filled():
    cfg = NetnsConfig(rate_mbit=100, net=232)
    with Testbed(cfg) as link:
        assert link.ns[0] in _namespaces()
        out = measure_transfer(link, TransferConfig(size_mb=6, connections=2, repeats=2))
    assert link.ns[0] not in _namespaces() and link.ns[1] not in _namespaces()  # cleaned up
    assert out["bytes"] == 6 << 20
    # The shaper really limits (goodput cannot beat the rate) and lowband keeps the link busy.
    assert out["goodput_mbit"] <= 100 * 1.03
    assert out["utilisation"] >= 0.8


def test_namespaces_are_removed_even_if_the_body_fails():
    with pytest.raises(RuntimeError, match="boom"):
        with Testbed(NetnsConfig(rate_mbit=50, net=233)) as link:
            names = link.ns
            raise RuntimeError("boom")
    assert names[0] not in _namespaces()
