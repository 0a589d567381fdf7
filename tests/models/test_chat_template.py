# ruff: noqa: E501 - the two published templates below are kept verbatim, long lines and all
"""Chat templates rendered in our sandbox equal transformers' ``apply_chat_template`` byte for
byte (Llama 3.1 and Qwen2.5 templates as the models publish them); the end-of-turn token is
read off the template; a checkpoint directory's template is found; the sandbox holds."""

from __future__ import annotations

import json
from datetime import datetime

import pytest
import tokenizers
from transformers import PreTrainedTokenizerFast

from lowband.errors import ChatTemplateError, ConfigError
from lowband.models.chat_template import (
    build_chat_template,
    load_chat_template,
    normalize_messages,
    template_from_gguf_metadata,
)
from lowband.models.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer

# meta-llama/Llama-3.1-8B-Instruct, tokenizer_config.json "chat_template".
LLAMA31 = r"""{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}

{#- This block extracts the system message, so we can slot it into the right place. #}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}

{#- System message + builtin tools #}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{%- if builtin_tools is defined or tools is not none %}
    {{- "Environment: ipython\n" }}
{%- endif %}
{%- if builtin_tools is defined %}
    {{- "Tools: " + builtin_tools | reject('equalto', 'code_interpreter') | join(", ") + "\n\n"}}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\n" }}
{{- "Today Date: " + date_string + "\n\n" }}
{%- if tools is not none and not tools_in_user_message %}
    {{- "You have access to the following functions. To call a function, please respond with JSON for a function call." }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}

{#- Custom tools are passed in a user message with some extra guidance #}
{%- if tools_in_user_message and not tools is none %}
    {#- Extract the first user message so we can plug it in here #}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
{%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\n\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\n\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}

{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {%- if builtin_tools is defined and tool_call.name in builtin_tools %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
            {{- "<|python_tag|>" + tool_call.name + ".call(" }}
            {%- for arg_name, arg_val in tool_call.arguments | items %}
                {{- arg_name + '="' + arg_val + '"' }}
                {%- if not loop.last %}
                    {{- ", " }}
                {%- endif %}
                {%- endfor %}
            {{- ")" }}
        {%- else  %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
            {{- '{"name": "' + tool_call.name + '", ' }}
            {{- '"parameters": ' }}
            {{- tool_call.arguments | tojson }}
            {{- "}" }}
        {%- endif %}
        {%- if builtin_tools is defined %}
            {#- This means we're in ipython mode #}
            {{- "<|eom_id|>" }}
        {%- else %}
            {{- "<|eot_id|>" }}
        {%- endif %}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\n\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""

# Qwen/Qwen2.5-7B-Instruct, tokenizer_config.json "chat_template".
QWEN25 = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""


LLAMA_SPECIAL = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eom_id|>",
    "<|eot_id|>",
    "<|python_tag|>",
]
QWEN_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
WORDS = ["[UNK]", "hello", "there", "What", "is", "2", "+", "?", "It", "4", ".", "Be", "brief"]

TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": 'Météo <now> & "later"',
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}

CONVERSATIONS = {
    "user": [{"role": "user", "content": "hello there"}],
    "system+user": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2 + 2?"},
    ],
    "multi-turn": [
        {"role": "system", "content": "  Be brief.\n"},
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": "It is 4."},
        {"role": "user", "content": "héllo 世界 ✓ <b>"},
    ],
    "user-first multi-turn": [
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": " there "},
        {"role": "user", "content": "?"},
    ],
}


def _vocab(special: list[str]) -> dict[str, int]:
    return {w: i for i, w in enumerate(WORDS + special)}


def _backend(special: list[str], *, bos: str | None = None) -> tokenizers.Tokenizer:
    """A tiny word-level tokenizer with the model's special tokens (no download); with ``bos``
    its post-processor prepends BOS, as Llama 3's tokenizer.json does."""
    vocab = _vocab(special)
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.add_special_tokens([tokenizers.AddedToken(s, special=True) for s in special])
    if bos is not None:
        tok.post_processor = tokenizers.processors.TemplateProcessing(
            single=f"{bos} $A", special_tokens=[(bos, vocab[bos])]
        )
    return tok


MODELS = {
    # name: (template, special tokens, bos, eos, end of turn)
    "llama3.1": (LLAMA31, LLAMA_SPECIAL, "<|begin_of_text|>", "<|eot_id|>", "<|eot_id|>"),
    "qwen2.5": (QWEN25, QWEN_SPECIAL, None, "<|im_end|>", "<|im_end|>"),
}


def _pair(name: str):
    source, special, bos, eos, _ = MODELS[name]
    hf = PreTrainedTokenizerFast(
        tokenizer_object=_backend(special, bos=bos),
        chat_template=source,
        bos_token=bos,
        eos_token=eos,
    )
    ours = build_chat_template(source, bos_token=bos, eos_token=eos, vocabulary=_vocab(special))
    return hf, ours


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("conversation", sorted(CONVERSATIONS))
@pytest.mark.parametrize("model", sorted(MODELS))
def test_render_equals_transformers(model, conversation, add_generation_prompt) -> None:
    hf, ours = _pair(model)
    messages = CONVERSATIONS[conversation]
    want = hf.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    got = ours.render(normalize_messages(messages), add_generation_prompt=add_generation_prompt)
    assert got == want
    assert messages[-1]["content"].strip() in got
    assert (
        got.endswith("assistant<|end_header_id|>\n\n" if model == "llama3.1" else "assistant\n")
        == add_generation_prompt
    )


@pytest.mark.parametrize("model", sorted(MODELS))
def test_tools_and_template_kwargs_equal_transformers(model) -> None:
    """Tools reach the template (and through ``tojson``: no HTML escaping, no ASCII escaping,
    ``indent``), as do extra variables such as Llama's ``date_string``."""
    hf, ours = _pair(model)
    messages = CONVERSATIONS["system+user"]
    kw = {"date_string": "01 Jan 2025"} if model == "llama3.1" else {}
    want = hf.apply_chat_template(
        messages, tools=[TOOL], tokenize=False, add_generation_prompt=True, **kw
    )
    got = ours.render(normalize_messages(messages), tools=[TOOL], **kw)
    assert got == want
    assert 'Météo <now> & \\"later\\"' in got
    if model == "llama3.1":
        assert "01 Jan 2025" in got and '\n    "type": "function"' in got  # tojson(indent=4)


def test_llama_tokens_have_one_bos_like_transformers(tmp_path) -> None:
    """Llama 3's template writes <|begin_of_text|> and its tokenizer.json adds it again: the
    prompt ids have one, as transformers' apply_chat_template(tokenize=True)."""
    hf, _ = _pair("llama3.1")
    _backend(LLAMA_SPECIAL, bos="<|begin_of_text|>").save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "chat_template": LLAMA31,
                "bos_token": "<|begin_of_text|>",
                "eos_token": {"content": "<|eot_id|>", "special": True},
            }
        )
    )
    tok = load_tokenizer(tmp_path)
    assert isinstance(tok, HFTokenizer) and tok.chat_template is not None
    for messages in CONVERSATIONS.values():
        text = tok.chat_template.render(normalize_messages(messages))
        bos = _vocab(LLAMA_SPECIAL)["<|begin_of_text|>"]
        assert tok.encode(text)[:2] == [bos, bos]  # what a naive encode would feed the model
        want = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
        assert tok.chat_template.encode(tok.encode, text) == list(want["input_ids"])


@pytest.mark.parametrize("model", sorted(MODELS))
def test_end_of_turn_is_read_off_the_template(model) -> None:
    source, special, bos, eos, eot = MODELS[model]
    t = build_chat_template(
        source, bos_token=bos, eos_token=eos, vocabulary=_vocab(special), eos_token_ids=(999,)
    )
    assert t.stop_strings[0] == eot and set(t.stop_strings) == {eot, eos}
    assert t.stop_token_ids == (_vocab(special)[eot], 999)
    # No vocabulary (a byte tokenizer): the marker after the reply is still found, as text.
    t = build_chat_template(source, bos_token=bos, eos_token=None)
    assert t.stop_strings == (eot,) and t.stop_token_ids == ()


@pytest.mark.parametrize(
    "source, eot",
    [
        # google/gemma-2 style and microsoft/Phi-3 style turn ends
        (
            "{% for m in messages %}<start_of_turn>{{ m.role }}\n{{ m.content | trim }}"
            "<end_of_turn>\n{% endfor %}",
            "<end_of_turn>",
        ),
        (
            "{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}<|end|>\n{% endfor %}",
            "<|end|>",
        ),
        # Mistral: the reply ends with EOS itself
        (
            "{{ bos_token }}{% for m in messages %}{% if m.role == 'user' %}[INST] {{ m.content }}"
            " [/INST]{% else %}{{ m.content }}{{ eos_token }}{% endif %}{% endfor %}",
            "</s>",
        ),
    ],
)
def test_end_of_turn_of_other_families(source, eot) -> None:
    vocab = {"<s>": 1, "</s>": 2, "<end_of_turn>": 7, "<|end|>": 8, "<|user|>": 9}
    t = build_chat_template(source, bos_token="<s>", eos_token="</s>", vocabulary=vocab)
    assert t.stop_strings[0] == eot and t.stop_token_ids[0] == vocab[eot]
    assert set(t.stop_strings) == {eot, "</s>"} and set(t.stop_token_ids) == {vocab[eot], 2}


def test_raise_exception_is_a_typed_error() -> None:
    _, llama = _pair("llama3.1")
    # The Llama 3.1 template refuses tools when there is no user message to put them in.
    with pytest.raises(ChatTemplateError, match="no first user message"):
        llama.render([{"role": "system", "content": "x"}], tools=[TOOL])
    t = build_chat_template("{{ raise_exception('Roles must alternate') }}")
    with pytest.raises(ChatTemplateError, match="Roles must alternate"):
        t.render([{"role": "user", "content": "a"}])


@pytest.mark.parametrize(
    "source",
    [
        "{{ messages.__class__.__mro__ }}",
        "{{ ''.__class__.__subclasses__() }}",
        "{% set ns = namespace(_x=1) %}{{ ns._x }}",
        "{% set ns = namespace() %}{% set ns._y = 2 %}",
        "{{ messages.append(1) }}",  # the environment is immutable
        "{{ messages[0].update({'role': 'x'}) }}",
    ],
)
def test_sandbox_refuses_escapes(source) -> None:
    t = build_chat_template(source)
    with pytest.raises(ChatTemplateError):
        t.render([{"role": "user", "content": "a"}])


def test_template_helpers() -> None:
    def render(source: str, **kw) -> str:
        return build_chat_template(source).render(
            [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], **kw
        )

    assert render("{{ {'k': 'é<&>'} | tojson }}") == '{"k": "é<&>"}'
    assert render("{{ [1] | tojson(indent=2) }}") == "[\n  1\n]"
    assert render("{{ strftime_now('%Y') }}") == str(datetime.now().year)
    loop = "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.content }}"
    assert render(loop + "{% endfor %}") == "a"
    assert render("{% generation %}{{ messages[1].content }}{% endgeneration %}") == "b"
    assert (
        render(
            "{% set ns = namespace(n=0) %}{% for m in messages %}"
            "{% set ns.n = ns.n + 1 %}{% endfor %}{{ ns.n }}"
        )
        == "2"
    )
    assert render("{{ dict(a=1)['a'] }}{{ flag }}", flag="!") == "1!"
    # trim_blocks / lstrip_blocks: block tags leave no newline or indentation behind
    assert render("{% if true %}\n    x\n{% endif %}\n") == "    x\n"
    with pytest.raises(ChatTemplateError, match="may not set"):
        render("x", bos_token="<s>")
    with pytest.raises(ChatTemplateError, match="does not parse"):
        build_chat_template("{% if %}")


def test_normalize_messages() -> None:
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    call = {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f"}}]}
    assert normalize_messages([{"role": "user", "content": parts, "name": None}, call]) == [
        {"role": "user", "content": "a\nb"},
        {"role": "assistant", "tool_calls": [{"function": {"name": "f"}}]},
    ]
    for bad in (
        [],
        "hi",
        [{"role": "wizard", "content": "x"}],
        [{"content": "x"}],
        [{"role": "user", "content": 3}],
        [{"role": "user"}],
        [{"role": "user", "content": [{"type": "image_url", "image_url": "u"}]}],
        ["user: hi"],
    ):
        with pytest.raises(ChatTemplateError):
            normalize_messages(bad)


def test_load_from_a_checkpoint_directory(tmp_path) -> None:
    assert load_chat_template(tmp_path) is None  # a base model: no template
    ByteTokenizer().save(tmp_path)
    assert load_tokenizer(tmp_path).chat_template is None  # type: ignore[attr-defined]
    named = [
        {"name": "default", "template": "D{{ messages[0].content }}"},
        {"name": "tool_use", "template": "T{{ tools | length }}"},
    ]
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "chat_template": named,
                "bos_token": {"content": "<s>", "lstrip": False},
                "eos_token": "</s>",
                "added_tokens_decoder": {"2": {"content": "</s>", "special": True}},
            }
        )
    )
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 32007]}))
    t = load_tokenizer(tmp_path).chat_template  # type: ignore[attr-defined]
    assert t is not None and t.bos_token == "<s>" and t.eos_token == "</s>"
    assert t.render([{"role": "user", "content": "x"}]) == "Dx"
    assert t.render([{"role": "user", "content": "x"}], tools=[TOOL]) == "T1"
    assert t.stop_strings == ("</s>",) and t.stop_token_ids == (2, 32007)
    # chat_template.jinja (transformers' newer layout) takes precedence
    (tmp_path / "chat_template.jinja").write_text("J{{ messages | length }}")
    t = load_chat_template(tmp_path)
    assert t is not None and t.render([{"role": "user", "content": "x"}]) == "J1"
    (tmp_path / "chat_template.jinja").unlink()
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": named[1:]}))
    with pytest.raises(ConfigError, match="default"):
        load_chat_template(tmp_path)


def test_gguf_metadata() -> None:
    t = template_from_gguf_metadata(
        QWEN25, eos_token="<|im_end|>", vocabulary={"<|im_end|>": 151645}
    )
    assert t.stop_token_ids == (151645,)
    hf, _ = _pair("qwen2.5")
    messages = CONVERSATIONS["multi-turn"]
    assert t.render(messages) == hf.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    with pytest.raises(ConfigError):
        template_from_gguf_metadata(b"{{ x }}")  # type: ignore[arg-type]
