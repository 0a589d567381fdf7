"""Tool calls and reasoning: each model format parsed back into OpenAI's tool_calls, the
reasoning split as llama-server's reasoning_format says, and over HTTP a required (or named)
call that always parses and validates against the tool's parameters, streamed as OpenAI's
deltas."""

from __future__ import annotations

import json

import jsonschema
import pytest

from edge.engine import Engine, LocalRunner
from edge.server import render_chat
from edge.tool_calls import (
    GENERIC,
    HERMES,
    LLAMA3,
    MISTRAL,
    REASONING_FORMATS,
    ReasoningStream,
    call_schema,
    check_tools,
    parse_tool_calls,
    split_reasoning,
    template_takes_tools,
    tool_format,
)
from lowband.errors import ConfigError
from lowband.models.chat_template import ChatTemplate
from lowband.models.llama import LlamaForCausalLM, init_weights
from tests.conftest import tiny_llama
from tests.edge.test_openai_api import _engine, post, run, sse
from tests.edge.test_structured import EosBytes

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 6},
        "unit": {"enum": ["c", "f"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "weather", "parameters": WEATHER}},
    {
        "type": "function",
        "function": {
            "name": "time",
            "parameters": {
                "type": "object",
                "properties": {},
                "additionalProperties": False,
            },
        },
    },
]


def _tools_engine(tokenizer=None) -> Engine:
    """The tiny model with room for the tools a template-less prompt describes (~520 bytes)."""
    model = LlamaForCausalLM(tiny_llama(max_position_embeddings=1024)).eval()
    init_weights(model, std=0.3, seed=1)
    return Engine(LocalRunner(model), tokenizer or EosBytes(), model_name="tiny")


def _args(call: dict) -> dict:
    return json.loads(call["function"]["arguments"])


def test_formats_from_templates() -> None:
    assert tool_format("{% if tools %}<tool_call>{% endif %}") == HERMES
    assert tool_format("[AVAILABLE_TOOLS] [TOOL_CALLS]") == MISTRAL
    assert tool_format("<|start_header_id|>ipython<|end_header_id|>") == LLAMA3
    assert tool_format(None) == GENERIC == tool_format("{{ messages }}")


@pytest.mark.parametrize(
    "fmt,text,content",
    [
        (
            HERMES,
            'Let me see.\n<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo", '
            '"unit": "c"}}\n</tool_call>\n<tool_call>{"name": "time", "arguments": {}}'
            "</tool_call>",
            "Let me see.",
        ),
        (
            MISTRAL,
            '[TOOL_CALLS][{"name": "weather", "arguments": {"city": "Oslo", "unit": "c"}},'
            ' {"name": "time", "arguments": {}}]',
            None,
        ),
        (
            LLAMA3,
            '<|python_tag|>{"name": "weather", "parameters": {"city": "Oslo", "unit": "c"}}; '
            '{"name": "time", "parameters": {}}',
            None,
        ),
        (
            GENERIC,
            '```json\n[{"name": "weather", "arguments": "{\\"city\\": \\"Oslo\\", '
            '\\"unit\\": \\"c\\"}"}, {"name": "time", "arguments": {}}]\n```',
            None,
        ),
    ],
)
def test_each_format_parses_to_tool_calls(fmt, text, content) -> None:
    rest, calls = parse_tool_calls(text, TOOLS, fmt)
    assert rest == content
    assert [c["function"]["name"] for c in calls] == ["weather", "time"]
    assert _args(calls[0]) == {"city": "Oslo", "unit": "c"} and _args(calls[1]) == {}
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)


def test_text_that_is_no_call_stays_content() -> None:
    for text in ("Hello there.", '{"name": "unknown", "arguments": {}}', '{"a": 1}', "[1, 2"):
        assert parse_tool_calls(text, TOOLS, GENERIC) == (text, [])
    bad = '<tool_call>{"name": "weather", "arguments": 3}</tool_call>'
    assert parse_tool_calls(bad, TOOLS, HERMES) == (bad, [])


def test_reasoning_formats() -> None:
    text = "<think>\nsum 2+2\n</think>\n\nIt is 4."
    assert split_reasoning(text, "none") == (None, text)
    assert split_reasoning(text, "auto") == ("sum 2+2", "It is 4.")
    assert split_reasoning(text, "deepseek") == ("sum 2+2", "It is 4.")
    assert split_reasoning(text, "deepseek-legacy") == ("sum 2+2", text)
    # the template opened the block in the prompt (Qwen3's thinking, forced open)
    assert split_reasoning("sum 2+2</think>It is 4.", "auto") == ("sum 2+2", "It is 4.")
    assert split_reasoning("<think>still going", "auto") == ("still going", "")
    assert split_reasoning("plain", "auto") == (None, "plain")
    assert split_reasoning("still going", "auto", opened=True) == ("still going", "")
    assert split_reasoning("<think>a", "deepseek-legacy") == ("a", "<think>a")


REPLIES = [
    "<think>\nsum 2+2\n</think>\n\nIt is 4.",
    "  <think> a b \n</think> It is 4. ",
    "<think>still going ",
    "plain text",
    "<thi",
    " plain",
    "<think></think>x",
    "<think>a</thin",
    "<think>a</think></think>b",
    "sum 2+2</think>It is 4.",  # a block the prompt opened
]


@pytest.mark.parametrize("fmt", REASONING_FORMATS)
@pytest.mark.parametrize("opened", [False, True])
def test_streamed_reasoning_equals_the_whole_reply_split(fmt: str, opened: bool) -> None:
    """Every reply cut into three pieces at every pair of places (tags split across pieces
    included): the deltas add up to what split_reasoning makes of the whole reply."""
    for text in REPLIES:
        if not opened and "</think>" in text and not text.lstrip().startswith("<think>"):
            continue  # an unopened close: only the whole reply shows it (split_reasoning)
        reasoning, content = split_reasoning(text, fmt, opened)
        for i in range(len(text) + 1):
            for j in range(i, len(text) + 1):
                stream, r, c = ReasoningStream(fmt, opened), "", ""
                for k, piece in enumerate((text[:i], text[i:j], text[j:])):
                    dr, dc = stream.feed(piece, final=k == 2)
                    r, c = r + dr, c + dc
                assert (r, c) == (reasoning or "", content), (text, i, j)


def test_tool_choice_checks_and_call_schema() -> None:
    assert check_tools(None, None) == ([], "none")
    assert check_tools(TOOLS, None)[1] == "auto"
    for tools, choice, field in [
        ([{"name": "x"}], None, "tools"),
        (TOOLS, "always", "tool_choice"),
        ([], "required", "tool_choice"),
        (TOOLS, {"type": "function", "function": {"name": "nope"}}, "tool_choice"),
    ]:
        with pytest.raises(ConfigError) as e:
            check_tools(tools, choice)
        assert e.value.field == field
    named = call_schema(TOOLS, {"type": "function", "function": {"name": "time"}}, LLAMA3)
    assert named["properties"]["name"] == {"const": "time"} and "parameters" in named["required"]
    assert len(call_schema(TOOLS, "required", GENERIC)["anyOf"]) == 2


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_required_and_named_calls_always_parse_and_validate(temperature) -> None:
    msgs = [{"role": "user", "content": "w?"}]

    async def body(s, engine):
        outs = []
        for seed, choice in enumerate(
            ["required", {"type": "function", "function": {"name": "weather"}}] * 2
        ):
            req = {
                "messages": msgs,
                "tools": TOOLS,
                "tool_choice": choice,
                "max_tokens": 88,
                "temperature": temperature,
                "seed": seed,
            }
            outs.append((choice, await post(s, "/v1/chat/completions", req)))
        none = await post(
            s,
            "/v1/chat/completions",
            {"messages": msgs, "tools": TOOLS, "tool_choice": "none", "max_tokens": 4},
        )
        return outs, none

    outs, none = run(body, _tools_engine())
    for choice, out in outs:
        c = out["choices"][0]
        assert c["finish_reason"] == "tool_calls", c
        (call,) = c["message"]["tool_calls"]
        assert c["message"]["content"] is None
        name = call["function"]["name"]
        if isinstance(choice, dict):
            assert name == "weather"
        params = next(t for t in TOOLS if t["function"]["name"] == name)["function"]["parameters"]
        jsonschema.validate(_args(call), params)
    assert "tool_calls" not in none["choices"][0]["message"]


def test_streamed_tool_calls_as_openai_deltas() -> None:
    async def body(s, engine):
        req = {
            "messages": [{"role": "user", "content": "w?"}],
            "tools": TOOLS,
            "tool_choice": {"type": "function", "function": {"name": "weather"}},
            "max_tokens": 88,
        }
        return await sse(s, "/v1/chat/completions", req)

    events = run(body, _tools_engine())
    deltas = [e["choices"][0]["delta"] for e in events]
    assert deltas[0] == {"role": "assistant"}
    head, args = deltas[1]["tool_calls"][0], deltas[2]["tool_calls"][0]
    assert head["index"] == 0 and head["type"] == "function" and head["id"].startswith("call_")
    assert head["function"] == {"name": "weather", "arguments": ""}
    jsonschema.validate(json.loads(args["function"]["arguments"]), WEATHER)
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_streamed_reasoning_content_deltas_over_http() -> None:
    """A reply forced (by a grammar) to think first: streamed, the block arrives as
    reasoning_content deltas and the rest as content, the same as the whole reply's message."""
    grammar = 'root ::= "<think>" [a-z]{2,6} "</think>" [a-z]{1,4}'
    req = {
        "messages": [{"role": "user", "content": "q"}],
        "grammar": grammar,
        "max_tokens": 40,
        "temperature": 0,
    }

    async def body(s, engine):
        whole = await post(s, "/v1/chat/completions", req)
        return whole, await sse(s, "/v1/chat/completions", req)

    whole, events = run(body, _engine(EosBytes()))
    message = whole["choices"][0]["message"]
    assert message["reasoning_content"] and "<think>" not in message["content"]
    deltas = [e["choices"][0]["delta"] for e in events]
    assert any("reasoning_content" in d and "content" not in d for d in deltas)
    assert "".join(d.get("reasoning_content", "") for d in deltas) == message["reasoning_content"]
    assert "".join(d.get("content") or "" for d in deltas) == message["content"]


def test_tools_reach_a_template_that_does_not_render_them() -> None:
    """Gemma 3's template never looks at ``tools``: they are described in the system message
    (merged into one the request has) in the generic format parse_tool_calls reads."""
    tpl = ChatTemplate(
        source="{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    )
    assert not template_takes_tools(tpl.source)
    hi = [{"role": "user", "content": "hi"}]
    prompt = render_chat(tpl, {"messages": hi, "tools": TOOLS})
    assert prompt.startswith("<system>You can call these functions:") and prompt.endswith(
        "<user>hi"
    )
    assert '"name": "weather"' in prompt and '"name": "time"' in prompt and '"arguments"' in prompt
    brief = [{"role": "system", "content": "Be brief."}, *hi]
    prompt = render_chat(tpl, {"messages": brief, "tools": TOOLS})
    assert prompt.count("<system>") == 1 and prompt.index('"weather"') < prompt.index("Be brief.")
    assert render_chat(tpl, {"messages": hi}) == "<user>hi"  # no tools: untouched
    # a template that renders tools itself is left to do it
    own = ChatTemplate(
        source="{{ tools | length }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    )
    assert template_takes_tools(own.source)
    assert render_chat(own, {"messages": hi, "tools": TOOLS}) == "2hi"


def test_tools_reach_a_model_without_a_template() -> None:
    """A file without a chat template (a base model) gets the role-tagged transcript; with
    tools offered (not tool_choice none) they are described in its system message, as for a
    template that does not render them: the prompt is that transcript, token for token."""
    from edge.server import chat_prompt
    from edge.tool_calls import with_tools_in_system

    hi = [{"role": "user", "content": "hi"}]

    async def body(s, engine):
        out = {}
        for choice in ("auto", "none"):
            req = {"messages": hi, "tools": TOOLS, "tool_choice": choice, "max_tokens": 1}
            out[choice] = (await post(s, "/v1/chat/completions", req))["usage"]["prompt_tokens"]
        return out

    tok = EosBytes()
    got = run(body, _tools_engine(tok))
    assert got["auto"] == len(tok.encode(chat_prompt(with_tools_in_system(hi, TOOLS))))
    assert got["none"] == len(tok.encode(chat_prompt(hi)))
