"""GGUF files of the published architectures, written the way llama.cpp's converter writes them
(``convert_hf_to_gguf.py``: names of gguf-py's ``MODEL_TENSORS``, q/k rows permuted for the
llama architecture only, Llama 3.1 rope as ``rope_freqs.weight``, the tokenizer as
``tokenizer.ggml.*`` with its chat template), from a transformers model with random weights:
the model lowband loads from the file gives transformers' logits, the tokenizer and the chat
template come from the file, and ``lowband edge generate FILE.gguf`` runs on it.

llama-cpp-python is not installed here, so greedy parity against llama.cpp itself is left to
``benchmarks.edge_vs_llamacpp``."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from edge.formats.gguf import load_gguf
from edge.quant import kernel
from edge.quant.linear import GGMLLinear
from edge.source import resolve_model
from lowband.errors import ConfigError
from tests.edge.test_ggml_quant import random_blocks

pytestmark = pytest.mark.timeout(600)  # may build the C++ extension first (minutes here)

ROOT = Path(__file__).resolve().parents[2]
SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>"]
SPECIALS += ["<|eot_id|>"]
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>"
    "\n\n{{ m['content'] }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
TEXT = "the quick brown fox jumps over the lazy dog. " * 20 + "hello world, a tiny model! 123"


def bpe() -> Tokenizer:
    """A byte-level BPE of ~300 tokens whose first ids are the special tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([TEXT], trainer)
    return tok


def add_tokenizer(w: gguf.GGUFWriter, tok: Tokenizer, vocab_size: int, pre: str) -> None:
    """``tokenizer.ggml.*`` as the converter writes a BPE tokenizer (padded to the model's
    vocabulary with unused tokens, as published Llama 3 / Qwen files are)."""
    vocab = tok.get_vocab()
    tokens = [""] * vocab_size
    for t, i in vocab.items():
        tokens[i] = t
    types = []
    for i, t in enumerate(tokens):
        if t in SPECIALS:
            types.append(gguf.TokenType.CONTROL)
        elif not t:
            tokens[i] = f"[PAD{i}]"
            types.append(gguf.TokenType.UNUSED)
        else:
            types.append(gguf.TokenType.NORMAL)
    merges = json.loads(tok.to_str())["model"]["merges"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in merges]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(vocab["<|begin_of_text|>"])
    w.add_eos_token_id(vocab["<|end_of_text|>"])
    w.add_add_bos_token(pre == "llama-bpe")
    w.add_chat_template(TEMPLATE)


def converter_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.LlamaModel.permute (weights and biases of q/k)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def llama3_factors(cfg) -> np.ndarray:
    """convert_hf_to_gguf.LlamaModel.generate_extra_tensors: rope_freqs for llama3 scaling."""
    sc, d = cfg.rope_parameters, cfg.head_dim
    factor, lo, hi = sc["factor"], sc["low_freq_factor"], sc["high_freq_factor"]
    old = sc["original_max_position_embeddings"]
    freqs = 1.0 / (sc["rope_theta"] ** (np.arange(0, d, 2, dtype=np.float32) / d))
    out = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < old / hi:
            out.append(1.0)
        elif wavelen > old / lo:
            out.append(factor)
        else:
            smooth = (old / wavelen - lo) / (hi - lo)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


GG = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
TOP = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


# Gemma 3's sandwich norms (convert_hf_to_gguf / gguf-py MODEL_TENSORS[GEMMA3]).
GG_GEMMA3 = {
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
}


def gguf_name(hf: str, arch: str = "llama") -> str:
    if hf in TOP:
        return TOP[hf]
    _, _, i, rest = hf.split(".", 3)
    names = {**GG, **GG_GEMMA3} if arch == "gemma3" else GG
    return f"blk.{i}.{names[rest]}"


def write_file(path: Path, hf_model, arch: str, pre: str, quant: str | None = None) -> Path:
    """``hf_model`` as llama.cpp's converter writes it (F32; with ``quant``, every matrix but
    the embedding as random blocks of that type, copied dequantized into ``hf_model``)."""
    cfg = hf_model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    rope = cfg.rope_parameters
    w.add_rope_freq_base(rope.get("full_attention", rope)["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_file_type(0 if quant is None else 15)
    add_tokenizer(w, bpe(), cfg.vocab_size, pre)
    if arch == "gemma3":
        w.add_sliding_window(cfg.sliding_window)
    if rope.get("rope_type") == "llama3":
        w.add_tensor("rope_freqs.weight", llama3_factors(cfg))
    state = hf_model.state_dict()
    for i, (hf, t) in enumerate(state.items()):
        if hf == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        a = t.detach().float().numpy().copy()
        qt = None
        if quant is not None and a.ndim == 2 and hf != "model.embed_tokens.weight":
            qt = gguf.GGMLQuantizationType[quant]
            raw = random_blocks(quant, *a.shape, seed=i, scale=0.1 / 945)
            t.data.copy_(torch.from_numpy(gguf.quants.dequantize(raw, qt)))
            a = raw
        if arch == "llama" and ".q_proj." in hf:
            a = converter_permute(a, cfg.num_attention_heads)
        elif arch == "llama" and ".k_proj." in hf:
            a = converter_permute(a, cfg.num_key_value_heads)
        if arch == "gemma3" and hf.endswith("norm.weight"):
            a = a + 1  # Gemma3Model.modify_tensors: the file stores 1 + w
        w.add_tensor(gguf_name(hf, arch), np.ascontiguousarray(a), raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def hf_llama32(hidden: int = 64, inter: int = 128):
    """Llama-3.2-style: GQA 4:1, tied head, llama3 rope scaling (short original context so the
    factors differ from 1 at this head size)."""
    cfg = transformers.LlamaConfig(
        vocab_size=320,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        max_position_embeddings=128,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
    )
    return _random(transformers.LlamaForCausalLM(cfg))


def hf_qwen25(hidden: int = 64, inter: int = 128):
    cfg = transformers.Qwen2Config(
        vocab_size=320,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        use_sliding_window=False,
    )
    return _random(transformers.Qwen2ForCausalLM(cfg))


def hf_qwen3():
    cfg = transformers.Qwen3Config(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,  # not hidden / heads, as in Qwen3
        max_position_embeddings=128,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        tie_word_embeddings=True,
    )
    return _random(transformers.Qwen3ForCausalLM(cfg))


def hf_gemma3():
    """Gemma-3-1B-style: 6 layers (every 6th global), a sliding window shorter than the
    prompt, a local rope base, GeGLU, sandwich (1 + w) norms, q/k norms, tied head."""
    cfg = transformers.Gemma3TextConfig(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=16,
        query_pre_attn_scalar=16,  # = head_dim, as llama.cpp assumes below 62 layers
        sliding_window=4,
        max_position_embeddings=128,
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        },
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    return _random(transformers.Gemma3ForCausalLM(cfg))


def _random(model):
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0, 0.1 if p.dim() == 2 else 0.05)
    return model.float().eval()


def _ids() -> torch.Tensor:
    return torch.randint(0, 300, (1, 9), generator=torch.Generator().manual_seed(1))


@pytest.fixture
def no_kernel():
    saved = kernel.get_config()
    kernel.configure(enabled=False)
    yield
    kernel.configure(enabled=saved.enabled)


@pytest.mark.parametrize(
    "make,arch,pre",
    [
        (hf_gemma3, "gemma3", "llama-bpe"),
        (hf_llama32, "llama", "llama-bpe"),
        (hf_qwen25, "qwen2", "qwen2"),
        (hf_qwen3, "qwen3", "qwen2"),
    ],
)
def test_f32_file_matches_transformers(tmp_path, make, arch, pre) -> None:
    hf = make()
    path = write_file(tmp_path / f"{arch}.gguf", hf, arch, pre)
    got = load_gguf(path)
    cfg = got.config
    assert cfg.model_type == {"gemma3": "gemma3_text"}.get(arch, arch)
    assert cfg.tie_word_embeddings == hf.config.tie_word_embeddings
    if arch == "llama":  # the file's factors, not a recomputation from a config
        assert cfg.rope_freq_factors is not None and max(cfg.rope_freq_factors) == 8.0
    with torch.no_grad():
        want = hf(_ids()).logits
        logits = got(_ids())
    assert want.abs().max().item() > 0.1
    torch.testing.assert_close(logits, want, atol=1e-4, rtol=0)


def test_llama_without_rope_freqs_differs(tmp_path) -> None:
    """The factors matter at these positions: the test above could fail without them."""
    hf = hf_llama32()
    got = load_gguf(write_file(tmp_path / "l.gguf", hf, "llama", "llama-bpe"))
    hf.config.rope_parameters = {"rope_type": "default", "rope_theta": 500000.0}
    plain = transformers.LlamaForCausalLM(hf.config).eval()
    plain.load_state_dict(hf.state_dict())
    with torch.no_grad():
        assert (got(_ids()) - plain(_ids()).logits).abs().max().item() > 1e-3


@pytest.mark.parametrize("make,arch", [(hf_llama32, "llama"), (hf_qwen25, "qwen2")])
def test_q4_k_file_matches_transformers(tmp_path, no_kernel, make, arch) -> None:
    """Q4_K blocks stay packed (``GGMLLinear``, Qwen2 biases inside it) and, with exact fp32
    matmuls, give transformers' logits on the dequantized weights."""
    hf = make(hidden=256, inter=256)
    path = write_file(tmp_path / f"{arch}.gguf", hf, arch, "qwen2", quant="Q4_K")
    got = load_gguf(path)
    q = got.model.layers[0].self_attn.q_proj
    assert isinstance(q, GGMLLinear) and q.weight_blocks.type.name == "Q4_K"
    assert (q.bias is not None) == (arch == "qwen2")
    with torch.no_grad():
        want = hf(_ids()).logits
        logits = got(_ids())
    assert want.abs().max().item() > 0.1
    torch.testing.assert_close(logits, want, atol=1e-4, rtol=1e-4)


def test_tokenizer_and_chat_template_from_the_file(tmp_path) -> None:
    path = write_file(tmp_path / "l.gguf", hf_llama32(), "llama", "llama-bpe")
    src = resolve_model(path)
    assert src.gguf and src.name == "l" and src.config.model_type == "llama"
    tok = src.tokenizer()
    ref = bpe()
    text = "hello world, the lazy fox"
    bos = ref.token_to_id("<|begin_of_text|>")
    assert tok.encode(text) == [bos, *ref.encode(text).ids]  # llama-bpe adds BOS
    assert tok.decode(ref.encode(text).ids) == text
    tpl = tok.chat_template
    assert tpl is not None
    assert ref.token_to_id("<|eot_id|>") in tpl.stop_token_ids
    prompt = tpl.render([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert prompt.startswith("<|begin_of_text|><|start_header_id|>user")


def test_unknown_architecture_is_refused(tmp_path) -> None:
    w = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "mamba")
    w.add_tensor("token_embd.weight", np.zeros((8, 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ConfigError, match="general.architecture.*'mamba'"):
        resolve_model(tmp_path / "m.gguf")


def test_cli_generate_on_a_gguf_file(tmp_path) -> None:
    """``lowband edge generate FILE.gguf``: the file's tokenizer, the model's greedy tokens."""
    hf = hf_qwen25()
    path = write_file(tmp_path / "qwen.gguf", hf, "qwen2", "qwen2")
    tok = resolve_model(path).tokenizer()
    ids = tok.encode("hello world")
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([ids]), max_new_tokens=8, do_sample=False, eos_token_id=tok.eos_token_id
        )
    want = tok.decode(out[0, len(ids) :].tolist())
    kernel.available()  # build (or find) the C++ extension here, so the command loads it
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "cli", "edge", "generate", str(path)]
        + ["--prompt", "hello world", "--max-tokens", "8", "--threads", "1"],
        capture_output=True,
        text=True,
        timeout=400,
        env=env,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == want + "\n"
    assert "8 tokens" in proc.stderr or tok.eos_token_id in out[0].tolist()


@pytest.mark.parametrize("make,arch", [(hf_qwen25, "qwen2"), (hf_llama32, "llama")])
def test_split_of_a_q4_k_file_keeps_blocks_and_greedy_tokens(tmp_path, make, arch) -> None:
    """``edge split FILE.gguf --devices 2``: each device's files hold its Q4_K rows/columns as
    the file's blocks, and the 2-way split picks the one-device model's greedy tokens (Qwen2:
    biases, own head; Llama 3.2: rope_freqs, one KV head on both devices, tied head split by
    vocabulary rows)."""
    from edge.shardio import load_shard, split_checkpoint
    from edge.tp import make_reduce
    from tests.conftest import run_ranks, tp_head
    from transport.loopback import LoopbackGroup

    hf = make(hidden=512, inter=512)  # 2 heads of 128 per device: whole Q4_K blocks
    path = write_file(tmp_path / "q.gguf", hf, arch, "qwen2", quant="Q4_K")
    out = split_checkpoint(path, tmp_path / "split", 2)
    one = load_shard(path).model
    # Greedy continuation on one device (recomputed from scratch each step: no cache involved).
    seq = _ids()[0].tolist()
    with torch.no_grad():
        for _ in range(6):
            seq.append(int(one(torch.tensor([seq]))[0, -1].argmax()))
    ids = torch.tensor([seq])
    with torch.no_grad():
        want = one(ids)[0].argmax(-1)
        x = one.embed(ids)
    assert resolve_model(out).tokenizer().encode("hello") == resolve_model(path).tokenizer().encode(
        "hello"
    )
    comms = LoopbackGroup(2, timeout=60).comms()

    def rank_fn(r: int):
        def body():
            reduce = make_reduce(comms[r])
            sh = load_shard(out, r, 2, reduce=reduce)
            down = sh.model.model.layers[1].mlp.down_proj
            assert isinstance(down, GGMLLinear) and down.in_features == 256
            assert down.weight_blocks.type.name == "Q4_K"
            with torch.no_grad():
                h = sh.model.forward_layers(x, cache=None, start=0)
                return tp_head(sh.model, sh.plan, r, h, reduce)

        return body

    got = run_ranks([rank_fn(0), rank_fn(1)], timeout=300)[0]
    assert torch.equal(got[0].argmax(-1), want)


def test_quantize_a_float_file_and_refuse_a_quantized_one(tmp_path) -> None:
    """``edge quantize FILE.gguf --bits 8``: a float file becomes a Q8 checkpoint directory
    that keeps the file's tokenizer; a file of K-quant blocks is refused, not requantized."""
    from edge.formats.gguf import quantize_gguf
    from edge.formats.quantized_checkpoint import QuantConfig, quantize_model
    from edge.quant import QuantLinear
    from edge.shardio import load_shard

    hf = hf_qwen25()
    path = write_file(tmp_path / "f.gguf", hf, "qwen2", "qwen2")
    out = quantize_gguf(path, tmp_path / "q8", QuantConfig(bits=8, group=32))
    got = load_shard(out, fast=False, fuse=False).model
    assert isinstance(got.model.layers[0].self_attn.q_proj, QuantLinear)
    ref = load_gguf(path)  # the same file quantized in memory: the directory holds exactly it
    quantize_model(ref, QuantConfig(bits=8, group=32))
    with torch.no_grad():
        want, logits = hf(_ids()).logits, got(_ids())
        assert torch.equal(logits, ref(_ids()))
    assert ((logits - want).norm() / want.norm()).item() < 5e-2  # int8 weights and activations
    src = resolve_model(out)
    assert not src.gguf and src.tokenizer().encode("hello world") == resolve_model(
        path
    ).tokenizer().encode("hello world")
    kq = write_file(tmp_path / "k.gguf", hf_qwen25(256, 256), "qwen2", "qwen2", quant="Q4_K")
    with pytest.raises(ConfigError, match="already quantized"):
        quantize_gguf(kq, tmp_path / "no", QuantConfig(bits=8, group=32))


def test_cli_run_two_devices_on_a_q4_k_file(tmp_path, spawn) -> None:
    """``lowband edge run FILE.gguf --devices 2``: tensor parallel over the star link on the
    file's Q4_K blocks answers the one-device greedy text, and /v1/models reports the file's
    chat template."""
    from edge.engine import Engine, LocalRunner
    from edge.sampling import SamplingParams
    from edge.shardio import load_shard
    from lowband.proc import free_port
    from tests.cli.test_edge_cli import _http, _wait_health

    path = write_file(tmp_path / "q.gguf", hf_qwen25(512, 512), "qwen2", "qwen2", quant="Q4_K")
    src = resolve_model(path)
    eng = Engine(LocalRunner(load_shard(path).model), src.tokenizer(), model_name="q")
    want = eng.complete("hello world", SamplingParams(max_tokens=8))[0]
    port = free_port()
    master = spawn(
        [sys.executable, "-m", "cli", "edge", "run", str(path), "--devices", "2"]
        + ["--port", str(port), "--threads", "1"]
    )
    _wait_health(port, master, timeout=400)
    status, models = _http(port, "/v1/models")
    assert status == 200 and models["data"][0]["chat_template"] == "model"
    body = {"prompt": "hello world", "max_tokens": 8, "temperature": 0}
    status, out = _http(port, "/v1/completions", body)
    assert status == 200, out
    assert out["choices"][0]["text"] == want
