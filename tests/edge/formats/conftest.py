"""llama.cpp's tokenizer test vectors, fetched from the llama-cpp-python source release.

The release vendors llama.cpp, whose ``models/ggml-vocab-NAME.gguf`` (vocabulary-only GGUF files
of real tokenizers) come with ``.inp`` (test strings) and ``.out`` (llama.cpp's token ids). They
are not committed: the fixture downloads the release once per checkout into pytest's cache and
keeps only those files. Without network the tests fail (with pip's output), they never skip.
"""

from __future__ import annotations

import subprocess
import tarfile
import tempfile
from pathlib import Path

import pytest

from benchmarks.edge_vs_llamacpp import LLAMA_CPP_PYTHON, download_sdist

_VOCAB_PREFIX = "vendor/llama.cpp/models/ggml-vocab-"


def _download_sdist(dest: Path) -> Path:
    try:
        return download_sdist(dest)
    except (RuntimeError, subprocess.TimeoutExpired) as exc:
        pytest.fail(
            f"could not fetch llama.cpp's tokenizer test vectors; these tests need PyPI: {exc}"
        )


def _extract_vocab_files(sdist: Path, out: Path) -> int:
    """Copy the ``ggml-vocab-*`` members, flattened to their base names, into ``out``."""
    out.mkdir(parents=True)
    n = 0
    with tarfile.open(sdist, "r:gz") as tar:
        for m in tar:
            rel = m.name.split("/", 1)[-1]  # drop the "llama_cpp_python-X.Y.Z/" top folder
            if not (m.isfile() and rel.startswith(_VOCAB_PREFIX)):
                continue
            src = tar.extractfile(m)
            assert src is not None
            (out / Path(rel).name).write_bytes(src.read())
            n += 1
    return n


@pytest.fixture(scope="session")
def llamacpp_vocab_dir(request: pytest.FixtureRequest) -> Path:
    """The folder holding ``ggml-vocab-*.gguf`` with their ``.inp``/``.out`` vectors."""
    name = "lowband-" + LLAMA_CPP_PYTHON.replace("==", "-")
    cache = getattr(request.config, "cache", None)
    root = Path(cache.mkdir(name)) if cache is not None else Path(".pytest_cache") / name
    root.mkdir(parents=True, exist_ok=True)
    models = root / "models"
    if (root / "COMPLETE").exists():
        return models
    with tempfile.TemporaryDirectory(dir=root) as tmp:
        staged = Path(tmp) / "models"
        n = _extract_vocab_files(_download_sdist(Path(tmp)), staged)
        if n == 0:
            pytest.fail(f"{LLAMA_CPP_PYTHON} holds no {_VOCAB_PREFIX}* files")
        if models.exists():  # a run interrupted before COMPLETE: replace what it left
            for f in models.iterdir():
                f.unlink()
            models.rmdir()
        staged.rename(models)
    (root / "COMPLETE").write_text(f"{n} files from {LLAMA_CPP_PYTHON}\n")
    return models
