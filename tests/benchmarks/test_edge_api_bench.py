"""Smoke-run of benchmarks.edge_api on a small GGUF file (llama.cpp's suite model: random
weights, the llama-bpe vocabulary, Llama 3.1's published template), every lowband arm at one
and two streams, no llama-server: the JSON line has each arm's figures, and the outputs that
the grammar made whole parse (tool calls parsed back by the server's parser, lists as
list.gbnf writes them)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from benchmarks.edge_api import ARMS, CONSTRAINED
from tests.conftest import PY
from tests.edge.llamacpp_suite.model import write_model

DATA = Path(__file__).parents[1] / "edge" / "data" / "templates"


@pytest.mark.timeout(600)
def test_bench_tiny(spawn, tmp_path) -> None:
    template = (DATA / "meta-llama-Llama-3.1-8B-Instruct.jinja").read_text()
    path = write_model(tmp_path / "m.gguf", template)
    argv = [PY, "-m", "benchmarks.edge_api", "--gguf", str(path), "--streams", "1", "2"]
    argv += ["--repeats", "1", "--max-tokens", "12", "--json"]
    p = spawn(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = p.communicate(timeout=540)
    assert p.returncode == 0, err[-3000:]
    res = json.loads(out.strip().splitlines()[-1])
    assert res["tool_format"] == "llama3"  # the template's own format
    for level in ("streams_1", "streams_2"):
        row = res[level]
        assert set(ARMS) <= set(row)
        assert row["plain"]["relative"] == 1.0
        for arm in ARMS:
            assert row[arm]["tokens_per_s"] > 0 and row[arm]["tokens_per_stream"] <= 12
        for arm in CONSTRAINED:
            assert row[arm]["matched_relative"] > 0
        assert row["grammar_valid_fraction"] == 1.0  # a list, cut or whole
        assert 0.0 <= row["json_valid_fraction"] <= 1.0  # 12 tokens may cut the object
        assert 0.0 <= row["tools_valid_fraction"] <= 1.0
        assert "llama_server" not in row
        assert all(row[arm]["prefill_tokens_per_request"] >= 1 for arm in ARMS)
    # one stream: the tools prompt the warm-up computed stays cached (only its last token,
    # whose logits start the reply, is computed again)
    assert res["streams_1"]["tools"]["prefill_tokens_per_request"] == 1.0
