"""The compiled single-token decode step (edge.fastpath) against the eager PyTorch path."""

from __future__ import annotations

import copy
import threading

import pytest
import torch

from edge import fastpath
from edge.formats.quantized_checkpoint import fuse_quant_rows
from edge.quant import kernel as qkernel
from edge.quant import quantize_modules
from edge.shardio import load_shard
from edge.tp import make_plan, make_reduce, shard
from lowband.errors import PeerLost, ProtocolError, TransportTimeout
from lowband.models.config import ModelConfig
from lowband.models.llama import (
    LlamaForCausalLM,
    fuse_projections,
    init_weights,
    unfuse_projections,
)
from lowband.models.weights import save_pretrained
from tests.conftest import run_ranks, tp_head
from transport.starlink import StarHub, StarSpoke

BASE = dict(
    vocab_size=97,
    hidden_size=128,
    intermediate_size=192,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)


def _model(bits=None, fuse=True, **over) -> LlamaForCausalLM:
    m = LlamaForCausalLM(ModelConfig(**{**BASE, **over})).eval()
    init_weights(m, seed=3)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if n.endswith("bias"):
                p.normal_(0, 0.1)
            elif ".q_norm." in n or ".k_norm." in n:  # Qwen3: per-head norms that matter
                p.normal_(1, 0.3)
    if bits:
        quantize_modules(m, bits=bits, group=32)
    if fuse:
        fuse_projections(m, fuse_quant_rows)
    return m


def _tol(bits) -> float:
    """Same weights and the same packed kernels on both paths; only the order of fp32 sums
    differs. For packed layers that difference can flip the rounding of one int8-quantized
    activation (the kernels quantize x per group), which moves a logit by ~1e-3."""
    return 1e-4 if bits is None else 1e-2


def _decode(m: LlamaForCausalLM, ids: torch.Tensor, prefill: int) -> torch.Tensor:
    """Prefill ``prefill`` tokens, then one token at a time; logits of every decoded step."""
    cache, out = m.new_cache(), []
    with torch.inference_mode():
        m(ids[:, :prefill], cache=cache)
        for t in range(prefill, ids.shape[1]):
            out.append(m(ids[:, t : t + 1], cache=cache)[0, -1])
    assert cache.length == ids.shape[1]
    return torch.stack(out)


@pytest.mark.parametrize("bits", [None, 8, 4], ids=["fp32", "q8", "q4"])
@pytest.mark.parametrize(
    "over",
    [
        {},
        {"sliding_window": 5, "model_type": "qwen2", "attention_bias": True},
        {"num_key_value_heads": 4},
        {"tie_word_embeddings": True},
        {"model_type": "qwen3", "qk_norm": True, "head_dim": 48},
    ],
    ids=["llama", "window+bias", "mha", "tied", "qwen3"],
)
@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "unfused"])
def test_compiled_step_matches_eager(bits, over, fuse) -> None:
    m = _model(bits, fuse, **over)
    ids = torch.randint(0, 97, (1, 20), generator=torch.Generator().manual_seed(1))
    ref = _decode(m, ids, 6)
    assert fastpath.install(m) is None
    assert fastpath.active(m)
    got = _decode(m, ids, 6)
    assert (got - ref).abs().max().item() <= _tol(bits) * max(1.0, ref.abs().max().item())
    if bits is None:
        assert torch.equal(got.argmax(-1), ref.argmax(-1))


def test_qwen3_qk_norm_matters_and_runs_under_tp() -> None:
    """The compiled step applies Qwen3's per-head q/k norms: without them it would not match
    (the parity case above could fail), and on a 2-way TP split (heads on both ranks, the
    (D,) weights replicated) it gives the unsplit model's logits."""
    over = {"model_type": "qwen3", "qk_norm": True, "head_dim": 48}
    full = _model(fuse=False, **over)
    ids = torch.randint(0, 97, (1, 16), generator=torch.Generator().manual_seed(6))
    ref = _decode(full, ids, 5)
    plain = copy.deepcopy(full)
    for layer in plain.model.layers:
        layer.self_attn.qk_norm = False
    assert (_decode(plain, ids, 5) - ref).abs().max().item() > 1e-2
    world = 2
    plan = make_plan(full.config, world)
    links = _star(world)
    x_all = full.embed(ids).detach()

    def rank_fn(r: int):
        def body():
            reduce = make_reduce(links[r], timeout=20)
            m = shard(copy.deepcopy(full), plan, r, world, reduce)
            fuse_projections(m)
            assert fastpath.install(m) is None
            cache, outs = m.new_cache(), []
            with torch.inference_mode():
                h = m.forward_layers(x_all[:, :5], cache=cache, start=0)
                for t in range(5, ids.shape[1]):
                    h = m.forward_layers(x_all[:, t : t + 1], cache=cache, start=t)
                    out = tp_head(m, plan, r, h, reduce)
                    if r == 0:
                        outs.append(out[0, -1])
            return torch.stack(outs) if outs else None

        return body

    try:
        got = run_ranks([rank_fn(r) for r in range(world)], timeout=60)[0]
    finally:
        for link in links:
            link.close()
    assert (got - ref).abs().max().item() <= _tol(None) * max(1.0, ref.abs().max().item())


def test_cache_growth_and_mixed_prefill() -> None:
    """Decode past the cache's first capacity (reallocation under the compiled step), then a
    multi-token chunk on the eager path reads what the compiled step wrote, and back."""
    m = _model(8)
    ids = torch.randint(0, 97, (1, 150), generator=torch.Generator().manual_seed(2))

    def run(fast: bool) -> torch.Tensor:
        (fastpath.install if fast else fastpath.uninstall)(m)
        cache, out = m.new_cache(), []
        with torch.inference_mode():
            m(ids[:, :2], cache=cache)
            for t in range(2, 100):  # capacity 64 -> 128 mid-way
                out.append(m(ids[:, t : t + 1], cache=cache)[0, -1])
            out.extend(m(ids[:, 100:130], cache=cache)[0])  # eager chunk after compiled steps
            for t in range(130, 150):  # 128 -> 256
                out.append(m(ids[:, t : t + 1], cache=cache)[0, -1])
        return torch.stack(out)

    ref, got = run(False), run(True)
    assert (got - ref).abs().max().item() <= _tol(8) * max(1.0, ref.abs().max().item())


def test_eager_fallback_reasons() -> None:
    half = _model().to(torch.bfloat16)
    assert "float32" in fastpath.install(half) and not fastpath.active(half)
    m = _model()
    assert fastpath.install(m) is None
    unfuse_projections(m)  # re-slicing drops the compiled step that read the fused weights
    assert not fastpath.active(m)
    try:
        qkernel.configure(enabled=False)
        assert "unavailable" in fastpath.install(m)
        ids = torch.randint(0, 97, (1, 8), generator=torch.Generator().manual_seed(3))
        assert _decode(m, ids, 4).shape == (4, 97)  # the eager path keeps serving
    finally:
        qkernel.configure(enabled=True)


def test_bad_inputs_are_refused() -> None:
    m = _model()
    assert fastpath.install(m) is None
    fast = m.fast_decode
    cache = m.new_cache()
    with pytest.raises(RuntimeError, match="hidden_size"):
        fast.layers(torch.zeros(1, 1, 64), cache, 0)
    x = torch.zeros(1, 1, 128)
    fast.layers(x, cache, 0)
    fast._dec.set_cache(cache.k, cache.v)
    with pytest.raises(RuntimeError, match="cannot hold position"):
        fast._dec.layers(x, cache.capacity(), None)
    with pytest.raises(RuntimeError, match="one K and one V"):
        fast._dec.set_cache(cache.k[:1], cache.v[:1])


def test_load_shard_installs_it(tmp_path) -> None:
    m = _model(fuse=False)
    save_pretrained(m, tmp_path / "m")
    shard = load_shard(tmp_path / "m")
    assert fastpath.active(shard.model)
    assert not fastpath.active(load_shard(tmp_path / "m", fast=False).model)
    ids = torch.randint(0, 97, (1, 12), generator=torch.Generator().manual_seed(4))
    eager = load_shard(tmp_path / "m", fast=False).model
    assert torch.allclose(_decode(shard.model, ids, 4), _decode(eager, ids, 4), atol=1e-4)


# ---- the star link driven natively -------------------------------------------------------------
def _star(world: int, spin_s: float = 0.0):
    hub = StarHub("127.0.0.1", spin_s=spin_s)
    spokes: list = [None] * world

    def connect(slot: int) -> None:
        spokes[slot] = StarSpoke(
            "127.0.0.1", hub.port, slot, 10.0, secret=hub.secret, spin_s=spin_s
        )

    threads = [threading.Thread(target=connect, args=(s,)) for s in range(1, world)]
    for t in threads:
        t.start()
    for s in range(1, world):
        hub.accept(s, timeout=10)
    for t in threads:
        t.join(10)
    return [hub, *spokes[1:]]


@pytest.mark.parametrize(
    "native",
    [(True, True), (True, False), (False, True)],
    ids=["both-native", "master-native", "worker-native"],
)
def test_native_star_link_matches_single_device(native) -> None:
    """TP over a real star link with the compiled step on either or both ends (the wire bytes are
    the same, so a native end talks to a Python end); logits equal a single device's."""
    full = _model(bits=8, fuse=False)
    world = 3
    ids = torch.randint(0, 97, (1, 14), generator=torch.Generator().manual_seed(5))
    ref = _decode(full, ids, 6)
    links = _star(world)
    plan = make_plan(full.config, world, None, ffn_unit=32)
    x_all = full.embed(ids).detach()

    def rank_fn(r: int):
        def body():
            reduce = make_reduce(links[r], timeout=20)
            m = shard(copy.deepcopy(full), plan, r, world, reduce)
            fuse_projections(m, fuse_quant_rows)
            if native[min(r, 1)]:
                assert fastpath.install(m) is None and m.fast_decode.link is links[r]
            cache, outs = m.new_cache(), []
            with torch.inference_mode():
                h = m.forward_layers(x_all[:, :6], cache=cache, start=0)
                for t in range(6, ids.shape[1]):
                    h = m.forward_layers(x_all[:, t : t + 1], cache=cache, start=t)
                    # the vocabulary-parallel head's gather runs on the same link, from Python,
                    # between natively driven steps (top=0: every logit, exact)
                    out = tp_head(m, plan, r, h, reduce)
                    if r == 0:
                        outs.append(out[0, -1])
            return torch.stack(outs) if outs else None

        return body

    try:
        got = run_ranks([rank_fn(r) for r in range(world)], timeout=60)[0]
        # Each decode step: 2 all-reduces per layer of one (1, 1, H) float32 activation, then
        # one gather of the logits (V float32).
        H, L, V = full.config.hidden_size, full.config.num_hidden_layers, full.config.vocab_size
        per_step = 2 * L * 4 * H
        steps = ids.shape[1] - 6
        assert links[1].stats().bytes_sent == per_step * ids.shape[1] + steps * 4 * V
        assert links[0]._seq == links[1]._seq == links[2]._seq == (2 * L + 1) * steps + 2 * L
    finally:
        for link in links:
            link.close()
    assert (got - ref).abs().max().item() <= _tol(8) * max(1.0, ref.abs().max().item())


def test_native_link_failures_raise_transport_errors() -> None:
    full = _model()
    plan = make_plan(full.config, 2, None)
    links = _star(2)
    try:
        m = shard(copy.deepcopy(full), plan, 0, 2, make_reduce(links[0], timeout=0.5))
        fuse_projections(m)
        assert fastpath.install(m) is None
        x = torch.randn(1, 1, 128)
        with pytest.raises(TransportTimeout):  # the worker never answers
            m.forward_layers(x, cache=m.new_cache(), start=0)
        links[1].close()  # the worker's end goes away
        m2 = shard(copy.deepcopy(full), plan, 0, 2, make_reduce(links[0], timeout=5))
        fuse_projections(m2)
        assert fastpath.install(m2) is None
        with pytest.raises((PeerLost, ProtocolError)):
            m2.forward_layers(x, cache=m2.new_cache(), start=0)
    finally:
        for link in links:
            link.close()


def test_windowed_cache_stops_growing_under_the_compiled_step() -> None:
    m = _model(8, sliding_window=6)
    ids = torch.randint(0, 97, (1, 200), generator=torch.Generator().manual_seed(6))
    ref = _decode(m, ids, 4)
    assert fastpath.install(m) is None
    cache, out = m.new_cache(), []
    with torch.inference_mode():
        m(ids[:, :4], cache=cache)
        for t in range(4, 200):
            out.append(m(ids[:, t : t + 1], cache=cache)[0, -1])
    assert cache.capacity() == 64 and cache.base > 100
    got = torch.stack(out)
    assert (got - ref).abs().max().item() <= _tol(8) * max(1.0, ref.abs().max().item())


def test_engine_restarts_from_zero_when_the_window_dropped_the_prefix() -> None:
    """A chat turn that shares only an early prefix with the previous request cannot reuse a
    sliding-window cache that dropped those keys: the engine prefills from 0 and the answer is
    the one a fresh engine gives."""
    from edge.engine import Engine, LocalRunner
    from edge.sampling import SamplingParams
    from lowband.models.tokenizer import ByteTokenizer

    def engine() -> Engine:
        m = _model(8, vocab_size=256, sliding_window=6, max_position_embeddings=512)
        assert fastpath.install(m) is None
        return Engine(LocalRunner(m), ByteTokenizer(), model_name="t")

    params = SamplingParams(max_tokens=150)
    e = engine()
    e.complete("the first request, " * 3, params)  # ~207 positions: keys before ~140 dropped
    assert e.runner.restart_floor() > 100
    second = "the first request, and now another"  # shares 19 tokens with the first
    got = e.complete(second, SamplingParams(max_tokens=20))
    assert got == engine().complete(second, SamplingParams(max_tokens=20))


def test_split_directory_compiles_unless_a_window_streams_it(tmp_path) -> None:
    """A split directory's blocks are mapped, not copied: fully resident they decode through
    the compiled step (same logits as eager); with a real window the layer hooks manage
    residency, so the eager path stays."""
    from edge.shardio import WindowConfig, split_checkpoint

    m = _model(fuse=False, num_hidden_layers=3)
    save_pretrained(m, tmp_path / "m")
    split_checkpoint(tmp_path / "m", tmp_path / "s", 1)
    resident = load_shard(tmp_path / "s")
    windowed = load_shard(tmp_path / "s", window=WindowConfig(window=1))
    try:
        assert fastpath.active(resident.model) and not fastpath.active(windowed.model)
        ids = torch.randint(0, 97, (1, 12), generator=torch.Generator().manual_seed(8))
        ref = _decode(windowed.model, ids, 4)
        got = _decode(resident.model, ids, 4)
        assert (got - ref).abs().max().item() <= 1e-4 * max(1.0, ref.abs().max().item())
    finally:
        resident.close()
        windowed.close()
