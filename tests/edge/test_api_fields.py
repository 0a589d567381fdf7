"""The whole request-field table of edge.api_fields, walked over HTTP: every field on every
endpoint is answered as the table says (200 for what is used or changes nothing, a JSON 400
naming it for what is refused, 200 again for a refused field at its neutral value), and an
unknown field is accepted, logged once and counted in /metrics."""

from __future__ import annotations

import asyncio
import logging

from edge.api_fields import (
    CHAT,
    COMPLETIONS,
    EMBEDDINGS,
    ENDPOINTS,
    FIELDS,
    Kind,
    UnknownFields,
    check_fields,
)
from lowband.models.tokenizer import ByteTokenizer
from tests.edge.test_openai_api import CFG, run
from tests.edge.test_tool_calls import _tools_engine

PATHS = {
    CHAT: "/v1/chat/completions",
    COMPLETIONS: "/v1/completions",
    EMBEDDINGS: "/v1/embeddings",
}
BASE: dict[str, dict] = {
    CHAT: {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
    COMPLETIONS: {"prompt": "hi", "max_tokens": 1},
    EMBEDDINGS: {"input": "hi"},
}

# A valid value of every used field (with whatever it needs beside it)
USED: dict[str, dict] = {
    "model": {"model": "tiny"},
    "messages": {},
    "prompt": {},
    "stream": {"stream": False},
    "stream_options": {"stream": True, "stream_options": {"include_usage": True}},
    "n": {"n": 2},
    "max_tokens": {"max_tokens": 1},
    "max_completion_tokens": {"max_completion_tokens": 1},
    "stop": {"stop": ["\n"]},
    "temperature": {"temperature": 0.5},
    "top_p": {"top_p": 0.9},
    "seed": {"seed": 3},
    "logprobs": {"logprobs": True},  # chat; completions below
    "top_logprobs": {"logprobs": True, "top_logprobs": 2},
    "echo": {"echo": True},
    "top_k": {"top_k": 5},
    "min_p": {"min_p": 0.05},
    "typical_p": {"typical_p": 0.9},
    "presence_penalty": {"presence_penalty": 0.5},
    "frequency_penalty": {"frequency_penalty": 0.5},
    "repeat_penalty": {"repeat_penalty": 1.1},
    "repeat_last_n": {"repeat_last_n": 16},
    "logit_bias": {"logit_bias": {"104": 3}},
    "response_format": {"response_format": {"type": "text"}},
    "json_schema": {"json_schema": None},
    "grammar": {"grammar": ""},
    "ignore_eos": {"ignore_eos": True},
    "tools": {"tools": []},
    "tool_choice": {
        "tools": [{"type": "function", "function": {"name": "f"}}],
        "tool_choice": "auto",
    },
    "reasoning_format": {"reasoning_format": "deepseek"},
    "chat_template_kwargs": {"chat_template_kwargs": {}},
    "add_generation_prompt": {"add_generation_prompt": False},
    "continue_final_message": {
        "continue_final_message": True,
        "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "So"}],
    },
    "input": {},
    "encoding_format": {"encoding_format": "base64"},
    "dimensions": {"dimensions": CFG.hidden_size},
}
NO_OP = {
    "user": "u1",
    "metadata": {"k": "v"},
    "store": True,
    "service_tier": "auto",
    "prompt_cache_key": "k",
    "safety_identifier": "s",
    "cache_prompt": True,
    "id_slot": 0,
    "n_keep": 4,
    "timings_per_token": True,
    "penalize_nl": True,
    "return_tokens": True,
    "parallel_tool_calls": True,
}
NOT_NEUTRAL = {
    "response_format": {"type": "json_object"},
    "tool_choice": "required",
    "reasoning_format": "deepseek",
}


def _cases() -> list[tuple[str, str, dict, int]]:
    """(endpoint, field, request fields, expected status) for every field on every endpoint."""
    out = []
    for name, f in FIELDS.items():
        for ep in ENDPOINTS:
            if f.kind is Kind.USED and ep in f.endpoints:
                extra = USED[name]
                if name == "logprobs" and ep == COMPLETIONS:
                    extra = {"logprobs": 2}
                out.append((ep, name, extra, 200))
            elif f.kind is Kind.NO_OP and ep in f.endpoints:
                out.append((ep, name, {name: NO_OP[name]}, 200))
            else:
                out.append((ep, name, {name: NOT_NEUTRAL.get(name, 0.5)}, 400))
                for v in f.neutral[:1]:
                    out.append((ep, name, {name: v}, 200))
    return out


def test_every_field_of_the_table_is_walked() -> None:
    used = {n for n, f in FIELDS.items() if f.kind is Kind.USED}
    no_op = {n for n, f in FIELDS.items() if f.kind is Kind.NO_OP}
    assert used == set(USED) and no_op == set(NO_OP)
    cases = _cases()
    assert {c[1] for c in cases} == set(FIELDS)
    assert sum(c[3] == 400 for c in cases) > 50  # refused, and sent to the wrong endpoint


def test_the_table_over_http() -> None:
    cases = _cases()

    async def one(s, ep: str, name: str, extra: dict, status: int) -> str:
        req = {**BASE[ep], **extra}
        if "max_completion_tokens" in extra:
            req.pop("max_tokens", None)
        r = await s.post(PATHS[ep], json=req)
        text = await r.text()
        assert r.status == status, (ep, name, extra, text)
        if status == 400:
            err = (await r.json())["error"]
            assert err["param"] == name and name in err["message"], (ep, name, err)
        return name

    async def body(s, engine):
        gate = asyncio.Semaphore(8)  # within the server's queue

        async def gated(c):
            async with gate:
                return await one(s, *c)

        return await asyncio.gather(*(gated(c) for c in cases))

    # room for the tools a template-less prompt describes
    assert len(run(body, _tools_engine(ByteTokenizer()))) == len(cases)


def test_unknown_fields_are_accepted_logged_once_and_counted(caplog) -> None:
    assert check_fields({"prompt": "x", "brand_new": 1}, COMPLETIONS) == (None, ["brand_new"])

    async def body(s, engine):
        for _ in range(3):
            r = await s.post("/v1/completions", json={"prompt": "x", "max_tokens": 1, "zz": 1})
            assert r.status == 200
        return await (await s.get("/metrics")).json(), await (
            await s.get("/metrics?format=prometheus")
        ).text()

    with caplog.at_level(logging.WARNING, logger="edge.api_fields"):
        snap, prom = run(body)
    assert snap["unknown_fields_total"] == 3 and snap["unknown_fields"] == {"zz": 3}
    assert "lowband_server_unknown_fields_total" in prom
    assert sum("'zz'" in r.getMessage() for r in caplog.records) == 1


def test_unknown_field_names_are_bounded() -> None:
    u = UnknownFields(max_names=2)
    u.note(["a", "b", "c", "a"])
    assert u.total == 4 and dict(u.counts) == {"a": 2, "b": 1}


def test_the_docs_list_every_field() -> None:
    from pathlib import Path

    doc = (Path(__file__).parents[2] / "docs" / "edge-serving.md").read_text()
    missing = [n for n in FIELDS if f"`{n}`" not in doc]
    assert not missing, missing
