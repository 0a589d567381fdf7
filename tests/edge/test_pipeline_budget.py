"""The pipeline layout within a per-device memory budget (``--layout pipeline
--memory-budget-mb``): the split that honours it (pure), the sizes it counts from a GGUF
header, the embedding pages a later stage gives back, and logits bit for bit those of one
device holding the same mapped weights."""

from __future__ import annotations

import pytest
import torch

from edge.cluster import ClusterConfig
from edge.cluster.layout import budget_ranges, head_rows_last, stage_weight_bytes
from edge.cluster.stage import LayerRange, load_stage
from edge.engine import Work
from edge.formats.gguf import write_gguf
from edge.formats.gguf_window import stage_sizes
from edge.launch import check_model
from edge.shardio import WindowConfig, load_shard
from edge.window import PAGE, release
from lowband.errors import ConfigError
from lowband.models.config import ModelConfig
from lowband.models.llama import LlamaForCausalLM, Span, init_weights
from tests.edge.test_edge_cluster import CFG
from tests.edge.test_pipeline import _start, _stop

pytestmark = pytest.mark.timeout(120)
MB = 2**20


def test_budget_ranges_move_layers_off_the_stage_with_the_embedding() -> None:
    layers = [10 * MB] * 16
    # the first stage holds the 60 MB embedding (a tied head: the last stage its rows too)
    ranges = budget_ranges([1.0, 1.0], 130 * MB, layers, 60 * MB, 60 * MB, True)
    assert [(r.lo, r.hi) for r in ranges] == [(0, 7), (7, 16)]
    held = stage_weight_bytes(ranges, layers, 60 * MB, 60 * MB, True)
    assert held[0] == 70 * MB + 60 * MB
    rows = head_rows_last(1 << 20, 7, 9) / (1 << 20)
    assert held[1] == 90 * MB + round(60 * MB * rows)
    assert max(held) <= 130 * MB
    # an even split would not fit the first device
    even = stage_weight_bytes(
        [LayerRange(0, 8, 16), LayerRange(8, 16, 16)], layers, 60 * MB, 60 * MB, True
    )
    assert even[0] > 130 * MB
    # untied: the first stage also holds its rows of the head
    untied = stage_weight_bytes(ranges, layers, 60 * MB, 60 * MB, False)
    assert untied[0] > held[0] and untied[0] + untied[1] == 160 * MB + 60 * MB + 60 * MB


def test_a_budget_no_split_honours_says_why() -> None:
    with pytest.raises(ConfigError, match="token embedding"):
        budget_ranges([1.0, 1.0], 90 * MB, [10 * MB] * 16, 60 * MB, 60 * MB, True)
    with pytest.raises(ConfigError):  # not even one layer beside the embedding
        budget_ranges([1.0, 1.0], 65 * MB, [10 * MB] * 4, 60 * MB, 60 * MB, True)


def test_release_gives_back_whole_pages_only() -> None:
    t = torch.ones(8 * PAGE, dtype=torch.uint8)
    start = PAGE - t.data_ptr() % PAGE  # the first page boundary inside t
    got = release(t, start, start + 3 * PAGE + 7)
    assert got == 3 * PAGE
    assert int(t[start : start + 3 * PAGE].sum()) == 0  # anonymous memory reads as zeros
    assert int(t[:start].sum()) == start and bool(t[start + 3 * PAGE :].all())
    assert release(t, 1, PAGE // 2) == 0  # no whole page inside
    with pytest.raises(ValueError):
        release(t, 0, t.numel() + 1)


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    """A 5-layer f32 GGUF (decoder weights mapped as views by a stage) with a tied head."""
    cfg = ModelConfig(**dict(CFG, num_hidden_layers=5, tie_word_embeddings=True))
    m = LlamaForCausalLM(cfg).eval()
    init_weights(m, std=0.2, seed=3)
    return write_gguf(m, tmp_path_factory.mktemp("budget") / "m.gguf")


def test_stage_sizes_read_the_header(gguf) -> None:
    layers, embed, head, tied = stage_sizes(gguf)
    assert len(layers) == 5 and len(set(layers)) == 1 and tied
    assert head == 256 * 64 * 4 and embed >= head  # (embed: the final norm too)


def test_a_later_stage_gives_back_the_embedding_rows_it_does_not_hold(gguf) -> None:
    whole = load_shard(gguf).model.model.embed_tokens.weight.detach()
    stage = load_stage(
        str(gguf), LayerRange(2, 5, 5), None, head_lo=100, window=WindowConfig(window=3)
    )
    try:
        rows = stage.model.model.embed_tokens.weight.detach()
        assert torch.equal(rows[100:], whole[100:])  # the head rows it holds are intact
        assert not torch.equal(rows[:100], whole[:100])  # pages of the others given back
        assert float(rows[:100].abs().sum()) < float(whole[:100].abs().sum())
    finally:
        stage.close()


@pytest.mark.parametrize("mapped", [True, False])
def test_a_stage_loads_without_parsing_the_tokenizer(gguf, monkeypatch, mapped) -> None:
    """A worker's stage never tokenizes: its load builds no tokenizer and its GGUF reader steps
    over the vocabulary's arrays (a Llama-3 vocabulary parsed is ~100 MB of a stage's RSS)."""
    import gguf as gguf_py

    import edge.formats.bounds as bounds
    import edge.formats.gguf_tokenizer as gguf_tokenizer

    real = bounds.open_reader
    assert "tokenizer.ggml.tokens" in real(gguf).fields  # the file has a vocabulary
    readers = []

    def spy(path, **kw):
        readers.append(real(path, **kw))
        return readers[-1]

    def refuse(*a, **kw):
        raise AssertionError("a stage's load built a tokenizer")

    monkeypatch.setattr(bounds, "open_reader", spy)
    monkeypatch.setattr(gguf_tokenizer, "tokenizer_from_gguf", refuse)
    window = WindowConfig(window=3) if mapped else None
    stage = load_stage(str(gguf), LayerRange(2, 5, 5), None, head_lo=100, window=window)
    stage.close()
    assert readers
    array = gguf_py.GGUFValueType.ARRAY
    for r in readers:
        parsed = [n for n, f in r.fields.items() if n.startswith("tokenizer.") and array in f.types]
        assert parsed == []


def test_budgeted_pipeline_logits_bit_identical_to_one_device(gguf) -> None:
    layers, embed, head, tied = stage_sizes(gguf)
    # a budget that holds layers 0..1 beside the embedding, 2..4 beside the head's rows: the
    # even split (0..2 on the first device) does not fit it
    split = [LayerRange(0, 2, 5), LayerRange(2, 5, 5)]
    budget = max(stage_weight_bytes(split, layers, embed, head, tied))
    even = [LayerRange(0, 3, 5), LayerRange(3, 5, 5)]
    assert stage_weight_bytes(even, layers, embed, head, tied)[0] > budget
    cfg_kw = dict(memory_budget_mb=budget / MB)
    check_model(str(gguf), ClusterConfig(devices=2, layout="pipeline", **cfg_kw))
    ref = load_shard(gguf, window=WindowConfig(window=5)).model  # the same mapped weights
    runner, workers = _start(gguf, 2, micro_batches=1, **cfg_kw)
    try:
        assert [(r.lo, r.hi) for r in runner.ranges] == [(0, 2), (2, 5)]
        assert runner.mapped and runner.head_lo > 0
        cache = ref.new_cache()
        ids, pos = [5, 9, 200, 3], 0
        for _ in range(3):
            (got,) = runner.forward_batch([Work(slot=0, ids=ids, start=pos)])
            with torch.inference_mode():
                h = ref.forward_ragged(ref.embed(torch.tensor([ids])), [Span(cache, pos, len(ids))])
                want = ref.head(h[0, -1:]).float()[0]
            assert got is not None and torch.equal(got, want)
            pos += len(ids)
            ids = [int(got.argmax())]
    finally:
        _stop(runner, workers)


def test_the_pipeline_still_refuses_a_window() -> None:
    with pytest.raises(ConfigError, match="memory-budget-mb"):
        check_model("unused", ClusterConfig(devices=2, layout="pipeline", window=2))
