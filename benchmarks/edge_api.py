"""What the API's sampling controls, structured output and tool calls cost per token on a real
model: tokens/s of the batched engine with penalties + logit bias + min-p, with a JSON schema
(llguidance), with a GBNF grammar (llama.cpp's own ``grammars/list.gbnf``, whose lists run as
long as the plain text; ``grammar_short``: a grammar done in ~6 tokens) and with tools
(``tool_choice: "required"``: the prompt rendered as the server renders a chat request with
``tools``, the call constrained by its schema), each relative to the plain request, at 1 and N
streams; and the fraction of outputs that parse and validate (JSON against the schema, tool
calls parsed back by the server's parser with arguments that validate against the tool's
parameters, lists and the short answer as their grammars write them, or a start of one
when max_tokens cut it; must be 1.0).

Two rates per arm: ``tokens_per_s`` over each request's wall time (prefill and per-request
setup included: an arm that ends when its grammar does, after fewer tokens than the plain
arm's ``max_tokens``, is charged more prefill per token), and ``decode_tokens_per_s`` from each
stream's first token to its last (the per-token cost). A constrained arm is also paired with a
plain request of as many tokens on the same prompt run right after it (``matched_relative``:
the median of the per-repeat ratios of wall-time tokens/s, prefill included on both sides; an
arm as long as the plain one on its prompt is paired with that repeat's plain arm).

``prefill_tokens_per_request``: the prompt tokens our engine computed per request of the arm
(the rest came from its prefix cache: the tools arm's prompt, 207 tokens on the Gemma 3 file,
is reused by the requests after the first that computed it, as a client with a fixed tool list
sees it; requests admitted together before any of them holds it each compute it).

``--llama-server [BINARY]``: the same arms on llama.cpp's ``llama-server`` (same file, its
own fields over HTTP, ``--jinja``), run before ours in every repeat, each relative to its own
plain arm, with the fraction of its outputs that validate (:class:`LlamaServerPeer`).
``--llama-server-chat-template FILE``: its ``--chat-template-file`` (the Gemma 3 270M file
carries no template; with its default, llama-server neither renders the tools nor constrains
``required``; Llama 3.1's published template, ``tests/edge/data/templates``, makes it do both).

    python -m benchmarks.edge_api --json                        # the Gemma 3 270M Q4_K_M file
    python -m benchmarks.edge_api --gguf FILE --streams 1 4 --repeats 5 --json
    python -m benchmarks.edge_api --streams 8 --arms penalties json grammar tools --json

Arms alternate within each repeat (plain, penalties, json, grammar, grammar_short, tools,
json_masked, grammar_masked; ``--arms`` picks some, plain always runs); the median of the
repeats with min and max is reported. The ``*_masked`` arms are the peer of the constrained
ones: the same grammar with a mask computed for every token (``Grammars(check_first=False)``)
instead of testing the unconstrained draw first and masking only when the grammar rejects it.
The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jsonschema

from edge.engine import Engine, LocalRunner
from edge.formats.gguf import load_gguf
from edge.sampling import SamplingParams
from edge.source import resolve_model
from edge.structured import Grammars
from edge.tool_calls import call_schema, parse_tool_calls

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 30}, "maxItems": 4},
    },
    "required": ["name", "age", "hobbies"],
    "additionalProperties": False,
}
# llama.cpp's own grammars/list.gbnf (vendor/llama.cpp/grammars/list.gbnf of the
# llama-cpp-python 0.3.36 source release), as published: the model writes a list as long as
# the plain arm's text, so both rates charge prefill alike
GBNF = (
    "root ::= item+\n\n# Excludes various line break characters\n"
    'item ::= "- " [^\\r\\n\\x0b\\x0c\\x85\\u2028\\u2029]+ "\\n"\n'
)
# a grammar the model completes in ~6 tokens: its wall-time rate is mostly prefill
GBNF_SHORT = 'root ::= "The answer is " [a-z ]+ "."'
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add_person",
            "description": "Store a person",
            "parameters": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 40},
                    "age": {"type": "integer", "minimum": 0, "maximum": 130},
                },
                "required": ["name", "age"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "weather",
            "description": "The weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 40}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    },
]
TOOL_ASK = [{"role": "user", "content": "Store a person named Ada who is 36 years old."}]
# arms that end when their grammar does; *_masked: the same grammar with a mask computed for
# every token (Grammars(check_first=False)), the peer of testing the unconstrained draw first
CONSTRAINED = ("json", "grammar", "grammar_short", "tools", "json_masked", "grammar_masked")
ARMS = ("plain", "penalties", *CONSTRAINED)
PROMPT = "Describe a person as a JSON object with name, age and hobbies:\n"


def tools_prompt(tok: Any) -> tuple[list[int], tuple[int, ...], str]:
    """(prompt ids, the template's end-of-turn ids, the tool-call format) of the tools arm, as
    the server renders a chat request with ``tools``: through the model's chat template, or, for
    a file without one (the Gemma 3 270M base model), its role-tagged transcript with the tools
    described in the system message."""
    from edge.server import chat_prompt, render_chat
    from edge.tool_calls import tool_format, with_tools_in_system

    template = getattr(tok, "chat_template", None)
    if template is None:
        text = chat_prompt(with_tools_in_system(TOOL_ASK, TOOLS))
        return list(tok.encode(text)), (), tool_format(None)
    text = render_chat(template, {"messages": TOOL_ASK, "tools": TOOLS})
    ends = tuple(template.stop_token_ids)
    return template.encode(tok.encode, text), ends, tool_format(template.source)


def _params(
    arm: str, max_tokens: int, grammars: dict[bool, Grammars], tools: tuple
) -> SamplingParams:
    base = {"max_tokens": max_tokens, "temperature": 0.0}
    if arm == "plain":
        return SamplingParams(**base, ignore_eos=True)
    if arm == "penalties":
        return SamplingParams(
            **base,
            ignore_eos=True,
            presence_penalty=0.5,
            frequency_penalty=0.5,
            repeat_penalty=1.1,
            min_p=0.05,
            logit_bias=((100, -5.0), (200, 2.0)),
        )
    g = grammars[not arm.endswith("_masked")]
    if arm == "tools":  # tool_choice "required": one call of one of the tools
        _, ends, fmt = tools
        schema = call_schema(TOOLS, "required", fmt)
        return SamplingParams(**base, constraint=g.compile("json_schema", schema, ends))
    if arm.startswith("json"):
        return SamplingParams(**base, constraint=g.compile("json_schema", SCHEMA))
    if arm == "grammar_short":
        return SamplingParams(**base, constraint=g.compile("gbnf", GBNF_SHORT))
    return SamplingParams(**base, constraint=g.compile("gbnf", GBNF))


def _calls_valid(calls: list) -> bool:
    """At least one call, each one of the tools with arguments that validate."""
    params = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    try:
        for c in calls:
            fn = c["function"]
            jsonschema.validate(json.loads(fn["arguments"]), params[fn["name"]])
    except (ValueError, KeyError, jsonschema.ValidationError):
        return False
    return bool(calls)


def _valid_call(text: str, fmt: str) -> bool:
    """The reply parses as tool calls that :func:`_calls_valid` accepts."""
    return _calls_valid(parse_tool_calls(text, TOOLS, fmt)[1])


def _one(engine: Engine, prompt: Any, params: SamplingParams) -> tuple[str, int, float]:
    """(text, tokens, seconds from the first token to the last) of one completion."""
    parts, n, first, last = [], 0, None, 0.0
    for ev in engine.generate(prompt, params):
        parts.append(ev.text)
        if ev.token is not None:
            n += 1
            last = time.perf_counter()
            first = last if first is None else first
    return "".join(parts), n, last - first if first is not None else 0.0


def _run(
    engine: Engine, prompt: Any, params: SamplingParams, streams: int
) -> tuple[float, int, float, list]:
    """(seconds, tokens generated, decode tokens/s, texts) of ``streams`` completions decoded
    together. Decode tokens/s: each stream's tokens after its first over the time from its
    first to its last, summed over the streams (no prefill, no per-request setup)."""
    t0 = time.perf_counter()
    with ThreadPoolExecutor(streams) as pool:
        outs = list(pool.map(lambda _: _one(engine, prompt, params), range(streams)))
    dt = time.perf_counter() - t0
    decode = sum((n - 1) / span for _, n, span in outs if n > 1 and span > 0)
    return dt, sum(n for _, n, _ in outs), decode, [t for t, _, _ in outs]


def _valid(text: str) -> bool:
    try:
        jsonschema.validate(json.loads(text), SCHEMA)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def _valid_list(text: str) -> bool:
    """Text list.gbnf allows: lines "- item" (the last one cut short by max_tokens)."""
    lines = text.split("\n")
    return (
        bool(text)
        and all(x.startswith("- ") and len(x) > 2 for x in lines[:-1])
        and (lines[-1] == "" or lines[-1].startswith("-"))
    )


def _valid_short(text: str) -> bool:
    """The short grammar's answer, whole, or (cut by max_tokens) a start of one."""
    whole = re.fullmatch(r"The answer is [a-z ]+\.", text) is not None
    return (
        whole
        or re.fullmatch(r"The answer is [a-z ]*", text) is not None
        or ("The answer is ".startswith(text))
    )


class LlamaServerPeer:
    """The same arms on llama.cpp's own ``llama-server`` (built once from the llama-cpp-python
    source release, :func:`benchmarks.edge_serving.build_llama_server`), same file, same
    cores, ``--jinja`` for tools: ``/v1/completions`` with the same prompt and its own fields
    (``json_schema``, ``grammar``, penalties, ``ignore_eos``), ``/v1/chat/completions`` with
    ``tools`` and ``tool_choice: "required"`` (its template: the file's, else its default)."""

    def __init__(
        self, path: Path, binary: str | None, slots: int, threads: int, template: str | None
    ) -> None:
        from benchmarks.edge_serving import Arm, ServerProcess, build_llama_server

        exe = Path(binary) if binary else build_llama_server(Path("~/.cache/lowband/bench"))
        argv = [str(exe), "-m", str(path), "-t", str(threads), "-tb", str(threads)]
        argv += ["-np", str(slots), "-c", str(slots * 512), "--jinja", "--host", "127.0.0.1"]
        argv += ["--port", "{port}", "--no-webui"]
        if template:
            argv += ["--chat-template-file", template]
        self.log = Path(tempfile.mkdtemp(prefix="edge-api-peer-")) / "llama-server.log"
        cores = tuple(sorted(os.sched_getaffinity(0)))[:threads]
        self.server = ServerProcess(Arm("llama-server", argv, cores, threads), self.log, 600.0)
        self.url = self.server.__enter__().url
        self.argv = argv

    def close(self) -> None:
        self.server.__exit__(None, None, None)
        shutil.rmtree(self.log.parent, ignore_errors=True)

    def body(self, arm: str, max_tokens: int) -> tuple[str, dict]:
        base: dict[str, Any] = {"max_tokens": max_tokens, "temperature": 0.0}
        if arm == "tools":
            return "/v1/chat/completions", {
                **base,
                "messages": TOOL_ASK,
                "tools": TOOLS,
                "tool_choice": "required",
            }
        base["prompt"] = PROMPT
        if arm == "plain":
            base["ignore_eos"] = True
        elif arm == "penalties":
            base.update(
                ignore_eos=True,
                presence_penalty=0.5,
                frequency_penalty=0.5,
                repeat_penalty=1.1,
                min_p=0.05,
                logit_bias=[[100, -5.0], [200, 2.0]],
            )
        elif arm.startswith("json"):
            base["json_schema"] = SCHEMA
        else:
            base["grammar"] = GBNF_SHORT if arm == "grammar_short" else GBNF
        return "/v1/completions", base

    def _post(self, route: str, body: dict) -> tuple[str, int, list]:
        req = urllib.request.Request(
            self.url + route, json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=600) as r:
            out = json.loads(r.read())
        ch = out["choices"][0]
        text = ch.get("text") if "text" in ch else (ch["message"].get("content") or "")
        calls = (ch.get("message") or {}).get("tool_calls") or []
        return text, int(out["usage"]["completion_tokens"]), calls

    def run(self, arm: str, max_tokens: int, streams: int) -> tuple[float, int, list]:
        route, body = self.body(arm, max_tokens)
        t0 = time.perf_counter()
        with ThreadPoolExecutor(streams) as pool:
            outs = list(pool.map(lambda _: self._post(route, body), range(streams)))
        return time.perf_counter() - t0, sum(n for _, n, _ in outs), outs


def _rate(xs: list[float], plain: float) -> dict[str, float]:
    """An arm's tokens/s over its repeats: median, min, max, and the median over the plain
    arm's median (ours or llama-server's, each against its own)."""
    med = statistics.median(xs)
    return {
        "tokens_per_s": round(med, 2),
        "min": round(min(xs), 2),
        "max": round(max(xs), 2),
        "relative": round(med / plain, 3),
    }


def _peer_valid(arm: str, out: tuple[str, int, list]) -> bool:
    text, _, calls = out
    if arm == "tools":
        return _calls_valid(calls)
    if arm == "grammar_short":
        return _valid_short(text)
    return _valid_list(text) if arm.startswith("grammar") else _valid(text)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gguf", help="the model file (default: the Gemma 3 270M Q4_K_M file)")
    p.add_argument("--streams", type=int, nargs="+", default=[1, 4])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS, help="plain always runs")
    p.add_argument(
        "--llama-server",
        nargs="?",
        const="",
        default=None,
        help="also run the arms on llama-server (a binary, or built once when none is given)",
    )
    p.add_argument(
        "--llama-server-chat-template",
        default=None,
        help="llama-server's --chat-template-file (its tools arm's template)",
    )
    p.add_argument("--threads", type=int, default=2, help="llama-server's threads")
    p.add_argument("--json", action="store_true", help="print one JSON line last")
    a = p.parse_args(argv)
    if a.gguf:
        path = Path(a.gguf)
    else:
        from benchmarks.real_models import gemma3_270m

        path = gemma3_270m()
    tok = resolve_model(path).tokenizer()  # as the server reads it: its template attached
    model = load_gguf(path).eval()
    engine = Engine(LocalRunner(model), tok, model_name=path.name, parallel=max(a.streams))
    fast = Grammars(tok, model.config.vocab_size)
    t0 = time.perf_counter()
    fast.tokenizer()  # the vocabulary's view, built once
    vocab_build_s = time.perf_counter() - t0
    grammars = {True: fast, False: Grammars(tok, model.config.vocab_size, check_first=False)}
    arms = ("plain", *[x for x in ARMS if x in a.arms and x != "plain"])
    tools = tools_prompt(tok)
    prompts = {arm: tools[0] if arm == "tools" else PROMPT for arm in arms}
    result: dict = {"vocab": model.config.vocab_size, "vocab_build_s": round(vocab_build_s, 2)}
    result["tool_format"] = tools[2]
    peer = None
    if a.llama_server is not None:
        peer = LlamaServerPeer(
            path, a.llama_server or None, max(a.streams), a.threads, a.llama_server_chat_template
        )
        result["llama_server_argv"] = [x.replace(str(Path.home()), "~") for x in peer.argv]
    try:
        for arm in arms:  # warm up: every arm once (a grammar's lexer is built on first use)
            engine.complete(prompts[arm], _params(arm, a.max_tokens, grammars, tools))
            if peer is not None:
                peer.run(arm, a.max_tokens, 1)
        for streams in a.streams:
            rates: dict[str, list[float]] = {arm: [] for arm in arms}
            decode: dict[str, list[float]] = {arm: [] for arm in arms}
            lengths: dict[str, list[float]] = {arm: [] for arm in arms}
            prefill: dict[str, list[float]] = {arm: [] for arm in arms}
            matched: dict[str, list[float]] = {arm: [] for arm in CONSTRAINED}
            valid = {"json": [0, 0], "tools": [0, 0], "grammar": [0, 0]}
            example: dict[str, str] = {}
            peer_rates: dict[str, list[float]] = {arm: [] for arm in arms}
            peer_lengths: dict[str, list[float]] = {arm: [] for arm in arms}
            peer_valid: dict[str, list[int]] = {arm: [0, 0] for arm in arms}
            for _ in range(a.repeats):
                if peer is not None:  # the peer's arms, then ours (alternating)
                    for arm in arms:
                        dt, n, outs = peer.run(arm, a.max_tokens, streams)
                        peer_rates[arm].append(n / dt)
                        peer_lengths[arm].append(n / streams)
                        if arm != "plain" and arm != "penalties":
                            peer_valid[arm][0] += sum(_peer_valid(arm, o) for o in outs)
                            peer_valid[arm][1] += len(outs)
                        example.setdefault(
                            "llama-server " + arm, str(outs[0][0] or outs[0][2])[:200]
                        )
                for arm in arms:
                    params = _params(arm, a.max_tokens, grammars, tools)
                    computed = engine.metrics.prompt_tokens_computed
                    dt, n, dec, texts = _run(engine, prompts[arm], params, streams)
                    computed = engine.metrics.prompt_tokens_computed - computed
                    prefill[arm].append(computed / streams)
                    rates[arm].append(n / dt)
                    decode[arm].append(dec)
                    lengths[arm].append(n / streams)
                    example.setdefault(arm, texts[0][:200])
                    k = max(1, round(n / streams))
                    if arm in CONSTRAINED and k == a.max_tokens and prompts[arm] == PROMPT:
                        matched[arm].append((n / dt) / rates["plain"][-1])  # that one ran
                    elif arm in CONSTRAINED:  # the plain request of as many tokens, right after
                        same = _params("plain", k, grammars, tools)
                        pdt, pn, _, _ = _run(engine, prompts[arm], same, streams)
                        matched[arm].append((n / dt) / (pn / pdt))
                    kind = arm.removesuffix("_masked").removesuffix("_short")
                    if kind in valid:
                        ok = {
                            "json": _valid,
                            "tools": lambda t: _valid_call(t, tools[2]),
                            "grammar": _valid_list,
                        }[kind]
                        if arm == "grammar_short":
                            ok = _valid_short
                        valid[kind][0] += sum(ok(t) for t in texts)
                        valid[kind][1] += len(texts)
            plain = statistics.median(rates["plain"])
            plain_decode = statistics.median(decode["plain"])
            row: dict[str, Any] = {}
            for arm in arms:
                dec = statistics.median(decode[arm])
                row[arm] = {
                    **_rate(rates[arm], plain),
                    "decode_tokens_per_s": round(dec, 2),
                    "decode_min": round(min(decode[arm]), 2),
                    "decode_max": round(max(decode[arm]), 2),
                    "decode_relative": round(dec / plain_decode, 3),
                    "tokens_per_stream": round(statistics.median(lengths[arm]), 1),
                    "prefill_tokens_per_request": round(statistics.median(prefill[arm]), 1),
                }
                if arm in CONSTRAINED:
                    row[arm]["matched_relative"] = round(statistics.median(matched[arm]), 3)
                    row[arm]["matched_min"] = round(min(matched[arm]), 3)
                    row[arm]["matched_max"] = round(max(matched[arm]), 3)
            for kind, (good, total) in valid.items():
                if total:
                    row[f"{kind}_valid_fraction"] = good / total
            if peer is not None:
                pplain = statistics.median(peer_rates["plain"])
                prow: dict[str, Any] = {}
                for arm in arms:
                    prow[arm] = {
                        **_rate(peer_rates[arm], pplain),
                        "tokens_per_stream": round(statistics.median(peer_lengths[arm]), 1),
                    }
                    good, total = peer_valid[arm]
                    if total:
                        prow[arm]["valid_fraction"] = good / total
                row["llama_server"] = prow
            row["example"] = example
            result[f"streams_{streams}"] = row
            print(f"streams {streams}: {row}", file=sys.stderr)
    finally:
        if peer is not None:
            peer.close()
        engine.close()
        for g in grammars.values():
            g.close()
    out = {"benchmark": "edge_api", "model": path.name, "max_tokens": a.max_tokens, **result}
    print(json.dumps(out) if a.json else json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
