"""A target/draft pair trained here on the same corpus, for draft-model speculative decoding.

Both are byte-level Llamas (vocabulary 256, ``diloco.config.byte_llama``) trained by lowband's
own trainer (``diloco.launch.run_threads``, one worker, DDP mode: plain AdamW steps) on the
embedded Shakespeare sample, the default corpus of ``lowband train``; the target is the larger,
the draft several times smaller in parameters and FLOPs per token. Each is exported as an F32
GGUF (``edge.formats.gguf.export_gguf``: placeholder token names, callers feed token ids) and,
where llama.cpp's quantizer is installed, as its Q4_K_M, so llama-server's ``-md`` runs the same
files. The recipe is fixed (seed, steps, shapes), so the files are a pure function of it and are
built once under ``CACHE/<name>-<recipe hash>/`` (``build_pair``; the ``.ok`` marker is written
last). Random weights say nothing about acceptance: two models trained on the same text agree
where the text is predictable, which is what a draft model is for.

    python -m benchmarks.spec_pair            # build (or find) the pair, print its paths as JSON
    python -m benchmarks.spec_pair --tiny     # a seconds-long recipe (the smoke test)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path

CACHE = Path.home() / ".cache/lowband/bench"

# shapes (hidden, layers, heads) and training (steps, batch, seq, lr, warmup) of each model
RECIPES: dict[str, dict] = {
    # target 18.9 M parameters (hidden 512, 6 layers: 76 MB as F32, more than this machine's
    # 32 MB L3, so a decode pass is bound by memory as a real model's is), trained by
    # lowband's trainer on 512 batches (seq 128, batch 16: 2048 tokens a step, 1.05 M tokens,
    # about 1.2 passes over the sample's training split), about 17 minutes on 2 CPU cores; the
    # draft 1.4 M (hidden 192, 3 layers, about 13x fewer FLOPs per token) distilled from it on
    # the same training split (``distill``: the target's next-byte distribution as the label,
    # the way draft models are usually made to agree with their target), a few minutes.
    "shakespeare-pair": dict(
        target=dict(hidden=512, layers=6, heads=8, steps=512, batch=16, seq=128, lr=3e-3),
        draft=dict(
            hidden=192, layers=3, heads=4, steps=512, batch=16, seq=128, lr=4e-3, distill=True
        ),
        max_positions=2048,
        seed=0,
    ),
    # the first pair (10.8 M / 0.46 M, 160 batches): its target fits the L3 cache nearly whole,
    # so verifying k tokens costs their arithmetic (``--pair small``)
    "shakespeare-pair-small": dict(
        target=dict(hidden=384, layers=6, heads=6, steps=160, batch=16, seq=128, lr=4e-3),
        draft=dict(hidden=128, layers=2, heads=4, steps=160, batch=16, seq=128, lr=4e-3),
        max_positions=2048,
        seed=0,
    ),
    "tiny-pair": dict(
        target=dict(hidden=64, layers=2, heads=4, steps=20, batch=4, seq=64, lr=3e-3),
        draft=dict(hidden=32, layers=1, heads=2, steps=20, batch=4, seq=64, lr=3e-3, distill=True),
        max_positions=1024,
        seed=0,
    ),
}


def recipe_key(name: str) -> str:
    """``name-<12 hex>``: the recipe's hash names its cache folder (a changed recipe rebuilds)."""
    blob = json.dumps(RECIPES[name], sort_keys=True).encode()
    return f"{name}-{hashlib.sha256(blob).hexdigest()[:12]}"


def _train_one(spec: dict, max_positions: int, seed: int, out: Path) -> dict:
    """Train one model of the pair with the library's trainer; its HF checkpoint is out/model."""
    from diloco.config import (
        DataConfig,
        DDPConfig,
        LrSchedule,
        OptimizerConfig,
        TrainConfig,
        byte_llama,
    )
    from diloco.launch import run_threads
    from lowband.models.llama import LlamaForCausalLM

    cfg = TrainConfig(
        model=byte_llama(spec["hidden"], spec["layers"], spec["heads"], seq_len=max_positions),
        data=DataConfig(seq_len=spec["seq"], batch_size=spec["batch"]),
        mode=DDPConfig(),
        inner=OptimizerConfig(name="adamw", lr=spec["lr"], weight_decay=0.1, betas=(0.9, 0.95)),
        lr_schedule=LrSchedule(warmup_steps=max(1, spec["steps"] // 10)),
        steps=spec["steps"],
        workers=1,
        seed=seed,
        eval_every=0,
        log_every=50,
    )
    t0 = time.perf_counter()
    res = run_threads(cfg, out_dir=out)
    return {
        "params": sum(p.numel() for p in LlamaForCausalLM(cfg.model).parameters()),
        "train_s": round(time.perf_counter() - t0, 1),
        "heldout_loss": None if res[0].final_eval is None else round(res[0].final_eval, 4),
        "steps": spec["steps"],
    }


def _q4_k_m(src: Path, dst: Path) -> bool:
    """llama.cpp's Q4_K_M of ``src``; False where llama-cpp-python is not installed."""
    try:
        import llama_cpp
    except ImportError:
        return False
    p = llama_cpp.llama_model_quantize_default_params()
    p.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M
    p.nthread = 2
    tmp = dst.with_suffix(".part")
    if llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(), p) != 0:
        raise RuntimeError(f"llama_model_quantize Q4_K_M of {src} failed")
    tmp.rename(dst)
    return True


def _distill_one(spec: dict, teacher_dir: Path, max_positions: int, seed: int, out: Path) -> dict:
    """Train a draft to agree with its target: on windows of the training split (the batches
    the trainer draws, ``diloco.data.train_batch``), minimise KL(target || draft) over the
    next-byte distributions of every position, AdamW with the trainer's warmup and cosine
    schedule. Writes the HF checkpoint to out/model."""
    import torch
    import torch.nn.functional as F

    from diloco.config import DataConfig, LrSchedule, byte_llama
    from diloco.data import load_corpus, train_batch
    from lowband.models.llama import LlamaForCausalLM, init_weights
    from lowband.models.weights import load_pretrained, save_pretrained

    teacher = load_pretrained(teacher_dir).float().eval()
    cfg = byte_llama(spec["hidden"], spec["layers"], spec["heads"], seq_len=max_positions)
    torch.manual_seed(seed)
    student = LlamaForCausalLM(cfg)
    init_weights(student, seed=seed)
    corpus = load_corpus(DataConfig(seq_len=spec["seq"], batch_size=spec["batch"]), 256)
    opt = torch.optim.AdamW(
        student.parameters(), lr=spec["lr"], weight_decay=0.1, betas=(0.9, 0.95)
    )
    sched = LrSchedule(warmup_steps=max(1, spec["steps"] // 10))
    t0 = time.perf_counter()
    for step in range(spec["steps"]):
        x = train_batch(corpus.train, spec["seq"], spec["batch"], seed=seed, slot=0, step=step)
        x = x[:, :-1]
        with torch.no_grad():
            p = F.log_softmax(teacher(x).float(), dim=-1)
        q = F.log_softmax(student(x).float(), dim=-1)
        loss = F.kl_div(q.flatten(0, 1), p.flatten(0, 1), log_target=True, reduction="batchmean")
        for g in opt.param_groups:
            g["lr"] = spec["lr"] * sched.factor(step, spec["steps"])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if step % 64 == 0:
            print(f"# distill step {step}: KL {loss.item():.4f}", file=sys.stderr, flush=True)
    save_pretrained(student.eval(), out / "model")
    return {
        "params": sum(p.numel() for p in student.parameters()),
        "train_s": round(time.perf_counter() - t0, 1),
        "steps": spec["steps"],
        "distilled_from": "target",
    }


def _heldout(model_dir: Path, other_dir: Path | None, seq: int) -> dict:
    """Held-out figures of one model (the sample's evaluation split, 8 batches of 16 windows):
    its loss in nats per byte and, beside ``other_dir``'s model, how often their most likely
    next bytes agree (what greedy draft acceptance estimates)."""
    import torch
    import torch.nn.functional as F

    from diloco.config import DataConfig
    from diloco.data import eval_batches, load_corpus
    from lowband.models.weights import load_pretrained

    corpus = load_corpus(DataConfig(seq_len=seq, batch_size=16), 256)
    m = load_pretrained(model_dir).float().eval()
    o = None if other_dir is None else load_pretrained(other_dir).float().eval()
    loss = agree = n = 0.0
    with torch.no_grad():
        for b in eval_batches(corpus.eval, seq, 16, 8):
            x, y = b[:, :-1], b[:, 1:]
            lg = m(x).float()
            loss += float(F.cross_entropy(lg.flatten(0, 1), y.flatten(), reduction="sum"))
            if o is not None:
                agree += float((lg.argmax(-1) == o(x).float().argmax(-1)).sum())
            n += y.numel()
    out = {"heldout_loss": round(loss / n, 4)}
    if o is not None:
        out["top1_agreement"] = round(agree / n, 4)
    return out


def build_pair(name: str = "shakespeare-pair", cache: Path = CACHE) -> dict:
    """The pair's files (built if missing): ``{role: {"f32": path, "q4_k_m": path | None}}``
    for role ``target`` and ``draft``, and ``info`` (parameters, training time, held-out loss,
    the draft's top-1 agreement with the target). Each role is built once (its ``.ok`` marker
    written last), the target first."""
    import torch

    from edge.formats.gguf import export_gguf

    r = RECIPES[name]
    root = cache / recipe_key(name)
    ok = root / ".ok"
    if not ok.exists():
        root.mkdir(parents=True, exist_ok=True)
        info_file = root / "info.json"
        info = json.loads(info_file.read_text()) if info_file.exists() else {}
        for role in ("target", "draft"):
            if (root / f"{role}.ok").exists():
                continue
            spec = r[role]
            print(f"# training the {role} of {name}", file=sys.stderr, flush=True)
            if spec.get("distill"):
                got = _distill_one(
                    spec, root / "target" / "model", r["max_positions"], r["seed"], root / role
                )
            else:
                got = _train_one(spec, r["max_positions"], r["seed"], root / role)
            other = root / "target" / "model" if role == "draft" else None
            got.update(_heldout(root / role / "model", other, spec["seq"]))
            info[role] = got
            f32 = export_gguf(root / role / "model", root / f"{role}-f32.gguf")
            _q4_k_m(f32, root / f"{role}-q4_k_m.gguf")
            info["threads"] = torch.get_num_threads()
            info_file.write_text(json.dumps(info, indent=1))
            (root / f"{role}.ok").write_text("")
        ok.write_text("")
    out: dict = {"info": json.loads((root / "info.json").read_text()), "dir": str(root)}
    for role in ("target", "draft"):
        q = root / f"{role}-q4_k_m.gguf"
        out[role] = {
            "f32": str(root / f"{role}-f32.gguf"),
            "q4_k_m": str(q) if q.exists() else None,
        }
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--cache", type=Path, default=CACHE)
    a = p.parse_args(argv)
    print(json.dumps(build_pair("tiny-pair" if a.tiny else "shakespeare-pair", a.cache)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
