"""End to end: ``edge quantize --bits`` and ``edge convert`` (GGUF) outputs served through the
OpenAI API by ``edge run`` on 2 devices give the same greedy text as the quantized model in
process."""

from __future__ import annotations

import json
import signal
import urllib.request

import pytest

from edge.engine import Engine, LocalRunner
from edge.formats.gguf import write_gguf
from edge.sampling import SamplingParams
from edge.shardio import load_shard
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
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)


def _expected(d) -> str:
    eng = Engine(LocalRunner(load_shard(d).model), ByteTokenizer(), model_name="x")
    return eng.complete("To be or", SamplingParams(max_tokens=8))[0]


def _serve_and_complete(d, spawn) -> str:
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
            "2",
            "--port",
            str(port),
            "--name",
            "q",
            "--threads",
            "1",
        ]
    )
    body = json.dumps(
        {"model": "q", "prompt": "To be or", "max_tokens": 8, "temperature": 0}
    ).encode()
    import time

    deadline = time.monotonic() + 120
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                if r.status == 200:
                    break
        except OSError:
            pass
        assert master.poll() is None and time.monotonic() < deadline
        time.sleep(0.3)
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        data=body,
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        text = json.loads(r.read())["choices"][0]["text"]
    master.send_signal(signal.SIGTERM)
    assert master.wait(timeout=30) == 0
    return text


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_quantized_and_gguf_serve_on_two_devices(tmp_path, spawn) -> None:
    m = LlamaForCausalLM(ModelConfig(**CFG)).eval()
    init_weights(m, std=0.2, seed=21)
    src = save_pretrained(m, tmp_path / "fp32")
    ByteTokenizer().save(src)
    q = tmp_path / "q4"
    p = spawn(
        [
            PY,
            "-m",
            "cli",
            "edge",
            "quantize",
            str(src),
            "--bits",
            "4",
            "--group",
            "32",
            "--out",
            str(q),
        ]
    )
    assert p.wait(timeout=120) == 0
    assert _serve_and_complete(q, spawn) == _expected(q)
    g = tmp_path / "conv"
    p = spawn(
        [
            PY,
            "-m",
            "cli",
            "edge",
            "convert",
            str(write_gguf(m, tmp_path / "m.gguf", ftype="q8_0")),
            "--out",
            str(g),
        ]
    )
    assert p.wait(timeout=120) == 0
    ByteTokenizer().save(g)
    assert _serve_and_complete(g, spawn) == _expected(g)
