"""Smoke run of ``python -m benchmarks.diloco`` at its tiny size: the JSON line and its
invariants."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.timeout(180)


def test_bench_tiny_prints_its_json_line(capsys, tmp_path):
    from benchmarks.diloco import main

    assert main(["--json", "--tiny", "--seeds", "2", "--plot", str(tmp_path / "p.png")]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    cfg = out["config"]
    for key in ("workers", "H", "P", "tau", "alpha", "codec", "steps", "tokens"):
        assert key in cfg
    assert cfg["tokens"] == cfg["workers"] * cfg["steps"] * cfg["batch_size"] * cfg["seq_len"]
    ddp, dl = out["ddp"], out["diloco"]
    # DDP all-reduces fp32 gradients every step; DiLoCo sends 4-bit fragments every H/P steps
    assert ddp["outer_syncs"] == cfg["steps"]
    assert dl["outer_syncs"] == cfg["steps"] // (cfg["H"] // cfg["P"])
    assert out["bytes_ratio"] == pytest.approx(ddp["bytes_per_worker"] / dl["bytes_per_worker"])
    assert out["bytes_ratio"] > 20
    assert out["loss_gap"] == pytest.approx((dl["eval_loss"] - ddp["eval_loss"]) / ddp["eval_loss"])
    seeds = out["seeds"]
    assert [s["seed"] for s in seeds] == [0, 1] and seeds[0]["ddp_eval"] != seeds[1]["ddp_eval"]
    assert dl["eval_loss"] == pytest.approx((seeds[0]["diloco_eval"] + seeds[1]["diloco_eval"]) / 2)
    assert 0 < dl["peak_sync_bytes"] < ddp["peak_sync_bytes"]
    wc = out["wallclock"]
    assert wc["link"].startswith("MODELLED")
    assert {"ddp", "diloco_no_overlap", "streaming_overlap"} <= set(wc)
    assert (tmp_path / "p.png").stat().st_size > 1000
    assert out["eval"]["split"] == "test" and out["eval"]["tokens"] >= 65536
    assert out["loss_gap_sd"] >= 0


def test_bench_reports_on_another_corpus(capsys, tmp_path):
    from benchmarks.diloco import main
    from lowband import SAMPLE_TEXT

    corpus = tmp_path / "other.txt"
    corpus.write_bytes(SAMPLE_TEXT.read_bytes()[-200_000:])
    assert (
        main(
            [
                "--json",
                "--tiny",
                "--wall-steps",
                "0",
                "--corpus",
                str(corpus),
                "--eval-split",
                "validation",
            ]
        )
        == 0
    )
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["eval"] == {
        "corpus": str(corpus),
        "split": "validation",
        "tokens": 20000,
        "scored_tokens": 2 * 4 * 16,
        "tokenizer": "bytes",
    }
    assert "wallclock" not in out


def test_bench_reads_the_packaged_second_corpus_by_name(capsys):
    from benchmarks.diloco import main
    from diloco.data import PARADISE_LOST

    assert (
        main(
            [
                "--json",
                "--tiny",
                "--wall-steps",
                "0",
                "--corpus",
                "paradise_lost",
                "--test-fraction",
                "0.15",
            ]
        )
        == 0
    )
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    n = PARADISE_LOST.stat().st_size
    assert out["eval"]["corpus"] == "paradise_lost" and out["eval"]["split"] == "test"
    assert out["eval"]["tokens"] == int(n * 0.15) >= 65536  # bytes: one token each


def test_overhead_bench_tiny_prints_its_json_line(capsys):
    from benchmarks.diloco_overhead import main

    assert main(["--json", "--tiny"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for key in (
        "device",
        "params",
        "dtype",
        "tokens_per_s_plain",
        "tokens_per_s_diloco",
        "overhead",
        "outer_step_ms",
    ):
        assert key in out
    assert out["device"] == "cpu" or "mfu" in out
    assert out["overhead"] == pytest.approx(
        1 - out["tokens_per_s_diloco"] / out["tokens_per_s_plain"]
    )
    assert out["tokens_per_s_plain"] > 0 and out["tokens_per_s_diloco"] > 0
    assert out["outer_syncs_per_run"] >= 2 and out["outer_step_ms"] > 0
    assert len(out["pairs_overhead"]) == out["repeats"]
    # the peer arm (nanoGPT-style loop) ran in the same alternation
    assert out["tokens_per_s_peer"] > 0 and len(out["peer"]) == 3
    assert out["peer"]["min"] <= out["tokens_per_s_peer"] <= out["peer"]["max"]
    assert out["overhead_vs_peer"] == pytest.approx(
        1 - out["tokens_per_s_diloco"] / out["tokens_per_s_peer"]
    )
    assert out["warmup"] == 1 and out["compiled"] is False  # CPU default: eager
    assert out["mfu_peer"] is None and out["peak_tflops"] is None  # no CPU peak given
    assert isinstance(out["exposed_outer_ms"], float)


def test_overhead_bench_mfu_with_a_peak(capsys):
    from benchmarks.diloco_overhead import main

    assert main(["--json", "--tiny", "--repeats", "1", "--peak-tflops", "0.5"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for arm in ("peer", "plain", "diloco"):
        mfu = out["tokens_per_s_" + arm] * out["flops_per_token"] / 0.5e12
        assert out["mfu_" + arm] == pytest.approx(mfu)
    assert out["mfu"] == out["mfu_diloco"]


def test_overhead_presets_are_the_350m_and_1b_llamas():
    """Built on the meta device (nothing allocated): TinyLlama's 1.1 B and the 368 M model of
    the H100 figures; FLOPs per token as 6·N (embedding lookup left out) + attention."""
    import torch

    from benchmarks.diloco_overhead import flops_per_token, preset_1b, preset_350m
    from diloco.config import llama_1b, llama_350m
    from lowband.models.llama import LlamaForCausalLM

    counts = {}
    for bench, model in ((preset_350m(), llama_350m(1024)), (preset_1b(), llama_1b(2048))):
        assert bench.model_config() == model
        with torch.device("meta"):
            m = LlamaForCausalLM(model)
        assert all(p.device.type == "meta" for p in m.parameters())
        counts[model.hidden_size] = sum(p.numel() for p in m.parameters())
        cfg = bench.train_config()
        assert cfg.data.seq_len == model.max_position_embeddings
        n = counts[model.hidden_size]
        assert flops_per_token(cfg, n) == 6 * (n - 32000 * model.hidden_size) + 12 * (
            model.num_hidden_layers * cfg.data.seq_len * model.hidden_size
        )
    assert counts == {1024: 367_969_280, 2048: 1_100_048_384}
    m1b = llama_1b()
    assert (m1b.num_attention_heads, m1b.num_key_value_heads, m1b.intermediate_size) == (
        32,
        4,
        5632,
    )
