"""/v1/chat/completions with a model's own chat template: the prompt the engine runs is the
rendered template's tokens, generation stops on the end-of-turn token, a template's
raise_exception and malformed messages are 400 JSON, a model without a template keeps the plain
transcript; /v1/models says which."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import aiohttp
import pytest

from edge.engine import Engine, LocalRunner
from edge.sampling import SamplingParams
from edge.server import ServerConfig, chat_prompt, start
from lowband.models.chat_template import ChatTemplate, normalize_messages
from lowband.models.llama import LlamaForCausalLM, init_weights
from lowband.models.tokenizer import ByteTokenizer, load_tokenizer
from lowband.models.weights import load_pretrained, save_pretrained
from tests.conftest import tiny_llama

# ChatML as Qwen2.5 writes it, without the tools branch.
CHATML = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if not (message.role == 'system' and loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# Gemma refuses a system turn with raise_exception.
GEMMA_LIKE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}"
    "{{ raise_exception('System role not supported') }}{% endif %}"
    "{% for m in messages %}<start_of_turn>{{ m.role }}\n{{ m.content }}<end_of_turn>\n"
    "{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
CFG = tiny_llama(max_position_embeddings=512)
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "hello"},
    {"role": "assistant", "content": "hi!"},
    {"role": "user", "content": "2+2?"},
]


def _model_dir(d: Path, template: str | None, **extra: object) -> Path:
    """A tiny random checkpoint with a byte tokenizer, as `lowband edge serve` loads one."""
    m = LlamaForCausalLM(CFG).eval()
    init_weights(m, std=0.3, seed=1)
    save_pretrained(m, d)
    ByteTokenizer().save(d)
    if template is not None:
        cfg = {"chat_template": template, "bos_token": "<bos>", "eos_token": "<eos>", **extra}
        (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    return d


def _engine(d: Path) -> Engine:
    return Engine(LocalRunner(load_pretrained(d).eval()), load_tokenizer(d), model_name="tiny")


def run(fn, engine: Engine):
    async def main():
        runner, port = await start(engine, ServerConfig(host="127.0.0.1", port=0))
        try:
            async with aiohttp.ClientSession(
                f"http://127.0.0.1:{port}", timeout=aiohttp.ClientTimeout(total=60)
            ) as s:
                return await fn(s)
        finally:
            await runner.cleanup()

    return asyncio.run(asyncio.wait_for(main(), 120))


def _template(engine: Engine) -> ChatTemplate:
    t = getattr(engine.tokenizer, "chat_template", None)
    assert isinstance(t, ChatTemplate)
    return t


def test_chat_prompt_is_the_rendered_template(tmp_path) -> None:
    engine = _engine(_model_dir(tmp_path, CHATML))
    template = _template(engine)
    text = template.render(normalize_messages(MESSAGES))
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhello<|im_end|>\n"
        "<|im_start|>assistant\nhi!<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    want_ids = list(text.encode())
    assert template.stop_strings == ("<|im_end|>", "<eos>")
    # What the engine generates from exactly these ids, stopping where the template would.
    expected, reason, n = engine.complete(
        want_ids, SamplingParams(max_tokens=12, stop=template.stop_strings)
    )

    async def body(s):
        r = await s.get("/v1/models")
        assert (await r.json())["data"][0]["chat_template"] == "model"
        req = {"messages": MESSAGES, "max_tokens": 12, "temperature": 0}
        r = await s.post("/v1/chat/completions", json=req)
        out = await r.json()
        assert r.status == 200, out
        assert out["usage"]["prompt_tokens"] == len(want_ids)
        assert engine.cached_prefix()[: len(want_ids)] == want_ids  # the K/V behind the reply
        assert out["choices"][0]["message"]["content"] == expected
        assert (
            out["choices"][0]["finish_reason"] == reason and out["usage"]["completion_tokens"] == n
        )
        # the plain transcript is no longer what the model sees
        assert engine.cached_prefix()[: len(want_ids)] != list(chat_prompt(MESSAGES).encode())

    run(body, engine)


def test_generation_stops_on_the_end_of_turn_token(tmp_path) -> None:
    """generation_config.json's eos ids end a chat reply at once (finish_reason stop), where the
    same prompt sent as a completion runs to max_tokens."""
    d = _model_dir(tmp_path, CHATML)
    engine = _engine(d)
    ids = list(_template(engine).render(normalize_messages(MESSAGES)).encode())
    first = next(ev.token for ev in engine.generate(ids, SamplingParams(max_tokens=1)))
    assert first is not None  # the greedy first token
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [first, 255]}))
    engine = _engine(d)
    assert _template(engine).stop_token_ids == (first, 255)

    async def body(s):
        req = {"messages": MESSAGES, "max_tokens": 8, "temperature": 0}
        out = await (await s.post("/v1/chat/completions", json=req)).json()
        assert out["choices"][0]["finish_reason"] == "stop"
        assert out["choices"][0]["message"]["content"] == ""
        assert out["usage"]["completion_tokens"] == 0
        # /v1/completions knows nothing of chat turns: the same ids run to max_tokens
        plain = {"prompt": ids, "max_tokens": 8, "temperature": 0}  # (messages is chat's: 400)
        out = await (await s.post("/v1/completions", json=plain)).json()
        assert out["choices"][0]["finish_reason"] == "length"
        assert out["usage"]["completion_tokens"] == 8

    run(body, engine)


def test_template_raise_exception_and_bad_messages_are_400(tmp_path) -> None:
    engine = _engine(_model_dir(tmp_path, GEMMA_LIKE))

    async def body(s):
        r = await s.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2})
        err = await r.json()
        assert r.status == 400 and "System role not supported" in err["error"]["message"]
        assert err["error"]["code"] == "chat_template_error"
        assert err["error"]["param"] == "messages"
        for bad in (
            [{"role": "wizard", "content": "x"}],
            [{"role": "user", "content": {"text": "x"}}],
            [],
            "hello",
        ):
            r = await s.post("/v1/chat/completions", json={"messages": bad})
            err = await r.json()
            assert r.status == 400 and err["error"]["param"] == "messages", err
        r = await s.post("/v1/chat/completions", json={"messages": MESSAGES[1:], "tools": "x"})
        assert r.status == 400 and (await r.json())["error"]["param"] == "tools"
        # still serving; the Gemma-style prompt starts with the template's own BOS text
        ok = {"messages": MESSAGES[1:], "max_tokens": 2, "temperature": 0}
        r = await s.post("/v1/chat/completions", json=ok)
        assert r.status == 200
        text = _template(engine).render(normalize_messages(MESSAGES[1:]))
        assert text.startswith("<bos><start_of_turn>user\nhello<end_of_turn>\n")
        assert engine.cached_prefix()[: len(text.encode())] == list(text.encode())

    run(body, engine)


def test_model_without_template_keeps_the_plain_transcript(tmp_path) -> None:
    engine = _engine(_model_dir(tmp_path, None))
    assert getattr(engine.tokenizer, "chat_template", None) is None
    want = list(b"system: Be brief.\nuser: hello\nassistant: hi!\nuser: 2+2?\nassistant:")
    assert list(chat_prompt(MESSAGES).encode()) == want

    async def body(s):
        r = await s.get("/v1/models")
        assert (await r.json())["data"][0]["chat_template"] == "none"
        req = {"messages": MESSAGES, "max_tokens": 3, "temperature": 0}
        out = await (await s.post("/v1/chat/completions", json=req)).json()
        assert out["usage"]["prompt_tokens"] == len(want)
        assert engine.cached_prefix()[: len(want)] == want
        r = await s.post("/v1/chat/completions", json={"messages": [{"role": "x"}]})
        assert r.status == 400 and "error" in await r.json()

    run(body, engine)


@pytest.mark.parametrize("stream", [False, True])
def test_streamed_chat_uses_the_template_too(tmp_path, stream) -> None:
    engine = _engine(_model_dir(tmp_path, CHATML))
    ids = list(_template(engine).render(normalize_messages(MESSAGES)).encode())
    expected = engine.complete(ids, SamplingParams(max_tokens=6, stop=("<|im_end|>", "<eos>")))[0]

    async def body(s):
        req = {"messages": MESSAGES, "max_tokens": 6, "temperature": 0, "stream": stream}
        r = await s.post("/v1/chat/completions", json=req)
        if not stream:
            return (await r.json())["choices"][0]["message"]["content"]
        parts = []
        async for raw in r.content:
            line = raw.decode().strip()
            if line.startswith("data: {"):
                parts.append(json.loads(line[6:])["choices"][0]["delta"].get("content") or "")
        return "".join(parts)

    assert run(body, engine) == expected
