"""llama.cpp's logit processors against hand-computed logits: penalties, logit bias, min-p,
locally typical sampling; and that requests without them keep the plain path."""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from edge.engine import Engine, LocalRunner
from edge.sampling import (
    Sampler,
    SamplingParams,
    apply_logit_bias,
    apply_penalties,
    argmax,
    min_p_mask,
    typical_mask,
)
from lowband.errors import ConfigError
from lowband.models.llama import LlamaForCausalLM, init_weights
from lowband.models.tokenizer import ByteTokenizer
from tests.conftest import tiny_llama


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_penalties_as_llama_cpp_defines_them(dtype) -> None:
    # float32/64 through the NumPy view of the logits, bfloat16 (no view) through torch
    x = torch.tensor([2.0, -1.0, 0.5, 3.0], dtype=dtype)
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-6
    # window of the last 4: token 1 once, token 3 three times (token 0 is outside it)
    out = apply_penalties(
        x.clone(), [0, 1, 3, 3, 3, 9, -1], last_n=6, repeat=2.0, frequency=0.1, presence=0.5
    )
    want = [2.0, -1.0 * 2.0 - 0.1 - 0.5, 0.5, 3.0 / 2.0 - 3 * 0.1 - 0.5]
    assert out.tolist() == pytest.approx(want, abs=tol)
    every = apply_penalties(x.clone(), [0, 0], last_n=-1, repeat=1.0, frequency=1.0, presence=0.0)
    assert every.tolist() == pytest.approx([0.0, -1.0, 0.5, 3.0], abs=tol)
    off = apply_penalties(x.clone(), [0, 1], last_n=0, repeat=2.0, frequency=1.0, presence=1.0)
    assert torch.equal(off, x)


def test_argmax_takes_the_first_largest_as_torch_does() -> None:
    nan = float("nan")
    for row in ([2.0, 5.0, 5.0], [1.0, nan, 3.0, nan], [float("-inf")] * 3, [0.5]):
        x = torch.tensor(row)
        assert argmax(x) == int(torch.argmax(x)), row
    big = torch.randn(262144, generator=torch.Generator().manual_seed(3))
    assert argmax(big) == int(torch.argmax(big))
    assert argmax(big.to(torch.bfloat16)) == int(torch.argmax(big.to(torch.bfloat16)))


def test_min_p_in_the_samplers_buffer_as_the_pure_mask() -> None:
    # sampled: min-p applied in place on the sampler's copy keeps exactly min_p_mask's tokens
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    s = Sampler(SamplingParams(max_tokens=4, temperature=1.0, min_p=0.2, logit_bias=((3, 0.0),)))
    got = s.process(logits.clone())
    assert torch.equal(torch.isfinite(got), torch.isfinite(min_p_mask(logits, 0.2)))
    assert {s(logits) for _ in range(200)} <= {0, 1, 2}
    assert torch.equal(logits, torch.tensor([0.5, 0.3, 0.15, 0.05]).log())  # not touched
    # greedy: min-p never drops the largest logit, so the draw skips it and agrees
    g = Sampler(SamplingParams(max_tokens=4, min_p=0.9, repeat_penalty=2.0), prompt=[0])
    assert g(logits) == 1  # 0.5 penalised: log 0.5 * 2 < log 0.3


def test_logit_bias_adds_and_bans() -> None:
    x = apply_logit_bias(torch.zeros(4), [(1, 2.5), (2, -100.0), (9, 5.0)])
    assert x[0] == 0 and x[1] == 2.5 and x[2] == float("-inf") and x[3] == 0


def test_min_p_keeps_tokens_at_least_p_times_the_best() -> None:
    x = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    assert torch.isfinite(min_p_mask(x, 0.2)).tolist() == [True, True, True, False]
    assert torch.isfinite(min_p_mask(x, 0.7)).tolist() == [True, False, False, False]
    assert torch.equal(min_p_mask(x, 0.0), x)


def test_typical_p_by_hand() -> None:
    p = [0.5, 0.3, 0.15, 0.05]
    h = -sum(q * math.log(q) for q in p)  # 1.142
    shifted = [abs(-math.log(q) - h) for q in p]  # 0.449, 0.062, 0.755, 1.853
    assert sorted(range(4), key=lambda i: shifted[i]) == [1, 0, 2, 3]
    x = torch.tensor(p).log()
    # cumulative mass in that order: 0.3, 0.8, 0.95, 1.0
    assert torch.isfinite(typical_mask(x, 0.5)).tolist() == [True, True, False, False]
    assert torch.isfinite(typical_mask(x, 0.9)).tolist() == [True, True, True, False]
    assert torch.isfinite(typical_mask(x, 0.2)).tolist() == [False, True, False, False]


def test_sampler_penalises_the_prompt_and_its_own_tokens() -> None:
    logits = torch.tensor([1.0, 0.9, 0.0])
    plain = Sampler(SamplingParams(max_tokens=4))
    assert plain(logits) == 0 and plain.history is None
    s = Sampler(SamplingParams(max_tokens=4, repeat_penalty=1.5), prompt=[0])
    assert s(logits) == 1  # 1.0 / 1.5 < 0.9
    assert s(logits) == 0  # both seen once now: 0.667 > 0.6
    assert s.history == [0, 1, 0]
    assert torch.equal(logits, torch.tensor([1.0, 0.9, 0.0]))  # the model's are not touched


def test_processors_need_every_logit_plain_requests_do_not() -> None:
    assert SamplingParams().candidates == 1
    assert SamplingParams(temperature=1.0, top_k=5).candidates == 5
    for kw in (
        {"presence_penalty": 0.1},
        {"frequency_penalty": -0.1},
        {"repeat_penalty": 1.1},
        {"min_p": 0.05},
        {"typical_p": 0.9},
        {"logit_bias": ((1, 1.0),)},
    ):
        assert SamplingParams(**kw).candidates == 0, kw
    assert not SamplingParams(repeat_penalty=1.3, repeat_last_n=0).processed


@pytest.mark.parametrize(
    "kw",
    [
        {"repeat_penalty": 0.0},
        {"repeat_last_n": -2},
        {"presence_penalty": 2.5},
        {"frequency_penalty": -3.0},
        {"min_p": 1.5},
        {"typical_p": 0.0},
        {"logit_bias": ((1, 101.0),)},
    ],
)
def test_bad_values_are_config_errors(kw) -> None:
    with pytest.raises(ConfigError) as e:
        SamplingParams(**kw)
    assert e.value.field == next(iter(kw))


def test_engine_applies_processors_per_sequence_in_one_batch() -> None:
    m = LlamaForCausalLM(tiny_llama(max_position_embeddings=64)).eval()
    init_weights(m, std=0.3, seed=1)
    eng = Engine(LocalRunner(m), ByteTokenizer(), model_name="t", parallel=2)
    try:
        plain = SamplingParams(max_tokens=6, ignore_eos=True)
        biased = SamplingParams(max_tokens=6, ignore_eos=True, logit_bias=((ord("z"), 100.0),))
        alone = eng.complete("hello", plain)[0]
        with ThreadPoolExecutor(2) as pool:  # decoded together in one batch
            a, b = pool.map(lambda p: eng.complete("hello", p)[0], [plain, biased])
        assert b == "zzzzzz" and a == alone != b
    finally:
        eng.close()
