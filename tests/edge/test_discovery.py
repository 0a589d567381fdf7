"""LAN discovery (edge/discovery.py): advertise + browse on this host, then a real zero-config
cluster in two network namespaces on a bridge (multicast crosses it): CURVE with the master's
key pinned, token still required."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from contextlib import contextmanager

import pytest

from edge.discovery import Advertisement, discover, key_fingerprint
from lowband.errors import ConfigError
from transport.links import netns

pytestmark = pytest.mark.timeout(240)


def test_advertise_then_discover_by_cluster_name() -> None:
    key = "k" * 40
    with Advertisement(
        "tcp://0.0.0.0:23456", cluster=f"a{os.getpid()}", key=key, signature="lowband-edge/1"
    ):
        found = discover(cluster=f"a{os.getpid()}", timeout=20, master_key=key)
    assert found.address.endswith(":23456") and found.address.startswith("tcp://")
    assert not found.address.startswith("tcp://127.") and not found.address.startswith("tcp://0.")
    # the key's fingerprint, not the key itself, and no secret
    assert (found.fingerprint, found.signature) == (key_fingerprint(key), "lowband-edge/1")


def test_nearest_address_is_on_our_subnet(monkeypatch) -> None:
    from edge import discovery

    monkeypatch.setattr(discovery, "local_ipv4", lambda: ["10.237.0.2", "172.17.0.1"])
    assert discovery._nearest(["192.0.2.2", "10.237.0.1", "10.1.0.1"]) == "10.237.0.1"
    assert discovery._nearest(["172.17.0.9"]) == "172.17.0.9"


def test_discover_times_out_with_an_actionable_message() -> None:
    with pytest.raises(ConfigError, match="--master"):
        discover(cluster=f"nobody{os.getpid()}", timeout=1.0, insecure=True)


def test_advertisement_rejects_a_bad_address() -> None:
    with pytest.raises(ConfigError, match="address"):
        Advertisement("127.0.0.1:5", cluster="x")


def _ckpt(path) -> None:
    from lowband.models.config import ModelConfig
    from lowband.models.llama import LlamaForCausalLM, init_weights
    from lowband.models.tokenizer import ByteTokenizer
    from lowband.models.weights import save_pretrained

    m = LlamaForCausalLM(
        ModelConfig(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=256,
        )
    ).eval()
    init_weights(m, std=0.2, seed=3)
    save_pretrained(m, path)
    ByteTokenizer().save(path)


def _get(url: str, body: dict | None = None) -> tuple[int, dict]:
    req = urllib.request.Request(
        url,
        data=None if body is None else json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


@contextmanager
def _bridge_forwarding(bridge: str):
    """Let frames cross the test bridge. With ``br_netfilter`` loaded (Docker loads it and sets
    the FORWARD policy to DROP), bridged frames go through iptables and every packet between
    the namespaces, unicast or multicast, is dropped. One ACCEPT rule for this bridge only,
    removed on exit (in DOCKER-USER, the chain Docker leaves to users, when it exists)."""
    if shutil.which("iptables") is None:
        yield
        return
    chain = (
        "DOCKER-USER"
        if subprocess.run(["iptables", "-S", "DOCKER-USER"], capture_output=True).returncode == 0
        else "FORWARD"
    )
    rule = [chain, "-i", bridge, "-o", bridge, "-j", "ACCEPT"]
    subprocess.run(["iptables", "-I", *rule], check=True, capture_output=True)
    try:
        yield
    finally:
        subprocess.run(["iptables", "-D", *rule], capture_output=True)


@pytest.mark.slow
@pytest.mark.netns
@pytest.mark.skipif(netns.available() is not None, reason=f"netns: {netns.available()}")
def test_zero_config_cluster_in_two_namespaces(tmp_path) -> None:
    from transport.auth import CurveKeys, keygen

    public, secret = keygen(tmp_path / "keys", "master")
    master_key = CurveKeys.load(public).public.decode()
    tmp_path = tmp_path / "model"
    tmp_path.mkdir()
    _ckpt(tmp_path)
    lb = [sys.executable, "-m", "cli", "edge"]
    name = f"c{os.getpid()}"
    procs: list[subprocess.Popen] = []

    def spawn(bed, site, args, **kw) -> subprocess.Popen:
        p = subprocess.Popen(
            bed.command(site, [*lb, *args]),
            start_new_session=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            **kw,
        )
        procs.append(p)
        return p

    with (
        netns.Testbed(netns.NetnsConfig(sites=2, net=237, name=f"ds{os.getpid() % 100000}")) as bed,
        _bridge_forwarding(bed.bridge),
    ):
        try:
            # the token reaches each process through its environment, never argv (ps)
            master = spawn(
                bed,
                0,
                [
                    "serve",
                    str(tmp_path),
                    "--workers",
                    "1",
                    "--layout",  # the tensor-parallel cluster and its recovery
                    "tp",
                    "--discover",
                    name,
                    "--curve-key",
                    str(secret),
                    "--bind",
                    "tcp://0.0.0.0:29500",
                    "--host",
                    "0.0.0.0",
                    "--port",
                    "8000",
                    "--op-timeout",
                    "20",
                ],
                env={**os.environ, "LOWBAND_TOKEN": "s3cret"},
            )
            # a device with the wrong token finds the master but is refused
            bad = spawn(
                bed,
                1,
                [
                    "worker",
                    "--discover",
                    name,
                    f"--master-key={master_key}",  # a Z85 key may begin with "-"
                    "--model-dir",
                    str(tmp_path),
                    "--discover-timeout",
                    "60",
                    "--op-timeout",
                    "10",
                ],
                env={**os.environ, "LOWBAND_TOKEN": "wrong"},
            )
            out, _ = bad.communicate(timeout=120)
            assert bad.returncode != 0
            assert f"found master tcp://{bed.addr(0)}:29500" in out, out
            url = f"http://{bed.addr(0)}:8000"
            good = spawn(
                bed,
                1,
                [
                    "worker",
                    "--discover",
                    name,
                    f"--master-key={master_key}",  # a Z85 key may begin with "-"
                    "--model-dir",
                    str(tmp_path),
                    "--discover-timeout",
                    "60",
                    "--op-timeout",
                    "20",
                ],
                env={**os.environ, "LOWBAND_TOKEN": "s3cret"},
            )
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                if _reachable(url) and _get(f"{url}/health")[0] == 200:
                    break
                if good.poll() is not None or master.poll() is not None:
                    os.killpg(master.pid, signal.SIGKILL)
                    raise AssertionError(
                        f"worker: {good.stdout.read()}\nmaster: {master.stdout.read()}"
                    )
                time.sleep(0.3)
            status, h = _get(f"{url}/health")
            assert status == 200 and h["devices"] == 2 and h["connected"] == 2, h
            assert h["insecure"] is False, h
            status, out = _get(
                f"{url}/v1/completions", {"prompt": "Hi", "max_tokens": 4, "temperature": 0}
            )
            assert status == 200 and out["usage"]["completion_tokens"] == 4, out
        finally:
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGTERM)
            for p in procs:
                try:
                    p.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait(timeout=10)


def _reachable(url: str) -> bool:
    try:
        urllib.request.urlopen(f"{url}/v1/models", timeout=2).close()
        return True
    except OSError:
        return False
