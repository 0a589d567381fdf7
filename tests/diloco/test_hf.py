"""Hugging Face causal LMs (tiny random Llama and Qwen2 configs built here) through Streaming
DiLoCo, exported and loaded back by ``transformers`` with identical logits."""

from __future__ import annotations

import threading

import pytest
import torch
import transformers  # in the dev extra (through [hf]): a broken install must fail loudly

from diloco.config import DataConfig, DilocoConfig, LrSchedule, TrainConfig
from diloco.hf import build_hf_model
from diloco.launch import make_worker
from diloco.task import lm_task
from lowband.errors import ConfigError
from tests.conftest import TINY_LLAMA
from transport.loopback import LoopbackGroup

pytestmark = pytest.mark.timeout(180)


def write_config(tmp_path, kind: str):
    cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config}[kind]
    cfg = cls(**TINY_LLAMA, tie_word_embeddings=False)
    d = tmp_path / kind
    cfg.save_pretrained(str(d))
    return d / "config.json"


def hf_cfg(path, **over) -> TrainConfig:
    kw = dict(
        hf_model=str(path),
        data=DataConfig(seq_len=16, batch_size=4, eval_batches=2),
        mode=DilocoConfig(
            inner_steps=6, n_fragments=2, tau=1, alpha=0.5, codec="int8", error_feedback=True
        ),
        lr_schedule=LrSchedule(warmup_steps=2),
        steps=12,
        workers=2,
        eval_every=0,
    )
    kw.update(over)
    return TrainConfig(**kw)


def run_workers(cfg: TrainConfig, out_dir):
    task = lm_task(cfg)
    comms = LoopbackGroup(cfg.workers).comms()
    workers = [
        make_worker(cfg, c, task, worker_id=str(r), out_dir=out_dir) for r, c in enumerate(comms)
    ]
    results = [None] * len(workers)

    def body(r):
        results[r] = workers[r].run()

    ts = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(len(workers))]
    for t in ts:
        t.start()
    for t in ts:
        t.join(150)
    assert all(r is not None for r in results)
    return task, workers, results


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_hf_model_trains_through_diloco_and_exports(tmp_path, kind):
    path = write_config(tmp_path, kind)
    cfg = hf_cfg(path)
    task, workers, results = run_workers(cfg, tmp_path / "run")
    start = task.evaluate(task.build_model())
    assert results[0].final_eval < start - 0.3, (start, results[0].final_eval)
    assert len({r.state_hash for r in results}) == 1  # θ_g bit-identical on both sites
    assert results[0].outer_syncs >= 3
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "run" / "model"))
    ids = torch.tensor([list(b"To be, or not to")])
    with torch.no_grad():
        want = workers[0].global_model(input_ids=ids).logits
        got = loaded(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_random_init_is_seeded_and_checkpoints_continue(tmp_path):
    path = write_config(tmp_path, "llama")
    a, b = build_hf_model(str(path), seed=3), build_hf_model(str(path), seed=3)
    c = build_hf_model(str(path), seed=4)
    for (n, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), n
    assert any(
        not torch.equal(pa, pc) for pa, pc in zip(a.parameters(), c.parameters()) if pa.dim() == 2
    )
    a.save_pretrained(str(tmp_path / "ckpt"))  # a checkpoint directory: continued pre-training
    d = build_hf_model(str(tmp_path / "ckpt"), seed=99)
    for pa, pd in zip(a.parameters(), d.parameters()):
        assert torch.equal(pa, pd)


def test_bad_hf_sources_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="hf_model"):
        lm_task(hf_cfg(tmp_path / "nothing-here"))
    path = write_config(tmp_path, "llama")
    with pytest.raises(ConfigError, match="seq_len"):
        lm_task(hf_cfg(path, data=DataConfig(seq_len=128, batch_size=2)))


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_hf_run_exports_to_a_gguf_edge_serves_with_the_same_greedy_tokens(tmp_path, kind):
    """``--model hf:DIR`` back to a servable file: the run's ``model/`` (save_pretrained)
    written as an F32 GGUF by ``lowband export``'s writer, loaded by ``edge``'s reader: the
    trainer's θ_g's logits and greedy tokens."""
    from edge.formats.gguf import export_gguf, load_gguf

    if kind == "gemma3":  # tied head, sandwich norms, q/k norms, a sliding window
        d = tmp_path / kind
        transformers.Gemma3TextConfig(
            **{**TINY_LLAMA, "num_key_value_heads": 1},
            head_dim=8,
            query_pre_attn_scalar=8,
            sliding_window=4,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
        ).save_pretrained(str(d))
        path = d / "config.json"
    else:
        path = write_config(tmp_path, kind)
    _, workers, _ = run_workers(hf_cfg(path), tmp_path / "run")
    served = load_gguf(export_gguf(tmp_path / "run" / "model", tmp_path / "m.gguf"))
    trained = workers[0].global_model
    ids = torch.tensor([list(b"To be, or not to")])
    with torch.no_grad():
        torch.testing.assert_close(served(ids), trained(input_ids=ids).logits, atol=1e-5, rtol=0)
        want = trained.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)
        got = ids
        for _ in range(8):  # greedy, the whole prefix each time
            got = torch.cat([got, served(got)[:, -1:].argmax(-1)], dim=1)
    assert got.tolist() == want.tolist()
