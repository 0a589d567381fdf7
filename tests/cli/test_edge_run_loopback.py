"""``lowband edge run`` keeps every socket on loopback end to end (issue 25): the coordinator,
each device's data socket and the master's star link, not only the coordinator."""

from __future__ import annotations

import ipaddress
import json
import signal
import time
import urllib.error
import urllib.request

import psutil
import pytest

from lowband.models.llama import LlamaForCausalLM, init_weights
from lowband.models.tokenizer import ByteTokenizer
from lowband.models.weights import save_pretrained
from lowband.proc import free_port
from tests.conftest import PY, tiny_llama

pytestmark = [pytest.mark.security, pytest.mark.timeout(180)]


def _health(port: int) -> dict | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
            return json.loads(r.read())
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return None


def test_edge_run_listens_only_on_loopback(tmp_path, spawn) -> None:
    m = LlamaForCausalLM(tiny_llama()).eval()
    init_weights(m, std=0.2, seed=3)
    save_pretrained(m, tmp_path)
    ByteTokenizer().save(tmp_path)
    port = free_port()
    master = spawn(
        [PY, "-m", "cli", "edge", "run", str(tmp_path), "--devices", "3", "--port", str(port)]
    )
    deadline = time.monotonic() + 120
    health = None
    while time.monotonic() < deadline:
        assert master.poll() is None, "edge run exited"
        health = _health(port)
        if health is not None and health.get("healthy"):
            break
        time.sleep(0.3)
    assert health is not None and health["healthy"] and health["insecure"] is False, health
    procs = [psutil.Process(master.pid), *psutil.Process(master.pid).children(recursive=True)]
    listening = [
        (p.pid, c.laddr.ip, c.laddr.port)
        for p in procs
        for c in p.net_connections(kind="inet")
        if c.status == psutil.CONN_LISTEN
    ]
    # HTTP API, coordinator, 3 data sockets, the star link: at least 6 listening sockets
    assert len(listening) >= 6, listening
    exposed = [x for x in listening if not ipaddress.ip_address(x[1]).is_loopback]
    assert not exposed, f"listening beyond loopback: {exposed} of {listening}"
    master.send_signal(signal.SIGTERM)
    assert master.wait(timeout=30) == 0
