"""`lowband worker --connections K` reaches the transport's ZmqConfig (K TCP connections per
peer); out-of-range values are refused by the parser (tests/cli/test_relay_cli.py)."""

from __future__ import annotations

import pytest

from cli import main


@pytest.mark.parametrize(("extra", "k"), [((), 4), (("--connections", "16"), 16)])
def test_worker_passes_its_connections_to_the_transport(monkeypatch, extra, k):
    import diloco.launch

    seen = []

    class _Result:
        def summary(self):
            return {}

    def fake_worker_main(cfg):
        seen.append(cfg)
        return _Result()

    monkeypatch.setattr(diloco.launch, "worker_main", fake_worker_main)
    args = ["worker", "--coordinator", "tcp://127.0.0.1:1", "--preset", "tiny", *extra]
    assert main(args) == 0
    assert [c.transport.connections for c in seen] == [k]
