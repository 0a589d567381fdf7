"""LoRA under Streaming DiLoCo: only the adapters train and cross the wire, and the export has
them merged into the weights."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from diloco.config import byte_llama, config_from_dict, config_to_dict, preset, with_overrides
from diloco.launch import run_threads
from diloco.lora import LoraConfig, merged, trainable, with_lora
from diloco.task import lm_task
from lowband.errors import ConfigError
from lowband.models.llama import LlamaForCausalLM
from lowband.models.weights import load_pretrained

pytestmark = pytest.mark.timeout(300)


def _cfg(**over: object):
    return with_overrides(
        preset("tiny"),
        workers=2,
        steps=8,
        inner_steps=4,
        n_fragments=2,
        tau=1,
        eval_every=0,
        batch_size=2,
        seq_len=32,
        codec="int8",
        **over,
    )


def test_merged_model_computes_what_the_adapted_one_does() -> None:
    torch.manual_seed(0)
    model = with_lora(LlamaForCausalLM(byte_llama(64, 2, 1)), LoraConfig(rank=4), seed=0)
    for name, p in model.named_parameters():
        assert p.requires_grad == ("lora_" in name)
        if "lora_B" in name:  # B starts at zero; make the adapters do something
            torch.nn.init.normal_(p)
    x = torch.randint(0, 256, (2, 12))
    plain = merged(model)
    assert not any("lora" in n for n, _ in plain.named_parameters())
    torch.testing.assert_close(plain(x), model(x), rtol=1e-4, atol=1e-4)


def test_only_the_adapters_sync_and_the_export_has_them_merged(tmp_path: Path) -> None:
    full = run_threads(_cfg(), timeout=240)
    cfg = _cfg(lora_rank=4)
    lora = run_threads(cfg, out_dir=tmp_path, timeout=240)
    base = lm_task(cfg).build_model()
    adapted = with_lora(lm_task(cfg).build_model(), LoraConfig(rank=4), cfg.seed)
    share = trainable(adapted) / sum(p.numel() for p in base.parameters())
    assert 0 < share < 0.1
    for f, r in zip(full, lora):
        assert r.steps == 8 and r.outer_syncs == f.outer_syncs > 0
        # The same codec over share of the elements: the bytes scale with it (headers aside).
        assert 0 < r.bytes_sent < 1.5 * share * f.bytes_sent
    assert lora[0].state_hash == lora[1].state_hash
    out = load_pretrained(tmp_path / "model", dtype=torch.float32)
    got, ref = out.state_dict(), base.state_dict()
    assert got.keys() == ref.keys()
    for name, t in ref.items():
        targeted = any(k in name for k in ("_proj.",))
        if targeted:  # W + (α/r)·B·A: moved by the trained adapters
            assert not torch.equal(got[name], t), name
        else:  # embeddings and norms were frozen
            assert torch.equal(got[name], t), name


def test_the_global_copy_shares_the_frozen_weights() -> None:
    from diloco.trainer import DilocoWorker
    from transport.loopback import LoopbackGroup

    cfg = dataclasses.replace(_cfg(lora_rank=4), workers=1)
    w = DilocoWorker(cfg, LoopbackGroup(1).comms()[0], lm_task(cfg))
    local, glob = dict(w.model.named_parameters()), dict(w.global_model.named_parameters())
    for name, p in local.items():  # one tensor for a frozen weight, two for an adapter
        assert (glob[name] is p) == (not p.requires_grad) == ("lora_" not in name), name


def test_lora_needs_diloco_and_a_rank() -> None:
    with pytest.raises(ConfigError):
        _cfg(lora_rank=4, mode="ddp")
    with pytest.raises(ConfigError):
        LoraConfig(rank=0)


def test_a_lora_run_config_round_trips_through_json() -> None:
    """The launcher writes config.json (the CLI's ``--lora-rank`` run failed there)."""
    import json

    cfg = _cfg(lora_rank=4)
    assert config_from_dict(json.loads(json.dumps(config_to_dict(cfg)))) == cfg
    assert config_from_dict(json.loads(json.dumps(config_to_dict(_cfg())))).lora is None
