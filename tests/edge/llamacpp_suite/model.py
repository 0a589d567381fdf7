"""The small model llama.cpp's server test-suite runs against here: a two-layer Llama with
random weights and a byte-level BPE of ~300 tokens, written as llama.cpp's converter writes a
GGUF (``tests.edge.test_gguf_models``), carrying whichever chat template a test asks the server
for (llama-server takes ``--chat-template-file``; ``lowband edge run`` reads the file's own).

``python -m tests.edge.llamacpp_suite.model OUT.gguf [TEMPLATE.jinja]`` writes one."""

from __future__ import annotations

import sys
from pathlib import Path

import gguf
import torch
import transformers

from tests.edge import test_gguf_models as g

CONTEXT = 8192  # the suite's tool-call tests render long templates into a byte-level vocabulary


def hf_model() -> transformers.LlamaForCausalLM:
    cfg = transformers.LlamaConfig(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=CONTEXT,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    return g._random(transformers.LlamaForCausalLM(cfg))


def write_model(path: Path, template: str | None = None) -> Path:
    """The suite's model at ``path``, with ``template`` as its chat template (default: the
    Llama-3-style one of ``tests.edge.test_gguf_models``)."""
    saved = g.TEMPLATE
    g.TEMPLATE = template or saved
    try:
        return g.write_file(path, hf_model(), "llama", "llama-bpe")
    finally:
        g.TEMPLATE = saved


if __name__ == "__main__":
    out = Path(sys.argv[1])
    tpl = Path(sys.argv[2]).read_text() if len(sys.argv) > 2 else None
    write_model(out, tpl)
    print(gguf.GGUFReader(str(out)).fields["general.architecture"].contents())
