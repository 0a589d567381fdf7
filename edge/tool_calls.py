"""Tool calls and reasoning in a chat reply: what the model wrote, in its own format, turned
into OpenAI's ``tool_calls`` and ``reasoning_content``; and the JSON schema that makes a
``required`` (or named) call parse whatever the model's logits.

Formats (:func:`tool_format`, from the chat template's text, as llama-server's chat-format
detection): Qwen 2.5/3 and Hermes ``<tool_call>{"name", "arguments"}</tool_call>``; Mistral
``[TOOL_CALLS][{"name", "arguments"}, ...]``; Llama 3.x ``{"name", "parameters"}`` (after
``<|python_tag|>`` or bare, several joined by ``;``); anything else a generic JSON object
``{"name", "arguments"}`` (or a list of them). Control tokens such as ``[TOOL_CALLS]`` and
``<|python_tag|>`` decode to no text, so every format also parses from its bare JSON.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from lowband.errors import ConfigError

HERMES, MISTRAL, LLAMA3, GENERIC = "hermes", "mistral", "llama3", "json"
REASONING_FORMATS = ("none", "auto", "deepseek", "deepseek-legacy")
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def tool_format(template_source: str | None) -> str:
    """The tool-call format of a chat template, from the markers its text uses."""
    src = template_source or ""
    if "<tool_call>" in src:
        return HERMES
    if "[TOOL_CALLS]" in src:
        return MISTRAL
    if "<|python_tag|>" in src or "ipython" in src or "<|eom_id|>" in src:
        return LLAMA3
    return GENERIC


def template_takes_tools(template_source: str | None) -> bool:
    """Whether a chat template renders the ``tools`` it is given (Gemma 3's, and most base
    models', never look at them)."""
    return "tools" in (template_source or "")


def with_tools_in_system(
    messages: list[dict], tools: list[dict], role: str = "system"
) -> list[dict]:
    """``messages`` with the tools described in the system message (one added first when there
    is none), for a template that does not render tools itself: the model is told the functions
    and the generic format to call them in, which :func:`parse_tool_calls` reads back (as
    llama-server's generic tool format does for such templates). ``role="user"``: in the first
    message instead, whatever its role (a template that refuses system messages, as Gemma 2's)."""
    lines = "\n".join(json.dumps(t.get("function", t), ensure_ascii=False) for t in tools)
    text = (
        "You can call these functions:\n"
        + lines
        + '\n\nTo call one, reply with only a JSON object {"name": <function name>, '
        '"arguments": <its arguments>} (a list of them for several calls); otherwise reply '
        "as usual."
    )
    if messages and (role == "user" or messages[0].get("role") == "system"):
        first = dict(messages[0])
        content = first.get("content")
        if isinstance(content, str):
            first["content"] = text + "\n\n" + content
        elif isinstance(content, list):
            first["content"] = [{"type": "text", "text": text + "\n\n"}, *content]
        else:
            first["content"] = text
        return [first, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def check_tools(tools: Any, tool_choice: Any) -> tuple[list[dict], Any]:
    """(function tools, tool_choice) checked: ``ConfigError`` naming the field otherwise.
    ``tool_choice``: "none", "auto", "required" or ``{"type": "function", "function":
    {"name"}}`` naming one of the tools; null is "auto" with tools, "none" without."""
    if tools is None:
        tools = []
    if not isinstance(tools, list) or not all(
        isinstance(t, dict)
        and t.get("type", "function") == "function"
        and isinstance(t.get("function"), dict)
        and isinstance(t["function"].get("name"), str)
        and t["function"]["name"]
        for t in tools
    ):
        raise ConfigError(
            "tools", 'must be a list of {"type": "function", "function": {"name", "parameters"}}'
        )
    if tool_choice is None:
        tool_choice = "auto" if tools else "none"
    names = [t["function"]["name"] for t in tools]
    if isinstance(tool_choice, dict):
        fn = tool_choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if tool_choice.get("type") != "function" or name not in names:
            raise ConfigError("tool_choice", f"must name one of the tools {names}")
    elif tool_choice not in ("none", "auto", "required"):
        raise ConfigError("tool_choice", 'must be "none", "auto", "required" or a function')
    if tool_choice == "required" and not tools:
        raise ConfigError("tool_choice", '"required" needs tools')
    return tools, tool_choice


def call_schema(tools: list[dict], tool_choice: Any, fmt: str) -> dict:
    """The JSON schema of one call the model must make (``required`` or a named function):
    its name one of the tools (or the named one), its arguments that tool's parameters."""
    named = tool_choice["function"]["name"] if isinstance(tool_choice, dict) else None
    key = "parameters" if fmt == LLAMA3 else "arguments"
    options = []
    for t in tools:
        fn = t["function"]
        if named is not None and fn["name"] != named:
            continue
        params = fn.get("parameters") or {"type": "object"}
        options.append(
            {
                "type": "object",
                "properties": {"name": {"const": fn["name"]}, key: params},
                "required": ["name", key],
                "additionalProperties": False,
            }
        )
    return options[0] if len(options) == 1 else {"anyOf": options}


def _json_values(text: str) -> list[Any] | None:
    """The JSON values ``text`` is made of (joined by whitespace or ``;``), or None."""
    dec, out, i = json.JSONDecoder(), [], 0
    text = text.strip()
    while i < len(text):
        try:
            v, end = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            return None
        out.append(v)
        i = end
        while i < len(text) and text[i] in " \t\r\n;":
            i += 1
    return out or None


def _as_call(v: Any, names: set[str]) -> dict | None:
    if not isinstance(v, dict) or v.get("name") not in names:
        return None
    args = v.get("arguments", v.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return {
        "id": "call_" + uuid.uuid4().hex[:24],
        "type": "function",
        "function": {"name": v["name"], "arguments": json.dumps(args, ensure_ascii=False)},
    }


def _calls(values: list[Any], names: set[str]) -> list[dict] | None:
    flat: list[Any] = []
    for v in values:
        if isinstance(v, dict) and isinstance(v.get("tool_calls"), list):
            flat.extend(v["tool_calls"])
        elif isinstance(v, list):
            flat.extend(v)
        else:
            flat.append(v)
    calls: list[dict] = []
    for v in flat:
        call = _as_call(v, names)
        if call is None:
            return None
        calls.append(call)
    return calls or None


FENCE = re.compile(r"^```(?:json)?\s*(.*?)\s*```$", re.S)
HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)


def parse_tool_calls(text: str, tools: list[dict], fmt: str) -> tuple[str | None, list[dict]]:
    """(the reply's text beside its calls, or None when it is only calls; the calls as
    OpenAI's ``tool_calls``). Text that is no call of a known tool is content, untouched."""
    names = {t["function"]["name"] for t in tools}
    if fmt == HERMES and "<tool_call>" in text:
        calls: list[dict] = []
        for body in HERMES_CALL.findall(text):
            values = _json_values(body)
            found = _calls(values, names) if values else None
            if found is None:
                return text, []
            calls.extend(found)
        rest = HERMES_CALL.sub("", text).strip()
        return rest or None, calls
    body = text.strip()
    for marker in ("[TOOL_CALLS]", "<|python_tag|>"):
        if body.startswith(marker):
            body = body[len(marker) :].strip()
    m = FENCE.match(body)
    if m:
        body = m.group(1)
    values = _json_values(body) if body[:1] in "[{" else None
    found = _calls(values, names) if values else None
    return (text, []) if found is None else (None, found)


def split_reasoning(
    text: str, reasoning_format: str, opened: bool = False
) -> tuple[str | None, str]:
    """(reasoning, content) of a reply: the text inside ``<think>...</think>`` (or before a
    ``</think>`` when the template opened the block in the prompt: ``opened``, and then all of
    it when the block never closed) is the reasoning, as llama-server's ``reasoning_format``:
    "none" leaves the text as it is, "deepseek" (and "auto") moves it out, "deepseek-legacy"
    also keeps the tags in the content."""
    if opened and reasoning_format != "none" and THINK_CLOSE not in text:
        body = text.strip()
        body = body[len(THINK_OPEN) :].strip() if body.startswith(THINK_OPEN) else body
        return body, text if reasoning_format == "deepseek-legacy" else ""
    if reasoning_format == "none" or THINK_CLOSE not in text:
        if reasoning_format != "none" and text.lstrip().startswith(THINK_OPEN):
            # still thinking (cut by max_tokens): all of it is reasoning
            body = text.lstrip()[len(THINK_OPEN) :].strip()
            return body, text if reasoning_format == "deepseek-legacy" else ""
        return None, text
    head, _, tail = text.partition(THINK_CLOSE)
    start = head.find(THINK_OPEN)
    reasoning = head[start + len(THINK_OPEN) :] if start >= 0 else head
    if reasoning_format == "deepseek-legacy":
        return reasoning.strip(), text
    return reasoning.strip(), tail.lstrip()


def _held(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that begins ``tag`` (it may continue as the tag)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class ReasoningStream:
    """A reply streamed as (reasoning, content) deltas, split as :func:`split_reasoning` splits
    the whole reply: a ``<think>`` block that opens the reply (or that the prompt left open:
    ``opened``) goes to the reasoning, without its tags and surrounding whitespace, what
    follows ``</think>`` to the content. Text that may be the start of a tag (a tag split
    across tokens) or whitespace that may end the reasoning is held until the next piece
    tells. "deepseek-legacy" also sends everything, tags included, as content; "none" sends
    everything as content."""

    def __init__(self, reasoning_format: str, opened: bool = False) -> None:
        self.fmt = reasoning_format
        self._state = "content" if reasoning_format == "none" else "start"
        self._opened = opened
        self._buf = ""
        self._lead = True  # whitespace at the start of the current part is dropped

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        """(reasoning, content) to send for ``text``; ``final``: the reply ends here."""
        legacy = text if self.fmt == "deepseek-legacy" else ""
        self._buf += text
        reasoning, content = "", ""
        if self._state == "start":
            head = self._buf.lstrip()
            if head.startswith(THINK_OPEN):
                self._state, self._buf = "reasoning", head[len(THINK_OPEN) :]
            elif (final or not THINK_OPEN.startswith(head)) and self._opened:
                self._state = "reasoning"  # the prompt opened the block
            elif final or not THINK_OPEN.startswith(head):
                self._state = "content"
                self._lead = False  # no block: the reply is left as it is
        if self._state == "reasoning":
            i = self._buf.find(THINK_CLOSE)
            if i >= 0:
                reasoning = self._part(self._buf[:i], end=True)
                self._state, self._buf, self._lead = (
                    "after",
                    self._buf[i + len(THINK_CLOSE) :],
                    True,
                )
            else:
                keep = 0 if final else _held(self._buf, THINK_CLOSE)
                out, self._buf = (
                    self._buf[: len(self._buf) - keep],
                    self._buf[len(self._buf) - keep :],
                )
                reasoning = self._part(out, end=final)
                if final:
                    self._buf = ""
        if self._state in ("content", "after"):
            out, self._buf = self._buf, ""
            if self._lead:
                out = out.lstrip()
                self._lead = not out
            content = out
        if self.fmt == "deepseek-legacy":
            content = legacy
        elif self.fmt == "none":
            content = text
        return reasoning, content

    def _part(self, text: str, end: bool) -> str:
        """Reasoning text to send: leading whitespace of the block dropped, trailing whitespace
        held back (it is dropped when the block ends there)."""
        if self._lead:
            text = text.lstrip()
            self._lead = not text
        if end:
            return text.rstrip()
        body = text.rstrip()
        self._buf = text[len(body) :] + self._buf  # held whitespace comes before the rest
        return body
