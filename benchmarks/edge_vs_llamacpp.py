"""lowband's edge runtime vs llama.cpp, same weights, same core, same run:
``python -m benchmarks.edge_vs_llamacpp --json`` (last line of output is JSON).

For each model (``small``: ~56 M parameters, hidden 512, 8 layers, GQA, vocab 32000; ``360m``:
the default preset of ``benchmarks.edge``) a random-init Llama is written as an F32 GGUF with
``edge.formats.gguf.write_gguf``, and llama.cpp's own quantizer (``llama_model_quantize``,
``pure`` so every matrix gets the one type) makes the Q8_0 and Q4_0 files. Both runtimes then
read the *same three files* (lowband's GGUF loader maps Q8_0/Q4_0 blocks onto its packed
layout without requantizing), so ms/token compares kernels and runtimes, not weights.

Timing: greedy decode of ``--tokens`` tokens after a ``--prompt-len`` prompt fed as token ids,
the first token (the prefill) excluded; each measurement is a child process pinned to core 0
with one thread; lowband and llama.cpp alternate, ``--repeats`` rounds, medians with min/max.
``tp2_speedup``: lowband on 2 pinned devices (``edge worker`` + master over the real
transport, cores 0 and 1, from a 2-way ``edge split`` directory) vs 1 (a 1-way split), with
the master's time inside the all-reduces (link + waiting for the other shard) reported beside
it. NOTE: this VM's two cores share one memory bus, so the two simulated
devices contend for bandwidth in a way two boards would not.

Without llama-cpp-python installed the llama.cpp columns are reported as unavailable with the
reason (``pip install 'lowband[bench]'``); without ``gguf`` nothing can run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

MODELS = {
    "small": dict(
        vocab_size=32000,
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=1024,
    ),
    "360m": dict(
        vocab_size=256,
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=32,
        num_attention_heads=16,
        num_key_value_heads=4,
        max_position_embeddings=1024,
    ),
    "tiny": dict(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    ),
}
WIDTHS = ("fp32", "int8", "q4")


def _llamacpp_reason() -> str | None:
    try:
        import llama_cpp  # noqa: F401
    except ImportError as exc:
        return f"llama-cpp-python not installed ({exc}); pip install 'lowband[bench]'"
    return None


def _pin() -> None:
    os.sched_setaffinity(0, {0})
    torch.set_num_threads(1)


def _prompt(vocab: int, n: int) -> list[int]:
    return [3 + (7 * i) % (vocab - 3) for i in range(n)]


# ---- roles (each in its own pinned process) ------------------------------------------------
def role_lowband(a) -> dict:
    _pin()
    from edge.engine import LocalRunner
    from edge.shardio import load_shard

    shard = load_shard(a.model)
    runner = LocalRunner(shard.model)
    prompt = _prompt(shard.model.config.vocab_size, a.prompt_len)
    logits = runner.forward(prompt, 0)
    tok, pos, times, out = int(torch.argmax(logits)), len(prompt), [], []
    for _ in range(a.tokens):
        out.append(tok)
        t = time.perf_counter()
        logits = runner.forward([tok], pos)
        times.append(time.perf_counter() - t)
        pos += 1
        tok = int(torch.argmax(logits))
    out.append(tok)
    return {"ms_per_token": 1e3 * statistics.median(times), "tokens": out}


def role_llamacpp(a) -> dict:
    _pin()
    import llama_cpp

    llm = llama_cpp.Llama(
        model_path=a.model,
        n_threads=1,
        n_threads_batch=1,
        n_ctx=a.prompt_len + a.tokens + 8,
        verbose=False,
    )
    prompt = _prompt(llm.n_vocab(), a.prompt_len)
    out, stamps = [], []
    for tok in llm.generate(prompt, top_k=1, temp=0.0, repeat_penalty=1.0):
        stamps.append(time.perf_counter())
        out.append(int(tok))
        if len(out) == a.tokens + 1:
            break
    gaps = [b - s for s, b in zip(stamps, stamps[1:])]  # first token (prefill) excluded
    return {"ms_per_token": 1e3 * statistics.median(gaps), "tokens": out}


# ---- orchestration ---------------------------------------------------------------------------
def _run_role(args: list[str], timeout: float) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.edge_vs_llamacpp", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if out.returncode != 0:
        raise RuntimeError(f"role {args[:2]} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _make_files(cfg: dict, work: Path, have_llamacpp: bool) -> dict[str, Path]:
    """F32 GGUF written here; Q8_0 / Q4_0 from llama.cpp's quantizer when it is installed
    (else from gguf's reference quantizer, which implements the same block formats)."""
    from edge.formats.gguf import write_gguf
    from lowband.models.config import ModelConfig
    from lowband.models.llama import LlamaForCausalLM, init_weights

    model = LlamaForCausalLM(ModelConfig(**cfg)).eval()
    init_weights(model, std=0.02, seed=0)
    files = {"fp32": write_gguf(model, work / "f32.gguf")}
    for width, ftype in (("int8", "q8_0"), ("q4", "q4_0")):
        dst = work / f"{ftype}.gguf"
        if have_llamacpp:
            import llama_cpp

            p = llama_cpp.llama_model_quantize_default_params()
            p.ftype = (
                llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0
                if ftype == "q8_0"
                else llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0
            )
            p.pure = True  # every matrix in this one type (else the head becomes Q6_K)
            p.nthread = 2
            rc = llama_cpp.llama_model_quantize(str(files["fp32"]).encode(), str(dst).encode(), p)
            if rc != 0:
                raise RuntimeError(f"llama_model_quantize {ftype} failed: {rc}")
            files[width] = dst
        else:
            files[width] = write_gguf(model, dst, ftype=ftype)
    return files


def _stats(xs: list[float]) -> dict:
    return {
        "median": round(statistics.median(xs), 3),
        "min": round(min(xs), 3),
        "max": round(max(xs), 3),
        "runs": [round(x, 3) for x in xs],
    }


def _agree(a: list[int], b: list[int]) -> float:
    return round(sum(x == y for x, y in zip(a, b)) / max(1, min(len(a), len(b))), 3)


def _kl_vs_fp32(files: dict[str, Path], prompt_len: int) -> dict:
    """Mean KL(fp32 || width) of next-token distributions over a prompt (lowband, in-process)."""
    from edge.formats.gguf import load_gguf

    ref = load_gguf(files["fp32"])
    ids = torch.tensor([_prompt(ref.config.vocab_size, prompt_len)])
    with torch.no_grad():
        p = torch.log_softmax(ref(ids).float(), -1)
        out = {}
        for w in ("int8", "q4"):
            q = torch.log_softmax(load_gguf(files[w])(ids).float(), -1)
            out[w] = round(float((p.exp() * (p - q)).sum(-1).mean()), 5)
    return out


def _tp(files: dict[str, Path], work: Path, a) -> dict:
    """lowband 2 pinned devices vs 1 through benchmarks.edge's master/worker roles, on a
    checkpoint directory converted from the GGUF (packing kept)."""
    from benchmarks import edge as eb
    from edge.formats.gguf import convert_gguf
    from edge.shardio import split_checkpoint

    out = {}
    for width in a.tp_widths:
        # Both sides run from `lowband edge split` directories, as a TP deployment would (each
        # device maps its own files: measured faster than slicing a checkpoint in memory for
        # 1 device as well as for 2).
        full = convert_gguf(files[width], work / f"dir-{width}")
        d1 = split_checkpoint(full, work / f"split1-{width}", 1)
        d = split_checkpoint(full, work / f"split2-{width}", 2)
        ns = argparse.Namespace(
            tokens=a.tokens,
            warmup=2,
            prompt_len=a.prompt_len,
            wire=a.wire,
            link_spin_us=1000.0,
            timeout=a.timeout,
        )
        one, two = [], []
        for _ in range(a.tp_repeats):  # alternate 1 and 2 devices
            one.append(
                eb._run_role(
                    [
                        "--role",
                        "single",
                        "--model",
                        str(d1),
                        "--core",
                        "0",
                        "--tokens",
                        str(a.tokens),
                        "--warmup",
                        "2",
                        "--prompt-len",
                        str(a.prompt_len),
                    ],
                    a.timeout,
                )
            )
            two.append(eb._run_tp(str(d), ns))
        m1 = statistics.median(r["decode_ms_per_token"] for r in one)
        m2 = statistics.median(r["decode_ms_per_token"] for r in two)
        ar = statistics.median(r["allreduce_ms_per_token"] for r in two)
        out[width] = {
            "ms_per_token_1dev": _stats([r["decode_ms_per_token"] for r in one]),
            "ms_per_token_2dev": _stats([r["decode_ms_per_token"] for r in two]),
            "tp2_speedup": round(m1 / m2, 3),
            # Time the master spends inside all-reduces per decoded token (link +
            # waiting for the other device), from the compiled step's own counter;
            # the rest of ms_per_token_2dev is the master's compute.
            "master_allreduce_ms_per_token": round(ar, 3),
            "master_compute_ms_per_token": round(m2 - ar, 3),
            "allreduce_native": bool(two[0].get("allreduce_native")),
            "same_tokens": two[0]["tokens"] == one[0]["tokens"],
            "bytes_per_token_wire": two[0]["bytes_per_token_wire"],
            "wire": a.wire,
        }
    return out


def bench_model(name: str, a) -> dict:
    cfg = MODELS[name]
    reason = _llamacpp_reason()
    work = Path(tempfile.mkdtemp(prefix=f"lowband-vs-llamacpp-{name}-", dir=a.workdir))
    files = _make_files(cfg, work, reason is None)
    common = ["--tokens", str(a.tokens), "--prompt-len", str(a.prompt_len)]
    ours: dict[str, list[dict]] = {w: [] for w in WIDTHS}
    theirs: dict[str, list[dict]] = {w: [] for w in WIDTHS}
    for _ in range(a.repeats):  # alternate runtimes and widths so drifting load hits all alike
        for w in WIDTHS:
            ours[w].append(
                _run_role(["--role", "lowband", "--model", str(files[w]), *common], a.timeout)
            )
            if reason is None:
                theirs[w].append(
                    _run_role(["--role", "llamacpp", "--model", str(files[w]), *common], a.timeout)
                )
    H, I, L, V = (
        cfg["hidden_size"],
        cfg["intermediate_size"],
        cfg["num_hidden_layers"],
        cfg["vocab_size"],
    )
    D = H // cfg["num_attention_heads"]
    n_params = (
        2 * V * H
        + L
        * (
            H * D * (cfg["num_attention_heads"] * 2 + 2 * cfg["num_key_value_heads"])
            + 3 * H * I
            + 2 * H
        )
        + H
    )
    ref = ours["fp32"][0]["tokens"]
    res: dict = {
        "params": n_params,
        "ms_per_token": {"lowband": {}, "llamacpp": {}},
        "ratio_vs_llamacpp": {},
        "greedy_agreement_vs_fp32": {"lowband": {}, "llamacpp": {}},
        "file_mb": {w: round(files[w].stat().st_size / 2**20, 1) for w in WIDTHS},
    }
    for w in WIDTHS:
        res["ms_per_token"]["lowband"][w] = _stats([r["ms_per_token"] for r in ours[w]])
        res["greedy_agreement_vs_fp32"]["lowband"][w] = _agree(ours[w][0]["tokens"], ref)
        if reason is None:
            res["ms_per_token"]["llamacpp"][w] = _stats([r["ms_per_token"] for r in theirs[w]])
            res["greedy_agreement_vs_fp32"]["llamacpp"][w] = _agree(theirs[w][0]["tokens"], ref)
            res["ratio_vs_llamacpp"][w] = round(
                res["ms_per_token"]["lowband"][w]["median"]
                / res["ms_per_token"]["llamacpp"][w]["median"],
                3,
            )
    if reason is not None:
        res["llamacpp"] = {"available": False, "reason": reason}
    res["kl_vs_fp32_lowband"] = _kl_vs_fp32(files, a.prompt_len)
    if a.tp_widths:
        res["tp"] = _tp(files, work, a)
        res["tp2_speedup"] = {w: r["tp2_speedup"] for w, r in res["tp"].items()}
    if not a.keep:
        import shutil

        shutil.rmtree(work, ignore_errors=True)
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.edge_vs_llamacpp", description=__doc__.split("\n")[0]
    )
    p.add_argument("--json", action="store_true", help="print only the JSON result line")
    p.add_argument("--models", default="small,360m", help=f"comma-separated, of {sorted(MODELS)}")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--tp-widths", default="fp32,q4", help="widths timed on 2 devices ('' = none)")
    p.add_argument("--tp-repeats", type=int, default=5)
    p.add_argument("--wire", default="fp32", choices=["fp32", "fp16", "bf16", "int8"])
    p.add_argument("--keep", action="store_true")
    p.add_argument("--workdir", default=None)
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--role", choices=["lowband", "llamacpp"], help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.role == "lowband":
        print(json.dumps(role_lowband(a)))
        return 0
    if a.role == "llamacpp":
        print(json.dumps(role_llamacpp(a)))
        return 0
    a.tp_widths = [w for w in a.tp_widths.split(",") if w]
    t0 = time.perf_counter()
    load0 = os.getloadavg()[0]
    result = {
        "bench": "edge_vs_llamacpp",
        "tokens": a.tokens,
        "prompt_len": a.prompt_len,
        "repeats": a.repeats,
        "threads": 1,
        "cores": "taskset core 0 (TP: 0 and 1)",
        "models": {m: bench_model(m, a) for m in a.models.split(",")},
        "bench_seconds": round(time.perf_counter() - t0, 1),
        "loadavg_1m": [round(load0, 2), round(os.getloadavg()[0], 2)],
        "cpus": os.cpu_count(),
    }
    if not a.json:
        print(json.dumps(result, indent=2))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
