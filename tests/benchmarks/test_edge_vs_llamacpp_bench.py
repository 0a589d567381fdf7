"""Smoke-run of benchmarks.edge_vs_llamacpp at a tiny size (llama.cpp optional: reported as
unavailable with a reason when llama-cpp-python is not installed)."""

from __future__ import annotations

import json

import pytest

from tests.conftest import PY


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bench_tiny(spawn, tmp_path) -> None:
    p = spawn(
        [
            PY,
            "-m",
            "benchmarks.edge_vs_llamacpp",
            "--models",
            "tiny",
            "--tokens",
            "4",
            "--repeats",
            "1",
            "--tp-widths",
            "",
            "--workdir",
            str(tmp_path),
            "--json",
        ],
        stdout=-1,
    )
    out, _ = p.communicate(timeout=280)
    assert p.returncode == 0
    res = json.loads(out.decode().strip().splitlines()[-1])["models"]["tiny"]
    for w in ("fp32", "int8", "q4"):
        assert res["ms_per_token"]["lowband"][w]["median"] > 0
    assert res["greedy_agreement_vs_fp32"]["lowband"]["fp32"] == 1.0
    assert res["kl_vs_fp32_lowband"]["int8"] < res["kl_vs_fp32_lowband"]["q4"] + 1e-6
    if "llamacpp" in res:
        assert (
            res["llamacpp"]["available"] is False
            and "llama-cpp-python" in res["llamacpp"]["reason"]
        )
    else:
        assert res["ratio_vs_llamacpp"]["q4"] > 0
        assert res["greedy_agreement_vs_fp32"]["llamacpp"]["fp32"] == 1.0
