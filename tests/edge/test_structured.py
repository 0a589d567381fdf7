"""Structured output: whatever the model's logits, the text parses and validates against the
schema the request gave (many schemas, greedy and sampled), a GBNF grammar is obeyed, and a
grammar that does not compile is a JSON 400 naming its field."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from edge.structured import GrammarError, Grammars, vocab_bytes
from lowband.models.tokenizer import ByteTokenizer
from tests.edge.test_openai_api import _engine, post, run


class EosBytes(ByteTokenizer):
    """Bytes, with NUL as the end of sequence (JSON text never holds a raw NUL)."""

    eos_token_id = 0


def _closed(schema: dict) -> dict:
    return {**schema, "additionalProperties": False}


SCHEMAS = [
    _closed(
        {
            "type": "object",
            "properties": {"ok": {"type": "boolean"}},
            "required": ["ok"],
        }
    ),
    _closed(
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 8},
                "age": {"type": "integer", "minimum": 0, "maximum": 150},
            },
            "required": ["name", "age"],
        }
    ),
    _closed(
        {
            "type": "object",
            "properties": {"color": {"enum": ["red", "green", "blue"]}},
            "required": ["color"],
        }
    ),
    _closed(
        {
            "type": "object",
            "properties": {
                "tags": {
                    "type": "array",
                    "items": {"type": "string", "maxLength": 4},
                    "maxItems": 3,
                }
            },
            "required": ["tags"],
        }
    ),
    _closed(
        {
            "type": "object",
            "properties": {
                "point": _closed(
                    {
                        "type": "object",
                        "properties": {
                            "x": {"type": "integer", "minimum": -9, "maximum": 9},
                            "y": {"type": "integer", "minimum": -9, "maximum": 9},
                        },
                        "required": ["x", "y"],
                    }
                ),
                "label": {"anyOf": [{"type": "null"}, {"type": "string", "maxLength": 5}]},
            },
            "required": ["point", "label"],
        }
    ),
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "maxItems": 4},
    {"type": "string", "pattern": "^[a-c]{2,5}$"},
    {"enum": [1, "two", None]},
]


def test_vocab_bytes_of_a_byte_tokenizer() -> None:
    tokens, special = vocab_bytes(EosBytes())
    assert tokens[65] == b"A" and tokens[0].startswith(b"\xff") and special == [0]


@pytest.mark.parametrize("temperature", [0.0, 1.5])
def test_every_schema_parses_and_validates_over_http(temperature) -> None:
    engine = _engine(EosBytes())

    async def body(s, engine):
        outs = []
        for i, schema in enumerate(SCHEMAS):
            for way in ("response_format", "json_schema")[i % 2 : i % 2 + 1]:
                req: dict = {
                    "prompt": "data: ",
                    "max_tokens": 120,
                    "temperature": temperature,
                    "seed": i,
                }
                if way == "response_format":
                    fmt = {"name": f"s{i}", "schema": schema, "strict": True}
                    req["response_format"] = {"type": "json_schema", "json_schema": fmt}
                else:
                    req["json_schema"] = schema
                out = await post(s, "/v1/completions", req)
                outs.append((schema, out["choices"][0]))
        return outs

    for schema, choice in run(body, engine):
        assert choice["finish_reason"] == "stop", choice
        jsonschema.validate(json.loads(choice["text"]), schema)


def test_chat_json_object_and_grammar() -> None:
    engine = _engine(EosBytes())

    async def body(s, engine):
        msgs = [{"role": "user", "content": "hi"}]
        g = await post(
            s,
            "/v1/chat/completions",
            {"messages": msgs, "max_tokens": 40, "grammar": 'root ::= ("yes" | "no") "!"'},
        )
        n = await post(
            s,
            "/v1/completions",
            {
                "prompt": "x",
                "max_tokens": 40,
                "temperature": 1.0,
                "seed": 1,
                "n": 3,
                "grammar": 'root ::= [0-9]+ "." [0-9]',
            },
        )
        return g, n

    g, n = run(body, engine)
    assert g["choices"][0]["message"]["content"] in ("yes!", "no!")
    for c in n["choices"]:
        whole, frac = c["text"].split(".")
        assert whole.isdigit() and frac.isdigit() and len(frac) == 1, c


def test_any_json_object_is_forced_from_the_first_token() -> None:
    g = Grammars(EosBytes(), 256)
    m = g.compile("json_object", None)()
    x = m.mask(torch.zeros(256))
    assert torch.isfinite(x).nonzero().flatten().tolist() == [ord("{")]
    for t in b'{"a": 1}':
        m.advance(t)
    assert torch.isfinite(m.mask(torch.zeros(256)))[0]  # complete: the end token allowed


@pytest.mark.parametrize(
    "grammar,text",
    [('root ::= [a-z]+ "."', b"abc."), ('root ::= "x" [0-9] "yz"', b"x7yz")],
)
def test_masks_computed_ahead_equal_the_grammar(grammar: str, text: bytes) -> None:
    """Sparse (few allowed) and dense masks, computed on the grammar thread while the caller
    works, keep exactly the allowed tokens' logits and set every other one to -inf."""
    g = Grammars(EosBytes(), 256)
    c = g.compile("gbnf", grammar)
    m, ref = c(), c()  # ref: llguidance asked directly, on this thread
    logits = torch.randn(256, generator=torch.Generator().manual_seed(0))
    for t in [*text, 0]:
        allowed = torch.zeros(256, dtype=torch.bool)
        bits = ref._m.compute_bitmask()
        for i in range(256):
            allowed[i] = bool(bits[i // 8] >> (i % 8) & 1) or (i == 0 and ref._m.is_accepting())
        x = m.mask(logits.clone())
        assert torch.equal(torch.isfinite(x), allowed), chr(t)
        assert torch.equal(x[allowed], logits[allowed])
        m.advance(t)
        if t:
            ref._m.consume_token(t)
    assert m.done
    g.close()


def test_a_complete_grammar_ends_without_a_step_for_the_end_token() -> None:
    """Once the grammar allows nothing more, the only draw left is an end token: the request
    ends there (finish "stop") instead of running the model once more to draw it; with
    logprobs (which score that end token) the step still runs."""
    from edge.sampling import SamplingParams

    engine = _engine(EosBytes())
    c = Grammars(EosBytes(), 256).compile("gbnf", 'root ::= "ab" [0-9]')
    try:
        text, reason, n = engine.complete("x", SamplingParams(max_tokens=8, constraint=c))
        steps = engine.metrics.steps
        assert (text, reason, n, steps) == (text, "stop", 3, 3)  # prefill + 2 decode steps
        assert text[:2] == "ab" and text[2].isdigit()
        scored = [
            ev
            for ev in engine.generate("x", SamplingParams(max_tokens=8, constraint=c, logprobs=1))
        ]
        assert engine.metrics.steps - steps == 4 and scored[-1].finish_reason == "stop"
    finally:
        engine.close()


@pytest.mark.parametrize(
    "field,value",
    [
        ("grammar", "root ::= undefined_rule"),
        ("json_schema", {"type": "no-such-type"}),
        ("response_format", {"type": "xml"}),
        ("response_format", {"type": "json_schema", "json_schema": {"schema": {"type": 3}}}),
    ],
)
def test_bad_grammars_are_400_naming_the_field(field, value) -> None:
    async def body(s, engine):
        r = await s.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, field: value})
        return r.status, (await r.json())["error"]

    status, err = run(body, _engine(EosBytes()))
    assert status == 400 and err["param"] == field, err


def test_no_end_token_no_structured_output() -> None:
    with pytest.raises(Exception) as e:
        Grammars(ByteTokenizer(), 256).compile("json_object", None)
    assert "end-of-sequence" in str(e.value)
    with pytest.raises(GrammarError):
        Grammars(EosBytes(), 256).compile("gbnf", "")
