"""A GGUF file as the starting point of training: every matrix dequantized into float32 master
weights, the tokenizer (with its BOS/EOS) taken from the same file.

``load_gguf`` gives the runtime's model, whose quantized matrices (``QuantLinear``,
``GGMLLinear``, a quantized embedding and the head tied to it) hold the file's blocks and have
no gradient. Training needs plain float parameters, so each is replaced here by an ``nn.Linear``
/ ``nn.Embedding`` holding its dequantized weight: the same model the edge runtime runs on this
file, up to the rounding of its quantized kernels. :class:`GGUFPretrained` is what
``diloco.task.Pretrained`` asks of a reader (the CLI passes it to the trainer).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from edge.formats.bounds import open_gguf
from edge.formats.gguf import load_gguf
from edge.formats.gguf_arch import read_config
from edge.formats.gguf_tokenizer import tokenizer_from_gguf
from edge.quant.embedding import GGMLEmbedding, QuantEmbedding
from edge.quant.linear import GGMLLinear, QuantLinear
from lowband.models.config import ModelConfig
from lowband.models.llama import LlamaForCausalLM


def _dense(mod: QuantLinear | GGMLLinear) -> nn.Linear:
    w = mod.dequantize_weight(torch.float32)
    lin = nn.Linear(w.shape[1], w.shape[0], bias=mod.bias is not None)
    lin.weight = nn.Parameter(w.contiguous())
    if mod.bias is not None:
        lin.bias = nn.Parameter(mod.bias.detach().float().clone())
    return lin


def dequantized(model: LlamaForCausalLM) -> LlamaForCausalLM:
    """``model`` (from ``load_gguf``) with every quantized module replaced, in place, by its
    float32 ``nn`` equivalent; a tied head shares the embedding's new weight. Returned in
    training mode with every parameter requiring grad."""
    emb = model.model.embed_tokens
    if isinstance(emb, (GGMLEmbedding, QuantEmbedding)):
        w = emb.dequantize_weight(torch.float32)
        model.model.embed_tokens = nn.Embedding.from_pretrained(w, freeze=False)
        if model.config.tie_word_embeddings:
            head = nn.Linear(w.shape[1], w.shape[0], bias=False)
            head.weight = model.model.embed_tokens.weight
            model.lm_head = head
    for name, mod in list(model.named_modules()):
        if isinstance(mod, (QuantLinear, GGMLLinear)):
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, _dense(mod))
    for p in model.parameters():
        if p.dtype != torch.float32:
            p.data = p.data.float()
        p.requires_grad_(True)
    return model.train()


def load_gguf_fp32(path: str | Path) -> LlamaForCausalLM:
    """The model of a GGUF file with float32 master weights, ready to train."""
    return dequantized(load_gguf(path, torch.float32))


class GGUFPretrained:
    """``diloco.task.Pretrained`` for GGUF files (every family ``load_gguf`` reads)."""

    def config(self, path: str) -> ModelConfig:
        return read_config(open_gguf(path))

    def model(self, path: str) -> LlamaForCausalLM:
        return load_gguf_fp32(path)

    def tokenizer(self, path: str) -> tuple[Any, int | None, int | None]:
        """The file's ``tokenizers.Tokenizer``, its BOS id when the file says to add it
        (``tokenizer.ggml.add_bos_token``) and its EOS id."""
        tok = tokenizer_from_gguf(path)
        bos = tok.vocab.bos_token_id if tok.vocab.add_bos else None
        return tok.hf, bos, tok.vocab.eos_token_id
