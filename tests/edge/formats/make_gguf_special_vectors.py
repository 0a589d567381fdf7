"""Write ``gguf_special_vectors.json``: llama.cpp's token ids for texts holding special tokens.

llama.cpp's own vectors (``ggml-vocab-*.gguf.inp``) are tokenized without BOS/EOS and without
parsing special tokens; a served prompt has both. This records what llama.cpp does there, for
chat-shaped texts and texts around each vocabulary's special tokens, in three modes
(add_special, parse_special) = (1, 1), (0, 1), (1, 0). Run it against a build of the llama.cpp
that llama-cpp-python 0.3.36 vendors (only the ``llama`` library is needed):

    cmake -S vendor/llama.cpp -B build -DLLAMA_CURL=OFF -DGGML_NATIVE=OFF -DLLAMA_BUILD_TESTS=OFF \\
        -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TOOLS=OFF
    cmake --build build --target llama -j
    python -m tests.edge.formats.make_gguf_special_vectors LLAMA_CPP_DIR BUILD_DIR VOCAB_DIR
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import tempfile
from pathlib import Path

import gguf

from edge.formats.gguf_reader import open_reader
from edge.formats.gguf_tokenizer import CONTROL, UNKNOWN, USER_DEFINED, read_vocab

OUT = Path(__file__).with_name("gguf_special_vectors.json")
SEP = "\n@@SEP@@\n"
MODES = ((True, True), (False, True), (True, False))
CHATS = {
    "qwen2": ["<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"],
    "llama-bpe": [
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    ],
    "llama-spm": ["<s>[INST] Hi [/INST] ok</s>", "<s> [INST]  Hi</s>  <s>x"],
    "phi-3": [
        "<|user|>\nHi<|end|>\n<|assistant|>\n",
        "<|user|>  Hi <|end|> \n<|assistant|> ok<|endoftext|> x</s> y",
    ],
}
HARNESS = r"""
#include "llama.h"
#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>
int main(int argc, char ** argv) {
    llama_backend_init();
    auto mp = llama_model_default_params();
    mp.vocab_only = true;
    llama_model * m = llama_model_load_from_file(argv[1], mp);
    if (!m) return 1;
    const llama_vocab * v = llama_model_get_vocab(m);
    std::ifstream f(argv[2], std::ios::binary);
    std::stringstream ss; ss << f.rdbuf();
    std::string raw = ss.str(), sep = "\n@@SEP@@\n";
    const bool modes[3][2] = {{true, true}, {false, true}, {true, false}};
    size_t pos = 0;
    while (pos < raw.size()) {
        size_t nxt = raw.find(sep, pos);
        std::string s = raw.substr(pos, nxt == std::string::npos ? std::string::npos : nxt - pos);
        for (int k = 0; k < 3; ++k) {
            std::vector<llama_token> t(s.size() + 16);
            const bool add = modes[k][0], parse = modes[k][1];
            int n = llama_tokenize(v, s.data(), s.size(), t.data(), t.size(), add, parse);
            for (int i = 0; i < n; ++i) printf("%d ", t[i]);
            printf("\n");
        }
        if (nxt == std::string::npos) break;
        pos = nxt + sep.size();
    }
    return 0;
}
"""


def texts_for(name: str, reader: gguf.GGUFReader) -> list[str]:
    v = read_vocab(reader)
    special = [t for t, k in zip(v.tokens, v.token_types) if k in (CONTROL, UNKNOWN)][:8]
    user = sorted(t for t, k in zip(v.tokens, v.token_types) if k == USER_DEFINED)
    picked = special + random.Random(0).sample(user, min(4, len(user)))
    texts = list(CHATS.get(name, []))
    for s in picked:
        texts += [f"a{s}b", f" {s} ", f"{s}\n\n x", f"x \n{s}  {picked[0]}y"]
    return [t for t in texts if SEP not in t]


def main(llama_cpp: Path, build: Path, vocab_dir: Path, names: list[str]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        exe = Path(tmp) / "tok"
        (Path(tmp) / "tok.cpp").write_text(HARNESS)
        subprocess.run(
            ["g++", "-O1", "-std=c++17", str(Path(tmp) / "tok.cpp"), "-o", str(exe)]
            + [f"-I{llama_cpp / 'include'}", f"-I{llama_cpp / 'ggml/include'}"]
            + [f"-L{build / 'bin'}", "-lllama", "-lggml", "-lggml-base"]
            + [f"-Wl,-rpath,{build / 'bin'}"],
            check=True,
        )
        vectors: dict[str, list[list[object]]] = {}
        for name in names:
            path = vocab_dir / f"ggml-vocab-{name}.gguf"
            texts = texts_for(name, open_reader(path))
            (Path(tmp) / "in.txt").write_bytes(SEP.join(texts).encode("utf-8"))
            r = subprocess.run(
                [str(exe), str(path), str(Path(tmp) / "in.txt")],
                capture_output=True,
                text=True,
                check=True,
            )
            lines = r.stdout.split("\n")
            assert len(lines) >= 3 * len(texts), name
            vectors[name] = [
                [t] + [[int(x) for x in lines[3 * i + k].split()] for k in range(3)]
                for i, t in enumerate(texts)
            ]
    doc = {"llama.cpp": "vendored by llama-cpp-python 0.3.36", "modes": MODES, "vectors": vectors}
    OUT.write_text(json.dumps(doc, ensure_ascii=False, separators=(",", ":")) + "\n")


if __name__ == "__main__":
    from tests.models.test_gguf_tokenizer import VOCABS

    a = sys.argv[1:]
    main(Path(a[0]), Path(a[1]), Path(a[2]), a[3:] or VOCABS)
