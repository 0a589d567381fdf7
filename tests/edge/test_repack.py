"""K-quant weights repacked at load for the batch GEMM (``kernel.ggml_pack``): the same bits
as the blocks on every route, refused when the copy does not fit its weight, the compiled
decode step of a model takes them, and every device of a TP cluster repacks its slice."""

from __future__ import annotations

import copy
import threading
import time

import pytest
import torch
import transformers

from edge import fastpath
from edge.cluster import ClusterConfig
from edge.engine import Engine
from edge.launch import BatchConfig
from edge.quant import kernel
from edge.quant.linear import GGMLLinear, repack_for_batches
from edge.sampling import SamplingParams
from edge.shardio import LoadedShard
from edge.tp import make_plan
from lowband.errors import ConfigError
from lowband.models.tokenizer import ByteTokenizer
from tests.edge.test_family_devices import WIDE, two_devices, write_gguf_file
from tests.edge.test_fastpath_batch import _check_step, _model, _prefilled
from tests.edge.test_ggml_quant import weight
from tests.edge.test_gguf_models import _random

pytestmark = pytest.mark.timeout(600)  # the first test may build the C++ extension (minutes)

KQUANTS = ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"]


def _packable() -> None:
    if kernel.load() is None:
        pytest.skip(f"C++ kernels unavailable: {kernel.unavailable_reason()}")
    if kernel.ggml_pack(weight("Q4_K", 16, 256, seed=0, scale=0.02)) is None:
        pytest.skip("this build has no AVX-512 VNNI GEMM: nothing is repacked")


@pytest.mark.parametrize("name", KQUANTS)
def test_repacked_weights_give_the_same_bits(name) -> None:
    _packable()
    # 70 rows = 4 groups of 16 + 6 (a zero-padded last group); K = 5 super-blocks (a K tile
    # of 4 and a tail)
    w = weight(name, 70, 1280, seed=3, scale=0.02)
    packed = kernel.ggml_pack(w)
    assert packed is not None and packed.numel() == kernel.ggml_packed_bytes(w)
    assert packed.numel() > w.data.numel()  # memory for speed
    threads = torch.get_num_threads()
    gen = torch.Generator().manual_seed(1)
    try:
        for t in (1, 2):  # two threads split the rows on group bounds
            torch.set_num_threads(t)
            for m in (1, 2, 4, 5, 6, 16, 33):  # below and above the repacked path's start
                x = torch.randn(m, 1280, generator=gen)
                want = kernel.ggml_gemv(x, w)
                got = kernel.ggml_gemv(x, w, packed=packed)
                assert torch.equal(got, want), (name, t, m)
    finally:
        torch.set_num_threads(threads)


def test_a_repacked_copy_that_does_not_fit_its_weight_is_refused() -> None:
    _packable()
    w = weight("Q4_K", 70, 1280, seed=3, scale=0.02)
    packed = kernel.ggml_pack(w)
    assert packed is not None
    x = torch.randn(8, 1280)
    with pytest.raises(RuntimeError, match="packed must be"):
        kernel.ggml_gemv(x, w, packed=packed[:-1])
    other = weight("Q2_K", 70, 1280, seed=3, scale=0.02)  # same shape, a larger layout
    with pytest.raises(RuntimeError, match="packed must be"):
        kernel.ggml_gemv(x, other, packed=packed)
    q5_0 = weight("Q5_0", 70, 1280, seed=3, scale=0.02)  # no repacked path for Q5_0
    assert kernel.ggml_pack(q5_0) is None and kernel.ggml_packed_bytes(q5_0) == 0
    with pytest.raises(RuntimeError, match="no repacked path"):
        kernel.ggml_gemv(x, q5_0, packed=packed)


@pytest.mark.parametrize("kind", ["Q4_K", "Q4_K+Q6_K+Q5_0+Q2_K"])
def test_compiled_batch_step_on_repacked_weights(kind) -> None:
    _packable()
    plain = _model(kind)
    m = copy.deepcopy(plain)
    added = repack_for_batches(m, 1 << 40)
    lins = [x for x in m.modules() if isinstance(x, GGMLLinear)]
    assert added == sum(x.packed_bytes() for x in lins) > 0
    assert any(x.packed is None for x in lins) == (kind != "Q4_K")  # Q5_0 has no repacked path
    assert repack_for_batches(copy.deepcopy(plain), added - 1) == 0  # all or none
    for model in (plain, m):
        assert fastpath.install(model) is None, fastpath.unsupported_reason(model)
    lengths = [3, 11, 1, 30, 7, 18]  # 6 rows: the repacked route (from 5)
    caches = _prefilled(m, lengths)
    caches_plain = _prefilled(plain, lengths)
    gen = torch.Generator().manual_seed(7)
    for _ in range(2):
        x = torch.randn(len(lengths), 1, m.config.hidden_size, generator=gen)
        got = _check_step(m, caches, x)  # batch == one row at a time (blocks, not the copy)
        with torch.inference_mode():
            want = plain.fast_decode.layers_batch(x, caches_plain, [c.length for c in caches_plain])
        assert torch.equal(got, want)
    assert torch.equal(m.fast_decode.head(got), plain.fast_decode.head(want))


def test_serving_repacks_only_when_asked_or_batching() -> None:
    _packable()
    with pytest.raises(ConfigError):
        BatchConfig(repack="yes")
    with pytest.raises(ConfigError):
        ClusterConfig(devices=2, repack="always")
    for mode, parallel, expect in [
        ("auto", 1, False),
        ("auto", 4, True),
        ("off", 4, False),
        ("on", 1, True),
    ]:
        m = _model("Q4_K")
        fastpath.install(m)
        shard = LoadedShard(model=m, plan=make_plan(m.config, 1), rank=0)
        added = shard.repack(BatchConfig(repack=mode, parallel=parallel).repack_mode(m.config))
        assert (added > 0) == expect, (mode, parallel)
        lins = [x for x in m.modules() if isinstance(x, GGMLLinear)]
        assert all((x.packed is not None) == expect for x in lins)
        assert m.fast_decode is not None


@pytest.fixture(scope="module")
def q4k_file(tmp_path_factory):
    """A Llama of whole Q4_K blocks on both devices of a 2-way split."""
    cfg = transformers.LlamaConfig(**WIDE, num_hidden_layers=2, tie_word_embeddings=False)
    hf = _random(transformers.LlamaForCausalLM(cfg))
    return write_gguf_file(tmp_path_factory.mktemp("q4k") / "m.gguf", hf, "llama", quant="Q4_K")


def _queued(eng: Engine) -> int:
    m = eng.metrics.snapshot()
    return m["requests_waiting"] + m["requests_running"]


def _cluster_texts(path, repack: str, prompts: list[str]) -> list[str]:
    """Every prompt's greedy text from a 2-device cluster, all requests batched together."""
    with two_devices(path, repack=repack) as runner:
        eng = Engine(runner, ByteTokenizer(), model_name="m", parallel=len(prompts))
        params = SamplingParams(max_tokens=10)
        out: dict[int, str] = {}

        def complete(i: int) -> None:
            out[i] = eng.complete(prompts[i], params)[0]

        with runner._lock:  # every request queued before the first step: one batch
            ts = [threading.Thread(target=complete, args=(i,)) for i in range(len(prompts))]
            for t in ts:
                t.start()
            deadline = time.monotonic() + 20
            while _queued(eng) < len(prompts):
                assert time.monotonic() < deadline, "the requests were not queued"
                time.sleep(0.01)
        for t in ts:
            t.join(120)
        assert eng.metrics.snapshot()["batch_sequences_mean"] > 4  # the repacked route: >= 5 rows
        return [out[i] for i in range(len(prompts))]


def test_every_device_of_a_cluster_repacks_its_slice(q4k_file, monkeypatch) -> None:
    """``repack`` travels in the assign: master and worker each copy their slice, and the
    batched texts are those of the same cluster without the copies."""
    _packable()
    real = LoadedShard.repack
    calls: list[tuple[int, str, int]] = []

    def spy(self, mode):
        added = real(self, mode)
        calls.append((self.rank, mode, added))
        return added

    monkeypatch.setattr(LoadedShard, "repack", spy)
    prompts = ["The quick brown fox", "Once upon a time", "Hello", "abc def", "xyz", "0123456"]
    plain = _cluster_texts(q4k_file, "off", prompts)
    assert sorted(r for r, _, _ in calls) == [0, 1] and all(a == 0 for _, _, a in calls)
    calls.clear()
    assert _cluster_texts(q4k_file, "on", prompts) == plain
    assert sorted(r for r, _, _ in calls) == [0, 1]
    assert all(mode == "on" and added > 0 for _, mode, added in calls), calls
    assert len(set(plain)) > 1, plain
