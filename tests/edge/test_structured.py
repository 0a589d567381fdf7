"""Structured output: whatever the model's logits, the text parses and validates against the
schema the request gave (many schemas, greedy and sampled), a GBNF grammar is obeyed, and a
grammar that does not compile is a JSON 400 naming its field."""

from __future__ import annotations

import json

import jsonschema
import llguidance
import pytest
import torch

from edge.structured import GrammarError, Grammars, Matcher, vocab_bytes
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
    m = c()
    # ref: llguidance asked directly, on this thread (a second Matcher would have its first
    # mask in flight on the grammar thread, and llguidance refuses a matcher borrowed twice)
    ref = llguidance.LLMatcher(g.tokenizer(), c.grammar, log_level=0)
    logits = torch.randn(256, generator=torch.Generator().manual_seed(0))
    for t in [*text, 0]:
        allowed = torch.zeros(256, dtype=torch.bool)
        bits = ref.compute_bitmask()
        for i in range(256):
            allowed[i] = bool(bits[i // 8] >> (i % 8) & 1) or (i == 0 and ref.is_accepting())
        x = m.mask(logits.clone())
        assert torch.equal(torch.isfinite(x), allowed), chr(t)
        assert torch.equal(x[allowed], logits[allowed])
        m.advance(t)
        if t:
            ref.consume_token(t)
    assert m.done
    g.close()


WALKS = [
    ("gbnf", 'root ::= "The answer is " [a-z ]+ "."', b"The answer is ok."),
    ("gbnf", 'root ::= ("yes" | "no") "!"', b"no!"),
    ("json_schema", SCHEMAS[1], b'{"name": "Bo", "age": 31}'),
    ("json_schema", SCHEMAS[3], b'{"tags": ["ab", "c"]}'),
]


@pytest.mark.parametrize("kind,source,text", WALKS)
@pytest.mark.parametrize("ahead", [False, True])
def test_allows_is_exactly_the_mask(kind, source, text, ahead) -> None:
    """At every position of a valid text, the one-token test the sampler asks first accepts
    exactly the tokens the mask keeps (forced text included, where the mask keeps only the
    canonical token), whether or not the mask was computed ahead."""
    g = Grammars(EosBytes(), 256)
    c = g.compile(kind, source)
    for k in range(len(text) + 1):
        m = Matcher(g.tokenizer(), c.grammar, c.ends, g.pool() if ahead else None)
        ref = Matcher(g.tokenizer(), c.grammar, c.ends, None)
        for t in text[:k]:
            m.advance(t)
            ref.advance(t)
        kept = torch.isfinite(ref.mask(torch.zeros(256)))
        assert [m.allows(i) for i in range(256)] == kept.tolist(), text[:k]
    g.close()


class Pieces:
    """A SentencePiece-like vocabulary with multi-byte pieces ("The", "Th", " answer" ...)
    beside the 256 bytes: forced text can be written more than one way, and the grammar's
    mask keeps only its canonical token."""

    PIECES = ["The", "Th", "▁answer", "▁ans", "▁is", "▁ok", "ok", '{"', '":', "name", '▁"', "no"]

    def __init__(self) -> None:
        from types import SimpleNamespace

        from edge.formats.gguf_tokenizer import BYTE, CONTROL, NORMAL

        tokens = ["<eos>"] + [f"<0x{b:02X}>" for b in range(256)] + self.PIECES
        types = [CONTROL] + [BYTE] * 256 + [NORMAL] * len(self.PIECES)
        self.vocab = SimpleNamespace(model="llama", tokens=tokens, token_types=types)
        self.vocab_size, self.eos_token_id = len(tokens), 0
        self._text = {p.replace("▁", " ").encode(): 257 + i for i, p in enumerate(self.PIECES)}

    def encode(self, text: str, add_special: bool = False) -> list[int]:
        data, out = text.encode(), []
        while data:  # longest piece first, else the byte
            n = max((len(p) for p in self._text if data.startswith(p)), default=0)
            out.append(self._text[data[:n]] if n else 1 + data[0])
            data = data[max(n, 1) :]
        return out


@pytest.mark.parametrize(
    "kind,source,text",
    [
        ("gbnf", 'root ::= "The answer is " [a-z ]+ "."', "The answer is ok."),
        ("json_schema", SCHEMAS[1], '{"name": "Th", "age": 7}'),
    ],
)
def test_allows_is_exactly_the_mask_with_multibyte_pieces(kind, source, text) -> None:
    """Where text is forced ("The answer is ", '{"name": "'), a piece that is only a prefix
    of it ("T", "Th", " ans") fits the grammar, but the mask keeps the canonical piece only:
    the one-token test answers as the mask does there too."""
    tok = Pieces()
    g = Grammars(tok, tok.vocab_size)
    c = g.compile(kind, source)
    ids = tok.encode(text)
    forced = 0
    for k in range(len(ids) + 1):
        m = Matcher(g.tokenizer(), c.grammar, c.ends, None)
        ref = Matcher(g.tokenizer(), c.grammar, c.ends, None)
        for t in ids[:k]:
            m.advance(t)
            ref.advance(t)
        kept = torch.isfinite(ref.mask(torch.zeros(tok.vocab_size)))
        fits = [ref._m.validate_tokens([i]) == 1 for i in range(1, tok.vocab_size)]
        forced += fits != kept[1:].tolist()  # more pieces fit than the mask keeps
        assert [m.allows(i) for i in range(tok.vocab_size)] == kept.tolist(), ids[:k]
    assert forced  # the case this test is about occurred
    g.close()


def _walk(c, text: bytes, seed: int) -> tuple[list[int], int]:
    """A greedy completion under ``c`` from random logits (seeded) that favour ``text``'s next
    byte 2 times in 3, and how many of its draws were not the unconstrained argmax."""
    from edge.sampling import Sampler, SamplingParams

    gen = torch.Generator().manual_seed(seed)
    s = Sampler(SamplingParams(temperature=0.0, constraint=c))
    toks: list[int] = []
    rejected = 0
    while not s.constraint.done and not s.ended and len(toks) < 60:
        x = torch.randn(256, generator=gen)
        if len(toks) < len(text) and torch.rand((), generator=gen) < 2 / 3:
            x[text[len(toks)]] += 10.0
        given = x.clone()
        toks.append(s(x))
        assert torch.equal(x, given)  # the model's logits are left as they were (logprobs)
        rejected += toks[-1] != int(torch.argmax(x))
    return toks, rejected


@pytest.mark.parametrize("kind,source,text", WALKS)
def test_greedy_draw_first_equals_mask_first(kind, source, text) -> None:
    """Greedy: testing the unconstrained argmax first draws the same tokens as masking first
    (allowed argmaxes and rejected ones both occur in these walks)."""
    rejected = drawn = 0
    for seed in range(4):
        fast = Grammars(EosBytes(), 256).compile(kind, source)
        slow = Grammars(EosBytes(), 256, check_first=False).compile(kind, source)
        toks, n = _walk(fast, text, seed)
        again, _ = _walk(slow, text, seed)
        assert toks == again
        rejected, drawn = rejected + n, drawn + len(toks)
        fast.grammars.close()
        slow.grammars.close()
    assert 0 < rejected < drawn


def test_an_allowed_draw_computes_no_mask(monkeypatch) -> None:
    """Where the grammar accepts the unconstrained draw, no mask is computed: only the one
    computed ahead at creation; masking first computes one per token."""
    calls = {"n": 0}
    compute = Matcher._compute

    def counted(self):
        calls["n"] += 1
        return compute(self)

    monkeypatch.setattr(Matcher, "_compute", counted)
    from edge.sampling import Sampler, SamplingParams

    for check_first, masks in ((True, 0), (False, 7)):
        c = Grammars(EosBytes(), 256, check_first=check_first).compile("gbnf", "root ::= [a-z]+")
        s = Sampler(SamplingParams(temperature=0.0, constraint=c))
        s.constraint._wait()  # the mask computed ahead at creation, used by the first draw
        calls["n"] = 0
        for t in b"lowband":
            x = torch.zeros(256)
            x[t] = 5.0
            assert s(x) == t
        s.constraint._wait()  # the one ahead for the next position, if any, is done
        assert calls["n"] == masks, check_first
        c.grammars.close()


def test_sampled_draw_first_is_the_masked_distribution() -> None:
    """Sampling (no truncation): draw, and redraw from the masked distribution when the grammar
    rejects the draw; each allowed token comes out with its masked probability p(t)/p(A)."""
    from edge.sampling import Sampler, SamplingParams

    c = Grammars(EosBytes(), 256).compile("gbnf", 'root ::= [a-d] "."')
    logits = torch.randn(256, generator=torch.Generator().manual_seed(0))
    logits[ord("a")] += 3.0  # mass on an allowed token, and on forbidden ones
    logits[ord("x")] += 3.5
    allowed = [ord(ch) for ch in "abcd"]
    want = torch.softmax(logits[allowed], -1)
    counts = torch.zeros(4)
    n = 4000
    for i in range(n):
        s = Sampler(SamplingParams(temperature=1.0, seed=i, constraint=c))
        tok = s(logits)
        assert tok in allowed
        counts[allowed.index(tok)] += 1
    assert torch.allclose(counts / n, want, atol=0.03), (counts / n, want)
    c.grammars.close()


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


def test_a_grammar_compiled_again_is_the_one_kept(monkeypatch) -> None:
    """The same grammar (and ends) compiled again is the constraint kept from before (not
    parsed again, its lexer warm); other ends or another grammar are not; the least recently
    used is dropped past Grammars.CACHED."""
    monkeypatch.setattr(Grammars, "CACHED", 2)
    g = Grammars(EosBytes(), 256)
    a = g.compile("json_schema", SCHEMAS[0])
    assert g.compile("json_schema", dict(SCHEMAS[0])) is a
    assert g.compile("json_schema", SCHEMAS[0], ends=(7,)) is not a
    assert g.compile("json_schema", SCHEMAS[0], ends=(7,)).ends == (0, 7)
    b = g.compile("gbnf", 'root ::= "x"')
    assert g.compile("gbnf", 'root ::= "x"') is b
    assert g.compile("json_schema", SCHEMAS[0]) is not a  # dropped: two others came after
    with pytest.raises(GrammarError):
        g.compile("gbnf", "root ::= nothing")  # a bad grammar is refused each time
    with pytest.raises(GrammarError):
        g.compile("gbnf", "root ::= nothing")
    g.close()


def test_a_grammar_end_token_ends_the_completion() -> None:
    """An end token of the grammar that the request's own stops do not name (a template's end
    of turn on /v1/completions) ends the completion: nothing after it would be constrained."""
    from edge.sampling import SamplingParams

    class EogBytes(EosBytes):
        eog_token_ids = (1,)

    tok = EogBytes()
    g = Grammars(tok, 256)
    c = g.compile("gbnf", 'root ::= "a"+')
    engine = _engine(tok)
    try:
        for bias, want in (((1, 100.0),), "a"), (((0, 100.0),), "a"), ((), None):
            params = SamplingParams(max_tokens=6, constraint=c, logit_bias=bias)
            text, finish, _ = engine.complete("x", params)
            if want is None:  # no end token pushed: "a"s to max_tokens, or an end
                assert set(text) <= {"a"} and text
            else:
                assert (text, finish) == (want, "stop")
    finally:
        engine.close()
        g.close()
