"""Fine-tuning from a GGUF file: the training model (fp32 master weights dequantized from the
file) gives the edge runtime's logits on the same file, trains, and the CLI runs it end to end
with the file's own tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from edge.formats.gguf import load_gguf
from edge.formats.gguf_train import GGUFPretrained, load_gguf_fp32
from tests.edge.test_gguf_models import (  # noqa: F401 (no_kernel: a fixture)
    TEXT,
    hf_gemma3,
    hf_llama32,
    hf_qwen25,
    no_kernel,
    write_file,
)

CASES = [
    (hf_gemma3, "gemma3", "llama-bpe", None),
    (hf_llama32, "llama", "llama-bpe", None),
    (hf_llama32, "llama", "llama-bpe", "Q4_K"),
    (hf_qwen25, "qwen2", "qwen2", None),
    (hf_qwen25, "qwen2", "qwen2", "Q6_K"),
    (hf_qwen25, "qwen2", "qwen2", "Q4_K"),
]


@pytest.mark.usefixtures("no_kernel")
@pytest.mark.parametrize("make,arch,pre,quant", CASES)
def test_training_model_gives_the_runtimes_logits(tmp_path: Path, make, arch, pre, quant) -> None:
    hf = make() if quant is None else make(hidden=256, inter=256)  # K-quants: 256-wide rows
    path = write_file(tmp_path / f"{arch}.gguf", hf, arch, pre, quant)
    ids = torch.randint(0, 300, (2, 11), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = load_gguf(path)(ids).float()
    model = load_gguf_fp32(path)
    params = list(model.parameters())
    assert params and all(p.dtype == torch.float32 and p.requires_grad for p in params)
    assert not any(b.dtype == torch.uint8 for b in model.buffers())  # no packed blocks left
    with torch.no_grad():
        got = model.eval()(ids).float()
    tol = 0 if quant is None else 2e-3  # the runtime's quantized kernels round differently
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    # and it trains: one AdamW step on these ids lowers their loss
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def loss() -> torch.Tensor:
        out = model(ids[:, :-1])
        return torch.nn.functional.cross_entropy(
            out.reshape(-1, out.shape[-1]), ids[:, 1:].reshape(-1)
        )

    before = loss()
    before.backward()
    opt.step()
    assert float(loss().detach()) < float(before.detach())


def test_the_files_tokenizer_and_specials(tmp_path: Path) -> None:
    path = write_file(tmp_path / "llama.gguf", hf_llama32(), "llama", "llama-bpe")
    reader = GGUFPretrained()
    tok, bos, eos = reader.tokenizer(str(path))
    assert reader.config(str(path)).vocab_size == 320
    assert bos == 0 and eos == 1  # <|begin_of_text|>, <|end_of_text|> of the test's vocabulary
    assert tok.encode("the quick", add_special_tokens=False).ids[0] != bos


def test_cli_fine_tunes_a_gguf_file(tmp_path: Path, capsys) -> None:
    from cli import main

    path = write_file(tmp_path / "m.gguf", hf_llama32(), "llama", "llama-bpe")
    corpus = tmp_path / "docs.jsonl"
    corpus.write_text("".join(json.dumps({"text": TEXT[i:] + " end"}) + "\n" for i in range(40)))
    out = tmp_path / "run"
    argv = ["train", "--model", str(path), "--corpus", str(corpus), "--data-kind", "jsonl"]
    argv += ["--workers", "2", "--steps", "8", "-H", "4", "-P", "2", "--tau", "1"]
    argv += ["--batch-size", "2", "--seq-len", "16", "--eval-every", "4", "--codec", "int8"]
    argv += ["--inner-lr", "1e-3", "--loopback", "--no-progress", "--out", str(out)]
    assert main(argv) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["consistent"] and len(summary["finished"]) == 2
    assert np.isfinite(summary["initial_eval"]) and summary["final_eval"] < summary["initial_eval"]
    from lowband.models.weights import load_pretrained

    model = load_pretrained(out / "model")
    assert model(torch.tensor([[0, 5, 6]])).shape == (1, 3, 320)
    # Back to a servable file: the fine-tuned weights with the starting file's tokenizer.
    exported = tmp_path / "ft.gguf"
    assert main(["export", str(out / "model"), "--gguf", str(exported)]) == 0
    got, x = load_gguf(exported, torch.float32), torch.tensor([[1, 5, 6, 7]])
    with torch.no_grad():
        torch.testing.assert_close(got(x), model.float()(x), rtol=1e-4, atol=1e-4)
    assert (
        GGUFPretrained().tokenizer(str(exported))[1:] == GGUFPretrained().tokenizer(str(path))[1:]
    )
    a, b = GGUFPretrained().tokenizer(str(exported))[0], GGUFPretrained().tokenizer(str(path))[0]
    assert a.encode(TEXT[:80]).ids == b.encode(TEXT[:80]).ids


@pytest.mark.slow
def test_real_gemma3_starts_from_its_pretrained_loss(real_gemma3: Path) -> None:
    """The real Gemma 3 270M as the trainer builds it (Q4_K_M dequantized to fp32, the file's
    tokenizer, BOS first): its loss on held-out text is a pretrained model's, far below a random
    model's ln(262144) = 12.5, and lower than on the same windows without BOS."""
    import dataclasses

    from diloco.config import DataConfig, TrainConfig
    from diloco.data import PARADISE_LOST, eval_batches
    from diloco.task import PretrainedTask

    data = DataConfig(kind="text", path=str(PARADISE_LOST), seq_len=64, batch_size=2)
    cfg = TrainConfig(gguf_model=str(real_gemma3), data=dataclasses.replace(data, eval_batches=2))
    task = PretrainedTask(cfg, GGUFPretrained())
    assert task.corpus.specials.bos == 2 and task.corpus.specials.eos == 1  # <bos>, <eos>
    model = task.build_model()
    with_bos = task.evaluate(model)
    task._eval = eval_batches(task.corpus.eval, 64, 2, 2, None)
    without = task.evaluate(model)
    assert with_bos < 6.0 < 12.0 < np.log(262144)
    assert with_bos < without - 1.0


@pytest.mark.usefixtures("no_kernel")
def test_cli_lora_fine_tune_of_a_gemma3_file_exports_merged_to_gguf(tmp_path: Path, capsys) -> None:
    """LoRA from a GGUF file back to a servable GGUF: the run's model/ holds the adapters merged
    into the projections (moved from the starting file's; the rest as it was), and
    ``lowband export`` writes a file that ``edge`` runs with model/'s logits and greedy text."""
    from cli import main
    from lowband.models.weights import load_pretrained

    path = write_file(tmp_path / "g.gguf", hf_gemma3(), "gemma3", "llama-bpe")
    corpus = tmp_path / "text.txt"
    corpus.write_text(TEXT * 20)
    out = tmp_path / "run"
    argv = ["train", "--model", str(path), "--corpus", str(corpus), "--lora-rank", "4"]
    argv += ["--workers", "2", "--steps", "8", "-H", "4", "-P", "2", "--tau", "1"]
    argv += ["--batch-size", "2", "--seq-len", "16", "--eval-every", "0", "--codec", "int8"]
    argv += ["--inner-lr", "1e-2", "--loopback", "--no-progress", "--out", str(out)]
    assert main(argv) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["consistent"] and len(summary["finished"]) == 2
    tuned = load_pretrained(out / "model", dtype=torch.float32).eval()
    start = load_gguf_fp32(path).state_dict()
    got = tuned.state_dict()
    assert got.keys() == start.keys() and not any("lora" in k for k in got)
    for name, t in start.items():
        if "_proj." in name:  # W + (α/r)·B·A: moved by the trained adapters
            assert not torch.equal(got[name], t), name
        else:  # embeddings and norms were frozen
            assert torch.equal(got[name], t), name
    exported = tmp_path / "lora.gguf"
    assert main(["export", str(out / "model"), "--gguf", str(exported)]) == 0
    served = load_gguf(exported, torch.float32)
    x = torch.tensor([[2, 5, 17, 42, 8, 99]])
    with torch.no_grad():
        torch.testing.assert_close(served(x).float(), tuned(x), rtol=1e-4, atol=1e-4)
        ids_a, ids_b = x.tolist()[0], x.tolist()[0]
        for _ in range(12):
            ids_a.append(int(served(torch.tensor([ids_a]))[0, -1].argmax()))
            ids_b.append(int(tuned(torch.tensor([ids_b]))[0, -1].argmax()))
    assert ids_a == ids_b
