"""The HTTP API with a real aiohttp client on 127.0.0.1: OpenAI shapes, SSE streaming, bad
requests (4xx with a JSON body, server keeps serving), 16 concurrent streams, cluster down."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest

from edge.engine import Engine, LocalRunner, Request
from edge.sampling import SamplingParams
from edge.server import ApiError, ServerConfig, start
from lowband.errors import CorruptWeights, LowbandError
from lowband.models.llama import LlamaForCausalLM, init_weights
from lowband.models.tokenizer import ByteTokenizer
from tests.conftest import tiny_llama

CFG = tiny_llama(max_position_embeddings=128)


def _engine() -> Engine:
    m = LlamaForCausalLM(CFG).eval()
    init_weights(m, std=0.3, seed=1)
    return Engine(LocalRunner(m), ByteTokenizer(), model_name="tiny")


async def _with_server(fn, engine=None, **cfg):
    engine = engine or _engine()
    runner, port = await start(engine, ServerConfig(host="127.0.0.1", port=0, **cfg))
    try:
        async with aiohttp.ClientSession(
            f"http://127.0.0.1:{port}", timeout=aiohttp.ClientTimeout(total=60)
        ) as s:
            return await fn(s, engine)
    finally:
        await runner.cleanup()


async def _sse(resp) -> list:
    events = []
    async for raw in resp.content:
        line = raw.decode().strip()
        if line.startswith("data: "):
            data = line[6:]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 120))


def test_completions_models_health_metrics() -> None:
    async def body(s, engine):
        r = await s.get("/v1/models")
        assert r.status == 200 and (await r.json())["data"][0]["id"] == "tiny"
        r = await s.get("/health")
        assert r.status == 200 and (await r.json())["healthy"] is True
        req = {"model": "tiny", "prompt": "Hi there", "max_tokens": 8, "temperature": 0}
        r = await s.post("/v1/completions", json=req)
        out = await r.json()
        assert r.status == 200, out
        expected, _, _ = engine.complete("Hi there", SamplingParams(max_tokens=8))
        assert out["choices"][0]["text"] == expected
        assert out["usage"] == {"prompt_tokens": 8, "completion_tokens": 8, "total_tokens": 16}
        # the same request streamed gives the same text, then [DONE]
        r = await s.post("/v1/completions", json={**req, "stream": True})
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
        ev = await _sse(r)
        assert ev[-1] == "[DONE]"
        assert "".join(e["choices"][0]["text"] for e in ev[:-1]) == expected
        assert ev[-2]["choices"][0]["finish_reason"] == "length"
        # chat, streamed
        r = await s.post(
            "/v1/chat/completions",
            json={
                "messages": [{"role": "user", "content": "hello"}],
                "max_tokens": 5,
                "temperature": 0.8,
                "seed": 3,
                "stream": True,
            },
        )
        ev = await _sse(r)
        assert ev[0]["object"] == "chat.completion.chunk"
        assert ev[0]["choices"][0]["delta"]["role"] == "assistant"
        r = await s.post(
            "/v1/chat/completions",
            json={
                "messages": [{"role": "user", "content": "hello"}],
                "max_tokens": 5,
                "temperature": 0.8,
                "seed": 3,
            },
        )
        chat = await r.json()
        assert chat["choices"][0]["message"]["content"] == "".join(
            e["choices"][0]["delta"].get("content") or ""
            for e in ev
            if isinstance(e, dict) and e["choices"]
        )
        m = await (await s.get("/metrics")).json()
        assert (
            m["requests_total"] == 5 and m["completion_tokens_total"] == 34
        )  # 4 via HTTP + 1 direct
        assert m["ttft_ms_mean"] > 0 and m["decode_tokens_per_s"] > 0

    run(_with_server(body))


@pytest.mark.parametrize(
    "payload,status,param",
    [
        (b"{not json", 400, None),
        (b"[1, 2]", 400, None),
        (json.dumps({"model": "gpt-9", "prompt": "x"}).encode(), 404, "model"),
        (json.dumps({"prompt": "x", "max_tokens": 0}).encode(), 400, "max_tokens"),
        (json.dumps({"prompt": "x", "max_tokens": -5}).encode(), 400, "max_tokens"),
        (json.dumps({"prompt": "x", "max_tokens": 10**9}).encode(), 400, "max_tokens"),
        (json.dumps({"prompt": "x" * 200, "max_tokens": 4}).encode(), 400, "max_tokens"),
        (json.dumps({"prompt": 12}).encode(), 400, "prompt"),
        (json.dumps({"prompt": [1, 999]}).encode(), 400, "prompt"),
        (json.dumps({"prompt": "x", "top_p": 0}).encode(), 400, "top_p"),
        (json.dumps({"prompt": "x", "stop": 5}).encode(), 400, "stop"),
    ],
)
def test_bad_requests_get_json_4xx_and_server_survives(payload, status, param) -> None:
    async def body(s, engine):
        r = await s.post(
            "/v1/completions", data=payload, headers={"Content-Type": "application/json"}
        )
        err = await r.json()
        assert r.status == status and "message" in err["error"]
        assert err["error"]["param"] == param
        ok = await s.post("/v1/completions", json={"prompt": "ok", "max_tokens": 2})
        assert ok.status == 200

    run(_with_server(body))


def test_bad_chat_and_unknown_route() -> None:
    async def body(s, engine):
        r = await s.post("/v1/chat/completions", json={"messages": "hi"})
        assert r.status == 400 and (await r.json())["error"]["param"] == "messages"
        r = await s.get("/v1/nothing")
        assert r.status == 404 and "error" in await r.json()

    run(_with_server(body))


def test_sixteen_concurrent_streams() -> None:
    async def body(s, engine):
        async def one(i):
            r = await s.post(
                "/v1/completions",
                json={"prompt": f"client {i}", "max_tokens": 6, "temperature": 0, "stream": True},
            )
            assert r.status == 200
            ev = await _sse(r)
            return "".join(e["choices"][0]["text"] for e in ev[:-1])

        texts = await asyncio.gather(*(one(i) for i in range(16)))
        for i, t in enumerate(texts):  # each stream got its own, correct completion
            assert t == engine.complete(f"client {i}", SamplingParams(max_tokens=6))[0]
        assert (await (await s.get("/health")).json())["queue"] == 0

    run(_with_server(body))


def test_queue_limit_answers_429() -> None:
    async def body(s, engine):
        async def one(i):
            r = await s.post("/v1/completions", json={"prompt": f"q{i}", "max_tokens": 40})
            return r.status

        statuses = await asyncio.gather(*(one(i) for i in range(12)))
        assert statuses.count(200) >= 2 and statuses.count(429) >= 1
        assert set(statuses) <= {200, 429}
        r = await s.post("/v1/completions", json={"prompt": "after", "max_tokens": 2})
        assert r.status == 200

    run(_with_server(body, max_queue=1))


class _DownRunner(LocalRunner):
    def health(self) -> dict:
        return {"healthy": False, "status": "degraded: worker lost"}


def test_cluster_down_is_503() -> None:
    m = LlamaForCausalLM(CFG).eval()
    engine = Engine(_DownRunner(m), ByteTokenizer(), model_name="tiny")

    async def body(s, engine):
        r = await s.get("/health")
        assert r.status == 503 and (await r.json())["healthy"] is False
        r = await s.post("/v1/completions", json={"prompt": "x", "stream": True})
        assert r.status == 503 and (await r.json())["error"]["code"] == "cluster_unavailable"

    run(_with_server(body, engine=engine))


class _DamagedEngine(Engine):
    def submit(self, ids, params, sink):  # the request fails at its first step
        req = Request(ids, params, sink)
        sink(CorruptWeights("block 3 of model.safetensors: checksum mismatch"))
        return req


def test_a_lowband_error_during_generation_is_500_with_its_message() -> None:
    """Any error of the lowband hierarchy is a server error the user can read, not a crash."""
    assert issubclass(ApiError, LowbandError)
    m = LlamaForCausalLM(CFG).eval()
    engine = _DamagedEngine(LocalRunner(m), ByteTokenizer(), model_name="tiny")

    async def body(s, engine):
        r = await s.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        err = (await r.json())["error"]
        assert r.status == 500 and err["type"] == "server_error"
        assert err["message"] == "block 3 of model.safetensors: checksum mismatch"
        assert (await s.get("/health")).status == 200

    run(_with_server(body, engine=engine))


def test_body_over_the_limit_is_413_json_and_server_survives() -> None:
    async def body(s, engine):
        big = {"prompt": "x" * 5000, "max_tokens": 1}
        r = await s.post("/v1/completions", json=big)
        out = await r.json()
        assert r.status == 413 and out["error"]["code"] == "request_too_large"
        r = await s.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
        assert r.status == 200

    run(_with_server(body, max_body_bytes=4096))


def test_huge_prompt_is_refused_before_tokenizing() -> None:
    class Counting(ByteTokenizer):
        calls = 0

        def encode(self, text):
            Counting.calls += 1
            return super().encode(text)

    m = LlamaForCausalLM(CFG).eval()
    init_weights(m, std=0.3, seed=1)
    engine = Engine(LocalRunner(m), Counting(), model_name="tiny")

    async def body(s, engine):
        # 3 MB of text against a 128-token context: 400 without a tokenizer call, and
        # /health answers while the body is parsed (off the event loop).
        r, h = await asyncio.gather(
            s.post("/v1/completions", json={"prompt": "a" * (3 << 20), "max_tokens": 1}),
            s.get("/health"),
        )
        out = await r.json()
        assert r.status == 400 and out["error"]["code"] == "context_length_exceeded"
        assert h.status == 200
        assert Counting.calls == 0
        r = await s.post("/v1/completions", json={"prompt": list(range(200)), "max_tokens": 1})
        assert r.status == 400 and (await r.json())["error"]["param"] == "prompt"

    run(_with_server(body, engine=engine, max_body_bytes=8 << 20))


class _SlowRunner(LocalRunner):
    """Sleeps ``delay`` seconds per batched step (so requests overlap) and records the largest
    batch it ran."""

    def __init__(self, model, delay: float) -> None:
        super().__init__(model)
        self.delay, self.widest = delay, 0

    def forward_batch(self, work, top=0):
        self.widest = max(self.widest, len(work))
        time.sleep(self.delay)
        return super().forward_batch(work, top)


def _slow_engine(delay: float, **kw) -> Engine:
    m = LlamaForCausalLM(CFG).eval()
    init_weights(m, std=0.3, seed=1)
    return Engine(_SlowRunner(m, delay), ByteTokenizer(), model_name="tiny", **kw)


async def _until(pred, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "timed out waiting"
        await asyncio.sleep(0.01)


def test_concurrent_greedy_requests_batch_and_equal_one_at_a_time() -> None:
    """Eight concurrent requests (mixed prompt lengths, streamed and not) through an engine of
    four slots: the batches hold several sequences and every text equals the same request sent
    alone."""
    engine = _slow_engine(0.005, parallel=4)
    prompts = [f"client {i}: " + "x" * (3 * i) for i in range(8)]

    async def body(s, engine):
        async def one(i: int, stream: bool) -> str:
            req = {"prompt": prompts[i], "max_tokens": 10, "temperature": 0, "stream": stream}
            r = await s.post("/v1/completions", json=req)
            assert r.status == 200
            if stream:
                return "".join(e["choices"][0]["text"] for e in (await _sse(r))[:-1])
            return (await r.json())["choices"][0]["text"]

        together = await asyncio.gather(*(one(i, i % 2 == 0) for i in range(8)))
        assert engine.runner.widest >= 2
        widest, engine.runner.widest = engine.runner.widest, 0
        alone = [await one(i, False) for i in range(8)]
        assert engine.runner.widest == 1 and widest > 1
        assert together == alone
        m = await (await s.get("/metrics")).json()
        assert m["requests_running"] == 0 and m["requests_waiting"] == 0

    run(_with_server(body, engine=engine))


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_disconnects_cancels_its_request(stream) -> None:
    engine = _slow_engine(0.02, parallel=2)

    async def body(s, engine):
        port = s._base_url.port
        req = {"prompt": "x", "max_tokens": 100, "temperature": 0, "stream": stream}
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as c:

            async def call() -> None:
                r = await c.post(f"http://127.0.0.1:{port}/v1/completions", json=req)
                await r.content.readline()  # the first chunk (streaming); else waits

            task = asyncio.ensure_future(call())
            await _until(lambda: engine.metrics.completion_tokens >= 3)
            if stream:
                await asyncio.wait_for(task, 30)  # read one chunk; leaving drops the connection
            else:
                task.cancel()
        await _until(lambda: engine.metrics.running == 0)
        done = engine.metrics.completion_tokens
        await asyncio.sleep(0.2)  # ten steps' time: nothing more is generated
        assert engine.metrics.completion_tokens == done < 100
        assert engine.metrics.cancelled == 1
        h = await (await s.get("/health")).json()
        assert h["queue"] == 0
        # the server still serves
        r = await s.post("/v1/completions", json={"prompt": "y", "max_tokens": 2})
        assert r.status == 200

    run(_with_server(body, engine=engine))


def test_max_queue_bounds_the_waiting_beyond_the_running() -> None:
    """Two running, one waiting (max_queue=1): a fourth request is 429 until one ends."""
    engine = _slow_engine(0.02, parallel=2)

    async def body(s, engine):
        req = {"prompt": "x", "max_tokens": 30, "temperature": 0}
        held = [asyncio.ensure_future(s.post("/v1/completions", json=req)) for _ in range(3)]
        await _until(lambda: engine.metrics.running == 2 and engine.metrics.waiting == 1)
        r = await s.post("/v1/completions", json=req)
        err = (await r.json())["error"]
        assert r.status == 429 and err["code"] == "queue_full" and err["type"] == "rate_limit_error"
        r = await s.post("/v1/completions", json={**req, "n": 4})  # can never fit
        assert r.status == 400 and (await r.json())["error"]["param"] == "n"
        assert [(await h).status for h in held] == [200, 200, 200]
        r = await s.post("/v1/completions", json={**req, "n": 3, "max_tokens": 2})
        assert r.status == 200 and len((await r.json())["choices"]) == 3

    run(_with_server(body, engine=engine, max_queue=1))
