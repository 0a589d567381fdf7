"""The OpenAI API fields clients and evaluators rely on, over HTTP against a tiny random model:
logprobs (completions and chat), echo with prompt logprobs as lm-evaluation-harness scores
with, n choices with seeds, stop strings across tokens, ignore_eos, include_usage, the JSON 400
for every bad field, /metrics in Prometheus text, vLLM's tokenizer endpoints, and the official
``openai`` client when it is installed."""

from __future__ import annotations

import asyncio
import json
import math
import re
import threading

import aiohttp
import pytest
import torch

from edge.engine import Engine, LocalRunner
from edge.sampling import SamplingParams
from edge.server import ServerConfig, prometheus_text, start
from lowband.models.llama import LlamaForCausalLM, init_weights
from lowband.models.tokenizer import ByteTokenizer
from tests.conftest import tiny_llama

CFG = tiny_llama(max_position_embeddings=128)


def _model() -> LlamaForCausalLM:
    m = LlamaForCausalLM(CFG).eval()
    init_weights(m, std=0.3, seed=1)
    return m


def _engine(tokenizer=None, **kw) -> Engine:
    return Engine(LocalRunner(_model()), tokenizer or ByteTokenizer(), model_name="tiny", **kw)


def run(fn, engine: Engine | None = None, **cfg):
    engine = engine or _engine()

    async def main():
        runner, port = await start(engine, ServerConfig(host="127.0.0.1", port=0, **cfg))
        try:
            async with aiohttp.ClientSession(
                f"http://127.0.0.1:{port}", timeout=aiohttp.ClientTimeout(total=60)
            ) as s:
                return await fn(s, engine)
        finally:
            await runner.cleanup()

    return asyncio.run(asyncio.wait_for(main(), 120))


async def post(s, path: str, body: dict) -> dict:
    r = await s.post(path, json=body)
    out = await r.json()
    assert r.status == 200, out
    return out


async def sse(s, path: str, body: dict) -> list:
    r = await s.post(path, json={**body, "stream": True})
    assert r.status == 200, await r.text()
    events = []
    async for raw in r.content:
        line = raw.decode().strip()
        if line.startswith("data: "):
            events.append(line[6:] if line[6:] == "[DONE]" else json.loads(line[6:]))
    assert events[-1] == "[DONE]"
    return events[:-1]


def _prompt_logprobs(ids: list[int]) -> tuple[list[float], list[bool]]:
    """log p(ids[t] | ids[:t]) for t >= 1, and whether ids[t] is the most likely token there,
    from one full forward of the model."""
    with torch.inference_mode():
        logits = _model()(torch.tensor([ids]))[0].float()
    lp = torch.log_softmax(logits, dim=-1)
    top = lp.argmax(-1)
    return (
        [float(lp[t - 1, ids[t]]) for t in range(1, len(ids))],
        [int(top[t - 1]) == ids[t] for t in range(1, len(ids))],
    )


# ---- completions: logprobs, echo -------------------------------------------------------------


def test_completion_logprobs_match_the_engine() -> None:
    async def body(s, engine):
        req = {"prompt": "Hello", "max_tokens": 6, "temperature": 0, "logprobs": 3}
        out = await post(s, "/v1/completions", req)
        ch = out["choices"][0]
        lp = ch["logprobs"]
        assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
        ref = list(engine.generate("Hello", SamplingParams(max_tokens=6, logprobs=3)))
        assert len(lp["tokens"]) == len(ref) == out["usage"]["completion_tokens"] == 6
        for ev, tok, v, top in zip(ref, lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
            assert tok == ByteTokenizer().decode([ev.token])
            assert v == pytest.approx(ev.logprob, abs=1e-4)  # a reused prefix: not bit-equal
            assert len(top) <= 3 and max(top.values()) == v  # greedy: the top one
        offsets = lp["text_offset"]
        assert offsets[0] == 0 and all(
            b - a == len(t) for a, b, t in zip(offsets, offsets[1:], lp["tokens"])
        )
        # streamed: the same entries, chunk by chunk
        chunks = await sse(s, "/v1/completions", req)
        streamed = [c["choices"][0]["logprobs"] for c in chunks]
        got = sum((x["token_logprobs"] for x in streamed), [])
        assert got == pytest.approx(lp["token_logprobs"], abs=1e-4)  # prefix reused: not bit-equal
        assert sum((x["tokens"] for x in streamed), []) == lp["tokens"]
        assert sum((x["text_offset"] for x in streamed), []) == offsets
        assert "".join(c["choices"][0]["text"] for c in chunks) == ch["text"]
        # no logprobs asked: null
        out = await post(s, "/v1/completions", {"prompt": "Hello", "max_tokens": 2})
        assert out["choices"][0]["logprobs"] is None

    run(body)


def test_echo_with_logprobs_scores_the_prompt_as_lm_eval_does() -> None:
    ids = list(b"The cat sat on the mat")
    want, argmax = _prompt_logprobs(ids)

    async def body(s, engine):
        # exactly what lm-eval's local-completions sends for loglikelihood, token ids batched
        req = {
            "model": "tiny",
            "prompt": [ids],
            "temperature": 0,
            "max_tokens": 1,
            "logprobs": 1,
            "seed": 1234,
            "echo": True,
        }
        out = await post(s, "/v1/completions", req)
        (ch,) = out["choices"]
        lp = ch["logprobs"]
        assert ch["index"] == 0 and ch["text"].startswith("The cat sat on the mat")
        assert len(lp["token_logprobs"]) == len(ids) + 1  # the prompt, then the one generated
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert lp["tokens"][: len(ids)] == [chr(i) for i in ids]
        assert lp["token_logprobs"][1 : len(ids)] == pytest.approx(want, abs=1e-4)
        # lm-eval's parse_logprobs: the continuation " on the mat" after ctxlen tokens
        ctxlen = len(b"The cat sat")
        cont = lp["token_logprobs"][ctxlen:-1]
        assert sum(cont) == pytest.approx(sum(want[ctxlen - 1 :]), abs=1e-3)
        greedy = all(t == max(top.values()) for t, top in zip(cont, lp["top_logprobs"][ctxlen:-1]))
        assert greedy == all(argmax[ctxlen - 1 :])
        assert out["usage"]["prompt_tokens"] == len(ids)
        # max_tokens 0 with echo: the prompt only, scored; as text, two prompts at once
        req = {"prompt": ["ab", "abc"], "max_tokens": 0, "echo": True, "logprobs": 0}
        out = await post(s, "/v1/completions", req)
        assert [c["text"] for c in out["choices"]] == ["ab", "abc"]
        assert [c["index"] for c in out["choices"]] == [0, 1]
        assert [len(c["logprobs"]["tokens"]) for c in out["choices"]] == [2, 3]
        assert out["choices"][1]["logprobs"]["top_logprobs"][1] == {}  # 0 alternatives
        assert out["usage"]["completion_tokens"] == 0 and out["usage"]["prompt_tokens"] == 5
        # echo without logprobs: the prompt prepended to the completion
        plain = await post(
            s, "/v1/completions", {"prompt": "Hi", "max_tokens": 3, "temperature": 0}
        )
        out = await post(
            s, "/v1/completions", {"prompt": "Hi", "max_tokens": 3, "temperature": 0, "echo": True}
        )
        assert out["choices"][0]["text"] == "Hi" + plain["choices"][0]["text"]
        # streamed echo: the prompt (with its logprobs) is the first chunk
        req = {"prompt": ids, "max_tokens": 2, "temperature": 0, "echo": True, "logprobs": 1}
        chunks = await sse(s, "/v1/completions", req)
        first = chunks[0]["choices"][0]
        assert (
            first["text"] == "The cat sat on the mat"
            and first["logprobs"]["token_logprobs"][0] is None
        )
        streamed = sum((c["choices"][0]["logprobs"]["token_logprobs"] for c in chunks), [])
        assert streamed[1 : len(ids)] == pytest.approx(want, abs=1e-4)

    run(body)


# ---- chat logprobs -------------------------------------------------------------------------------


def test_chat_logprobs_and_top_logprobs() -> None:
    msgs = [{"role": "user", "content": "hello"}]

    async def body(s, engine):
        req = {
            "messages": msgs,
            "max_tokens": 5,
            "temperature": 0,
            "logprobs": True,
            "top_logprobs": 2,
        }
        out = await post(s, "/v1/chat/completions", req)
        ch = out["choices"][0]
        content = ch["logprobs"]["content"]
        assert len(content) == out["usage"]["completion_tokens"] == 5
        for item in content:
            assert set(item) == {"token", "logprob", "bytes", "top_logprobs"}
            assert len(item["bytes"]) == 1 and item["logprob"] <= 0  # a byte tokenizer
            assert len(item["top_logprobs"]) == 2
            best = item["top_logprobs"][0]
            assert set(best) == {"token", "logprob", "bytes"}
            assert best["logprob"] == pytest.approx(item["logprob"])  # greedy: the top one
            assert best["bytes"] == item["bytes"]
        decoded = bytes(b for it in content for b in it["bytes"]).decode("utf-8", "replace")
        # (an incomplete character at the very end is never shown as text)
        assert decoded.rstrip("\ufffd") == ch["message"]["content"].rstrip("\ufffd")
        # logprobs without top_logprobs: no alternatives; streamed, the same entries
        chunks = await sse(s, "/v1/chat/completions", req)
        streamed = sum((c["choices"][0]["logprobs"]["content"] for c in chunks), [])
        assert [it["bytes"] for it in streamed] == [it["bytes"] for it in content]
        assert [it["logprob"] for it in streamed] == pytest.approx(
            [it["logprob"] for it in content], abs=1e-4
        )
        out = await post(s, "/v1/chat/completions", {**req, "top_logprobs": None})
        assert all(it["top_logprobs"] == [] for it in out["choices"][0]["logprobs"]["content"])
        out = await post(s, "/v1/chat/completions", {"messages": msgs, "max_tokens": 2})
        assert out["choices"][0]["logprobs"] is None

    run(body)


# ---- n, seed, stop, ignore_eos, usage ---------------------------------------------------------


def test_n_choices_with_seeds_and_same_seed_same_text() -> None:
    async def body(s, engine):
        base = {"prompt": "Once", "max_tokens": 8, "temperature": 1.0, "seed": 7}
        out = await post(s, "/v1/completions", {**base, "n": 3})
        assert [c["index"] for c in out["choices"]] == [0, 1, 2]
        texts = [c["text"] for c in out["choices"]]
        for i, t in enumerate(texts):  # choice i draws with seed + i
            one = await post(s, "/v1/completions", {**base, "seed": 7 + i})
            assert one["choices"][0]["text"] == t
        assert len(set(texts)) > 1
        assert out["usage"]["completion_tokens"] == 24 and out["usage"]["prompt_tokens"] == 4
        again = await post(s, "/v1/completions", {**base, "n": 3})
        assert [c["text"] for c in again["choices"]] == texts  # same seed, same texts
        # streamed chat, n=2: chunks carry their choice's index; each joins to its text
        chat = {
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 6,
            "temperature": 1.0,
        }
        ref = await post(s, "/v1/chat/completions", {**chat, "seed": 3, "n": 2})
        chunks = await sse(s, "/v1/chat/completions", {**chat, "seed": 3, "n": 2})
        got = {0: "", 1: ""}
        roles = []
        for c in chunks:
            (choice,) = c["choices"]
            got[choice["index"]] += choice["delta"].get("content") or ""
            roles += [choice["index"]] if "role" in choice["delta"] else []
        assert sorted(roles) == [0, 1]
        assert [got[0], got[1]] == [c["message"]["content"] for c in ref["choices"]]

    run(body)


def test_stop_string_spanning_two_tokens() -> None:
    async def body(s, engine):
        req = {"prompt": "Tell me", "max_tokens": 24, "temperature": 0}
        text = (await post(s, "/v1/completions", req))["choices"][0]["text"]
        # a stop string of two characters, i.e. two byte tokens, that first occurs at k >= 1
        ks = [
            k
            for k in range(1, len(text) - 1)
            if text[k : k + 2].isascii() and text.find(text[k : k + 2]) == k
        ]
        assert ks, text
        k = ks[len(ks) // 2]
        stop = text[k : k + 2]
        out = await post(s, "/v1/completions", {**req, "stop": [stop]})
        assert out["choices"][0]["text"] == text[:k]
        assert out["choices"][0]["finish_reason"] == "stop"
        chunks = await sse(s, "/v1/completions", {**req, "stop": stop})
        assert "".join(c["choices"][0]["text"] for c in chunks) == text[:k]
        assert chunks[-1]["choices"][0]["finish_reason"] == "stop"

    run(body)


def test_ignore_eos_and_the_eos_token_scored() -> None:
    """A tokenizer whose EOS is the model's greedy first token: the completion stops at once
    (its logprob still reported, as evaluators expect one per generated position) unless
    ignore_eos."""
    first = next(iter(_engine().generate("abc", SamplingParams(max_tokens=1)))).token

    class Eos(ByteTokenizer):
        eos_token_id = first

    async def body(s, engine):
        req = {"prompt": "abc", "max_tokens": 5, "temperature": 0, "logprobs": 1}
        out = await post(s, "/v1/completions", req)
        ch = out["choices"][0]
        assert ch["finish_reason"] == "stop" and ch["text"] == ""
        assert out["usage"]["completion_tokens"] == 0
        assert len(ch["logprobs"]["token_logprobs"]) == 1  # the EOS token's
        assert ch["logprobs"]["tokens"] == [ByteTokenizer().decode([first])]
        out = await post(s, "/v1/completions", {**req, "ignore_eos": True})
        assert out["choices"][0]["finish_reason"] == "length"
        assert out["usage"]["completion_tokens"] == 5

    run(body, _engine(Eos()))


def test_include_usage_and_context_length() -> None:
    async def body(s, engine):
        req = {"prompt": "Hi", "max_tokens": 4, "temperature": 0, "n": 2}
        chunks = await sse(s, "/v1/completions", {**req, "stream_options": {"include_usage": True}})
        last = chunks[-1]
        assert last["choices"] == [] and last["usage"] == {
            "prompt_tokens": 2,
            "completion_tokens": 8,
            "total_tokens": 10,
        }
        assert all(c["usage"] is None for c in chunks[:-1])
        chunks = await sse(s, "/v1/completions", req)
        assert all("usage" not in c and c["choices"] for c in chunks)
        r = await s.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 127})
        err = (await r.json())["error"]
        assert r.status == 400 and err["code"] == "context_length_exceeded"
        assert err["param"] == "max_tokens"

    run(body)


# ---- bad values ----------------------------------------------------------------------------------

BAD = [
    ("/v1/completions", {"logprobs": 21}, "logprobs"),
    ("/v1/completions", {"logprobs": -1}, "logprobs"),
    ("/v1/completions", {"logprobs": "3"}, "logprobs"),
    ("/v1/completions", {"logprobs": True}, "logprobs"),
    ("/v1/completions", {"echo": "yes"}, "echo"),
    ("/v1/completions", {"n": 0}, "n"),
    ("/v1/completions", {"n": 17}, "n"),
    ("/v1/completions", {"n": 2.0}, "n"),
    ("/v1/completions", {"max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"max_tokens": "8"}, "max_tokens"),
    ("/v1/completions", {"temperature": "hot"}, "temperature"),
    ("/v1/completions", {"temperature": -1}, "temperature"),
    ("/v1/completions", {"top_p": "1"}, "top_p"),
    ("/v1/completions", {"top_k": 1.5}, "top_k"),
    ("/v1/completions", {"seed": -1}, "seed"),
    ("/v1/completions", {"seed": 1.5}, "seed"),
    ("/v1/completions", {"stop": [""]}, "stop"),
    ("/v1/completions", {"stop": [1]}, "stop"),
    ("/v1/completions", {"stop": ["a"] * 17}, "stop"),
    ("/v1/completions", {"stream": "true"}, "stream"),
    ("/v1/completions", {"stream_options": {"include_usage": True}}, "stream_options"),
    ("/v1/completions", {"stream": True, "stream_options": "x"}, "stream_options"),
    (
        "/v1/completions",
        {"stream": True, "stream_options": {"include_usage": 1}},
        "stream_options.include_usage",
    ),
    ("/v1/completions", {"ignore_eos": 1}, "ignore_eos"),
    ("/v1/completions", {"prompt": []}, "prompt"),
    ("/v1/completions", {"prompt": [[1], "a"]}, "prompt"),
    ("/v1/completions", {"prompt": [True]}, "prompt"),
    ("/v1/completions", {"prompt": [[1, 999]]}, "prompt"),
    ("/v1/chat/completions", {"echo": True}, "echo"),
    ("/v1/chat/completions", {"logprobs": 1}, "logprobs"),
    ("/v1/chat/completions", {"top_logprobs": 3}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": "2"}, "top_logprobs"),
    ("/v1/chat/completions", {"n": 0}, "n"),
    ("/v1/chat/completions", {"max_completion_tokens": 0}, "max_completion_tokens"),
    ("/v1/chat/completions", {"temperature": None, "top_p": 2}, "top_p"),
]


@pytest.mark.parametrize("path,fields,param", BAD, ids=[f"{p[4:]}-{f}" for p, f, _ in BAD])
def test_bad_values_answer_json_400_with_param(path, fields, param) -> None:
    base = (
        {"prompt": "x"}
        if path == "/v1/completions"
        else {"messages": [{"role": "user", "content": "x"}]}
    )

    async def body(s, engine):
        r = await s.post(path, json={**base, "max_tokens": 2, **fields})
        err = (await r.json())["error"]
        assert r.status == 400, err
        assert err["param"] == param and err["type"] == "invalid_request_error" and err["message"]
        ok = await s.post(path, json={**base, "max_tokens": 2})
        assert ok.status == 200

    run(body)


def test_choices_beyond_what_can_ever_run_are_400() -> None:
    async def body(s, engine):
        r = await s.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "n": 4})
        err = (await r.json())["error"]
        assert r.status == 400 and err["param"] == "n"
        r = await s.post("/v1/completions", json={"prompt": ["a", "b", "c", "d"], "max_tokens": 2})
        assert r.status == 400 and (await r.json())["error"]["param"] == "prompt"
        r = await s.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "n": 3})
        assert r.status == 200 and len((await r.json())["choices"]) == 3

    run(body, max_queue=2)  # one running + two waiting


# ---- /metrics in Prometheus text -----------------------------------------------------------------

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? (\S+)$")


def parse_prometheus(text: str) -> dict[str, tuple[str, float]]:
    """A strict reader of the text exposition format as we write it: every sample follows its
    own HELP and TYPE lines; returns {name: (type, value)} (names unique: no labels repeat)."""
    types: dict[str, str] = {}
    helps: set[str] = set()
    out: dict[str, tuple[str, float]] = {}
    for line in text.splitlines():
        if line.startswith("# HELP "):
            name, _, help_ = line[7:].partition(" ")
            assert help_, line
            helps.add(name)
        elif line.startswith("# TYPE "):
            name, _, kind = line[7:].partition(" ")
            assert kind in ("counter", "gauge"), line
            types[name] = kind
        else:
            m = _SAMPLE.match(line)
            assert m, f"not a sample line: {line!r}"
            name, value = m.group(1), float(m.group(3))
            assert name in types and name in helps, f"{name} has no TYPE/HELP"
            assert name not in out, f"{name} twice"
            if types[name] == "counter":
                assert name.endswith("_total") and value >= 0, line
            out[name] = (types[name], value)
    return out


def test_metrics_in_prometheus_text_and_json() -> None:
    async def body(s, engine):
        await post(s, "/v1/completions", {"prompt": "Hello there", "max_tokens": 3})
        await post(s, "/v1/completions", {"prompt": "Hello there!", "max_tokens": 3})
        js = await (await s.get("/metrics")).json()  # aiohttp sends Accept: */*
        assert js["requests_total"] == 2 and js["model"] == "tiny"
        for headers, query in (
            ({"Accept": "text/plain"}, ""),
            ({"Accept": "application/openmetrics-text;version=1.0.0,text/plain;q=0.5"}, ""),
            ({}, "?format=prometheus"),
        ):
            r = await s.get("/metrics" + query, headers=headers)
            assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain")
            assert "version=0.0.4" in r.headers["Content-Type"]
            m = parse_prometheus(await r.text())
            assert m["lowband_requests_total"] == ("counter", 2)
            assert m["lowband_completion_tokens_total"] == ("counter", 6)
            assert m["lowband_requests_running"] == ("gauge", 0)
            assert m["lowband_requests_waiting"] == ("gauge", 0)
            assert m["lowband_prefix_cache_lookups_total"] == ("counter", 2)
            assert m["lowband_prefix_cache_hits_total"][1] == js["prefix_cache_hits_total"] == 1
            assert m["lowband_prefix_cache_tokens_reused_total"][1] == 11
            assert m["lowband_model_info"] == ("gauge", 1)
            ttft = m["lowband_time_to_first_token_seconds_mean"][1]
            assert ttft == pytest.approx(js["ttft_ms_mean"] / 1e3)
        for headers, query in (
            ({"Accept": "application/json, text/plain"}, ""),
            ({"Accept": "text/plain"}, "?format=json"),
        ):
            r = await s.get("/metrics" + query, headers=headers)
            assert r.headers["Content-Type"].startswith("application/json")

    run(body, _engine(parallel=2))


def test_prometheus_text_of_missing_and_odd_values() -> None:
    text = prometheus_text(
        {"requests_total": 3, "ttft_ms_mean": None, "new_thing_total": 4, "note": "x"},
        {"expert_store_hit-rate": ("gauge", "hits", 0.5)},
        'a "quoted"\nname',
    )
    m = parse_prometheus(text)
    assert m["lowband_requests_total"] == ("counter", 3)
    assert math.isnan(m["lowband_time_to_first_token_seconds_mean"][1])
    assert m["lowband_new_thing_total"] == ("counter", 4)
    assert m["lowband_expert_store_hit_rate"] == ("gauge", 0.5)
    assert "lowband_note" not in m
    assert 'lowband_model_info{model="a \\"quoted\\"\\nname"} 1' in text


# ---- vLLM's tokenizer endpoints (lm-eval's remote tokenizer) -------------------------------------


def test_tokenizer_endpoints() -> None:
    async def body(s, engine):
        out = await post(s, "/tokenize", {"prompt": "héllo", "add_special_tokens": False})
        assert out["tokens"] == list("héllo".encode()) and out["count"] == 6
        assert out["max_model_len"] == 128
        out = await post(s, "/detokenize", {"tokens": list("héllo".encode())})
        assert out["prompt"] == "héllo"
        info = await (await s.get("/tokenizer_info")).json()
        assert "eos_token" in info and info["eos_token"] is None
        r = await s.post("/detokenize", json={"tokens": [1, 256]})
        assert r.status == 400 and (await r.json())["error"]["param"] == "tokens"
        r = await s.post("/tokenize", json={"prompt": 5})
        assert r.status == 400 and (await r.json())["error"]["param"] == "prompt"

    run(body)


# ---- the official client ------------------------------------------------------------------------


def test_the_openai_client() -> None:
    openai = pytest.importorskip("openai")
    engine = _engine(parallel=2)
    ready = threading.Event()
    box: dict = {}
    stop = None

    def serve() -> None:
        nonlocal stop

        async def main():
            nonlocal stop
            runner, port = await start(engine, ServerConfig(host="127.0.0.1", port=0))
            box["port"] = port
            stop = asyncio.Event()
            box["loop"] = asyncio.get_running_loop()
            ready.set()
            try:
                await stop.wait()
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
        assert [m.id for m in client.models.list().data] == ["tiny"]
        c = client.completions.create(
            model="tiny", prompt="Hello", max_tokens=5, temperature=0, logprobs=2
        )
        assert c.choices[0].text == engine.complete("Hello", SamplingParams(max_tokens=5))[0]
        lp = c.choices[0].logprobs
        assert lp is not None and len(lp.token_logprobs) == 5 and len(lp.top_logprobs[0]) <= 2
        assert c.usage.completion_tokens == 5
        chat = client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=4,
            temperature=0,
            logprobs=True,
            top_logprobs=3,
            n=2,
        )
        assert [ch.index for ch in chat.choices] == [0, 1]
        content = chat.choices[0].logprobs.content
        assert len(content) == 4 and len(content[0].top_logprobs) == 3
        assert content[0].top_logprobs[0].logprob == pytest.approx(content[0].logprob)
        assert chat.choices[0].message.content == chat.choices[1].message.content  # greedy
        stream = client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=4,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        parts, usage = [], None
        for chunk in stream:
            if chunk.choices:
                parts.append(chunk.choices[0].delta.content or "")
            else:
                usage = chunk.usage
        assert "".join(parts) == chat.choices[0].message.content
        assert usage is not None and usage.completion_tokens == 4
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model="tiny", prompt="x", max_tokens=2, logprobs=99)
    finally:
        box["loop"].call_soon_threadsafe(stop.set)
        t.join(30)
        assert not t.is_alive()


def test_streamed_chat_opens_with_the_role_and_sends_no_empty_deltas() -> None:
    """The role alone first (content null), then only non-empty text (a byte tokenizer's
    incomplete characters make events with no text), the finish_reason last; the chat and
    model routes also answer without /v1, as llama-server's."""

    async def body(s, engine):
        req = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 24}
        chunks = await sse(s, "/chat/completions", {**req, "temperature": 1.0, "seed": 5})
        models = await (await s.get("/models")).json()
        return chunks, models

    chunks, models = run(body)
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert deltas[0] == {"role": "assistant", "content": None}
    assert all("role" not in d and d.get("content") != "" for d in deltas[1:])
    assert all(d for d in deltas[1:-1])  # no empty chunk before the last one
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert models["data"][0]["id"] == "tiny"
