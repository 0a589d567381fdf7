"""Tier 1: the pure pieces of diloco — schedule (exhaustive), fragments, config validation, data."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from diloco.config import DataConfig, DDPConfig, DilocoConfig, LrSchedule, OptimizerConfig, tiny
from diloco.data import eval_batches, load_corpus, train_batch
from diloco.fragments import plan_fragments
from diloco.schedule import Kind, drain_actions, fragment_actions, in_flight_after, syncs_launched
from lowband.errors import ConfigError
from lowband.models.llama import LlamaForCausalLM

CASES = [
    (H, P, tau)
    for H in range(1, 13)
    for P in range(1, H + 1)
    if H % P == 0
    for tau in range(H // P)
]


@pytest.mark.parametrize("H,P,tau", CASES)
def test_schedule_exhaustive(H, P, tau):
    T = 3 * H + tau + 2
    s = H // P
    sends: dict[tuple[int, int], int] = {}
    applies: dict[tuple[int, int], int] = {}
    inflight = None
    for step in range(1, T + 1):
        acts = fragment_actions(step, P, H, tau)
        kinds = [a.kind for a in acts]
        # ordering within a step: an older sync's APPLY, then SEND, then (τ=0) its own APPLY
        assert kinds in (
            [],
            [Kind.SEND, Kind.APPLY] if tau == 0 else [Kind.SEND],
            [Kind.APPLY],
            [Kind.APPLY, Kind.SEND],
        )
        for a in acts:
            key = (a.fragment, a.round)
            if a.kind is Kind.SEND:
                assert inflight is None, "two fragments in flight at once"
                assert key not in sends
                sends[key] = step
                inflight = key
            else:
                assert inflight == key, "APPLY of something not in flight"
                applies[key] = step
                inflight = None
        got = in_flight_after(step, P, H, tau)
        assert (None if got is None else (got.fragment, got.round)) == inflight
    for a in drain_actions(T, P, H, tau):
        assert a.kind is Kind.APPLY and inflight == (a.fragment, a.round)
        inflight = None
    assert inflight is None
    for (p, k), t in sends.items():
        assert t == (p + 1) * s + k * H  # staggered by H/P, every H steps
        assert applies.get((p, k), T + 1) - t == tau or t > T - tau
    assert len(sends) == syncs_launched(T, P, H)
    for p in range(P):  # every fragment syncs every H steps
        times = sorted(t for (q, _), t in sends.items() if q == p)
        assert all(b - a == H for a, b in zip(times, times[1:]))


def test_plain_diloco_schedule_is_every_H():
    steps = [t for t in range(1, 31) if fragment_actions(t, 1, 10, 0)]
    assert steps == [10, 20, 30]
    assert [a.kind for a in fragment_actions(10, 1, 10, 0)] == [Kind.SEND, Kind.APPLY]


@pytest.mark.parametrize(
    "kw,field",
    [
        (dict(inner_steps=10, n_fragments=3), "n_fragments"),
        (dict(inner_steps=10, n_fragments=2, tau=5), "tau"),
        (dict(inner_steps=10, tau=-1), "tau"),
        (dict(alpha=1.5), "alpha"),
        (dict(alpha=-0.1), "alpha"),
        (dict(codec="int7"), "codec"),
        (dict(inner_steps=0), "inner_steps"),
        (dict(fragment_strategy="random"), "fragment_strategy"),
    ],
)
def test_diloco_config_errors_name_the_field(kw, field):
    with pytest.raises(ConfigError) as e:
        DilocoConfig(**kw)
    assert e.value.field == field


def test_other_config_errors():
    with pytest.raises(ConfigError, match="codec"):
        DDPConfig(codec="zip")
    with pytest.raises(ConfigError, match="optimizer.name"):
        OptimizerConfig(name="lion")
    with pytest.raises(ConfigError, match="data.path"):
        DataConfig(kind="text")
    with pytest.raises(ConfigError, match="data.seq_len"):
        dataclasses.replace(tiny(), data=DataConfig(seq_len=100_000))
    with pytest.raises(ConfigError, match="steps"):
        dataclasses.replace(tiny(), steps=0)


def test_empty_and_short_datasets_are_refused(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(ConfigError, match="empty"):
        load_corpus(DataConfig(kind="text", path=str(tmp_path / "empty.txt")), 256)
    (tmp_path / "short.txt").write_text("to be")
    with pytest.raises(ConfigError, match="too few"):
        load_corpus(DataConfig(kind="text", path=str(tmp_path / "short.txt")), 256)
    with pytest.raises(ConfigError, match="does not exist"):
        load_corpus(DataConfig(kind="text", path=str(tmp_path / "missing.txt")), 256)
    (tmp_path / "d").mkdir()
    with pytest.raises(ConfigError, match="no \\*.bin"):
        load_corpus(DataConfig(kind="tokens", path=str(tmp_path / "d")), 256)


def test_token_shards_and_vocab_check(tmp_path):
    tokens = (np.arange(5000) % 300).astype("<u2")
    tokens.tofile(tmp_path / "a.bin")
    with pytest.raises(ConfigError, match="vocab_size"):
        load_corpus(DataConfig(kind="tokens", path=str(tmp_path)), 256)
    c = load_corpus(DataConfig(kind="tokens", path=str(tmp_path)), 512)
    assert c.train.size == 4500 and c.eval.size == 500 and int(c.eval[0]) == 4500 % 300


def test_embedded_corpus_split_and_pure_batches():
    c = load_corpus(DataConfig(), 256)
    total = c.train.size + c.eval.size
    assert c.train.size == int(total * 0.9)
    a = train_batch(c.train, 32, 4, seed=1, slot=2, step=7)
    b = train_batch(c.train, 32, 4, seed=1, slot=2, step=7)
    other = train_batch(c.train, 32, 4, seed=1, slot=3, step=7)
    assert a.shape == (4, 33) and torch.equal(a, b) and not torch.equal(a, other)
    ev = eval_batches(c.eval, 32, 4, 3)
    assert len(ev) == 3 and all(e.shape == (4, 33) for e in ev)


def test_lr_schedule():
    s = LrSchedule(warmup_steps=10, decay="cosine", min_ratio=0.1)
    assert s.factor(0, 100) == pytest.approx(0.1) and s.factor(9, 100) == pytest.approx(1.0)
    assert s.factor(99, 100) == pytest.approx(0.1, abs=1e-3)
    assert LrSchedule(decay="constant").factor(50, 100) == 1.0


@pytest.mark.parametrize("strategy", ["strided", "sequential"])
@pytest.mark.parametrize("P", [1, 2, 3, 4])
def test_fragments_partition_the_model(strategy, P):
    model = LlamaForCausalLM(dataclasses.replace(tiny().model, num_hidden_layers=4))
    named = list(model.named_parameters())
    plan = plan_fragments(named, P, strategy)
    flat = [n for frag in plan.names for n in frag]
    assert sorted(flat) == sorted(n for n, _ in named) and len(flat) == len(set(flat))
    assert all(plan.names)
    layers = [
        sorted({int(n.split(".")[2]) for n in frag if ".layers." in n}) for frag in plan.names
    ]
    if strategy == "strided":
        assert layers == [list(range(p, 4, P)) for p in range(P)]
    else:
        assert [b for f in layers for b in f] == [0, 1, 2, 3]  # contiguous, in order
    sizes = {n: t.numel() for n, t in named}
    loads = [sum(sizes[n] for n in f) for f in plan.names]
    assert max(loads) <= 2.0 * sum(loads) / P  # embeddings/head spread, not piled up


def test_fragments_without_blocks_and_too_many():
    named = list(
        torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 2)).named_parameters()
    )
    plan = plan_fragments(named, 2, "sequential")
    assert sum(len(f) for f in plan.names) == 4 and all(plan.names)
    with pytest.raises(ConfigError, match="n_fragments"):
        plan_fragments(named, 5, "strided")
