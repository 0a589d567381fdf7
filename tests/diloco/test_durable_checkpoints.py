"""Checkpoints and exports survive a crash mid-write (issue 25).

Before, ``save_state`` replaced ``.safetensors`` and ``.json`` one after the other without fsync
and with nothing marking the pair complete: a crash between them left a checkpoint whose
tensors and metadata came from different saves, and resume took whatever ``.json`` it found.
Exports were written in place (a crash left half a model directory). The crash is simulated by
making the second write of a save fail.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

import diloco.checkpoint as ckpt
from diloco.checkpoint import export_model, is_complete, latest_state, load_state, save_state
from lowband.errors import ConfigError
from lowband.models.config import ModelConfig
from lowband.models.llama import LlamaForCausalLM

pytestmark = [pytest.mark.security, pytest.mark.timeout(60)]


def _state(step: int) -> ckpt.State:
    return {"w": torch.full((4,), float(step))}, {"step": step}


class Crash(RuntimeError):
    pass


def _crash_on_write(monkeypatch, n: int) -> None:
    """Make the ``n``-th durable write of the next save fail, as a crash would."""
    real, count = ckpt.durable_write, [0]

    def flaky(path: Path, write) -> None:
        count[0] += 1
        if count[0] == n:
            raise Crash(f"simulated crash writing {path.name}")
        real(path, write)

    monkeypatch.setattr(ckpt, "durable_write", flaky)


def test_a_crash_between_the_two_files_leaves_the_previous_checkpoint_resumable(
    tmp_path, monkeypatch
):
    root = tmp_path / "checkpoints"
    save_state(root / "step-000100" / "worker-0", _state(100))
    _crash_on_write(monkeypatch, 2)  # the .safetensors is written, the .json is not
    with pytest.raises(Crash):
        save_state(root / "step-000200" / "worker-0", _state(200))
    assert not is_complete(root / "step-000200" / "worker-0")
    stem = latest_state(root, "worker-0")
    assert stem == root / "step-000100" / "worker-0"
    tensors, meta = load_state(stem)
    assert meta == {"step": 100} and torch.equal(tensors["w"], torch.full((4,), 100.0))


def test_a_crash_overwriting_a_checkpoint_is_detected_not_mixed(tmp_path, monkeypatch):
    root = tmp_path / "checkpoints"
    save_state(root / "step-000100" / "worker-0", _state(100))
    save_state(root / "final" / "worker-0", _state(150))
    _crash_on_write(monkeypatch, 2)  # new tensors in place, old metadata and manifest
    with pytest.raises(Crash):
        save_state(root / "final" / "worker-0", _state(200))
    assert not is_complete(root / "final" / "worker-0")
    with pytest.raises(ConfigError, match="incomplete"):
        load_state(root / "final" / "worker-0")
    assert latest_state(root, "worker-0") == root / "step-000100" / "worker-0"


def test_a_crash_before_the_manifest_leaves_the_checkpoint_incomplete(tmp_path, monkeypatch):
    root = tmp_path / "checkpoints"
    save_state(root / "step-000100" / "worker-0", _state(100))
    _crash_on_write(monkeypatch, 3)
    with pytest.raises(Crash):
        save_state(root / "step-000200" / "worker-0", _state(200))
    assert latest_state(root, "worker-0") == root / "step-000100" / "worker-0"
    assert latest_state(root / "step-000200", "worker-0") is None


def test_resume_picks_the_newest_complete_checkpoint(tmp_path):
    root = tmp_path / "checkpoints"
    for step in (100, 300, 200):
        save_state(root / f"step-{step:06d}" / "worker-0", _state(step))
    assert latest_state(root, "worker-0") == root / "step-000200" / "worker-0"  # written last
    assert latest_state(root / "step-000300", "worker-0") == root / "step-000300" / "worker-0"
    assert latest_state(root, "worker-1") is None


def test_the_files_are_fsynced_before_the_rename(tmp_path, monkeypatch):
    synced: list[str] = []
    real = os.fsync

    def spy(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(os, "fsync", spy)
    save_state(tmp_path / "worker-0", _state(1))
    names = [Path(p).name for p in synced]
    # each file as a temp name (before its rename), then the directory
    assert sum(n.endswith(".tmp") for n in names) == 3, names
    assert names.count(tmp_path.name) == 3, names
    doc = json.loads((tmp_path / "worker-0.manifest.json").read_text())
    assert doc["tensors"] == "worker-0.safetensors" and doc["meta"] == "worker-0.json"


def _model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(
        ModelConfig(
            vocab_size=32,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
        )
    )


def test_an_export_is_complete_or_absent(tmp_path, monkeypatch):
    from lowband.models import weights

    out = tmp_path / "model"
    real = weights.save_pretrained

    def crash(model, directory):
        (Path(directory) / "config.json").write_text("{}")  # half an export
        raise Crash("simulated crash while exporting")

    monkeypatch.setattr(weights, "save_pretrained", crash)
    with pytest.raises(Crash):
        export_model(_model(), out, byte_tokenizer=False)
    assert not out.exists()
    assert list(tmp_path.iterdir()) == []  # no temp directory left behind

    monkeypatch.setattr(weights, "save_pretrained", real)
    export_model(_model(), out, byte_tokenizer=True)
    first = {f.name: f.read_bytes() for f in out.iterdir()}
    assert {"config.json", "model.safetensors"} <= first.keys()
    (out / "outer.json").write_text("kept")  # a Flower checkpoint keeps its outer state here

    monkeypatch.setattr(weights, "save_pretrained", crash)
    with pytest.raises(Crash):
        export_model(_model(), out, byte_tokenizer=True)
    assert {f.name: f.read_bytes() for f in out.iterdir()} == {**first, "outer.json": b"kept"}

    monkeypatch.setattr(weights, "save_pretrained", real)
    export_model(_model(), out, byte_tokenizer=True)
    assert (out / "outer.json").read_text() == "kept"
    assert sorted(f.name for f in tmp_path.iterdir()) == ["model"]
