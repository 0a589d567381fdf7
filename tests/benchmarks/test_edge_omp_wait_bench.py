"""Smoke run of benchmarks.edge_omp_wait on a tiny random checkpoint: both arms serve, time
their requests and the JSON carries each arm's figures."""

from __future__ import annotations

import json

import pytest

from benchmarks import edge_omp_wait
from lowband.models.config import ModelConfig
from lowband.models.llama import LlamaForCausalLM, init_weights
from lowband.models.tokenizer import ByteTokenizer
from lowband.models.weights import save_pretrained
from tests.edge.test_edge_cluster import CFG


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_edge_omp_wait_tiny(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    m = LlamaForCausalLM(ModelConfig(**CFG)).eval()
    init_weights(m, std=0.2, seed=11)
    save_pretrained(m, tmp_path)
    ByteTokenizer().save(tmp_path)
    argv = ["--model", str(tmp_path), "--tokens", "8", "--rounds", "1", "--requests", "1"]
    assert edge_omp_wait.main([*argv, "--threads", "1", "--json"]) == 0
    rec = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rec["benchmark"] == "edge_omp_wait"
    res = rec["result"]
    assert set(res["tok_s"]) == {"cli_default", "libgomp_default"}
    assert all(s["n"] == 1 and s["median"] > 0 for s in res["tok_s"].values())
    assert res["cli_over_libgomp"] > 0
