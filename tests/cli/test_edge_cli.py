"""End to end: ``lowband edge`` commands as separate processes over real sockets on 127.0.0.1.

* split writes per-device files; bad arguments exit 2 with a message;
* ``edge run`` (3 devices, uneven weights) serves the same greedy text as one device;
* ``edge serve`` + 2 ``edge worker`` processes: SIGKILL a worker -> the request fails with a
  JSON 503, /health says unavailable, the master stays up; a restarted worker heals it.
"""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.error
import urllib.request
from pathlib import Path

import psutil
import pytest

import transport.zmq_comm  # noqa: F401 - the project's own module: never a skip
from edge.engine import Engine, LocalRunner
from edge.sampling import SamplingParams
from lowband.models.config import ModelConfig
from lowband.models.llama import LlamaForCausalLM, init_weights
from lowband.models.tokenizer import ByteTokenizer
from lowband.models.weights import save_pretrained
from lowband.proc import free_port
from tests.conftest import PY

CFG = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)
PROMPT = "To be or not"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> tuple[Path, str]:
    d = tmp_path_factory.mktemp("edge_ckpt")
    m = LlamaForCausalLM(ModelConfig(**CFG)).eval()
    init_weights(m, std=0.2, seed=21)
    save_pretrained(m, d)
    ByteTokenizer().save(d)
    eng = Engine(LocalRunner(m), ByteTokenizer(), model_name="x")
    return d, eng.complete(PROMPT, SamplingParams(max_tokens=12))[0]


def _http(port: int, path: str, body: dict | None = None, timeout: float = 60) -> tuple[int, dict]:
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}",
        data=None if body is None else json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _wait_health(port: int, proc, want: int = 200, timeout: float = 90) -> dict:
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the master exited"
        try:
            status, body = _http(port, "/health", timeout=5)
            last = body
            if status == want:
                return body
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.2)
    raise AssertionError(f"/health never returned {want}; last: {last}")


def _complete(port: int) -> tuple[int, dict]:
    return _http(port, "/v1/completions", {"prompt": PROMPT, "max_tokens": 12, "temperature": 0})


def test_split_cli(ckpt, tmp_path, spawn) -> None:
    d, _ = ckpt
    out = tmp_path / "s"
    p = spawn(
        [
            PY,
            "-m",
            "cli",
            "edge",
            "split",
            str(d),
            "--devices",
            "3",
            "--weights",
            "1,1,2",
            "--out",
            str(out),
        ]
    )
    assert p.wait(timeout=120) == 0
    meta = json.loads((out / "lowband_split.json").read_text())
    assert meta["plan"]["world"] == 3 and meta["plan"]["weights"] == [1.0, 1.0, 2.0]
    for r in range(3):
        assert len(list((out / f"rank{r}").glob("layer*.safetensors"))) == 3
    assert (out / "rank0" / "head.safetensors").exists()
    # rank 0: embedding, final norm, its LM-head rows; the others: final norm and their rows
    from safetensors import safe_open

    for r in range(3):
        with safe_open(str(out / f"rank{r}" / "head.safetensors"), framework="pt") as sf:
            keys = set(sf.keys())
            a, b = meta["plan"]["vocab"][r]
            assert sf.get_slice("lm_head.weight").get_shape()[0] == b - a
        assert keys == {"model.norm.weight", "lm_head.weight"} | (
            {"model.embed_tokens.weight"} if r == 0 else set()
        )
    bad = spawn(
        [
            PY,
            "-m",
            "cli",
            "edge",
            "split",
            str(d),
            "--devices",
            "2",
            "--weights",
            "1,x",
            "--out",
            str(tmp_path / "bad"),
        ],
        stderr=-1,
    )
    _, err = bad.communicate(timeout=120)
    assert bad.returncode == 2 and b"weights" in err


@pytest.mark.slow
def test_run_three_devices_uneven_matches_single_device(ckpt, spawn) -> None:
    d, expected = ckpt
    port = free_port()
    master = spawn(
        [
            PY,
            "-m",
            "cli",
            "edge",
            "run",
            str(d),
            "--devices",
            "3",
            "--weights",
            "2,1,1",
            "--port",
            str(port),
            "--name",
            "tiny",
            "--threads",
            "1",
        ]
    )
    _wait_health(port, master)
    status, out = _complete(port)
    assert status == 200, out
    assert out["choices"][0]["text"] == expected
    _, metrics = _http(port, "/metrics")
    # star all-reduce of fp32 activations: 2 workers x (embedding + 2 per layer out and back
    # + the greedy candidates of the vocabulary-parallel head, one (value, id) per rank)
    H, L = CFG["hidden_size"], CFG["num_hidden_layers"]
    assert metrics["wire_bytes_per_token"] == 2 * (H * 4 + 2 * L * 2 * H * 4 + 2 * 3 * 2 * 4)
    workers = psutil.Process(master.pid).children(recursive=True)
    assert len(workers) >= 2
    master.send_signal(signal.SIGTERM)  # like systemd/timeout: must not orphan the workers
    assert master.wait(timeout=30) == 0
    _, alive = psutil.wait_procs(workers, timeout=20)
    assert not alive


@pytest.mark.slow
def test_worker_kill_and_return(ckpt, spawn) -> None:
    d, expected = ckpt
    port, cport = free_port(), free_port()
    bind = f"tcp://127.0.0.1:{cport}"
    master = spawn(
        [
            PY,
            "-m",
            "cli",
            "-v",
            "edge",
            "serve",
            str(d),
            "--workers",
            "2",
            "--layout",  # the tensor-parallel cluster and its recovery
            "tp",
            "--bind",
            bind,
            "--port",
            str(port),
            "--op-timeout",
            "10",
        ]
    )
    worker = [PY, "-m", "cli", "-v", "edge", "worker", "--master", bind, "--threads", "1"]
    worker += ["--model-dir", str(d)]
    w1, w2 = spawn(worker), spawn(worker)
    _wait_health(port, master)
    status, out = _complete(port)
    assert status == 200 and out["choices"][0]["text"] == expected
    os.killpg(w2.pid, signal.SIGKILL)
    w2.wait(timeout=10)
    # the next request (or the idle heartbeat) finds the worker gone: a JSON 503, no crash
    deadline = time.monotonic() + 60
    while True:
        status, out = _complete(port)
        if status != 200 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert status == 503 and "error" in out, out
    health = _wait_health(port, master, want=503)
    assert health["healthy"] is False
    assert master.poll() is None and w1.poll() is None
    spawn(worker)  # the device comes back
    health = _wait_health(port, master, want=200)
    assert health["epoch"] >= 1
    status, out = _complete(port)
    assert status == 200 and out["choices"][0]["text"] == expected


@pytest.mark.slow
def test_a_worker_with_no_model_copy_takes_the_masters(ckpt, spawn, tmp_path) -> None:
    d, expected = ckpt
    port, cport = free_port(), free_port()
    bind = f"tcp://127.0.0.1:{cport}"
    serve = [PY, "-m", "cli", "edge", "serve", str(d), "--workers", "1", "--ship", "--layout", "tp"]
    master = spawn([*serve, "--bind", bind, "--port", str(port), "--op-timeout", "10"])
    cache = tmp_path / "cache"
    worker = [PY, "-m", "cli", "edge", "worker", "--master", bind, "--threads", "1"]
    spawn([*worker, "--cache-dir", str(cache)])  # no --model-dir: nothing of the model here
    _wait_health(port, master)
    status, out = _complete(port)
    assert status == 200 and out["choices"][0]["text"] == expected
    shipped = {p.name for p in cache.rglob("*") if p.is_file()}
    assert shipped == {p.name for p in d.rglob("*") if p.is_file()}
