"""Tool calls and structured output through real chat templates: Llama 3.1's and Qwen2.5's
(``data/templates``: the models' published templates as llama.cpp keeps them in
``models/templates``, from their HF ``tokenizer_config.json``; these two and Gemma 2's are
byte for byte ``vendor/llama.cpp/models/templates/*.jinja`` of the llama-cpp-python 0.3.36
source release), carried by small GGUF files, and Gemma 3's instruction-tuned template
(``google-gemma-3-it.jinja``, the ``chat_template`` of google/gemma-3-*-it) on the published
270M file.

Provenance of the Gemma 3 file: no copy of Gemma 3's template is available offline here. The
270M GGUF is the base model and carries none; the llama-cpp-python 0.3.36 release has Gemma 2's
and Gemma 4's templates in ``models/templates`` but not Gemma 3's (its
``tests/test-chat-template.cpp`` has only google/gemma-7b-it's); no transformers or Hugging
Face cache is installed. ``google-gemma-3-it.jinja`` was checked equal, all 1,532 characters,
to the ``chat_template`` string of Gemma 3's ``tokenizer_config.json`` as quoted verbatim in
the Berkeley Function-Calling Leaderboard's Gemma handler
(``bfcl/model_handler/local_inference/gemma.py``), read from a stored index of public
repositories, not from this machine. Gemma 2's template (genuine, offline) has the same turns
and refuses system messages: the tools then go into the first user turn.

For each: the tools are rendered into the prompt the way the template writes them (Gemma 3's
template ignores tools, so the server describes them in the system message), a call written in
the model's own format (as the template itself writes an assistant's past calls) parses back
into the same ``tool_calls``, and over HTTP a ``required`` or named call, greedy and sampled,
always parses and validates against the tool's parameters, as does a ``json_schema`` reply."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from edge.engine import Engine, LocalRunner
from edge.server import ApiError, render_chat
from edge.shardio import load_shard
from edge.source import resolve_model
from edge.tool_calls import (
    GENERIC,
    HERMES,
    LLAMA3,
    parse_tool_calls,
    template_takes_tools,
    tool_format,
)
from lowband.models.chat_template import (
    ChatTemplate,
    normalize_messages,
    template_from_gguf_metadata,
)
from tests.edge.llamacpp_suite.model import write_model
from tests.edge.test_openai_api import post, run
from tests.edge.test_tool_calls import TOOLS, WEATHER

pytestmark = pytest.mark.timeout(600)
DATA = Path(__file__).with_name("data") / "templates"
TEMPLATES = {
    "llama3.1": ("meta-llama-Llama-3.1-8B-Instruct.jinja", LLAMA3),
    "qwen2.5": ("Qwen-Qwen2.5-7B-Instruct.jinja", HERMES),
}
ENDS = ("<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<end_of_turn>")
CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "weather", "arguments": json.dumps({"city": "Paris", "unit": "c"})},
}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


def _template(name: str) -> ChatTemplate:
    return ChatTemplate(
        source=(DATA / TEMPLATES[name][0]).read_text(),
        bos_token="<|begin_of_text|>",
        eos_token="<|end_of_text|>",
    )


def _reply_as_rendered(tpl: ChatTemplate, messages: list[dict]) -> str:
    """What the template writes for the last (assistant) message: the model's own format."""
    head = tpl.render(normalize_messages(messages[:-1]), add_generation_prompt=True, tools=TOOLS)
    full = tpl.render(normalize_messages(messages), add_generation_prompt=False, tools=TOOLS)
    assert full.startswith(head)
    reply = full[len(head) :].strip()
    for end in ENDS:
        reply = reply.removesuffix(end).strip()
    return reply


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_tools_are_rendered_and_calls_parse_back(name: str) -> None:
    tpl = _template(name)
    fmt = tool_format(tpl.source)
    assert fmt == TEMPLATES[name][1]
    prompt = render_chat(tpl, {"messages": ASK, "tools": TOOLS})
    for t in TOOLS:  # each tool's definition, as JSON, in the prompt
        fn = t["function"]
        assert f'"name": "{fn["name"]}"' in prompt
        for key, spec in fn["parameters"]["properties"].items():  # (indented or not)
            assert f'"{key}"' in prompt
            assert all(f'"{k}"' in prompt for k in spec)
    reply = _reply_as_rendered(tpl, [*ASK, {"role": "assistant", "tool_calls": [CALL]}])
    assert ("<tool_call>" in reply) == (fmt == HERMES)
    content, calls = parse_tool_calls(reply, TOOLS, fmt)
    assert content is None and len(calls) == 1
    assert calls[0]["function"]["name"] == "weather"
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris", "unit": "c"}
    # a reply in prose stays content
    assert parse_tool_calls("It is sunny.", TOOLS, fmt) == ("It is sunny.", [])


def _engine(path: Path) -> Engine:
    src = resolve_model(path)
    return Engine(LocalRunner(load_shard(path).model), src.tokenizer(), model_name="m")


def _check_calls(out: dict, names: set[str]) -> None:
    msg = out["choices"][0]["message"]
    assert out["choices"][0]["finish_reason"] == "tool_calls", msg
    assert msg["tool_calls"], msg
    for call in msg["tool_calls"]:
        fn = call["function"]
        assert fn["name"] in names
        params = next(
            t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == fn["name"]
        )
        jsonschema.validate(json.loads(fn["arguments"]), params)


async def _http_checks(s, engine) -> None:
    for temperature in (0.0, 1.0):
        for choice, names in (
            ("required", {"weather", "time"}),
            (
                {"type": "function", "function": {"name": "weather"}},
                {"weather"},
            ),
        ):
            req = {
                "messages": ASK,
                "tools": TOOLS,
                "tool_choice": choice,
                "max_tokens": 200,
                "temperature": temperature,
                "seed": 1,
            }
            _check_calls(await post(s, "/v1/chat/completions", req), names)
        req = {
            "messages": ASK,
            "max_tokens": 200,
            "temperature": temperature,
            "seed": 2,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "w", "schema": WEATHER},
            },
        }
        out = await post(s, "/v1/chat/completions", req)
        if out["choices"][0]["finish_reason"] == "stop":
            jsonschema.validate(json.loads(out["choices"][0]["message"]["content"]), WEATHER)


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_required_calls_over_http_with_the_real_template(name: str, tmp_path: Path) -> None:
    path = write_model(tmp_path / f"{name}.gguf", (DATA / TEMPLATES[name][0]).read_text())
    engine = _engine(path)
    assert tool_format(engine.tokenizer.chat_template.source) == TEMPLATES[name][1]
    run(_http_checks, engine)


def test_gemma2_template_refuses_a_system_message_so_tools_go_first(tmp_path: Path) -> None:
    """Gemma 2's published template (``google-gemma-2-2b-it.jinja``: llama.cpp's
    ``models/templates`` as vendored in the llama-cpp-python 0.3.36 source release, the
    ``chat_template`` of google/gemma-2-2b-it) renders no tools and raises on a system message:
    the tools go at the head of the first user turn instead, and required/named calls and
    json_schema replies over HTTP parse and validate (a request with its own system message
    stays a 400, as the template says)."""
    source = (DATA / "google-gemma-2-2b-it.jinja").read_text()
    assert "System role not supported" in source and not template_takes_tools(source)
    tpl = ChatTemplate(source=source, bos_token="<bos>", eos_token="<eos>")
    prompt = render_chat(tpl, {"messages": ASK, "tools": TOOLS})
    assert prompt.startswith("<bos><start_of_turn>user\nYou can call these functions:")
    assert '"name": "weather"' in prompt and prompt.count("<start_of_turn>user") == 1
    assert prompt.endswith("Weather in Paris?<end_of_turn>\n<start_of_turn>model\n")
    assert render_chat(tpl, {"messages": ASK}).startswith("<bos><start_of_turn>user\nWeather")
    with pytest.raises(ApiError):
        render_chat(tpl, {"messages": [{"role": "system", "content": "x"}, *ASK], "tools": TOOLS})
    engine = _engine(write_model(tmp_path / "gemma2.gguf", source))
    assert tool_format(engine.tokenizer.chat_template.source) == GENERIC
    run(_http_checks, engine)


@pytest.mark.slow
def test_gemma3_real_file_tools_and_calls(real_gemma3: Path) -> None:
    """The published 270M file is the base model: its GGUF carries no chat template, so the
    instruction-tuned models' one (``google-gemma-3-it.jinja``) is attached as the GGUF reader
    attaches a file's own."""
    engine = _engine(real_gemma3)
    tok = engine.tokenizer
    tokens = tok.vocab.tokens
    tok.chat_template = template_from_gguf_metadata(
        (DATA / "google-gemma-3-it.jinja").read_text(),
        bos_token=tokens[tok.bos_token_id],
        eos_token=tokens[tok.eos_token_id],
        vocabulary=tok.special_tokens,
        eos_token_ids=[tok.eos_token_id],
    )
    tpl = tok.chat_template
    assert "<end_of_turn>" in tpl.stop_strings or tpl.stop_token_ids
    fmt = tool_format(tpl.source)
    assert fmt == GENERIC
    prompt = render_chat(tpl, {"messages": ASK, "tools": TOOLS})
    assert '"name": "weather"' in prompt and prompt.count("<start_of_turn>user") == 1
    reply = json.dumps({"name": "weather", "arguments": {"city": "Paris", "unit": "c"}})
    content, calls = parse_tool_calls(reply, TOOLS, fmt)
    assert content is None and json.loads(calls[0]["function"]["arguments"])["city"] == "Paris"
    run(_http_checks, engine)


def test_continue_final_message_leaves_the_last_turn_open() -> None:
    """vLLM's and transformers' continue_final_message (llama.cpp's suite checks this very
    prompt end with Llama 3.1's template); both it and add_generation_prompt: a 400."""
    tpl = _template("llama3.1")
    msgs = [
        {"role": "system", "content": "Book"},
        {"role": "user", "content": "What is the best book"},
        {"role": "assistant", "content": "Whill"},
    ]
    body = {"messages": msgs, "continue_final_message": True, "add_generation_prompt": False}
    assert render_chat(tpl, body).endswith(
        "<|start_header_id|>user<|end_header_id|>\n\nWhat is the best book<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\nWhill"
    )
    assert render_chat(tpl, {"messages": msgs, "continue_final_message": True}) == render_chat(
        tpl, body
    )
    closed = render_chat(tpl, {"messages": msgs, "add_generation_prompt": False})
    assert closed.endswith("Whill<|eot_id|>")
    for bad in (
        {"messages": msgs, "continue_final_message": True, "add_generation_prompt": True},
        {"messages": msgs[:2], "continue_final_message": True},
        {"messages": msgs, "continue_final_message": "yes"},
    ):
        with pytest.raises(ApiError) as e:
            render_chat(tpl, bad)
        assert e.value.status == 400
