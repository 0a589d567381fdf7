"""Writing a fine-tuned model back to GGUF for every family the trainer fine-tunes from a GGUF
file that the writer covers (llama, qwen2, gemma3): the file carries the trained weights (not the
starting ones), ``edge`` loads it with the trainer's logits and greedy tokens, and llama.cpp
(a benchmark-only peer: skipped, saying so, where ``llama_cpp`` is not installed) gives the same
greedy tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from edge.formats.gguf import load_gguf, write_gguf
from edge.formats.gguf_reader import open_reader
from edge.formats.gguf_train import load_gguf_fp32
from lowband.errors import ConfigError
from tests.edge.test_gguf_models import (  # noqa: F401 (no_kernel: a fixture)
    hf_gemma3,
    hf_llama32,
    hf_qwen25,
    no_kernel,
    write_file,
)

FAMILIES = {
    "gemma3": (hf_gemma3, "gemma3", "llama-bpe"),
    "qwen2": (hf_qwen25, "qwen2", "qwen2"),
}
PROMPT = [5, 17, 42, 8, 99, 3]


@torch.no_grad()
def _greedy(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt) :]


def _fine_tuned(tmp_path: Path, family: str) -> tuple[Path, torch.nn.Module]:
    """The starting GGUF and the training model read from it, its weights moved as training
    would move them (so a file that kept the starting weights fails)."""
    make, arch, pre = FAMILIES[family]
    src = write_file(tmp_path / f"{family}-start.gguf", make(), arch, pre)
    model = load_gguf_fp32(src).eval()
    with torch.no_grad():
        g = torch.Generator().manual_seed(7)
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return src, model


@pytest.mark.usefixtures("no_kernel")
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_written_file_gives_the_trainers_logits_and_greedy_text(
    tmp_path: Path, family: str
) -> None:
    src, model = _fine_tuned(tmp_path, family)
    out = write_gguf(model, tmp_path / f"{family}-tuned.gguf", tokenizer_from=src)
    assert open_reader(str(out)).fields["general.architecture"].contents() == FAMILIES[family][1]
    got = load_gguf(out, torch.float32).eval()
    x = torch.tensor([PROMPT])
    with torch.no_grad():
        want = model(x)
        torch.testing.assert_close(got(x).float(), want, rtol=1e-4, atol=1e-4)
        assert not torch.allclose(load_gguf(src, torch.float32)(x).float(), want, atol=1e-2)
    assert _greedy(got, PROMPT, 16) == _greedy(model, PROMPT, 16)


@pytest.mark.usefixtures("no_kernel")
def test_gemma3_q8_0_keeps_the_greedy_text(tmp_path: Path) -> None:
    src, model = _fine_tuned(tmp_path, "gemma3")
    out = write_gguf(model, tmp_path / "q8.gguf", ftype="q8_0", tokenizer_from=src)
    assert _greedy(load_gguf(out, torch.float32), PROMPT, 8) == _greedy(model, PROMPT, 8)


def test_gemma3_fields_llamacpp_fixes_are_checked(tmp_path: Path) -> None:
    import dataclasses

    _, model = _fine_tuned(tmp_path, "gemma3")
    model.config = dataclasses.replace(model.config, rope_local_theta=5000.0)
    with pytest.raises(ConfigError, match="rope_local_theta"):
        write_gguf(model, tmp_path / "bad.gguf")


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_llamacpp_loads_the_written_file_with_the_same_greedy_text(
    tmp_path: Path, family: str
) -> None:
    """llama.cpp's greedy tokens are the trainer's. Its F32 path rounds differently (logits
    agree to ~2e-3 here), so at a near-tie of random weights the two may pick different tokens:
    a first difference is accepted only where the trainer's top-2 margin is within twice the
    logits' measured disagreement (gemma3's text here has none; qwen2's one, at a 3e-4 margin)."""
    llama_cpp = pytest.importorskip(
        "llama_cpp", reason="llama-cpp-python is not installed: the llama.cpp check is skipped"
    )
    import numpy as np

    src, model = _fine_tuned(tmp_path, family)
    out = write_gguf(model, tmp_path / f"{family}-tuned.gguf", tokenizer_from=src)
    llm = llama_cpp.Llama(
        model_path=str(out), n_ctx=64, n_threads=1, logits_all=True, verbose=False
    )
    n = 12
    want = _greedy(model, PROMPT, n)
    ids = list(PROMPT)
    for _ in range(n):
        llm.reset()
        llm.eval(ids)
        ids.append(int(llm.scores[llm.n_tokens - 1].argmax()))
    got = ids[len(PROMPT) :]
    # teacher-forced on the trainer's text: how far apart the two runtimes' logits are
    text = PROMPT + want
    llm.reset()
    llm.eval(text)
    theirs = torch.tensor(np.array(llm.scores[: len(text)]))
    with torch.no_grad():
        ours = model(torch.tensor([text]))[0]
    err = float((theirs - ours).abs().max())
    assert err < 1e-2 * float(ours.abs().max()), err
    if got != want:
        i = next(k for k, (a, b) in enumerate(zip(got, want)) if a != b)
        top2 = ours[len(PROMPT) + i - 1].topk(2).values
        margin = float(top2[0] - top2[1])
        assert margin < 2 * err, (i, got, want, margin, err)


@pytest.mark.usefixtures("no_kernel")
def test_cli_exports_a_gemma3_runs_model_directory(tmp_path: Path) -> None:
    """The path a user takes: the run's model/ directory (what the trainer exports) through
    ``lowband export`` to a GGUF that ``edge`` serves with the trainer's greedy tokens."""
    from cli import main
    from diloco.checkpoint import export_model

    src, model = _fine_tuned(tmp_path, "gemma3")
    run_model = export_model(model, tmp_path / "run" / "model", byte_tokenizer=False)
    out = tmp_path / "tuned.gguf"
    argv = ["export", str(run_model), "--gguf", str(out), "--tokenizer", str(src)]
    assert main(argv) == 0
    assert _greedy(load_gguf(out, torch.float32), PROMPT, 16) == _greedy(model, PROMPT, 16)
