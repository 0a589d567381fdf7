"""The published Gemma 3 270M Q4_K_M file decodes through the compiled step, token for token
as the eager path does."""

from __future__ import annotations

import pytest
import torch

from edge import fastpath
from edge.shardio import load_shard
from lowband.models.llama import LlamaForCausalLM

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def _greedy(m: LlamaForCausalLM, prompt: list[int], n: int, compiled: bool) -> list[int]:
    """The prompt through the eager layers in both arms (one cache, the same bits), then ``n``
    greedy decode steps through the compiled step or the eager layers: the steps compared."""
    fastpath.uninstall(m)
    cache, out = m.new_cache(), []
    with torch.inference_mode():
        logits = m(torch.tensor([prompt]), cache=cache)[0, -1]
        if compiled:
            assert fastpath.install(m) is None
        for _ in range(n):
            out.append(int(logits.argmax()))
            logits = m(torch.tensor([[out[-1]]]), cache=cache)[0, -1]
    return out


def test_real_gemma3_greedy_equals_eager(real_gemma3) -> None:
    m = load_shard(str(real_gemma3)).model
    assert fastpath.unsupported_reason(m) is None
    assert fastpath.active(m), "the loader installs the compiled step on Gemma 3"
    prompts = [[2, 818, 5279, 529, 7001, 563], [2, 1509, 496, 1535, 3925, 236764, 1070]]
    fast = [_greedy(m, p, 24, compiled=True) for p in prompts]
    eager = [_greedy(m, p, 24, compiled=False) for p in prompts]
    assert fast == eager
    assert len(set(fast[0])) > 3  # a real continuation, not one token repeated


def test_real_gemma3_temperature_zero_repeats_with_the_prefix_cache(real_gemma3) -> None:
    """The same request at temperature 0, first computed whole, then from the prefix cache,
    then beside another stream's prompt chunk and decodes: the same tokens and log-probabilities
    each time (every row of a step computes as its token alone)."""
    from edge.engine import Engine, LocalRunner
    from edge.formats.gguf_tokenizer import tokenizer_from_gguf
    from edge.sampling import SamplingParams

    m = load_shard(str(real_gemma3)).model
    eng = Engine(LocalRunner(m), tokenizer_from_gguf(real_gemma3), model_name="g", parallel=4)
    prompt = "The history of the city of Rome begins with a small settlement on the Tiber, where"
    params = SamplingParams(max_tokens=24, temperature=0.0, logprobs=2)

    def run() -> list[tuple]:
        return [(e.token, e.logprob, e.top_logprobs) for e in eng.generate(prompt, params)]

    first = run()
    other = eng.generate(
        "A recipe for bread: mix flour, water, salt and", SamplingParams(max_tokens=60)
    )
    next(other)  # a second stream decoding while the same request runs again
    again = run()
    other.close()
    third = run()
    assert eng.metrics.snapshot()["prefix_cache_hits_total"] >= 2
    assert first == again == third
    assert len({t for t, _, _ in first if t is not None}) > 3
