"""``/v1/embeddings`` on a cluster: the tensor-parallel layout (every rank runs its shard of
each pass, no logits; within 2e-6 of one device, the all-reduces' order of addition) and the
pipeline layout (each pass through every stage, the last stage's hidden state back to the
master; bit for bit one device's) give one device's vectors, over HTTP too; the throw-away
caches are dropped and generation after it is one device's."""

from __future__ import annotations

import pytest
import torch

from edge.cluster.pipeline import PipelineRunner
from edge.cluster.protocol import MAX_SEQS
from edge.embeddings import EmbeddingConfig
from edge.engine import Engine, LocalRunner
from edge.sampling import SamplingParams
from edge.shardio import load_shard
from lowband.models.tokenizer import ByteTokenizer
from tests.edge.test_edge_cluster import CFG, _start_cluster
from tests.edge.test_openai_api import post, run
from tests.edge.test_pipeline import _start as _start_pipeline
from tests.edge.test_pipeline import _stop, write_ckpt
from transport.loopback import LoopbackGroup

pytestmark = pytest.mark.timeout(180)

TEXTS = ["hello", "a longer input of several words, chunked", "x", "the quick brown fox"]
SEQS = [list(t.encode()) for t in TEXTS]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_ckpt(tmp_path_factory.mktemp("emb"), 4, 7)


def _one_device(ckpt, pooling: str, chunk: int) -> torch.Tensor:
    runner = LocalRunner(load_shard(ckpt).model)
    return runner.embed(SEQS, pooling, chunk)


def _check(runner, ckpt, exact: bool) -> None:
    """Every pooling, whole passes and chunked ones (chunk 7: several passes, long inputs
    split), equal to one device's; no throw-away cache left on the master."""
    for pooling in ("mean", "last", "cls"):
        for chunk in (512, 7):
            got = runner.embed(SEQS, pooling, chunk)
            want = _one_device(ckpt, pooling, chunk)
            assert got.shape == want.shape == (len(SEQS), CFG["hidden_size"])
            if exact:
                assert torch.equal(got, want), (pooling, chunk)
            else:  # the all-reduces sum the shards' partial products in another order
                torch.testing.assert_close(got, want, rtol=0, atol=2e-6)
    assert not any(c >= MAX_SEQS - len(SEQS) for c in runner._kv)


def _http_and_generation(runner, ckpt) -> None:
    """Over HTTP the cluster's vectors are one device's; a completion after it as well."""
    cfg = EmbeddingConfig(pooling="mean", batch_tokens=7)
    greedy = SamplingParams(max_tokens=8)

    async def body(s, engine):
        return await post(s, "/v1/embeddings", {"model": "m", "input": TEXTS})

    eng = Engine(runner, ByteTokenizer(), model_name="m")
    out = run(body, eng, embeddings=cfg)
    want = _one_device(ckpt, "mean", 7)
    got = torch.tensor([d["embedding"] for d in out["data"]])
    torch.testing.assert_close(got, want, rtol=0, atol=2e-6)
    local = Engine(LocalRunner(load_shard(ckpt).model), ByteTokenizer(), model_name="m")
    try:
        assert eng.complete("Hello", greedy)[0] == local.complete("Hello", greedy)[0]
    finally:
        local.close()
        eng.close()


@pytest.mark.parametrize("link", ["direct", "comm"])
def test_tensor_parallel_embeddings_equal_one_device(ckpt, link) -> None:
    runner, workers = _start_cluster(ckpt, 2, LoopbackGroup(2, timeout=20), link=link)
    try:
        _check(runner, ckpt, exact=False)
        _http_and_generation(runner, ckpt)
    finally:
        _stop(runner, workers)


@pytest.mark.parametrize("world", [2, 3])
def test_pipeline_embeddings_equal_one_device(ckpt, world) -> None:
    runner, workers = _start_pipeline(ckpt, world)
    try:
        assert isinstance(runner, PipelineRunner)
        _check(runner, ckpt, exact=True)
        _http_and_generation(runner, ckpt)
    finally:
        _stop(runner, workers)
