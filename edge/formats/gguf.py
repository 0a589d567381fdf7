"""GGUF files (llama.cpp's format): read a ``.gguf`` (llama, qwen2, qwen3, gemma3, phi3,
smollm3 and qwen3moe architectures: see ``edge.formats.gguf_arch``) into the edge runtime,
and write one (for the llama.cpp benchmark and for users who want to take a lowband model there).

Reading maps each tensor onto what the runtime already has, without requantizing:

* ``F32`` / ``F16`` / ``BF16``: floating tensors;
* ``Q8_0``: blocks of 32 = fp16 ``d`` + 32 int8 -> ``QuantLinear`` bits 8, group 32
  (``qweight`` int8 [N, K], ``scales`` fp16 [N, K/32]);
* ``Q4_0``: blocks of 32 = fp16 ``d`` + 16 bytes -> bits 4, group 32. Byte ``j`` holds element
  ``j`` in its low nibble and ``j + 16`` in its high nibble, which is exactly the packed layout
  of ``edge.quant.formats`` at group 32, so the bytes are copied as they are.
* ``Q4_1``, ``Q5_0``, ``Q5_1``, ``Q2_K``, ``Q3_K``, ``Q4_K``, ``Q5_K``, ``Q6_K`` (what
  ``Q4_K_M``/``*_K_S`` files mix): the blocks are kept exactly as in the file
  (``edge.quant.ggml.GGMLWeight``) -> ``GGMLLinear``, decoded block by block at matmul time.

Any other type (IQ*, TQ*, MXFP4, ...) is refused with a :class:`ConfigError` naming the tensor
and the type. A quantized token embedding stays in the file's type too
(``edge.quant.embedding``: a lookup dequantizes the rows it reads); when the head is tied to it
(no ``output.weight``: Llama 3.2, Qwen2.5) the head is a ``GGMLLinear`` / ``QuantLinear`` over
the same bytes, as in llama.cpp, instead of a float32 copy of the whole vocabulary read every
decode step.

For the llama architecture llama.cpp stores ``attn_q`` / ``attn_k`` with the rows of each head
permuted for its rotary kernel (pairs ``(i, i + D/2)`` interleaved); :func:`_unpermute` undoes
it on rows, which works on packed rows too (a row's blocks run along K).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch
from torch import nn

from edge.formats.bounds import open_gguf
from edge.formats.gguf_arch import (
    ARCHS,
    EXPERTS,
    ROPE_FREQS,
    TOKENIZER_GGUF,
    architecture,
    hf_names,
)
from edge.formats.gguf_arch import read_config as read_config
from edge.formats.gguf_reader import open_reader
from edge.formats.quantized_checkpoint import (
    QuantConfig,
    QuantLayout,
    quantize_model,
    save_quantized,
    untied_config,
)
from edge.quant import QuantLinear
from edge.quant.embedding import GGMLEmbedding, QuantEmbedding, packed_embedding
from edge.quant.formats import PackedWeight, QuantSpec
from edge.quant.ggml import GGML_TYPES, GGMLWeight
from edge.quant.linear import GGMLLinear
from edge.tp import Reduce, TPPlan, make_plan, shard, split_row_parallel
from lowband.errors import ConfigError
from lowband.models.config import ModelConfig
from lowband.models.llama import LlamaForCausalLM, rope_inv_freq

SUPPORTED = ("F32", "F16", "BF16", "Q8_0", "Q4_0", *GGML_TYPES)


def _import_gguf():
    try:
        import gguf
    except ModuleNotFoundError:
        raise ConfigError(
            "model", "reading/writing GGUF needs the 'gguf' package (pip install 'lowband[edge]')"
        ) from None
    return gguf


def _permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """HF rows -> llama.cpp rows: within each head, (first half, second half) -> interleaved."""
    n = w.shape[0]
    return w.reshape(n_head, 2, n // n_head // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    n = w.shape[0]
    return w.reshape(n_head, n // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


# ---- writing ----------------------------------------------------------------------------------
# The families :func:`write_gguf` writes: lowband's model_type -> GGUF architecture.
WRITABLE = {"llama": "llama", "qwen2": "qwen2", "gemma3_text": "gemma3"}


def _writable(cfg: ModelConfig) -> str:
    """The GGUF architecture ``cfg`` is written as; ConfigError where llama.cpp's reading of that
    architecture (which fixes some fields instead of reading them) would give another model."""
    arch = WRITABLE.get(cfg.model_type)
    if arch is None or cfg.is_moe:
        raise ConfigError(
            "model_type",
            f"GGUF writing covers dense {', '.join(WRITABLE)}; got {cfg.model_type}",
        )
    if cfg.attention_bias and arch != "qwen2":
        raise ConfigError("attention_bias", f"a {arch} GGUF has no q/k/v biases")
    if (cfg.rope_scaling or {}).get("rope_type", "default") != "default":
        raise ConfigError("rope_scaling", "GGUF writing covers unscaled rotary embeddings")
    if arch == "gemma3":
        n, hd = cfg.num_hidden_layers, cfg.dim_per_head
        # What llama.cpp fixes for LLM_ARCH_GEMMA3 (edge.formats.gguf_arch._gemma3 reads the same)
        fixed = {
            "layer_types": tuple(
                "sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(n)
            ),
            "rope_local_theta": 10000.0,
            "query_pre_attn_scalar": float(
                cfg.hidden_size // cfg.num_attention_heads if n == 62 else hd
            ),
            "hidden_act": "gelu_pytorch_tanh",
            "norm_unit_offset": True,
            "sandwich_norms": True,
            "scale_embeddings": True,
            "qk_norm": True,
        }
        for key, want in fixed.items():
            got = getattr(cfg, key)
            if (float(got) if isinstance(want, float) and got is not None else got) != want:
                raise ConfigError(
                    key, f"{got!r}: a gemma3 GGUF is read with {want!r} (llama.cpp fixes it)"
                )
    elif cfg.sliding_window is not None or cfg.qk_norm or cfg.norm_unit_offset:
        raise ConfigError("model_type", f"{cfg.model_type} with Gemma/Qwen3 features")
    return arch


def write_gguf(
    model: LlamaForCausalLM,
    path: str | Path,
    *,
    ftype: str = "f32",
    tokenizer_from: str | Path | None = None,
) -> Path:
    """Write ``model`` (fp32 weights) as a GGUF of its family (llama, qwen2 or gemma3, as
    llama.cpp's converter writes them: llama's q/k rows permuted, Gemma's norms as 1 + w).
    ``ftype``: ``f32``, ``f16``, ``q8_0`` or ``q4_0`` (matrices only; norms stay F32; quantized
    with gguf's reference code). ``tokenizer_from``: a GGUF whose ``tokenizer.*`` metadata
    (vocabulary, merges, specials, chat template) the file carries, e.g. the file a fine-tune
    started from; without it the vocabulary is placeholder tokens (callers feed token ids, not
    text)."""
    gguf = _import_gguf()
    cfg = model.config
    arch = _writable(cfg)
    spec = ARCHS[arch]
    qtypes = {
        "f32": None,
        "f16": None,
        "q8_0": gguf.GGMLQuantizationType.Q8_0,
        "q4_0": gguf.GGMLQuantizationType.Q4_0,
    }
    if ftype not in qtypes:
        raise ConfigError("ftype", f"must be one of {sorted(qtypes)}, got {ftype!r}")
    p = Path(path)
    w = gguf.GGUFWriter(str(p), arch)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.n_kv_heads)
    w.add_key_length(cfg.dim_per_head)
    w.add_value_length(cfg.dim_per_head)
    w.add_rope_dimension_count(cfg.dim_per_head)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_file_type({"f32": 0, "f16": 1, "q8_0": 7, "q4_0": 2}[ftype])
    if arch == "gemma3":
        w.add_sliding_window(cfg.sliding_window or 4096)
        if cfg.final_logit_softcapping is not None:
            w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    if tokenizer_from is None:
        _add_vocab(w, cfg)
    else:
        _copy_tokenizer(w, tokenizer_from, cfg.vocab_size)
    if cfg.rope_freq_factors is not None:  # Llama 3.1+: llama.cpp's divisors of the frequencies
        w.add_tensor(ROPE_FREQS, np.asarray(cfg.rope_freq_factors, dtype=np.float32))
    state = model.state_dict()
    names = {h: g for g, h in hf_names(cfg.num_hidden_layers, spec).items() if h in state}
    unknown = sorted(set(state) - set(names) - {"lm_head.weight"})
    if unknown:
        raise ConfigError("model", f"no {arch} GGUF name for {unknown[0]!r}")
    for hf, g in names.items():
        if hf == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        t = state[hf].detach().float()
        if spec.permuted and ".q_proj." in hf:
            t = _permute(t, cfg.num_attention_heads)
        elif spec.permuted and ".k_proj." in hf:
            t = _permute(t, cfg.n_kv_heads)
        if spec.norm_shift and g.endswith("norm.weight"):
            t = t + spec.norm_shift  # the reader takes it off again
        a = t.contiguous().numpy()
        qt = qtypes[ftype]
        if t.dim() == 2 and qt is not None and t.shape[1] % 32 == 0:
            w.add_tensor(g, gguf.quants.quantize(a, qt), raw_dtype=qt)
        elif t.dim() == 2 and ftype != "f32":
            w.add_tensor(g, a.astype(np.float16))
        else:
            w.add_tensor(g, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return p


def export_gguf(
    model_dir: str | Path,
    path: str | Path,
    *,
    ftype: str = "f32",
    tokenizer_from: str | Path | None = None,
) -> Path:
    """The HF checkpoint directory a training run exported (``OUT/model``) as one GGUF file
    that ``edge`` and llama.cpp load. The tokenizer: ``tokenizer_from`` (a GGUF, e.g. the file
    the fine-tune started from), else the directory's ``tokenizer.gguf`` if it has one, else
    placeholder tokens."""
    from lowband.models.weights import load_pretrained

    src = Path(model_dir)
    if tokenizer_from is None and (src / TOKENIZER_GGUF).is_file():
        tokenizer_from = src / TOKENIZER_GGUF
    model = load_pretrained(src, dtype=torch.float32)
    return write_gguf(model, path, ftype=ftype, tokenizer_from=tokenizer_from)


def _add_vocab(w: Any, cfg: ModelConfig) -> None:
    """A SentencePiece-style vocabulary of placeholders: llama.cpp insists on one."""
    gguf = _import_gguf()
    n = cfg.vocab_size
    tokens = [b"<unk>", b"<s>", b"</s>"][:n] + [
        f"<0x{i:02X}>".encode() for i in range(min(256, n - 3))
    ]
    tokens += [f"t{i}".encode() for i in range(len(tokens), n)]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL][:n]
    types += [gguf.TokenType.BYTE] * min(256, max(0, n - 3))
    types += [gguf.TokenType.NORMAL] * (n - len(types))
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * n)
    w.add_token_types(types)
    if n > 2:
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_unk_token_id(0)
    w.add_add_bos_token(False)


def _copy_tokenizer(w: Any, src: str | Path, vocab_size: int) -> None:
    """``src``'s ``tokenizer.*`` fields into the writer ``w``; its vocabulary must fit the model."""
    reader = open_reader(str(src))
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    n = len(tokens.data) if tokens is not None else 0
    if not 0 < n <= vocab_size:
        raise ConfigError(
            "tokenizer", f"{src} has {n} tokens; the model's vocabulary has {vocab_size} rows"
        )
    for f in reader.fields.values():
        if f.name.startswith("tokenizer."):
            sub = f.types[-1] if len(f.types) > 1 else None
            w.add_key_value(f.name, f.contents(), f.types[0], sub_type=sub)


def write_tokenizer_gguf(src: str | Path, path: str | Path) -> Path:
    """``src``'s ``tokenizer.*`` metadata (and its architecture) in a GGUF with no tensors: what
    a directory made from a GGUF file (split, convert, quantize) keeps as its tokenizer."""
    gguf = _import_gguf()
    reader = open_reader(str(src))
    arch = reader.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(str(path), arch)
    for f in reader.fields.values():
        if f.name.startswith("tokenizer."):
            sub = f.types[-1] if len(f.types) > 1 else None
            w.add_key_value(f.name, f.contents(), f.types[0], sub_type=sub)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)


# ---- reading ----------------------------------------------------------------------------------
Weight = torch.Tensor | PackedWeight | GGMLWeight
# The file's bytes [offset, offset + n) as a uint8 tensor the weights may keep (a memory map:
# ``edge.window.MappedBytes.view``); weights built on it are views of the file, not copies.
ByteView = Callable[[int, int], torch.Tensor]


def _tensor(t: Any, view: ByteView | None = None) -> Weight:
    """One GGUF tensor as a float tensor (N, K) / (N,), a PackedWeight or a GGMLWeight, without
    requantizing. With ``view``, the types usable as stored (ggml blocks, F32) are views of
    the file's bytes; the others are converted (copied) as without it."""
    kind = t.tensor_type.name
    shape = tuple(int(s) for s in reversed(t.shape))  # (N, K)
    if len(shape) == 3:  # a stack of (N, K) matrices (a MoE layer's experts): all their rows
        shape = (shape[0] * shape[1], shape[2])
    if view is not None and (kind == "F32" or (kind in GGML_TYPES and len(shape) == 2)):
        mapped = view(int(t.data_offset), int(t.n_bytes))
        if kind != "F32":
            nk = (shape[0], shape[1])
            return GGMLWeight(GGML_TYPES[kind], nk, mapped.view(shape[0], -1))
        if mapped.data_ptr() % 4 == 0:  # (GGUF aligns tensor data to 32 bytes)
            return mapped.view(torch.float32).view(shape)
    data = np.asarray(t.data)
    if kind in ("F32", "F16"):
        return torch.from_numpy(data.astype(np.float32).reshape(shape))
    if kind == "BF16":
        u32 = data.view(np.uint16).reshape(shape).astype(np.uint32) << 16  # bf16 = top half of fp32
        return torch.from_numpy(u32.view(np.float32).copy())
    if kind not in SUPPORTED:
        raise ConfigError(
            "model",
            f"GGUF tensor {t.name} has type {kind}, which lowband does not "
            f"load (supported: {', '.join(SUPPORTED)}); re-quantize the file with "
            f"llama-quantize to one of those (e.g. Q4_K_M or Q8_0)",
        )
    if len(shape) != 2:
        raise ConfigError("model", f"GGUF tensor {t.name}: a {kind} tensor must be 2-D")
    n, k = shape
    if kind in GGML_TYPES:  # kept as the file's blocks: row n is K/qk blocks back to back
        raw = data.view(np.uint8).reshape(n, -1)
        return GGMLWeight(GGML_TYPES[kind], (n, k), torch.from_numpy(raw.copy()))
    blocks = data.view(np.uint8).reshape(n, k // 32, -1)  # (N, K/32, 34 | 18)
    scales = torch.from_numpy(
        np.ascontiguousarray(blocks[:, :, :2]).view(np.float16).reshape(n, k // 32)
    )
    q = np.ascontiguousarray(blocks[:, :, 2:]).reshape(n, -1)
    if kind == "Q8_0":
        qweight = torch.from_numpy(q.view(np.int8).copy())
        return PackedWeight(QuantSpec(8, 32, (n, k)), qweight, scales.clone())
    return PackedWeight(QuantSpec(4, 32, (n, k)), torch.from_numpy(q.copy()), scales.clone())


def _rows(x: Weight, fn) -> Weight:
    if isinstance(x, GGMLWeight):  # a row's blocks run along K: permuting rows moves bytes
        return GGMLWeight(x.type, x.shape, fn(x.data).contiguous())
    if isinstance(x, PackedWeight):
        return PackedWeight(x.spec, fn(x.qweight).contiguous(), fn(x.scales).contiguous())
    return fn(x).contiguous()


def _split_rows(x: Weight, sizes: Sequence[int]) -> list[Weight]:
    """``x`` cut into consecutive row blocks (a packed row is whole blocks along K)."""
    out: list[Weight] = []
    start = 0
    for n in sizes:
        if isinstance(x, GGMLWeight):
            out.append(GGMLWeight(x.type, (n, x.shape[1]), x.data[start : start + n].clone()))
        elif isinstance(x, PackedWeight):
            spec = QuantSpec(x.spec.bits, x.spec.group, (n, x.spec.shape[1]))
            rows = slice(start, start + n)
            out.append(PackedWeight(spec, x.qweight[rows].clone(), x.scales[rows].clone()))
        else:
            out.append(x[start : start + n].clone())
        start += n
    return out


def _rows_of(x: Weight) -> int:
    return x.shape[0] if isinstance(x, (GGMLWeight, torch.Tensor)) else x.spec.shape[0]


def _unfuse(name: str, x: Weight, cfg: ModelConfig) -> list[tuple[str, Weight]]:
    """The runtime's tensors of a fused GGUF tensor: Phi-3's ``attn_qkv`` (rows q | k | v) and
    ``ffn_up`` (rows gate | up), a MoE layer's stacked experts (rows expert by expert)."""
    prefix, _, what = name.rpartition(".")
    if what in ("w1", "w2", "w3") and prefix.endswith(EXPERTS):
        e = cfg.num_local_experts
        if _rows_of(x) % e:
            raise ConfigError("model", f"GGUF {name}: {_rows_of(x)} rows for {e} experts")
        parts = _split_rows(x, [_rows_of(x) // e] * e)
        return [(f"{prefix}.{i}.{what}.weight", p) for i, p in enumerate(parts)]
    if name.endswith("self_attn.qkv_proj.weight"):
        nq, nkv = cfg.num_attention_heads * cfg.dim_per_head, cfg.n_kv_heads * cfg.dim_per_head
        sizes, names = [nq, nkv, nkv], ["q_proj", "k_proj", "v_proj"]
    elif name.endswith("mlp.gate_up_proj.weight"):
        sizes, names = [cfg.intermediate_size] * 2, ["gate_proj", "up_proj"]
    else:
        return [(name, x)]
    if _rows_of(x) != sum(sizes):
        raise ConfigError("model", f"GGUF {name}: {_rows_of(x)} rows, expected {sum(sizes)}")
    base = name.rsplit(".", 2)[0]
    return [(f"{base}.{n}.weight", p) for n, p in zip(names, _split_rows(x, sizes))]


def _read_tensors(reader: Any, cfg: ModelConfig, view: ByteView | None = None) -> dict[str, Weight]:
    """Every tensor of the file by HF name, q/k rows back in HF order where llama.cpp's
    converter permuted them (the llama architecture: weights and biases) and norm weights
    back in HF's form (Gemma: the file stores 1 + w). ``view``: the decoder layers' tensors
    used as stored are views of the file (:func:`_tensor`); transformed ones are copies."""
    arch, spec = architecture(reader)
    hf_of = hf_names(cfg.num_hidden_layers, spec)
    out: dict[str, Weight] = {}
    for t in reader.tensors:
        if t.name == ROPE_FREQS:  # read into cfg.rope_freq_factors by read_config
            continue
        name = hf_of.get(t.name)
        if name is None:
            raise ConfigError(
                "model", f"GGUF tensor {t.name!r} is not part of a {arch!r} model lowband runs"
            )
        x = _tensor(t, view if t.name.startswith("blk.") else None)
        if spec.norm_shift and t.name.endswith("norm.weight") and isinstance(x, torch.Tensor):
            x = x - spec.norm_shift
        if spec.permuted and ".q_proj." in name:
            x = _rows(x, lambda r: _unpermute(r, cfg.num_attention_heads))
        elif spec.permuted and ".k_proj." in name:
            x = _rows(x, lambda r: _unpermute(r, cfg.n_kv_heads))
        out.update(_unfuse(name, x, cfg))
    return out


def load_gguf(
    path: str | Path, dtype: torch.dtype | None = None, *, view: ByteView | None = None
) -> LlamaForCausalLM:
    """The whole model of a GGUF file: Q8_0/Q4_0 matrices as ``QuantLinear``, the other block
    types (Q4_K, Q6_K, ...) as ``GGMLLinear`` (with their biases), float ones as ``nn.Linear``.
    ``view``: decoder-layer weights usable as stored are views of the file's bytes (the
    sliding window, ``edge.formats.gguf_window``), not copies."""
    _import_gguf()  # a ConfigError naming the extra when gguf is not installed
    # header bounded by the file before anything is built; the tokenizer's arrays not parsed
    reader = open_gguf(path, tokenizer=False)
    cfg = read_config(reader)
    dt = dtype or torch.float32
    tensors = _read_tensors(reader, cfg, view)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    packed = {n for n, x in tensors.items() if not isinstance(x, torch.Tensor)}
    floats: dict[str, torch.Tensor] = {}
    for name, x in tensors.items():
        if isinstance(x, torch.Tensor):
            if name.removesuffix(".bias") + ".weight" not in packed:  # else the module's bias
                floats[name] = x.to(dt)
            continue
        if name == "model.embed_tokens.weight":  # the file's bytes; a tied head shares them
            emb = packed_embedding(x, dt)
            model.model.embed_tokens = emb  # type: ignore[assignment]
            if cfg.tie_word_embeddings:
                model.lm_head = emb.tied_head()
            continue
        mod_name = name.rpartition(".")[0]
        bias = tensors.get(mod_name + ".bias")
        b = bias if isinstance(bias, torch.Tensor) else None
        parent, _, child = mod_name.rpartition(".")
        mod = QuantLinear.from_packed(x, b) if isinstance(x, PackedWeight) else GGMLLinear(x, b)
        setattr(model.get_submodule(parent), child, mod)
    if cfg.tie_word_embeddings:
        floats.pop("lm_head.weight", None)
    missing = {k for k, p in model.named_parameters() if p.is_meta} - floats.keys()
    if cfg.tie_word_embeddings:
        missing.discard("lm_head.weight")
    if missing:
        raise ConfigError("model", f"GGUF {path} lacks {sorted(missing)[:3]}")
    model.load_state_dict(floats, strict=False, assign=True)
    model.inv_freq = rope_inv_freq(cfg)
    split_row_parallel(model)  # one device adds partial sums as a 2-way TP split does
    if cfg.tie_word_embeddings and "model.embed_tokens.weight" not in packed:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval()


def float_embedding(model: LlamaForCausalLM) -> None:
    """Replace a quantized token embedding (and the head tied to it) by float tensors, in
    place: what a checkpoint directory stores (``convert``, ``quantize``)."""
    emb = model.model.embed_tokens
    if not isinstance(emb, (GGMLEmbedding, QuantEmbedding)):
        return
    w = emb.dequantize_weight(emb.dtype_ref.dtype)
    model.model.embed_tokens = nn.Embedding.from_pretrained(w, freeze=True)
    if model.config.tie_word_embeddings:
        with torch.device("meta"):
            head = nn.Linear(emb.embedding_dim, emb.num_embeddings, bias=False)
        head.weight = model.model.embed_tokens.weight
        model.lm_head = head


def load_gguf_shard(
    path: str | Path,
    rank: int = 0,
    world: int = 1,
    *,
    weights: Sequence[float] | None = None,
    reduce: Reduce | None = None,
    dtype: torch.dtype | None = None,
    view: ByteView | None = None,
) -> tuple[LlamaForCausalLM, TPPlan]:
    """Rank ``rank``'s slice of a GGUF model (the whole file is read, then sliced: packed
    matrices keep their packing through ``narrow_out/narrow_in``; a column split that cuts a
    block, e.g. ``o_proj`` heads not on 256-value boundaries for Q4_K, is a ``ConfigError``).
    ``view``: as for :func:`load_gguf`; a row slice of a view stays a view, a column slice
    is a copy."""
    model = load_gguf(path, dtype, view=view)
    # the FFN columns split on whole blocks of the layers' matrices (the head splits by rows)
    layers = model.model.layers.modules()
    groups = [m.group for m in layers if isinstance(m, (QuantLinear, GGMLLinear))]
    plan = make_plan(model.config, world, weights, ffn_unit=max(groups, default=8))
    return shard(model, plan, rank, world, reduce), plan


def convert_gguf(path: str | Path, out_dir: str | Path) -> Path:
    """``lowband edge convert FILE.gguf --out DIR``: a checkpoint directory every edge command
    (split, serve, run, TP, window) reads; Q8_0/Q4_0 blocks are copied, never requantized."""
    model = load_gguf(path)
    float_embedding(model)
    blocks = sorted({m.qtype.name for m in model.modules() if isinstance(m, GGMLLinear)})
    if blocks:
        raise ConfigError(
            "model",
            f"{path} holds {', '.join(blocks)} matrices, which a lowband checkpoint directory "
            "cannot store; serve the .gguf directly (every edge command reads it)",
        )
    packed = {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    bits = {m.bits for m in packed.values()}
    if len(bits) > 1:
        raise ConfigError(
            "model",
            f"{path} mixes Q8_0 and Q4_0 matrices; convert supports one "
            "width per file (serve the .gguf directly instead)",
        )
    if model.config.tie_word_embeddings and "lm_head" in packed:
        raise ConfigError("model", "tied quantized embeddings are not supported")
    layout = QuantLayout(bits.pop(), 32, tuple(packed)) if packed else None
    out = Path(out_dir)
    if layout is None:
        from lowband.models.weights import save_pretrained

        save_pretrained(model, out)
    else:
        save_quantized(model, layout, out)
    write_tokenizer_gguf(path, out / TOKENIZER_GGUF)
    return out


def quantize_gguf(src: Path, out: Path, cfg: QuantConfig) -> Path:
    """A float GGUF file (F32/F16/BF16 matrices) quantized like a checkpoint; its tokenizer
    kept as ``tokenizer.gguf``. A file with quantized blocks is served as it is instead."""
    model = load_gguf(src)
    float_embedding(model)
    if any(isinstance(m, (QuantLinear, GGMLLinear)) for m in model.modules()):
        raise ConfigError(
            "model_dir",
            f"{src} is already quantized; serve the .gguf directly (every edge command reads it)",
        )
    mcfg = model.config
    layout = quantize_model(model, cfg)
    if mcfg.tie_word_embeddings and "lm_head" in layout.modules:
        model.config = untied_config(mcfg)
    save_quantized(model, layout, out)
    write_tokenizer_gguf(src, out / TOKENIZER_GGUF)
    return out


__all__ = [
    "write_gguf",
    "write_tokenizer_gguf",
    "load_gguf",
    "load_gguf_shard",
    "convert_gguf",
    "quantize_gguf",
    "read_config",
    "SUPPORTED",
]
