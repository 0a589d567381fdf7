"""lowband's edge runtime vs llama.cpp, same GGUF files, same cores, same run:
``python -m benchmarks.edge_vs_llamacpp --json`` (last line of output is JSON).

Models (``--models``): ``llama32-1b`` and ``qwen25-0.5b`` are random-init models at the exact
shapes of Llama-3.2-1B (hidden 2048, 16 layers, GQA 32/8, FFN 8192, vocab 128256, tied, rope
theta 500000 with Llama 3's ``rope_freqs``) and Qwen2.5-0.5B (hidden 896, 24 layers, GQA 14/2,
FFN 4864, vocab 151936, tied, q/k/v biases, ``qwen2`` architecture), carrying the real
tokenizer's metadata (llama.cpp's ``ggml-vocab-llama-bpe.gguf`` / ``ggml-vocab-qwen2.gguf``,
from the llama-cpp-python source release). ``small``, ``360m``, ``tiny`` and ``tiny-qwen2`` are
smaller shapes with a placeholder vocabulary; ``qwen3moe-mini`` has Qwen3-MoE's layers (q/k
RMSNorms, head_dim 128, GQA 4:1, 128 routed experts of which 8 are used per token and
renormalised, ``qwen3moe`` architecture) at a size this machine holds: hidden 1024, 6 layers,
expert width 256, a placeholder vocabulary of 32000 (Qwen3-30B-A3B: hidden 2048, 48 layers,
expert width 768, vocabulary 151936); ``tiny-qwen3moe`` is its smoke-test size; ``markov-512``
is trained here (a few minutes on one core, :func:`write_trained_f32`) so that its logits have
margins. Each is written as an F32 GGUF with ``gguf.GGUFWriter`` (tensors streamed, never all
in memory), then llama.cpp's quantizer
(``llama_model_quantize``) makes each ``--widths`` file (``q4_k_m``: its Q4_K/Q6_K mix; ``q8_0``;
``q4_0`` pure). Files are cached under ``--cache`` (default ``~/.cache/lowband/bench``).

Per (model, width, threads), both runtimes read the *same file*, alternating, ``--repeats``
rounds, each measurement a child process pinned to cores ``0..threads-1`` (with libgomp's wait
policy as ``lowband edge`` sets it, :func:`role_env`; the result's ``openmp_env``):

* ``ms_per_token``: greedy decode of ``--tokens`` tokens after a ``--prompt-len`` prompt of
  token ids, the first token (the prefill) excluded; median with min/max over the rounds;
* ``ratio_vs_llamacpp``: lowband's median / llama.cpp's;
* ``prefill_ms``: the ``--prompt-len`` prompt in one call to its first logits (lowband's
  ``forward``; llama.cpp's whole-prompt batch and first token), median with min/max, and
  ``prefill_ratio_vs_llamacpp``;
* ``greedy_agreement``: fraction of the ``--tokens`` greedy tokens equal between the runtimes
  (the same prompt ids fed to both), and the first position where they differ;
* ``kl_vs_f32``: mean KL(F32 || width) of the next-token distributions, teacher-forced over a
  ``--kl-len`` random-token sequence, for each runtime against its own F32 logits (llama.cpp's
  with ``logits_all=True``); ``kl_lowband_vs_llamacpp``: the two runtimes on the same file
  (and ``top1_lowband_vs_llamacpp_same_file``: how often their argmax agrees there);
* ``tp2``: with ``--tp``, lowband on 2 pinned devices (``edge worker`` + master over the real
  transport, cores 0 and 1, from a 2-way ``edge split`` of the file) vs 1 (a 1-way split),
  and how often TP's teacher-forced argmax equals one device's over ``--kl-len`` positions
  (``top1_vs_1dev``; ``hidden_bit_equal_vs_1dev``: final hidden states with one device's
  bits; from ``benchmarks.edge_tp_agreement``);
  otherwise, or when the file cannot be split, ``null`` with the reason. This VM's two cores
  share one memory bus, so two simulated devices contend for bandwidth as two boards would not.

``--gguf FILE`` compares the runtimes on any GGUF file (its own width); with ``--f32 REF`` (the
same weights dequantized to F32, e.g. by llama.cpp's quantizer) the KL table is made against
REF too, and ``top1_vs_f32`` says how often each runtime's teacher-forced argmax on FILE equals
its own argmax on REF (the published Gemma 3 270M: ``benchmarks.real_models``).
``--lowband-only`` runs the lowband side alone (Q8_0/Q4_0 then come from gguf's reference
quantizer): what the smoke test does, so CI never needs llama.cpp.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import numpy as np

from edge.formats.gguf_reader import open_reader

LLAMA_CPP_PYTHON = "llama-cpp-python==0.3.36"
FORMAT = "v1"  # bump when the written files change, so stale caches are not reused

MODELS: dict[str, dict] = {
    "llama32-1b": dict(
        arch="llama",
        vocab="llama-bpe",
        hidden=2048,
        layers=16,
        heads=32,
        kv_heads=8,
        ffn=8192,
        vocab_size=128256,
        rope_theta=500000.0,
        eps=1e-5,
        ctx=131072,
        llama3_rope=dict(factor=32.0, low=1.0, high=4.0, original=8192),
    ),
    "qwen25-0.5b": dict(
        arch="qwen2",
        vocab="qwen2",
        hidden=896,
        layers=24,
        heads=14,
        kv_heads=2,
        ffn=4864,
        vocab_size=151936,
        rope_theta=1000000.0,
        eps=1e-6,
        ctx=32768,
        qkv_bias=True,
    ),
    "small": dict(
        arch="llama", hidden=512, layers=8, heads=8, kv_heads=4, ffn=1408, vocab_size=32000
    ),
    "360m": dict(
        arch="llama", hidden=1024, layers=32, heads=16, kv_heads=4, ffn=2816, vocab_size=256
    ),
    "tiny": dict(
        arch="llama",
        hidden=256,
        layers=2,
        heads=4,
        kv_heads=2,
        ffn=512,
        vocab_size=512,
        llama3_rope=dict(factor=32.0, low=1.0, high=4.0, original=8192),
    ),
    # Trained here (a few minutes on one core), so its logits have margins: an order-1 Markov
    # chain over 512 tokens where each token's favoured successor has probability 0.85. Random
    # init leaves near-ties that any two kernels' rounding breaks differently; this model is
    # where greedy decoding and top-1 agreement between the two runtimes mean something.
    "markov-512": dict(
        arch="llama",
        hidden=512,
        layers=4,
        heads=8,
        kv_heads=4,
        ffn=1536,
        vocab_size=512,
        train=dict(steps=240, batch=16, seq=64, lr=3e-3, favoured=0.85),
    ),
    "qwen3moe-mini": dict(
        arch="qwen3moe",
        hidden=1024,
        layers=6,
        heads=8,
        kv_heads=2,
        ffn=256,  # each expert's width (expert_feed_forward_length)
        experts=128,
        experts_used=8,
        qk_norm=True,
        vocab_size=32000,
        rope_theta=1000000.0,
        eps=1e-6,
    ),
    "tiny-qwen3moe": dict(
        arch="qwen3moe",
        hidden=256,
        layers=2,
        heads=2,
        kv_heads=1,
        ffn=256,
        experts=8,
        experts_used=2,
        qk_norm=True,
        vocab_size=512,
    ),
    "tiny-qwen2": dict(
        arch="qwen2",
        hidden=256,
        layers=2,
        heads=4,
        kv_heads=2,
        ffn=512,
        vocab_size=512,
        qkv_bias=True,
    ),
}
WIDTHS = ("f32", "q8_0", "q4_0", "q4_k_m")


def _llamacpp_reason() -> str | None:
    try:
        import llama_cpp  # noqa: F401
    except ImportError as exc:
        return f"llama-cpp-python not installed ({exc}); pip install 'lowband[bench]'"
    return None


def _pin(threads: int, kernels: str | None = None) -> None:
    import torch

    os.sched_setaffinity(0, set(range(threads)))
    torch.set_num_threads(threads)
    if kernels:
        # The C++ kernels' build directory is keyed by their sources' hash, but torch rebuilds
        # it whenever another checkout (another path) used it last: a private one per cache
        # keeps other checkouts' builds out of the timed runs.
        from edge.quant import kernel

        kernel.configure(build_root=Path(kernels).expanduser())


def _ids(vocab: int, n: int, seed: int) -> list[int]:
    """Token ids of ordinary tokens (below the specials of real vocabularies)."""
    rng = np.random.default_rng(seed)
    return [int(x) for x in rng.integers(3, min(vocab, 100_000), n)]


# ---- writing the files ------------------------------------------------------------------------
def download_sdist(dest: Path, timeout: float = 900) -> Path:
    """The llama-cpp-python source release, downloaded by pip into ``dest``. Only the package
    itself from source: ``--no-binary :all:`` would also build its build backend's dependencies
    (cmake, ...) from source to prepare its metadata, minutes on a fresh machine. A failure is a
    RuntimeError carrying the command and pip's output."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", "llama-cpp-python"]
    cmd += [LLAMA_CPP_PYTHON, "-d", str(dest)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    sdists = sorted(dest.glob("llama_cpp_python-*.tar.gz"))
    if r.returncode != 0 or not sdists:
        raise RuntimeError(
            f"{' '.join(cmd)} exited {r.returncode}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
        )
    return sdists[0]


def _vocab_file(name: str, cache: Path) -> Path:
    """llama.cpp's ``ggml-vocab-NAME.gguf``: from the cache, the tests' cache
    (tests/edge/formats/conftest.py keeps the same files), or the source release via pip."""
    out = cache / "vocab" / f"ggml-vocab-{name}.gguf"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    root = Path(__file__).resolve().parent.parent / ".pytest_cache"
    for d in (root / "d", root):
        src = d / f"lowband-{LLAMA_CPP_PYTHON.replace('==', '-')}" / "models" / out.name
        if src.exists():
            shutil.copyfile(src, out)
            return out
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        with tarfile.open(download_sdist(Path(tmp)), "r:gz") as tar:
            for m in tar:
                if m.isfile() and m.name.endswith("/vendor/llama.cpp/models/" + out.name):
                    data = tar.extractfile(m)
                    assert data is not None
                    (Path(tmp) / out.name).write_bytes(data.read())
                    (Path(tmp) / out.name).rename(out)
                    return out
    raise FileNotFoundError(f"{LLAMA_CPP_PYTHON} holds no {out.name}")


def _llama3_factors(spec: dict) -> np.ndarray:
    """Llama 3.1/3.2 rope scaling as llama.cpp's converter writes it (``rope_freqs.weight``)."""
    r, d = spec["llama3_rope"], spec["hidden"] // spec["heads"]
    lo_wl, hi_wl = r["original"] / r["low"], r["original"] / r["high"]
    out = []
    for i in range(0, d, 2):
        wavelen = 2 * math.pi * spec.get("rope_theta", 10000.0) ** (i / d)
        if wavelen < hi_wl:
            out.append(1.0)
        elif wavelen > lo_wl:
            out.append(r["factor"])
        else:
            smooth = (r["original"] / wavelen - r["low"]) / (r["high"] - r["low"])
            out.append(1 / ((1 - smooth) / r["factor"] + smooth))
    return np.asarray(out, dtype=np.float32)


def _tensor_specs(spec: dict) -> list[tuple[str, tuple[int, ...], str]]:
    """(GGUF name, numpy shape, kind) of every tensor; the head is tied (no ``output.weight``)."""
    h, f, d = spec["hidden"], spec["ffn"], spec["hidden"] // spec["heads"]
    kv = spec["kv_heads"] * d
    out = [("token_embd.weight", (spec["vocab_size"], h), "mat")]
    if "llama3_rope" in spec:
        out.append(("rope_freqs.weight", (d // 2,), "rope"))
    for i in range(spec["layers"]):
        b = f"blk.{i}."
        out += [(b + "attn_norm.weight", (h,), "norm")]
        for n, rows in (("attn_q", h), ("attn_k", kv), ("attn_v", kv)):
            out.append((b + n + ".weight", (rows, h), "mat"))
            if spec.get("qkv_bias"):
                out.append((b + n + ".bias", (rows,), "mat"))
        if spec.get("qk_norm"):  # Qwen3: per-head RMSNorm of q and k
            out += [
                (b + "attn_q_norm.weight", (d,), "norm"),
                (b + "attn_k_norm.weight", (d,), "norm"),
            ]
        out += [(b + "attn_output.weight", (h, h), "mat"), (b + "ffn_norm.weight", (h,), "norm")]
        if "experts" in spec:  # the router, then each layer's experts stacked in 3-D tensors
            e = spec["experts"]
            out += [
                (b + "ffn_gate_inp.weight", (e, h), "mat"),
                (b + "ffn_gate_exps.weight", (e, f, h), "mat"),
                (b + "ffn_up_exps.weight", (e, f, h), "mat"),
                (b + "ffn_down_exps.weight", (e, h, f), "mat"),
            ]
        else:
            out += [
                (b + "ffn_gate.weight", (f, h), "mat"),
                (b + "ffn_up.weight", (f, h), "mat"),
                (b + "ffn_down.weight", (h, f), "mat"),
            ]
    return [*out, ("output_norm.weight", (h,), "norm")]


def _add_tokenizer(w, spec: dict, cache: Path) -> None:
    import gguf

    if spec.get("vocab") is None:  # placeholders: llama.cpp insists on a vocabulary
        n = spec["vocab_size"]
        w.add_tokenizer_model("llama")
        w.add_token_list([b"<unk>", b"<s>", b"</s>"] + [f"t{i}".encode() for i in range(3, n)])
        w.add_token_scores([0.0] * n)
        w.add_token_types([gguf.TokenType.CONTROL] * 3 + [gguf.TokenType.NORMAL] * (n - 3))
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_add_bos_token(False)
        return
    r = open_reader(str(_vocab_file(spec["vocab"], cache)))
    for key, f in r.fields.items():
        if key.startswith("tokenizer."):
            sub = f.types[1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
            w.add_key_value(key, f.contents(), f.types[0], sub)


def write_f32(spec: dict, path: Path, cache: Path, seed: int = 0) -> Path:
    """A random-init model (matrices N(0, 0.02), norms 1) as an F32 GGUF, streamed."""
    import gguf

    rng = np.random.default_rng(seed)
    tmp = path.with_suffix(".part")
    w = gguf.GGUFWriter(str(tmp), spec["arch"])
    h, d = spec["hidden"], spec["hidden"] // spec["heads"]
    w.add_context_length(spec.get("ctx", 4096))
    w.add_embedding_length(h)
    w.add_block_count(spec["layers"])
    w.add_feed_forward_length(spec["ffn"])
    w.add_head_count(spec["heads"])
    w.add_head_count_kv(spec["kv_heads"])
    w.add_rope_dimension_count(d)
    w.add_rope_freq_base(spec.get("rope_theta", 10000.0))
    w.add_layer_norm_rms_eps(spec.get("eps", 1e-5))
    if "experts" in spec:
        w.add_expert_count(spec["experts"])
        w.add_expert_used_count(spec["experts_used"])
        w.add_expert_feed_forward_length(spec["ffn"])
    w.add_file_type(0)
    _add_tokenizer(w, spec, cache)
    tensors = _tensor_specs(spec)
    for name, shape, _ in tensors:
        w.add_tensor_info(name, shape, np.dtype(np.float32), 4 * math.prod(shape))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for _, shape, kind in tensors:
        if kind == "mat":
            a = rng.standard_normal(shape, dtype=np.float32) * np.float32(0.02)
        elif kind == "norm":
            a = np.ones(shape, dtype=np.float32)
        else:
            a = _llama3_factors(spec)
        w.write_tensor_data(a)
    w.close()
    tmp.rename(path)
    return path


def markov_chain(vocab: int, seed: int) -> np.ndarray:
    """Each token's favoured successor (a fixed random permutation of the vocabulary)."""
    return np.random.default_rng(seed + 7).permutation(vocab)


def markov_ids(succ: np.ndarray, favoured: float, n: int, rng: np.random.Generator) -> list[int]:
    """``n`` ids of the chain: the favoured successor with probability ``favoured``, else any."""
    out = [int(rng.integers(len(succ)))]
    for _ in range(n - 1):
        nxt = succ[out[-1]] if rng.random() < favoured else rng.integers(len(succ))
        out.append(int(nxt))
    return out


def write_trained_f32(spec: dict, path: Path, seed: int = 0) -> Path:
    """Train ``spec`` (a dense Llama with a placeholder vocabulary) on its Markov chain with
    AdamW and write it as an F32 GGUF (:func:`edge.formats.gguf.write_gguf`)."""
    import torch

    from edge.formats.gguf import write_gguf
    from lowband.models.config import ModelConfig
    from lowband.models.llama import LlamaForCausalLM, init_weights

    t = spec["train"]
    torch.manual_seed(seed)
    names = dict(hidden_size="hidden", intermediate_size="ffn", num_hidden_layers="layers")
    names.update(num_attention_heads="heads", num_key_value_heads="kv_heads")
    cfg = ModelConfig(
        vocab_size=spec["vocab_size"],
        max_position_embeddings=4096,
        **{field: spec[key] for field, key in names.items()},
    )
    model = LlamaForCausalLM(cfg)
    init_weights(model, std=0.02, seed=seed)
    succ = markov_chain(spec["vocab_size"], seed)
    rng = np.random.default_rng(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=t["lr"], weight_decay=0.0)
    model.train()
    for step in range(t["steps"]):
        x = torch.tensor(
            [markov_ids(succ, t["favoured"], t["seq"] + 1, rng) for _ in range(t["batch"])]
        )
        logits = model(x[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 40 == 0 or step == t["steps"] - 1:
            print(f"train {path.name} step {step} loss {loss.item():.3f}", file=sys.stderr)
    tmp = path.with_suffix(".part")
    write_gguf(model.eval(), tmp)
    tmp.rename(path)
    return path


def quantize(src: Path, dst: Path, width: str, use_llamacpp: bool) -> Path:
    """llama.cpp's quantizer (``q4_0`` pure, as the earlier runs; ``q4_k_m``/``q8_0`` as it
    ships them), or, with ``use_llamacpp`` false, gguf's reference code (q8_0 / q4_0 only)."""
    tmp = dst.with_suffix(".part")
    if use_llamacpp:
        import llama_cpp

        p = llama_cpp.llama_model_quantize_default_params()
        p.ftype = {
            "q8_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0,
            "q4_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0,
            "q4_k_m": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M,
        }[width]
        p.pure = width == "q4_0"
        p.nthread = 2
        if llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(), p) != 0:
            raise RuntimeError(f"llama_model_quantize {width} of {src} failed")
    else:
        _reference_quantize(src, tmp, width)
    tmp.rename(dst)
    return dst


def _reference_quantize(src: Path, dst: Path, width: str) -> None:
    import gguf

    if width not in ("q8_0", "q4_0"):
        raise SystemExit(f"--widths {width} needs llama.cpp's quantizer (drop --lowband-only)")
    qt = getattr(gguf.GGMLQuantizationType, width.upper())
    r = open_reader(str(src))
    w = gguf.GGUFWriter(str(dst), str(r.fields["general.architecture"].contents()))
    for key, f in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        sub = f.types[1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, f.contents(), f.types[0], sub)
    for t in r.tensors:
        a = np.asarray(t.data).reshape(tuple(reversed([int(x) for x in t.shape])))
        if a.ndim in (2, 3) and a.shape[-1] % 32 == 0 and not t.name.endswith("gate_inp.weight"):
            w.add_tensor(t.name, gguf.quants.quantize(a, qt), raw_dtype=qt)
        else:
            w.add_tensor(t.name, np.ascontiguousarray(a))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def make_files(name: str, widths: list[str], a) -> dict[str, Path]:
    """The F32 file and one file per width, cached (by model, seed and quantizer)."""
    q = "ref" if a.lowband_only else "llamacpp"
    d = Path(a.cache).expanduser() / f"{name}-seed{a.seed}-{FORMAT}"
    d.mkdir(parents=True, exist_ok=True)
    f32 = d / "f32.gguf"
    if not f32.exists():
        if "train" in MODELS[name]:
            write_trained_f32(MODELS[name], f32, a.seed)
        else:
            write_f32(MODELS[name], f32, Path(a.cache).expanduser(), a.seed)
    files = {"f32": f32}
    for wd in widths:
        if wd != "f32":
            dst = d / f"{wd}-{q}.gguf"
            files[wd] = dst if dst.exists() else quantize(f32, dst, wd, not a.lowband_only)
    return files


# ---- roles (each in its own pinned process) ----------------------------------------------------
def role_lowband(a) -> dict:
    _pin(a.threads, a.kernels)
    import torch

    from edge import fastpath
    from edge.engine import LocalRunner
    from edge.shardio import load_shard

    model = load_shard(a.model).model
    fastpath.set_repeatable(model, not a.fast_prompts)  # as `edge serve --fast-prompts`
    runner = LocalRunner(model)
    prompt = _ids(runner.config.vocab_size, a.prompt_len, a.seed)
    t0 = time.perf_counter()
    logits = runner.forward(prompt, 0)
    prefill_ms = 1e3 * (time.perf_counter() - t0)
    tok, pos, times, out = int(torch.argmax(logits)), len(prompt), [], []
    for _ in range(a.tokens):
        out.append(tok)
        t = time.perf_counter()
        logits = runner.forward([tok], pos)
        times.append(time.perf_counter() - t)
        pos += 1
        tok = int(torch.argmax(logits))
    return {
        "ms_per_token": 1e3 * statistics.median(times),
        "tokens": out,
        "prefill_ms": prefill_ms,
        "compiled": fastpath.active(model),  # decode through the compiled step, not eager
    }


def _llama(a, n_ctx: int, logits_all: bool = False):
    import llama_cpp

    return llama_cpp.Llama(
        model_path=a.model,
        n_threads=a.threads,
        n_threads_batch=a.threads,
        n_ctx=n_ctx,
        n_batch=max(n_ctx, 32),
        logits_all=logits_all,
        verbose=False,
    )


def role_llamacpp(a) -> dict:
    _pin(a.threads)
    llm = _llama(a, a.prompt_len + a.tokens + 8)
    prompt = _ids(llm.n_vocab(), a.prompt_len, a.seed)
    out, stamps = [], []
    t0 = time.perf_counter()
    for tok in llm.generate(prompt, top_k=1, temp=0.0, repeat_penalty=1.0):
        stamps.append(time.perf_counter())
        out.append(int(tok))
        if len(out) == a.tokens + 1:
            break
    gaps = [b - s for s, b in zip(stamps, stamps[1:])]  # first token (prefill) excluded
    return {
        "ms_per_token": 1e3 * statistics.median(gaps),
        "tokens": out[: a.tokens],
        "prefill_ms": 1e3 * (stamps[0] - t0),  # the prompt's batch and the first token
    }


def role_logits(a) -> dict:
    """Teacher-forced logits over ``--kl-len`` random ids, saved as ``--out`` (.npy, fp32)."""
    _pin(a.threads, a.kernels if a.runtime == "lowband" else None)
    given = json.loads(Path(a.ids).read_text()) if a.ids else None  # else random ids
    if a.runtime == "lowband":
        import torch

        from edge.formats.gguf import load_gguf

        model = load_gguf(a.model)
        ids = given or _ids(model.config.vocab_size, a.kl_len, a.seed + 1)
        with torch.inference_mode():
            logits = model(torch.tensor([ids])).float()[0].numpy()
    else:
        llm = _llama(a, a.kl_len + 8, logits_all=True)
        ids = given or _ids(llm.n_vocab(), a.kl_len, a.seed + 1)
        llm.eval(ids)
        logits = np.asarray(llm.scores[: len(ids)], dtype=np.float32)
    np.save(a.out, logits)
    return {"shape": list(logits.shape)}


# ---- orchestration ------------------------------------------------------------------------------
def role_env() -> dict[str, str]:
    """The roles' environment: libgomp's wait policy as ``lowband edge`` sets it
    (``cli.openmp_wait``: its idle workers spin before they sleep) unless the caller set
    ``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT``. llama.cpp's wheel here is built without OpenMP
    (its own threadpool), so only lowband's side reads them."""
    from cli import openmp_wait

    env = dict(os.environ)
    env.update(openmp_wait("edge", env, torch_loaded=False))
    return env


def _run_role(args: list[str], timeout: float) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.edge_vs_llamacpp", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=role_env(),
    )
    if out.returncode != 0:
        raise RuntimeError(f"role {args[:2]} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _stats(xs: list[float]) -> dict:
    return {
        "median": round(statistics.median(xs), 2),
        "min": round(min(xs), 2),
        "max": round(max(xs), 2),
        "runs": [round(x, 2) for x in xs],
    }


def _agreement(x: list[int], y: list[int]) -> dict:
    n = min(len(x), len(y))
    diff = next((i for i in range(n) if x[i] != y[i]), None)
    return {"fraction": round(sum(p == q for p, q in zip(x, y)) / max(1, n), 3), "first_diff": diff}


def _kl(p_logits: np.ndarray, q_logits: np.ndarray) -> float:
    """Mean over positions of KL(P || Q), from logits (float64 softmax)."""
    lp = p_logits.astype(np.float64)
    lq = q_logits.astype(np.float64)
    lp -= lp.max(-1, keepdims=True)
    lq -= lq.max(-1, keepdims=True)
    lp -= np.log(np.exp(lp).sum(-1, keepdims=True))
    lq -= np.log(np.exp(lq).sum(-1, keepdims=True))
    return float((np.exp(lp) * (lp - lq)).sum(-1).mean())


def _kl_table(
    files: dict[str, Path], runtimes: list[str], work: Path, a, spec: dict | None = None
) -> dict:
    """KL of each width vs the F32 file, per runtime, and lowband vs llama.cpp per file. For a
    model trained here (``spec["train"]``) the ids are a held-out sequence of its chain (a seed
    training never used) and each width's perplexity on it is reported too."""
    logits: dict[tuple[str, str], np.ndarray] = {}
    ids: list[int] | None = None
    if spec is not None and "train" in spec:
        succ = markov_chain(spec["vocab_size"], a.seed)
        held_out = np.random.default_rng(a.seed + 1_000_003)
        ids = markov_ids(succ, spec["train"]["favoured"], a.kl_len, held_out)
        (work / "ids.json").write_text(json.dumps(ids))
    for w, f in files.items():
        for rt in runtimes:
            out = work / f"logits-{rt}-{w}.npy"
            args = ["--role", "logits", "--runtime", rt, "--model", str(f), "--out", str(out)]
            args += ["--kl-len", str(a.kl_len), "--seed", str(a.seed), "--threads", "2"]
            args += ["--kernels", a.kernels]
            if ids is not None:
                args += ["--ids", str(work / "ids.json")]
            _run_role(args, a.timeout)
            logits[rt, w] = np.load(out)
            out.unlink()
    res: dict = {"top1_vs_f32": {}}
    for rt in runtimes:
        res[rt] = {
            w: float(f"{_kl(logits[rt, 'f32'], logits[rt, w]):.3g}") for w in files if w != "f32"
        }
        res["top1_vs_f32"][rt] = {
            w: round(_top1(logits[rt, "f32"], logits[rt, w]), 4) for w in files if w != "f32"
        }
    if len(runtimes) == 2:
        res["lowband_vs_llamacpp_same_file"] = {
            w: float(f"{_kl(logits['llamacpp', w], logits['lowband', w]):.3g}") for w in files
        }
        # Teacher-forced top-1 agreement on the same file: where greedy decoding diverges
        # because the kernels round differently, this says how often the runtimes would pick
        # the same next token at every position of the same context.
        res["top1_lowband_vs_llamacpp_same_file"] = {
            w: round(_top1(logits["llamacpp", w], logits["lowband", w]), 4) for w in files
        }
    if ids is not None:
        res["heldout_ppl"] = {
            rt: {w: round(_perplexity(logits[rt, w], ids), 4) for w in files} for rt in runtimes
        }
    return res


def _perplexity(logits: np.ndarray, ids: list[int]) -> float:
    """exp of the mean negative log-likelihood of ids[1:] under the logits at ids[:-1]."""
    x = logits[:-1].astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    logp = x - np.log(np.exp(x).sum(-1, keepdims=True))
    return float(np.exp(-logp[np.arange(len(ids) - 1), ids[1:]].mean()))


def _top1(p_logits: np.ndarray, q_logits: np.ndarray) -> float:
    """Fraction of positions whose argmax is the same in both."""
    return float(np.mean(p_logits.argmax(-1) == q_logits.argmax(-1)))


def _tp(file: Path, work: Path, a) -> dict:
    """lowband on 2 pinned devices vs 1 through benchmarks.edge's master/worker roles (the
    machinery of ``lowband edge run --devices 2``), each from an ``edge split`` of the file."""
    from benchmarks import edge as eb
    from edge.formats.gguf_split import split_gguf

    try:
        d1 = split_gguf(file, work / f"split1-{file.stem}", 1, None, None)
        d2 = split_gguf(file, work / f"split2-{file.stem}", 2, None, None)
    except Exception as exc:  # noqa: BLE001 - any refusal becomes the reported reason
        return {"tp2_speedup": None, "reason": f"edge split --devices 2 refused: {exc}"}
    ns = argparse.Namespace(
        tokens=a.tokens,
        warmup=2,
        prompt_len=a.prompt_len,
        wire="fp32",
        link_spin_us=1000.0,
        timeout=a.timeout,
    )
    single = ["--role", "single", "--model", str(d1), "--core", "0", "--tokens", str(a.tokens)]
    single += ["--warmup", "2", "--prompt-len", str(a.prompt_len)]
    one, two = [], []
    for _ in range(a.tp_repeats):
        one.append(eb._run_role(single, a.timeout))
        two.append(eb._run_tp(str(d2), ns))
    m1 = statistics.median(r["decode_ms_per_token"] for r in one)
    m2 = statistics.median(r["decode_ms_per_token"] for r in two)
    # Does TP give one device's answer: teacher-forced top-1 and final hidden bits over
    # --kl-len positions, greedy tokens of one prompt (benchmarks.edge_tp_agreement, in-process
    # loopback ranks on the same file).
    agree = subprocess.run(
        [sys.executable, "-m", "benchmarks.edge_tp_agreement", "--gguf", str(file), "--json"]
        + ["--len", str(a.kl_len), "--prompts", "1", "--prompt-len", str(a.prompt_len)]
        + ["--tokens", str(a.tokens), "--seed", str(a.seed)],
        capture_output=True,
        text=True,
        timeout=a.timeout,
        env=role_env(),
    )
    if agree.returncode != 0:
        raise RuntimeError(f"edge_tp_agreement failed:\n{agree.stderr[-3000:]}")
    vs1 = json.loads(agree.stdout.strip().splitlines()[-1])
    return {
        "tp2_speedup": round(m1 / m2, 3),
        "ms_per_token_1dev": _stats([r["decode_ms_per_token"] for r in one]),
        "ms_per_token_2dev": _stats([r["decode_ms_per_token"] for r in two]),
        "master_allreduce_ms_per_token": round(
            statistics.median(r["allreduce_ms_per_token"] for r in two), 2
        ),
        "same_tokens": two[0]["tokens"] == one[0]["tokens"],
        "top1_vs_1dev": vs1["top1_vs_1dev"],
        "hidden_bit_equal_vs_1dev": vs1["hidden_bit_equal"],
        "greedy_equal_vs_1dev": vs1["greedy_equal"][0],
    }


def bench_file(file: Path, threads: int, runtimes: list[str], a) -> dict:
    """Both runtimes on one file at one thread count, alternating, ``a.repeats`` rounds."""
    common = ["--model", str(file), "--tokens", str(a.tokens), "--prompt-len", str(a.prompt_len)]
    common += ["--threads", str(threads), "--seed", str(a.seed), "--kernels", a.kernels]
    common += ["--fast-prompts"] if a.fast_prompts else []
    runs: dict[str, list[dict]] = {rt: [] for rt in runtimes}
    for i in range(a.repeats):  # alternate, and swap who goes first each round
        for rt in runtimes if i % 2 == 0 else runtimes[::-1]:
            runs[rt].append(_run_role(["--role", rt, *common], a.timeout))
    res: dict = {
        "lowband_compiled": all(r["compiled"] for r in runs["lowband"]),
        "ms_per_token": {rt: _stats([r["ms_per_token"] for r in runs[rt]]) for rt in runtimes},
        "prefill_ms": {rt: _stats([r["prefill_ms"] for r in runs[rt]]) for rt in runtimes},
    }
    if len(runtimes) == 2:
        ms, pf = res["ms_per_token"], res["prefill_ms"]
        res["ratio_vs_llamacpp"] = round(ms["lowband"]["median"] / ms["llamacpp"]["median"], 3)
        res["prefill_ratio_vs_llamacpp"] = round(
            pf["lowband"]["median"] / pf["llamacpp"]["median"], 3
        )
        res["greedy_agreement"] = _agreement(
            runs["lowband"][0]["tokens"], runs["llamacpp"][0]["tokens"]
        )
    return res


def bench_model(name: str, files: dict[str, Path], runtimes: list[str], a) -> dict:
    res: dict = {
        "file_mb": {w: round(f.stat().st_size / 2**20, 1) for w, f in files.items()},
        "widths": {},
    }
    work = Path(tempfile.mkdtemp(prefix=f"lowband-vs-llamacpp-{name}-", dir=a.workdir))
    try:
        for w, f in files.items():
            if w == "f32" and "f32" not in a.widths:
                continue
            res["widths"][w] = {
                f"threads_{t}": bench_file(f, t, runtimes, a) for t in a.threads_list
            }
            if a.tp:
                res["widths"][w]["tp2"] = _tp(f, work, a)
            else:
                res["widths"][w]["tp2"] = {"tp2_speedup": None, "reason": "not run (no --tp)"}
        if "f32" in files and not a.no_kl:
            res["kl_vs_f32"] = _kl_table(files, runtimes, work, a, MODELS.get(name))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.edge_vs_llamacpp", description=__doc__.split("\n")[0]
    )
    p.add_argument("--json", action="store_true", help="print only the JSON result line")
    p.add_argument("--models", default="llama32-1b,qwen25-0.5b", help=f"of {sorted(MODELS)}")
    p.add_argument("--widths", default="q4_k_m,q8_0", help=f"comma-separated, of {WIDTHS}")
    p.add_argument("--threads", default="1", help="thread counts, e.g. 1,2 (cores 0..n-1)")
    p.add_argument("--gguf", help="compare the runtimes on this GGUF file instead of --models")
    p.add_argument("--f32", help="with --gguf: the same weights in F32, for the fidelity table")
    p.add_argument("--lowband-only", action="store_true", help="skip llama.cpp (smoke test)")
    p.add_argument(
        "--fast-prompts",
        action="store_true",
        help="lowband's prompt through the eager GEMMs (edge --fast-prompts): other rounding, "
        "temperature 0 no longer repeatable across prompt cuts; default: the serving default",
    )
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--kl-len", type=int, default=64)
    p.add_argument("--no-kl", action="store_true")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tp", action="store_true", help="also time lowband on 2 devices")
    p.add_argument("--tp-repeats", type=int, default=5)
    p.add_argument("--cache", default="~/.cache/lowband/bench")
    p.add_argument("--workdir", default=None)
    p.add_argument(
        "--kernels",
        default=None,
        help="C++ kernels' build root (default ~/.cache/lowband/bench/kernels-<checkout>; "
        "'' = the library's default)",
    )
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument("--role", choices=["lowband", "llamacpp", "logits"], help=argparse.SUPPRESS)
    p.add_argument("--runtime", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--ids", help=argparse.SUPPRESS)  # the logits role's token ids (JSON)
    a = p.parse_args(argv)
    a.threads_list = [int(t) for t in a.threads.split(",")]
    a.threads = a.threads_list[0]
    if a.kernels is None:
        here = Path(__file__).resolve().parent.parent
        tag = hashlib.sha256(str(here).encode()).hexdigest()[:12]  # per checkout: see _pin
        a.kernels = str(Path.home() / ".cache" / "lowband" / "bench" / f"kernels-{tag}")
    roles = {"lowband": role_lowband, "llamacpp": role_llamacpp, "logits": role_logits}
    if a.role:
        print(json.dumps(roles[a.role](a)))
        return 0
    a.widths = [w for w in a.widths.split(",") if w]
    if bad := [w for w in a.widths if w not in WIDTHS]:
        p.error(f"unknown widths {bad}; choose from {WIDTHS}")
    reason = None if a.lowband_only else _llamacpp_reason()
    if reason is not None:
        p.error(reason)
    runtimes = ["lowband"] if a.lowband_only else ["lowband", "llamacpp"]
    t0, load0 = time.perf_counter(), os.getloadavg()[0]
    if a.gguf:
        files = {"file": Path(a.gguf)}
        if a.f32:
            files["f32"] = Path(a.f32)
        models = {Path(a.gguf).name: bench_model(Path(a.gguf).stem, files, runtimes, a)}
    else:
        models = {
            m: bench_model(m, make_files(m, a.widths, a), runtimes, a) for m in a.models.split(",")
        }
    result = {
        "bench": "edge_vs_llamacpp",
        "tokens": a.tokens,
        "prompt_len": a.prompt_len,
        # lowband's prompt path: "repeatable" (the serving default) or "fast" (--fast-prompts)
        "prompts": "fast" if a.fast_prompts else "repeatable",
        "kl_len": a.kl_len,
        "repeats": a.repeats,
        "threads": a.threads_list,
        "runtimes": runtimes,
        "models": models,
        "bench_seconds": round(time.perf_counter() - t0, 1),
        "loadavg_1m": [round(load0, 2), round(os.getloadavg()[0], 2)],
        "cpus": os.cpu_count(),
        # libgomp's wait policy in the roles (role_env): what lowband's kernels ran under
        "openmp_env": {
            k: v for k, v in role_env().items() if k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
        },
    }
    if not a.json:
        print(json.dumps(result, indent=2))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
