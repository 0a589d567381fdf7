"""lowband export: a trained run's model/ directory as a GGUF file that edge loads and that
gives the trainer's greedy tokens."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from cli import main
from diloco.config import preset, with_overrides
from diloco.launch import run_threads
from edge.formats.gguf import load_gguf, write_gguf
from edge.formats.gguf_reader import open_reader
from lowband.models.weights import load_pretrained

pytestmark = pytest.mark.timeout(300)


@torch.no_grad()
def _greedy(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        logits = model(torch.tensor([ids]))[0, -1]
        ids.append(int(logits.argmax()))
    return ids[len(prompt) :]


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A byte-level Llama after 8 DiLoCo steps on the embedded corpus: its exported directory."""
    out = tmp_path_factory.mktemp("run")
    cfg = with_overrides(
        preset("tiny"), workers=2, steps=8, inner_steps=4, eval_every=0, batch_size=2, seq_len=32
    )
    run_threads(cfg, out_dir=out, timeout=240)
    return out / "model"


@pytest.mark.parametrize("ftype", ["f32", "q8_0"])
def test_exported_gguf_gives_the_trainers_greedy_tokens(
    trained: Path, tmp_path: Path, ftype: str
) -> None:
    gguf = tmp_path / f"model-{ftype}.gguf"
    assert main(["export", str(trained), "--gguf", str(gguf), "--ftype", ftype]) == 0
    ref = load_pretrained(trained, dtype=torch.float32)
    got = load_gguf(gguf, torch.float32)
    prompt = list(b"ROMEO: ")
    expected = _greedy(ref, prompt, 24)
    assert _greedy(got, prompt, 24) == expected
    if ftype == "f32":  # the same weights: the same logits up to the kernels' rounding
        x = torch.tensor([prompt])
        torch.testing.assert_close(got(x), ref(x), rtol=1e-4, atol=1e-4)


def test_export_carries_the_tokenizer_of_the_starting_file(trained: Path, tmp_path: Path) -> None:
    src = write_gguf(load_pretrained(trained, dtype=torch.float32), tmp_path / "start.gguf")
    out = tmp_path / "out.gguf"
    assert main(["export", str(trained), "--gguf", str(out), "--tokenizer", str(src)]) == 0
    a, b = open_reader(str(src)).fields, open_reader(str(out)).fields
    keys = {k for k in a if k.startswith("tokenizer.")}
    assert keys and keys == {k for k in b if k.startswith("tokenizer.")}
    for k in keys:
        assert a[k].contents() == b[k].contents(), k


def test_export_refuses_a_tokenizer_larger_than_the_model(trained: Path, tmp_path: Path) -> None:
    big = load_pretrained(trained, dtype=torch.float32)
    cfg = dataclasses.replace(big.config, vocab_size=big.config.vocab_size + 64)
    from lowband.models.llama import LlamaForCausalLM

    src = write_gguf(LlamaForCausalLM(cfg), tmp_path / "big.gguf")
    out = tmp_path / "out.gguf"
    assert main(["export", str(trained), "--gguf", str(out), "--tokenizer", str(src)]) == 2
