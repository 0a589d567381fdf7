"""Smoke-run of benchmarks.edge_serving on a tiny model, the lowband arms only
(``--lowband-only``: gguf's reference quantizer, no llama-server, no network), so CI never needs
the peer: one device and a 2-device local cluster behind the OpenAI server, two concurrency
levels, the interference scenario, the machine measurement and the roofline."""

from __future__ import annotations

import json

import pytest

from tests.conftest import PY


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_bench_tiny_lowband_only(spawn, tmp_path) -> None:
    max_tokens = 16
    p = spawn(
        [
            PY,
            "-m",
            "benchmarks.edge_serving",
            "--model",
            "tiny",
            "--width",
            "q4_0",
            "--lowband-only",
            "--concurrency",
            "1,2",
            "--requests-per-client",
            "2",
            "--min-prompt",
            "8",
            "--max-prompt",
            "48",
            "--max-tokens",
            str(max_tokens),
            "--interference-concurrency",
            "2",
            "--long-prompt",
            "64",
            "--parallel",
            "2",
            "--repeats",
            "1",
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
    out, _ = p.communicate(timeout=580)
    assert p.returncode == 0
    res = json.loads(out.decode().strip().splitlines()[-1])
    assert res["llama_server"] is None and res["lowband_vs_llama_server"] == {}
    assert set(res["arms"]) == {"lowband", "lowband-tp2"}
    assert res["arms"]["lowband-tp2"]["cores"] == [0, 1]
    costs = res["costs"]
    # tiny: hidden 256, 2 layers, FFN 512, vocab 512, GQA 4/2, tied head
    per_layer = 256 * 256 * 2 + 2 * 128 * 256 + 3 * 256 * 512
    assert costs["tied_head"] and costs["matmul_params"] == 2 * per_layer + 512 * 256
    assert costs["kv_bytes_per_context_token_f16"] == 2 * 2 * 2 * 64 * 2
    for name, arm in res["arms"].items():
        for c in (1, 2):
            lvl = arm["levels"][f"c{c}"]
            # every request done, each with all its tokens (random weights, ignore_eos)
            assert lvl["requests_done"]["median"] == lvl["requests_sent"] == 2 * c, name
            assert lvl["completion_tokens"]["median"] == 2 * c * max_tokens, name
            assert lvl["tokens_per_s"]["median"] > 0
            assert lvl["ttft_ms_p50"]["median"] <= lvl["ttft_ms_p99"]["median"]
            roof = lvl["roofline"]
            assert roof["batch"] == c and roof["bound_tokens_per_s"] > 0
            assert 0 < lvl["fraction_of_roofline"] < 1
        inter = arm["interference"]
        assert "errors" not in inter, inter
        assert inter["long_ttft_ms"]["median"] > 0
        assert inter["single_itl_ms_p50"]["median"] > 0 and inter["itl_ms_max"]["median"] > 0
        assert inter["triggers"] in (["all_streaming"], ["first_short_finished"])
    for machine in res["machine"].values():
        assert machine["read_gb_per_s"] > 0 and machine["fp32_gflop_per_s"] > 0
    assert set(res["tp2_vs_1_device"]) == {"c1", "c2"}


def test_no_ratio_where_an_arm_lost_requests() -> None:
    """A level where either server failed a request did other work than its peer: no ratio."""
    from benchmarks.edge_serving import _ratios

    def arm(tps: float, errors: bool) -> dict:
        lvl = {"tokens_per_s": {"median": tps}} | ({"errors": ["boom"]} if errors else {})
        return {"levels": {"c1": lvl, "c4": {"tokens_per_s": {"median": tps}}}}

    arms = {"lowband": arm(12.0, False), "llama-server": arm(10.0, True)}
    assert _ratios(arms, "lowband", "llama-server") == {"c1": None, "c4": 1.2}
    arms["llama-server"] = arm(10.0, False)
    assert _ratios(arms, "lowband", "llama-server") == {"c1": 1.2, "c4": 1.2}
