"""What the API's sampling controls and structured output cost per token on a real model:
tokens/s of the batched engine with penalties + logit bias + min-p, with a JSON schema
(llguidance) and with a GBNF grammar, each relative to the plain request, at 1 and N streams;
and the fraction of JSON outputs that parse and validate (must be 1.0).

Two rates per arm: ``tokens_per_s`` over each request's wall time (prefill and per-request
setup included: the constrained arms end when their grammar does, after fewer tokens than the
plain arm's ``max_tokens``, so this one charges them more prefill per token), and
``decode_tokens_per_s`` from each stream's first token to its last (the per-token cost).
A constrained arm is also paired with a plain request of as many tokens run right after it
(``matched_relative``: the median of the per-repeat ratios of wall-time tokens/s, prefill
included on both sides).

    python -m benchmarks.edge_api --json                        # the Gemma 3 270M Q4_K_M file
    python -m benchmarks.edge_api --gguf FILE --streams 1 4 --repeats 5 --json

Arms alternate within each repeat (plain, penalties, json, grammar, json_masked,
grammar_masked); the median of the repeats with min and max is reported. The ``*_masked`` arms
are the peer of the constrained ones: the same grammar with a mask computed for every token
(``Grammars(check_first=False)``) instead of testing the unconstrained draw first and masking
only when the grammar rejects it. The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jsonschema

from edge.engine import Engine, LocalRunner
from edge.formats.gguf import load_gguf
from edge.formats.gguf_tokenizer import tokenizer_from_gguf
from edge.sampling import SamplingParams
from edge.structured import Grammars

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
GBNF = 'root ::= "The answer is " [a-z ]+ "."'
# arms that end when their grammar does; *_masked: the same grammar with a mask computed for
# every token (Grammars(check_first=False)), the peer of testing the unconstrained draw first
CONSTRAINED = ("json", "grammar", "json_masked", "grammar_masked")
PROMPT = "Describe a person as a JSON object with name, age and hobbies:\n"


def _params(arm: str, max_tokens: int, grammars: dict[bool, Grammars]) -> SamplingParams:
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
    if arm.startswith("json"):
        return SamplingParams(**base, constraint=g.compile("json_schema", SCHEMA))
    return SamplingParams(**base, constraint=g.compile("gbnf", GBNF))


def _one(engine: Engine, params: SamplingParams) -> tuple[str, int, float]:
    """(text, tokens, seconds from the first token to the last) of one completion."""
    parts, n, first, last = [], 0, None, 0.0
    for ev in engine.generate(PROMPT, params):
        parts.append(ev.text)
        if ev.token is not None:
            n += 1
            last = time.perf_counter()
            first = last if first is None else first
    return "".join(parts), n, last - first if first is not None else 0.0


def _run(engine: Engine, params: SamplingParams, streams: int) -> tuple[float, int, float, list]:
    """(seconds, tokens generated, decode tokens/s, texts) of ``streams`` completions decoded
    together. Decode tokens/s: each stream's tokens after its first over the time from its
    first to its last, summed over the streams (no prefill, no per-request setup)."""
    t0 = time.perf_counter()
    with ThreadPoolExecutor(streams) as pool:
        outs = list(pool.map(lambda _: _one(engine, params), range(streams)))
    dt = time.perf_counter() - t0
    decode = sum((n - 1) / span for _, n, span in outs if n > 1 and span > 0)
    return dt, sum(n for _, n, _ in outs), decode, [t for t, _, _ in outs]


def _valid(text: str) -> bool:
    try:
        jsonschema.validate(json.loads(text), SCHEMA)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gguf", help="the model file (default: the Gemma 3 270M Q4_K_M file)")
    p.add_argument("--streams", type=int, nargs="+", default=[1, 4])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--json", action="store_true", help="print one JSON line last")
    a = p.parse_args(argv)
    if a.gguf:
        path = Path(a.gguf)
    else:
        from benchmarks.real_models import gemma3_270m

        path = gemma3_270m()
    tok = tokenizer_from_gguf(path)
    model = load_gguf(path).eval()
    engine = Engine(LocalRunner(model), tok, model_name=path.name, parallel=max(a.streams))
    fast = Grammars(tok, model.config.vocab_size)
    t0 = time.perf_counter()
    fast.tokenizer()  # the vocabulary's view, built once
    vocab_build_s = time.perf_counter() - t0
    grammars = {True: fast, False: Grammars(tok, model.config.vocab_size, check_first=False)}
    arms = ("plain", "penalties", *CONSTRAINED)
    result: dict = {"vocab": model.config.vocab_size, "vocab_build_s": round(vocab_build_s, 2)}
    try:
        for arm in arms:  # warm up: every arm once (a grammar's lexer is built on first use)
            engine.complete(PROMPT, _params(arm, a.max_tokens, grammars))
        for streams in a.streams:
            rates: dict[str, list[float]] = {arm: [] for arm in arms}
            decode: dict[str, list[float]] = {arm: [] for arm in arms}
            lengths: dict[str, list[float]] = {arm: [] for arm in arms}
            matched: dict[str, list[float]] = {arm: [] for arm in CONSTRAINED}
            valid, total = 0, 0
            for _ in range(a.repeats):
                for arm in arms:
                    dt, n, dec, texts = _run(engine, _params(arm, a.max_tokens, grammars), streams)
                    rates[arm].append(n / dt)
                    decode[arm].append(dec)
                    lengths[arm].append(n / streams)
                    if arm in CONSTRAINED:  # the plain request of as many tokens, right after
                        k = max(1, round(n / streams))
                        same = _params("plain", k, grammars)
                        pdt, pn, _, _ = _run(engine, same, streams)
                        matched[arm].append((n / dt) / (pn / pdt))
                    if arm.startswith("json"):
                        valid += sum(_valid(t) for t in texts)
                        total += len(texts)
            plain = statistics.median(rates["plain"])
            plain_decode = statistics.median(decode["plain"])
            row = {}
            for arm in arms:
                med = statistics.median(rates[arm])
                dec = statistics.median(decode[arm])
                row[arm] = {
                    "tokens_per_s": round(med, 2),
                    "min": round(min(rates[arm]), 2),
                    "max": round(max(rates[arm]), 2),
                    "relative": round(med / plain, 3),
                    "decode_tokens_per_s": round(dec, 2),
                    "decode_min": round(min(decode[arm]), 2),
                    "decode_max": round(max(decode[arm]), 2),
                    "decode_relative": round(dec / plain_decode, 3),
                    "tokens_per_stream": round(statistics.median(lengths[arm]), 1),
                }
                if arm in CONSTRAINED:
                    row[arm]["matched_relative"] = round(statistics.median(matched[arm]), 3)
                    row[arm]["matched_min"] = round(min(matched[arm]), 3)
                    row[arm]["matched_max"] = round(max(matched[arm]), 3)
            row["json_valid_fraction"] = valid / total if total else None
            result[f"streams_{streams}"] = row
            print(f"streams {streams}: {row}", file=sys.stderr)
    finally:
        engine.close()
        for g in grammars.values():
            g.close()
    out = {"benchmark": "edge_api", "model": path.name, "max_tokens": a.max_tokens, **result}
    print(json.dumps(out) if a.json else json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
