"""Sampling masks, seeded determinism, stop sequences."""

from __future__ import annotations

import pytest
import torch

from edge.sampling import Sampler, SamplingParams, StopMatcher, top_k_mask, top_p_mask
from lowband.errors import ConfigError


def test_top_k_mask_keeps_k_largest() -> None:
    x = torch.tensor([0.1, 3.0, -1.0, 2.0, 0.5])
    m = top_k_mask(x, 2)
    assert torch.isfinite(m).tolist() == [False, True, False, True, False]
    assert torch.equal(top_k_mask(x, 0), x) and torch.equal(top_k_mask(x, 5), x)


def test_top_p_mask_is_smallest_nucleus() -> None:
    probs = torch.tensor([0.05, 0.5, 0.3, 0.15])
    x = probs.log()
    assert torch.isfinite(top_p_mask(x, 0.5)).tolist() == [False, True, False, False]
    assert torch.isfinite(top_p_mask(x, 0.8)).tolist() == [False, True, True, False]
    assert torch.isfinite(top_p_mask(x, 0.81)).tolist() == [False, True, True, True]
    assert torch.isfinite(top_p_mask(x, 1.0)).all()
    assert torch.isfinite(top_p_mask(x, 1e-6)).sum() == 1


def test_greedy_and_seeded_determinism() -> None:
    logits = torch.randn(50, generator=torch.Generator().manual_seed(0))
    assert Sampler(SamplingParams())(logits) == int(logits.argmax())
    p = SamplingParams(temperature=1.5, top_k=20, top_p=0.9, seed=42)
    a = [Sampler(p)(logits) for _ in range(3)]
    s1, s2 = Sampler(p), Sampler(p)
    seq1 = [s1(logits) for _ in range(30)]
    seq2 = [s2(logits) for _ in range(30)]
    assert seq1 == seq2 and len(set(a)) == 1
    assert len(set(seq1)) > 1  # it really samples
    allowed = set(torch.topk(logits, 20).indices.tolist())
    assert set(seq1) <= allowed


def test_sampling_follows_distribution() -> None:
    logits = torch.tensor([0.0, 0.0, 2.0]).log_softmax(-1)
    s = Sampler(SamplingParams(temperature=1.0, seed=1))
    draws = torch.tensor([s(torch.tensor([1.0, 1.0, 2.0]).log()) for _ in range(2000)])
    frac = (draws == 2).float().mean().item()
    assert 0.45 < frac < 0.55  # p = 2/4
    assert logits.shape == (3,)


def test_params_validation() -> None:
    for bad in (
        dict(max_tokens=0),
        dict(temperature=-1.0),
        dict(top_p=0.0),
        dict(top_k=-2),
        dict(stop=("",)),
    ):
        with pytest.raises(ConfigError):
            SamplingParams(**bad)


def test_stop_matcher_holds_back_partial_matches() -> None:
    m = StopMatcher(("END", "\n\n"))
    out = [m.feed(t) for t in ["hel", "lo E", "N", "x wor", "ld\n", "\nmore"]]
    assert "".join(out) == "hello ENx world"
    assert m.stopped and m.feed("again") == ""
    m2 = StopMatcher(("END",))
    assert m2.feed("abcE") == "abc"
    assert m2.flush() == "E" and not m2.stopped
    m3 = StopMatcher(())
    assert m3.feed("anything") == "anything"
    m4 = StopMatcher(("ab",))
    assert m4.feed("xxab yy") == "xx" and m4.stopped
