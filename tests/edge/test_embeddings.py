"""``/v1/embeddings`` over HTTP against a tiny random model: every pooling equals an eager
PyTorch computation (the whole input in one plain forward, the final norm, the pooling, L2),
whatever the batching and chunking; every input shape and both encodings; bad inputs are JSON
400s (413 for too long) naming the field; the official client; generation goes on beside it."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest
import torch

from edge.embeddings import EmbeddingConfig, batches, decode_base64, embed_ragged
from edge.engine import Engine, EngineError, LocalRunner
from edge.sampling import SamplingParams
from edge.server import ServerConfig, start
from lowband.errors import ConfigError
from lowband.models.llama import LlamaForCausalLM, init_weights
from lowband.models.tokenizer import ByteTokenizer
from tests.conftest import tiny_llama
from tests.edge.test_openai_api import post, run

CFG = tiny_llama(max_position_embeddings=128)
H = CFG.hidden_size
TEXTS = ["hello", "a longer input of several words", "x", "the quick brown fox jumps"]


def _model() -> LlamaForCausalLM:
    m = LlamaForCausalLM(CFG).eval()
    init_weights(m, std=0.3, seed=1)
    return m


def _engine(**kw) -> Engine:
    return Engine(LocalRunner(_model()), ByteTokenizer(), model_name="tiny", **kw)


def eager(ids: list[int], pooling: str) -> torch.Tensor:
    """The reference: one plain forward of the whole input (no cache, no batching)."""
    m = _model()
    with torch.inference_mode():
        h = m.model.norm(m.forward_layers(m.embed(torch.tensor([ids])), cache=None, start=0))[0]
    v = {"mean": h.mean(0), "last": h[-1], "cls": h[0]}[pooling].float()
    return v / v.norm()


def _ids(text: str) -> list[int]:
    return ByteTokenizer().encode(text)


@pytest.mark.parametrize("pooling", ["mean", "last", "cls"])
@pytest.mark.parametrize("batch_tokens", [512, 7])
def test_pooling_matches_eager_pytorch(pooling: str, batch_tokens: int) -> None:
    """batch_tokens 7: inputs split over several engine calls and the long ones chunked."""
    cfg = EmbeddingConfig(pooling=pooling, batch_tokens=batch_tokens)

    async def body(s, engine):
        return await post(s, "/v1/embeddings", {"model": "tiny", "input": TEXTS})

    out = run(body, _engine(), embeddings=cfg)
    assert [d["index"] for d in out["data"]] == [0, 1, 2, 3]
    assert out["usage"]["prompt_tokens"] == sum(len(_ids(t)) for t in TEXTS)
    for text, d in zip(TEXTS, out["data"]):
        got = torch.tensor(d["embedding"])
        assert got.shape == (H,) and got.norm() == pytest.approx(1.0, abs=1e-5)
        torch.testing.assert_close(got, eager(_ids(text), pooling), atol=2e-5, rtol=1e-4)
    if pooling == "mean":  # distinct inputs, distinct vectors
        v = torch.tensor([d["embedding"] for d in out["data"]])
        assert (v @ v.T - torch.eye(4)).abs().max() < 0.9999


def test_embed_ragged_equals_one_at_a_time() -> None:
    m = _model()
    seqs = [_ids(t) for t in TEXTS]
    together = embed_ragged(m, seqs, "mean", chunk=5)
    alone = torch.stack([embed_ragged(m, [s], "mean", chunk=512)[0] for s in seqs])
    torch.testing.assert_close(together, alone, atol=2e-5, rtol=1e-4)


def test_every_input_shape_and_base64() -> None:
    ids = _ids("hello")

    async def body(s, engine):
        one = await post(s, "/v1/embeddings", {"input": "hello"})
        by_ids = await post(s, "/v1/embeddings", {"input": ids})
        lists = await post(s, "/v1/embeddings", {"input": [ids, _ids("x")]})
        b64 = await post(
            s, "/v1/embeddings", {"input": ["hello"], "encoding_format": "base64", "dimensions": H}
        )
        return one, by_ids, lists, b64

    one, by_ids, lists, b64 = run(body)
    ref = one["data"][0]["embedding"]
    assert one["object"] == "list" and one["model"] == "tiny"
    assert one["data"][0]["object"] == "embedding"
    assert by_ids["data"][0]["embedding"] == ref
    assert len(lists["data"]) == 2 and lists["data"][0]["embedding"] == ref
    assert lists["usage"] == {"prompt_tokens": len(ids) + 1, "total_tokens": len(ids) + 1}
    v = decode_base64(b64["data"][0]["embedding"])
    assert v.dtype == np.float32 and np.array_equal(v, np.asarray(ref, dtype=np.float32))


BAD = [
    ({"input": ""}, 400, "input"),
    ({"input": []}, 400, "input"),
    ({"input": [[]]}, 400, "input"),
    ({"input": ["a", 3]}, 400, "input"),
    ({"input": [["a"]]}, 400, "input"),
    ({"input": {"text": "a"}}, 400, "input"),
    ({"input": None}, 400, "input"),
    ({"input": [True]}, 400, "input"),
    ({"input": [300]}, 400, "input"),  # beyond the byte vocabulary
    ({"input": [-1]}, 400, "input"),
    ({"input": ["a"] * 5}, 400, "input"),  # max_inputs 4 below
    ({"input": [1] * 129}, 413, "input"),  # beyond the context of 128
    ({"input": "y" * 129}, 413, "input"),
    ({"input": ["y" * 100, "y" * 100]}, 413, "input"),  # max_tokens 150 below
    ({"input": "a", "dimensions": 8}, 400, "dimensions"),
    ({"input": "a", "dimensions": True}, 400, "dimensions"),
    ({"input": "a", "encoding_format": "int8"}, 400, "encoding_format"),
    ({"input": "a", "embd_normalize": 0}, 400, "embd_normalize"),
    ({"input": "a", "temperature": 0.5}, 400, "temperature"),
    ({"input": "a", "messages": []}, 400, "messages"),
]


def test_bad_inputs_are_json_errors_naming_the_field() -> None:
    cfg = EmbeddingConfig(max_inputs=4, max_tokens=150)

    async def body(s, engine):
        out = []
        for req, status, param in BAD:
            r = await s.post("/v1/embeddings", json=req)
            err = (await r.json())["error"]
            out.append((req, r.status, err["param"], status, param))
        ok = await s.post("/v1/embeddings", json={"input": "a", "embd_normalize": 2, "user": "u"})
        missing = await s.post("/v1/embeddings", json={"input": "a", "model": "other"})
        return out, ok.status, missing.status

    out, ok, missing = run(body, embeddings=cfg)
    for req, got, got_param, status, param in out:
        assert (got, got_param) == (status, param), req
    assert ok == 200 and missing == 404


def test_config_is_checked() -> None:
    with pytest.raises(ConfigError):
        EmbeddingConfig(pooling="max")
    with pytest.raises(ConfigError):
        EmbeddingConfig(batch_tokens=0)
    assert batches([3, 3, 9, 1, 1], 6) == [[0, 1], [2], [3, 4]]


def test_generation_goes_on_beside_embeddings() -> None:
    """Embedding calls run between decode steps: a streaming completion and several embedding
    requests at once all finish, and the completion is the one it is alone."""
    alone = _engine().complete("Hello", SamplingParams(max_tokens=24))[0]

    async def body(s, engine):
        comp = asyncio.create_task(
            post(s, "/v1/completions", {"prompt": "Hello", "max_tokens": 24, "temperature": 0})
        )
        embs = [post(s, "/v1/embeddings", {"input": TEXTS}) for _ in range(3)]
        outs = await asyncio.gather(*embs)
        return (await comp)["choices"][0]["text"], outs

    text, outs = run(body, _engine(parallel=2), embeddings=EmbeddingConfig(batch_tokens=8))
    assert text == alone
    assert outs[0]["data"] == outs[1]["data"] == outs[2]["data"]


def test_the_openai_client_embeds() -> None:
    openai = pytest.importorskip("openai")
    engine = _engine()
    ready = threading.Event()
    box: dict = {}

    def serve() -> None:
        async def main():
            runner, port = await start(engine, ServerConfig(host="127.0.0.1", port=0))
            box["port"], box["loop"], box["stop"] = (
                port,
                asyncio.get_running_loop(),
                asyncio.Event(),
            )
            ready.set()
            try:
                await box["stop"].wait()
            finally:
                await runner.cleanup()

        asyncio.run(main())

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    assert ready.wait(30)
    try:
        client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{box['port']}/v1", api_key="none", timeout=60, max_retries=0
        )
        res = client.embeddings.create(model="tiny", input=TEXTS[:2])  # base64 on the wire
        as_float = client.embeddings.create(model="tiny", input="hello", encoding_format="float")
        assert len(res.data) == 2 and len(res.data[0].embedding) == H
        np.testing.assert_allclose(res.data[0].embedding, as_float.data[0].embedding, atol=2e-6)
        np.testing.assert_allclose(
            res.data[1].embedding, eager(_ids(TEXTS[1]), "mean").tolist(), atol=2e-5
        )
        assert res.usage.prompt_tokens == len(_ids(TEXTS[0])) + len(_ids(TEXTS[1]))
        with pytest.raises(openai.BadRequestError):
            client.embeddings.create(model="tiny", input="x", dimensions=3)
    finally:
        box["loop"].call_soon_threadsafe(box["stop"].set)
        t.join(30)
        assert not t.is_alive()


class _NoEmbed(LocalRunner):
    """A runner without embeddings (a runner of another kind than this package's)."""

    embed = None  # type: ignore[assignment]


def test_a_runner_without_embeddings_answers_501() -> None:
    async def body(s, engine):
        r = await s.post("/v1/embeddings", json={"input": "a"})
        return r.status, (await r.json())["error"]

    status, err = run(body, Engine(_NoEmbed(_model()), ByteTokenizer(), model_name="tiny"))
    assert status == 501 and err["code"] == "embeddings_unsupported"


def test_engine_calls_fail_once_the_engine_is_closed() -> None:
    engine = _engine()
    assert engine.call(lambda: 7).result(30) == 7
    engine.close()
    with pytest.raises(EngineError):
        engine.call(lambda: 8)
