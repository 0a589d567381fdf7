"""Smoke-run of benchmarks.edge_vs_llamacpp at tiny shapes of the architectures it writes
(llama with Llama 3 rope_freqs, qwen2 with q/k/v biases, qwen3moe with routed experts decoding
through the compiled step), the lowband side only
(``--lowband-only``: gguf's reference quantizer, no llama.cpp), so CI never needs the peer."""

from __future__ import annotations

import json

import pytest

from tests.conftest import PY


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bench_tiny_lowband_only(spawn, tmp_path) -> None:
    p = spawn(
        [
            PY,
            "-m",
            "benchmarks.edge_vs_llamacpp",
            "--models",
            "tiny,tiny-qwen2,tiny-qwen3moe",
            "--widths",
            "q8_0,q4_0",
            "--lowband-only",
            "--tokens",
            "4",
            "--repeats",
            "1",
            "--kl-len",
            "8",
            "--cache",
            str(tmp_path / "cache"),
            "--workdir",
            str(tmp_path),
            "--kernels",
            "",  # the C++ kernels where the rest of the suite builds them
            "--json",
        ],
        stdout=-1,
    )
    out, _ = p.communicate(timeout=280)
    assert p.returncode == 0
    res = json.loads(out.decode().strip().splitlines()[-1])
    assert res["runtimes"] == ["lowband"]
    for name in ("tiny", "tiny-qwen2", "tiny-qwen3moe"):
        m = res["models"][name]
        for w in ("q8_0", "q4_0"):
            cell = m["widths"][w]
            assert cell["threads_1"]["lowband_compiled"] is True
            assert cell["threads_1"]["ms_per_token"]["lowband"]["median"] > 0
            assert cell["threads_1"]["prefill_ms"]["lowband"]["median"] > 0
            assert "ratio_vs_llamacpp" not in cell["threads_1"]
            assert "prefill_ratio_vs_llamacpp" not in cell["threads_1"]
            assert cell["tp2"]["tp2_speedup"] is None and cell["tp2"]["reason"]
        kl = m["kl_vs_f32"]["lowband"]
        # Q8_0 is closer to the F32 model than Q4_0, and both are close to it.
        assert 0 <= kl["q8_0"] < kl["q4_0"] < 0.1
        assert m["file_mb"]["q4_0"] < m["file_mb"]["q8_0"] < m["file_mb"]["f32"]


def test_trained_model_learns_its_chain_and_loads_from_gguf(tmp_path) -> None:
    """``markov-512``'s recipe at a toy size: the written GGUF loads in lowband and predicts the
    chain's favoured successor (what gives the parity comparison its margins)."""
    import numpy as np
    import torch

    from benchmarks.edge_vs_llamacpp import MODELS, markov_chain, write_trained_f32
    from edge.formats.gguf import load_gguf

    spec = dict(MODELS["markov-512"], hidden=256, layers=1, heads=4, kv_heads=2, ffn=256)
    spec.update(vocab_size=32, train=dict(spec["train"], steps=60, seq=32, lr=1e-2))
    path = write_trained_f32(spec, tmp_path / "m.gguf", seed=3)
    model = load_gguf(path)
    ids = list(range(32))
    with torch.inference_mode():
        pred = model(torch.tensor([ids])).argmax(-1)[0].numpy()
    hits = float(np.mean(pred == markov_chain(32, 3)[ids]))
    assert hits >= 0.9, hits  # chance: 1/32
