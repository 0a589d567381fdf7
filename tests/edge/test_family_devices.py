"""Every supported family, from HF safetensors and from GGUF, on one device and on a 2-device
tensor-parallel cluster: greedy tokens equal transformers' (eager, fp32) on the same weights.

The one-device run is what ``lowband edge run MODEL`` does (``load_shard`` with its fused
projections and compiled decode step, a ``LocalRunner``: prefill, then one token at a time
through the KV cache). The cluster is what ``lowband edge run MODEL --devices 2`` runs, in
process: a ``MasterRunner`` and a ``run_worker`` thread on the loopback communicator with the
direct star link for activations, each loading its slice with ``load_shard``, once from the
model as given and once from ``lowband edge split``'s per-device files. Each GGUF file is
written from the same transformers model the way llama.cpp's converter writes that
architecture (F32, so the tokens can be compared exactly)."""

from __future__ import annotations

import contextlib
import json
import sys
import threading
from pathlib import Path
from typing import Callable, Iterator

import gguf
import numpy as np
import pytest
import torch
import transformers

from edge.cluster import ClusterConfig, MasterRunner, WorkerConfig, run_worker
from edge.engine import LocalRunner, Runner
from edge.formats.gguf import load_gguf
from edge.formats.gguf_reader import open_reader
from edge.moe.checkpoint import load_dense, quantize_nested_checkpoint
from edge.moe.quant import NestedQuantConfig
from edge.moe.serve import ExpertServeConfig, load_nested_shard
from edge.quant import QuantLinear, kernel
from edge.quant.linear import GGMLLinear
from edge.shardio import load_shard, split_checkpoint
from edge.source import resolve_model
from lowband.errors import ConfigError
from lowband.proc import free_port
from tests.cli.test_edge_cli import _http, _wait_health
from tests.edge.test_gguf_models import (
    GG,
    GG_GEMMA3,
    TEMPLATE,
    TOP,
    _random,
    add_tokenizer,
    bpe,
    converter_permute,
    hf_gemma3,
    hf_llama32,
    hf_qwen3,
    hf_qwen25,
    llama3_factors,
)
from transport.loopback import LoopbackGroup

pytestmark = pytest.mark.timeout(600)  # the first load may build the C++ extension

SMALL = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=96,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)


def hf_mistral():
    cfg = transformers.MistralConfig(**SMALL, num_hidden_layers=2, sliding_window=None)
    return _random(transformers.MistralForCausalLM(cfg))


def hf_phi3():
    cfg = transformers.Phi3Config(
        **SMALL, num_hidden_layers=2, pad_token_id=0, bos_token_id=1, eos_token_id=2
    )
    return _random(transformers.Phi3ForCausalLM(cfg))


def hf_smollm3():
    """Four layers: the fourth is NoPE, as llama.cpp fixes for the architecture (every 4th)."""
    cfg = transformers.SmolLM3Config(
        **SMALL,
        num_hidden_layers=4,
        no_rope_layers=[1, 1, 1, 0],
        tie_word_embeddings=True,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    return _random(transformers.SmolLM3ForCausalLM(cfg))


def hf_qwen3_moe():
    """llama.cpp always renormalises the top-k routing weights of qwen3moe (as Qwen3-30B-A3B's
    config asks); the HF-only family test covers the raw ones."""
    cfg = transformers.Qwen3MoeConfig(
        **{**SMALL, "intermediate_size": 128},
        num_hidden_layers=2,
        head_dim=32,
        moe_intermediate_size=48,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=True,
    )
    return _random(transformers.Qwen3MoeForCausalLM(cfg))


def hf_mixtral():
    cfg = transformers.MixtralConfig(
        **SMALL, num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2
    )
    return _random(transformers.MixtralForCausalLM(cfg))


# family -> (transformers model, GGUF architecture llama.cpp's converter writes; None: no GGUF)
FAMILIES: dict[str, tuple[Callable[[], transformers.PreTrainedModel], str | None]] = {
    "llama3": (hf_llama32, "llama"),
    "mistral": (hf_mistral, "llama"),
    "qwen2": (hf_qwen25, "qwen2"),
    "qwen3": (hf_qwen3, "qwen3"),
    "gemma3": (hf_gemma3, "gemma3"),
    "phi3": (hf_phi3, "phi3"),
    "smollm3": (hf_smollm3, "smollm3"),
    "qwen3_moe": (hf_qwen3_moe, "qwen3moe"),
    "mixtral": (hf_mixtral, None),  # llama.cpp writes Mixtral as 'llama' with experts
}

PROMPT = [5, 77, 140, 9, 200, 31, 64, 250, 12]  # 9 tokens: past Gemma 3's window of 4
NEW = 12  # generated tokens


# ---- GGUF as llama.cpp's converter writes each architecture ----------------------------------
def _layer_name(hf: str, arch: str) -> str | None:
    """The GGUF name of a per-layer HF tensor (None: handled by the caller)."""
    _, _, i, rest = hf.split(".", 3)
    if arch == "phi3" and rest in ("self_attn.qkv_proj.weight", "mlp.gate_up_proj.weight"):
        return f"blk.{i}." + ("attn_qkv.weight" if "qkv" in rest else "ffn_up.weight")
    if arch == "qwen3moe" and rest.startswith("mlp."):
        return f"blk.{i}.ffn_gate_inp.weight" if rest == "mlp.gate.weight" else None
    names = {**GG, **GG_GEMMA3} if arch == "gemma3" else GG
    return f"blk.{i}.{names[rest]}"


# Block bytes of the quant types written below and where their fp16 scales sit.
_BLOCKS = {"Q8_0": (32, 34, (0,)), "Q4_K": (256, 144, (0, 2))}


def _random_blocks(quant: str, shape: tuple[int, ...], seed: int, scale: float) -> np.ndarray:
    """Random blocks of ``quant`` for a float tensor of ``shape`` (..., K): uint8
    (..., K / qk * size) with small finite fp16 scales (standard deviation ``scale``)."""
    qk, size, scales = _BLOCKS[quant]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (*shape[:-1], shape[-1] // qk, size), dtype=np.uint8)
    for at in scales:
        v = (rng.standard_normal((*shape[:-1], shape[-1] // qk, 1)) * scale).astype(np.float16)
        raw[..., at : at + 2] = v.view(np.uint8)
    return raw.reshape(*shape[:-1], -1)


def quantize_in_place(hf_model, quant: str) -> dict[str, np.ndarray]:
    """Every matrix of ``hf_model`` but the embedding and the MoE router as random ``quant``
    blocks, the model's weights set to what they decode to; returns the blocks by HF name
    (rows in HF order: the file's fusing, stacking and permuting move whole rows)."""
    qt = gguf.GGMLQuantizationType[quant]
    out: dict[str, np.ndarray] = {}
    with torch.no_grad():
        for i, (name, p) in enumerate(hf_model.named_parameters()):
            if p.dim() < 2 or "embed_tokens" in name or name.endswith("mlp.gate.weight"):
                continue
            sharp = any(k in name for k in ("q_proj", "k_proj", "qkv_proj"))
            raw = _random_blocks(quant, tuple(p.shape), seed=i, scale=3e-4 if sharp else 1e-4)
            flat = gguf.quants.dequantize(raw.reshape(-1, raw.shape[-1]), qt)
            p.copy_(torch.from_numpy(flat.reshape(p.shape)))
            out[name] = raw
    return out


def write_gguf_file(path: Path, hf_model, arch: str, quant: str | None = None) -> Path:
    """``hf_model`` as a GGUF of ``arch``: metadata keys and tensor names of gguf-py, q/k rows
    permuted for the architectures llama.cpp ropes interleaved (llama, smollm3), Phi-3's fused
    q/k/v and gate/up kept fused, Qwen3-MoE's experts stacked per layer. F32, or with
    ``quant`` every matrix but the embedding and router as random blocks of that type (the
    model's weights are set to what they decode to)."""
    blocks = quantize_in_place(hf_model, quant) if quant else {}
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
    w.add_file_type({None: 0, "Q8_0": 7, "Q4_K": 15}[quant])
    add_tokenizer(w, bpe(), cfg.vocab_size, "qwen2" if arch.startswith("qwen") else "llama-bpe")
    if arch == "gemma3":
        w.add_sliding_window(cfg.sliding_window)
    if arch == "phi3":
        w.add_sliding_window(0)  # the converter's "no window" (llama.cpp disables Phi-3's)
    if arch == "qwen3moe":
        w.add_expert_count(cfg.num_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if rope.get("rope_type") == "llama3":
        w.add_tensor("rope_freqs.weight", llama3_factors(cfg))
    permuted = arch in ("llama", "smollm3")
    state = {k: v.detach().float().numpy().copy() for k, v in hf_model.state_dict().items()}
    state.update(blocks)
    qtype = gguf.GGMLQuantizationType[quant] if quant else None

    def add(name: str, a: np.ndarray, hf: str) -> None:
        w.add_tensor(name, np.ascontiguousarray(a), raw_dtype=qtype if hf in blocks else None)

    for hf, a in state.items():
        if hf == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if permuted and ".q_proj." in hf:
            a = converter_permute(a, cfg.num_attention_heads)
        elif permuted and ".k_proj." in hf:
            a = converter_permute(a, cfg.num_key_value_heads)
        if arch == "gemma3" and hf.endswith("norm.weight"):
            a = a + 1  # Gemma3Model.modify_tensors: the file stores 1 + w
        name = TOP.get(hf) or _layer_name(hf, arch)
        if name is not None:
            add(name, a, hf)
    if arch == "qwen3moe":  # transformers keeps (E, 2I, H) gate|up and (E, H, I) down
        for i in range(cfg.num_hidden_layers):
            gate_up = f"model.layers.{i}.mlp.experts.gate_up_proj"
            down = f"model.layers.{i}.mlp.experts.down_proj"
            stacks = {
                "gate": (state[gate_up][:, : cfg.moe_intermediate_size], gate_up),
                "up": (state[gate_up][:, cfg.moe_intermediate_size :], gate_up),
                "down": (state[down], down),
            }
            for proj, (a, hf) in stacks.items():
                add(f"blk.{i}.ffn_{proj}_exps.weight", a, hf)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# ---- the models, their reference tokens, and the files ---------------------------------------
def reference_tokens(hf_model, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy continuation, every step recomputed from the whole sequence."""
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(hf_model(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(prompt) :]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """family -> {"ref": tokens, "hf": checkpoint dir, "gguf": file or None}, built once."""
    made: dict[str, dict] = {}

    def get(family: str) -> dict:
        if family not in made:
            make, arch = FAMILIES[family]
            hf = make()
            hf.config._attn_implementation = "eager"
            with torch.no_grad():  # sharper attention: positions and rope matter to the tokens
                for name, p in hf.named_parameters():
                    if any(k in name for k in ("q_proj", "k_proj", "qkv_proj")):
                        p.mul_(3)
            d = tmp_path_factory.mktemp(family)
            hf.save_pretrained(d / "hf")
            ref = reference_tokens(hf, PROMPT, NEW)
            assert len(set(ref)) >= 3, ref  # a continuation that can tell models apart
            made[family] = {
                "ref": ref,
                "model": hf,
                "hf": d / "hf",
                "gguf": write_gguf_file(d / "m.gguf", hf, arch) if arch else None,
            }
        return made[family]

    return get


def greedy(runner: Runner, prompt: list[int], n: int) -> list[int]:
    """The engine's greedy loop: the prompt in one forward, then one token at a time."""
    out: list[int] = []
    logits = runner.forward(prompt, 0, top=1)
    for i in range(n):
        out.append(int(logits.argmax()))
        if i + 1 < n:
            logits = runner.forward([out[-1]], len(prompt) + i, top=1)
    return out


@contextlib.contextmanager
def two_devices(path: Path, **cluster) -> Iterator[MasterRunner]:
    """The master of a 2-device cluster (master + one worker thread) serving ``path``
    (``cluster``: more ClusterConfig fields); the worker must end cleanly."""
    comms = LoopbackGroup(2, timeout=60).comms()
    errors: list[BaseException] = []

    def work() -> None:
        try:
            run_worker(comms[1], WorkerConfig(join_timeout=60))
        except BaseException as e:  # noqa: BLE001 - reported by the test
            errors.append(e)

    worker = threading.Thread(target=work, daemon=True)
    worker.start()
    runner = None
    try:
        cfg = ClusterConfig(devices=2, op_timeout=60.0, join_timeout=60, heartbeat_s=1.0, **cluster)
        runner = MasterRunner(comms[0], path, cfg)
        yield runner
    finally:
        if runner is not None:
            runner.close()
        worker.join(30)
        assert not worker.is_alive() and not errors, errors


def cluster_tokens(
    path: Path, prompt: list[int], n: int, experts: ExpertServeConfig | None = None
) -> list[int]:
    """Greedy tokens of a 2-device cluster serving ``path``."""
    with two_devices(path, experts=experts) as runner:
        return greedy(runner, prompt, n)


def _source(models, family: str, fmt: str) -> Path:
    return models(family)[fmt]


# (Mixtral has no GGUF architecture of its own: llama.cpp writes it as 'llama' with experts.)
CASES = [(f, fmt) for f in FAMILIES for fmt in ("hf", "gguf") if fmt == "hf" or FAMILIES[f][1]]


@pytest.mark.parametrize("family,fmt", CASES)
def test_one_device(models, family: str, fmt: str) -> None:
    path = _source(models, family, fmt)
    shard = load_shard(path)
    try:
        got = greedy(LocalRunner(shard.model), PROMPT, NEW)
    finally:
        shard.close()
    assert got == models(family)["ref"], (family, fmt)


@pytest.mark.parametrize("family,fmt", CASES)
def test_two_devices(models, family: str, fmt: str) -> None:
    path = _source(models, family, fmt)
    assert cluster_tokens(path, PROMPT, NEW) == models(family)["ref"], (family, fmt)


@pytest.mark.parametrize("family,fmt", CASES)
def test_two_devices_from_split(models, family: str, fmt: str, tmp_path) -> None:
    """``lowband edge split MODEL --devices 2``, then each device loads its own files."""
    path = _source(models, family, fmt)
    out = split_checkpoint(path, tmp_path / "split", 2)
    assert cluster_tokens(out, PROMPT, NEW) == models(family)["ref"], (family, fmt)


# ---- quantized files of the fused and stacked layouts ----------------------------------------
WIDE = dict(  # whole Q4_K blocks (256 values) on both devices: o_proj, down_proj, experts' w2
    vocab_size=320,
    hidden_size=256,
    intermediate_size=512,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=128,
    max_position_embeddings=128,
)


def wide_model(family: str):
    if family == "phi3":
        cfg = transformers.Phi3Config(
            **{**WIDE, "hidden_size": 512},  # Phi-3's head_dim is hidden / heads
            num_hidden_layers=2,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
        )
        hf = _random(transformers.Phi3ForCausalLM(cfg))
    else:
        cfg = transformers.Qwen3MoeConfig(
            **WIDE,
            num_hidden_layers=2,
            moe_intermediate_size=512,
            num_experts=4,
            num_experts_per_tok=2,
            norm_topk_prob=True,
        )
        hf = _random(transformers.Qwen3MoeForCausalLM(cfg))
    hf.config._attn_implementation = "eager"
    return hf


@pytest.fixture
def exact_matmuls():
    """The reference fp32 matmuls instead of the C++ kernels (which quantize activations)."""
    saved = kernel.get_config()
    kernel.configure(enabled=False)
    yield
    kernel.configure(enabled=saved.enabled)


@pytest.mark.parametrize("family", ["phi3", "qwen3_moe"])
@pytest.mark.parametrize("quant", ["Q4_K", "Q8_0"])
def test_packed_fused_and_stacked_tensors(tmp_path, exact_matmuls, family, quant) -> None:
    """Phi-3's fused ``attn_qkv`` / ``ffn_up`` and Qwen3-MoE's stacked ``ffn_*_exps`` of
    packed blocks are cut into the runtime's matrices on whole rows, kept packed (Q4_K:
    ``GGMLLinear``, Q8_0: ``QuantLinear``): the file gives transformers' logits on the weights
    its blocks decode to, and a 2-device split its greedy tokens."""
    hf = wide_model(family)
    path = write_gguf_file(tmp_path / "q.gguf", hf, FAMILIES[family][1], quant=quant)
    model = load_gguf(path)
    layer = model.model.layers[1]
    packed = GGMLLinear if quant == "Q4_K" else QuantLinear
    mats = [layer.self_attn.k_proj, layer.self_attn.o_proj]
    if family == "phi3":
        mats += [layer.mlp.gate_proj, layer.mlp.down_proj]
    else:
        mats += [layer.block_sparse_moe.experts[3].w1, layer.block_sparse_moe.experts[3].w2]
    assert all(isinstance(m, packed) for m in mats), [type(m) for m in mats]
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        want, got = hf(ids).logits, model(ids)
    assert want.abs().max().item() > 0.1
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    ref = reference_tokens(hf, PROMPT, NEW)
    assert len(set(ref)) >= 3, ref
    out = split_checkpoint(path, tmp_path / "split", 2)
    assert cluster_tokens(out, PROMPT, NEW) == ref


def test_unsupported_gguf_variants_are_refused(tmp_path, models) -> None:
    """Long-context Phi-3 (per-frequency ``rope_factors_long/short``) and partial rotary
    (``rope.dimension_count`` below the head size) change the maths: refused by name."""
    src = open_reader(str(models("phi3")["gguf"]))

    def copy(path: Path, extra_kv: dict, extra_tensors: dict) -> Path:
        w = gguf.GGUFWriter(str(path), "phi3")
        for f in src.fields.values():
            if f.name.startswith(("general.architecture", "GGUF.")):
                continue
            sub = f.types[-1] if len(f.types) > 1 else None
            w.add_key_value(f.name, f.contents(), f.types[0], sub_type=sub)
        for k, v in extra_kv.items():
            w.add_uint32(k, v)
        for t in src.tensors:
            w.add_tensor(t.name, np.array(t.data).reshape(tuple(reversed(t.shape.tolist()))))
        for name, a in extra_tensors.items():
            w.add_tensor(name, a)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        return path

    half = np.ones(8, np.float32)  # head_dim 16 / 2
    longrope = copy(tmp_path / "l.gguf", {}, {"rope_factors_long.weight": half})
    with pytest.raises(ConfigError, match="rope_factors_long"):
        load_shard(longrope)
    partial = copy(tmp_path / "p.gguf", {"phi3.rope.dimension_count": 8}, {})
    with pytest.raises(ConfigError, match="rope.dimension_count"):
        load_shard(partial)


# ---- bit-nested experts (``lowband edge quantize MODEL --nested``) ---------------------------
EXPERT_SERVE = ExpertServeConfig(budget_mb=64.0, policy="lru", lru_bits=8)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_nested_experts_one_and_two_devices(models, family, tmp_path) -> None:
    """A MoE checkpoint quantized to bit-nested expert planes (Qwen3-MoE's own expert and
    router names included) serves, on one device and on two, the greedy tokens of the same
    experts dequantized at 8 bits; that model is transformers' up to int8 weight error."""
    cfg = NestedQuantConfig(group_size=16)  # divides every width here
    out = quantize_nested_checkpoint(models(family)["hf"], tmp_path / "nested", cfg)
    dense = load_dense(out, 8)
    want = greedy(LocalRunner(dense), PROMPT, NEW)
    hf = transformers.AutoModelForCausalLM.from_pretrained(models(family)["hf"]).float().eval()
    with torch.no_grad():
        ref, got = hf(torch.tensor([PROMPT])).logits, dense(torch.tensor([PROMPT]))
    assert ((got - ref).norm() / ref.norm()).item() < 0.05
    one = load_nested_shard(out, experts=EXPERT_SERVE)
    try:
        assert greedy(LocalRunner(one.model), PROMPT, NEW) == want
    finally:
        one.close()
    assert cluster_tokens(out, PROMPT, NEW, experts=EXPERT_SERVE) == want


# ---- the command a user runs, and the OpenAI API with the model's chat template ---------------
def add_hf_tokenizer(d: Path) -> None:
    """The GGUF files' BPE tokenizer and Llama-3-style chat template, as an HF directory
    carries them (``tokenizer.json``, ``tokenizer_config.json``)."""
    bpe().save(str(d / "tokenizer.json"))
    config = {
        "chat_template": TEMPLATE,
        "bos_token": "<|begin_of_text|>",
        "eos_token": "<|end_of_text|>",
    }
    (d / "tokenizer_config.json").write_text(json.dumps(config))


@pytest.mark.slow
@pytest.mark.parametrize("family,fmt", [("phi3", "hf"), ("qwen3_moe", "gguf")])
def test_cli_run_two_devices_chat(models, family: str, fmt: str, spawn) -> None:
    """``lowband edge run MODEL --devices 2``: /v1/chat/completions renders the model's own
    template and answers transformers' greedy reply to the rendered prompt, stopping on the
    template's end of turn."""
    m = models(family)
    path = m[fmt]
    if fmt == "hf":
        add_hf_tokenizer(path)
    tok = resolve_model(path).tokenizer()
    tpl = tok.chat_template
    assert tpl is not None
    messages = [{"role": "user", "content": "hello world, the lazy fox"}]
    ids = tpl.encode(tok.encode, tpl.render(messages, add_generation_prompt=True))
    reply = reference_tokens(m["model"], ids, NEW)
    stops = {*tpl.stop_token_ids, tok.eos_token_id}
    cut = next((i for i, t in enumerate(reply) if t in stops), len(reply))
    assert cut >= 3, reply  # a reply to compare, not an immediate end of turn
    # (a reply cut by max_tokens inside a UTF-8 character: the server leaves the bytes out)
    want = tok.decode(reply[:cut]).rstrip("\ufffd")
    port = free_port()
    master = spawn(
        [sys.executable, "-m", "cli", "edge", "run", str(path), "--devices", "2"]
        + ["--port", str(port), "--threads", "1"]
    )
    _wait_health(port, master, timeout=400)
    status, listed = _http(port, "/v1/models")
    assert status == 200 and listed["data"][0]["chat_template"] == "model"
    body = {"messages": messages, "max_tokens": NEW, "temperature": 0}
    status, out = _http(port, "/v1/chat/completions", body)
    assert status == 200, out
    assert out["choices"][0]["message"]["content"] == want
    assert out["usage"]["prompt_tokens"] == len(ids)
