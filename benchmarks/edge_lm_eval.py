"""lm-evaluation-harness against lowband's OpenAI server: ``python -m benchmarks.edge_lm_eval
--json`` (the last line of output is JSON).

A tiny byte-level Llama is trained here for a few seconds on the successor of
each letter (``"c:d"``), served in this process by :func:`edge.server.start` with
``--parallel`` slots, and scored by lm-eval's own ``local-completions`` model on a
multiple-choice task of ``--docs`` such questions (four choices each), written to a temporary
folder and loaded from local JSON (nothing is fetched). lm-eval tokenises with the server's
``/tokenize`` (its remote tokenizer backend, vLLM's endpoints) and scores with ``echo`` +
``logprobs`` + ``max_tokens: 1``, exactly as it does against vLLM or llama-server,
``--concurrent`` requests at a time.

Reported: lm-eval's ``acc``; the same accuracy computed directly from one full forward of the
model per choice (``acc_direct``), and the largest difference between a log-likelihood lm-eval
got through the API and the direct one (``max_abs_loglik_diff``: float noise, or the API scored
something else; the exit status is 1 when it exceeds 1e-3 or the accuracies differ); the
accuracy of the untrained model (chance, about 0.25); wall times; the server's counters.

Without ``lm_eval`` installed (``pip install "lm-eval[api]"``; not part of lowband's extras:
it pulls in datasets, scikit-learn and more) the JSON line is ``{"skipped": ...}`` and the
exit status 0.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

from edge.engine import Engine, LocalRunner
from edge.server import ServerConfig, start
from lowband.models.config import ModelConfig
from lowband.models.llama import LlamaForCausalLM, init_weights
from lowband.models.tokenizer import ByteTokenizer

TASK = "lowband_letter_successor"
LETTERS = "abcdefghijklmnopqrstuvwxyz"
OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
CONFIG = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)


def train(steps: int, seed: int) -> LlamaForCausalLM:
    """Every ``"x:y"`` (y the letter after x) as one batch, the loss on y, AdamW."""
    torch.manual_seed(seed)
    m = LlamaForCausalLM(ModelConfig(**CONFIG))  # type: ignore[arg-type]
    init_weights(m, std=0.02, seed=seed)
    if steps == 0:
        return m.eval()
    x = torch.tensor([list(f"{a}:{b}".encode()) for a, b in zip(LETTERS, LETTERS[1:])])
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.0)
    m.train()
    for _ in range(steps):
        logits = m(x[:, :-1])[:, -1]
        loss = torch.nn.functional.cross_entropy(logits, x[:, -1])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return m.eval()


def documents(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    docs = []
    for _ in range(n):
        i = rng.randrange(len(LETTERS) - 1)
        right = LETTERS[i + 1]
        choices = [right] + rng.sample([c for c in LETTERS if c != right], 3)
        rng.shuffle(choices)
        docs.append(
            {"question": f"{LETTERS[i]}:", "choices": choices, "answer": choices.index(right)}
        )
    return docs


def direct_scores(m: LlamaForCausalLM, docs: list[dict]) -> list[list[float]]:
    """Each choice's log-likelihood given its question, from the model itself."""
    out = []
    with torch.inference_mode():
        for d in docs:
            ctx = list(d["question"].encode())
            scores = []
            for c in d["choices"]:
                ids = ctx + list(c.encode())
                lp = torch.log_softmax(m(torch.tensor([ids]))[0].float(), -1)
                scores.append(sum(float(lp[t - 1, ids[t]]) for t in range(len(ctx), len(ids))))
            out.append(scores)
    return out


def accuracy(scores: list[list[float]], docs: list[dict]) -> float:
    best = [max(range(len(s)), key=s.__getitem__) for s in scores]
    return sum(b == d["answer"] for b, d in zip(best, docs)) / len(docs)


def write_task(folder: Path, docs: list[dict]) -> None:
    data = folder / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in docs))
    (folder / f"{TASK}.yaml").write_text(
        f"task: {TASK}\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {data}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        'target_delimiter: ""\n'  # the choice follows the question directly, as trained
        'doc_to_text: "{{question}}"\n'
        'doc_to_choice: "{{choices}}"\n'
        'doc_to_target: "{{answer}}"\n'
        "metric_list:\n  - metric: acc\n"
    )


class Served:
    """The OpenAI server on a free loopback port, on its own thread and event loop."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self.port = 0
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    async def _main(self) -> None:
        runner, self.port = await start(self.engine, ServerConfig(host="127.0.0.1", port=0))
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        self._ready.set()
        try:
            await self._stop.wait()
        finally:
            await runner.cleanup()

    def __enter__(self) -> Served:
        self._thread.start()
        if not self._ready.wait(60):
            raise RuntimeError("the server did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._loop is not None and self._stop is not None
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(60)
        self.engine.close()


def evaluate(m: LlamaForCausalLM, folder: Path, a) -> tuple[float, list[list[float]], dict, float]:
    """lm-eval's accuracy, its log-likelihoods per document and choice (in document order),
    the server's counters, the wall time."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    engine = Engine(LocalRunner(m), ByteTokenizer(), model_name="digits", parallel=a.parallel)
    with Served(engine) as srv:
        t0 = time.perf_counter()
        out: Any = lm_eval.simple_evaluate(
            model="local-completions",
            model_args={
                "model": "digits",
                "base_url": f"http://127.0.0.1:{srv.port}/v1/completions",
                "tokenizer_backend": "remote",
                "num_concurrent": a.concurrent,
                "max_retries": 1,
                "max_length": CONFIG["max_position_embeddings"],
            },
            tasks=[TASK],
            task_manager=TaskManager(include_path=str(folder)),
            log_samples=True,
            verbosity="ERROR",
        )
        wall = time.perf_counter() - t0
        metrics = engine.metrics.snapshot()
    acc = float(out["results"][TASK]["acc,none"])
    samples = sorted(out["samples"][TASK], key=lambda x: x["doc_id"])
    lls = [[float(r[0][0]) for r in x["resps"]] for x in samples]
    keep = (
        "requests_total",
        "requests_failed",
        "prompt_tokens_total",
        "prompt_tokens_computed_total",
        "prefix_cache_hits_total",
        "batch_sequences_mean",
    )
    return acc, lls, {k: metrics[k] for k in keep}, wall


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true", help="print only the JSON result line")
    p.add_argument("--docs", type=int, default=20, help="documents of the task")
    p.add_argument("--steps", type=int, default=60, help="training steps")
    p.add_argument("--parallel", type=int, default=4, help="engine slots")
    p.add_argument("--concurrent", type=int, default=4, help="lm-eval's requests at a time")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (default 1: a model this small only loses from more, and a busy "
        "machine's spinning threads can make each step 100x slower)",
    )
    a = p.parse_args(argv)
    threads = torch.get_num_threads()
    torch.set_num_threads(a.threads)
    env = {k: os.environ.get(k) for k in OFFLINE}
    os.environ.update(OFFLINE)  # the task's data is a local file: nothing to fetch
    try:
        return _run(a)
    finally:  # a caller in the same process (the smoke test) gets its settings back
        torch.set_num_threads(threads)
        for k, v in env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _run(a: argparse.Namespace) -> int:
    try:
        import lm_eval  # noqa: F401
    except ImportError as exc:
        print(
            json.dumps({"skipped": f"lm_eval is not installed ({exc}): pip install 'lm-eval[api]'"})
        )
        return 0
    docs = documents(a.docs, a.seed)
    t0 = time.perf_counter()
    trained = train(a.steps, a.seed)
    train_s = time.perf_counter() - t0
    with tempfile.TemporaryDirectory() as tmp:
        write_task(Path(tmp), docs)
        acc, lls, server, wall = evaluate(trained, Path(tmp), a)
        untrained_acc = evaluate(train(0, a.seed), Path(tmp), a)[0]
    direct = direct_scores(trained, docs)
    diff = max(abs(x - y) for row, ref in zip(lls, direct) for x, y in zip(row, ref))
    result = {
        "benchmark": "edge_lm_eval",
        "task": TASK,
        "docs": a.docs,
        "model": "local-completions",
        "acc": acc,
        "acc_direct": accuracy(direct, docs),
        "max_abs_loglik_diff": diff,
        "acc_untrained": untrained_acc,
        "train_steps": a.steps,
        "train_s": round(train_s, 2),
        "eval_s": round(wall, 2),
        "parallel": a.parallel,
        "concurrent": a.concurrent,
        "threads": a.threads,
        "server": server,
    }
    if not a.json:
        print(
            f"lm-eval local-completions on {a.docs} letter successors: acc {acc:.3f} "
            f"(direct {result['acc_direct']:.3f}, untrained {untrained_acc:.3f}), "
            f"log-likelihoods within {diff:.1e} of the model's"
        )
    print(json.dumps(result))
    return 0 if acc == result["acc_direct"] and diff <= 1e-3 else 1


if __name__ == "__main__":
    sys.exit(main())
