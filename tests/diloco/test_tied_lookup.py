"""The tied embedding's lookup gradient added in place (``lowband.models.tied``): the same
gradient as autograd's dense sum, and no second and third (V, H) buffer in the backward pass."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from diloco.config import byte_llama
from lowband.models.llama import LlamaForCausalLM

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]


def _model(scale: bool = False) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = dataclasses.replace(
        byte_llama(64, 2, 2), vocab_size=300, tie_word_embeddings=True, scale_embeddings=scale
    )
    return LlamaForCausalLM(cfg)


def _loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(ids[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


@pytest.mark.parametrize("scale", [False, True])
@pytest.mark.parametrize("micro_batches", [1, 3])
def test_gradient_equals_autograds_dense_sum(scale: bool, micro_batches: int) -> None:
    model = _model(scale)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    ids = torch.randint(0, 300, (micro_batches * 2, 17), generator=torch.Generator().manual_seed(1))
    ids[:, 3] = ids[:, 5] = 7  # repeated tokens: several rows land on one
    for chunk in ids.chunk(micro_batches):
        _loss(model, chunk).backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    weight = model.model.embed_tokens.weight
    for chunk in ids.chunk(micro_batches):  # the plain path: F.embedding's dense gradient
        x = F.embedding(chunk[:, :-1], weight)
        if scale:
            x = x * torch.tensor(64**0.5).to(x.dtype)
        logits = model.head(model.forward_layers(x, cache=None, start=0))
        F.cross_entropy(logits.reshape(-1, 300), chunk[:, 1:].reshape(-1)).backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(got[n], p.grad, rtol=1e-5, atol=1e-6, msg=n)
    assert got["model.embed_tokens.weight"].abs().sum() > 0


def test_no_grad_and_frozen_weights_take_the_plain_lookup() -> None:
    model = _model()
    ids = torch.randint(0, 300, (2, 9))
    with torch.no_grad():
        a = model(ids)
    model.model.embed_tokens.weight.requires_grad_(False)
    torch.testing.assert_close(model(ids), a)


_PEAK = """
import dataclasses, json, resource, sys, torch
import torch.nn.functional as F
torch.set_num_threads(1)
from diloco.config import byte_llama
from diloco.device import limit_heap_retention
from lowband.models.llama import LlamaForCausalLM
limit_heap_retention()
cfg = dataclasses.replace(byte_llama(256, 1, 4), vocab_size=65536, tie_word_embeddings=True)
model = LlamaForCausalLM(cfg)
emb = model.model.embed_tokens.weight.numel()
ids = torch.randint(0, 65536, (1, 33))
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()
def hwm():  # this process's peak since the reset below (ru_maxrss keeps the parent's at fork)
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmHWM:"))
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
base = rss()
logits = model(ids[:, :-1])
F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)).backward()
peak = hwm()
print(json.dumps({"per_embedding_element": (peak - base) / emb}))
"""


def test_backward_holds_one_embedding_sized_gradient() -> None:
    """Peak resident bytes above the built model, per element of the (65536, 256) tied E,
    through one backward pass: the gradients (4, E is 94 % of the parameters) and the head's
    activations (5.7 measured). Autograd's dense lookup gradient and the sum of the two took
    13.5."""
    # A fresh interpreter with only what it needs from this one's environment (an earlier
    # test's settings must not move a process-wide figure).
    env = {k: os.environ[k] for k in ("PATH", "HOME") if k in os.environ}
    out = subprocess.run(
        [sys.executable, "-c", _PEAK],
        capture_output=True,
        text=True,
        timeout=100,
        check=True,
        env={**env, "PYTHONPATH": str(ROOT)},
        cwd=ROOT,
    )
    per = json.loads(out.stdout.strip().splitlines()[-1])["per_embedding_element"]
    assert 4.0 <= per <= 7.0, per
