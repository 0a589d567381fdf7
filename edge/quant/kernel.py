"""Lazy loader for the C++ quantized GEMV kernel, with a pure-PyTorch fallback.

The extension (``csrc/gemv.cpp`` + ``csrc/gemv_kernels.h``) is compiled with
``torch.utils.cpp_extension.load`` (ninja) the first time a kernel is needed, once per process
(thread-safe), into ``~/.cache/lowband/kernels/<hash>`` where the hash covers the sources, the
compiler flags, torch/Python versions and (for ``isa="native"``) the CPU.  Any failure (no
compiler, no ninja, compile error, unsupported machine) is logged once and ``gemv`` falls back to
``dequantize`` + ``F.linear``.

ggml block formats (``ggml``: Q4_1, Q5_0, Q5_1, Q2_K..Q6_K kept as in the GGUF file) go
through ``ggml_gemv`` (``csrc/ggml_kernels.h``): on AVX2 the K-quant super-blocks are unpacked
in registers and dotted directly (one unpack serving up to 8 activation rows in prefill), other
types and other ISAs decode a block to int8 first; either way against activations quantized to
int8 per 32 values like the Q8/Q4 kernel below (the min/offset terms use exact fp32 sums); the
fallback multiplies by the exactly dequantized weight, and the two agree
to about 1e-2 relative (``tests/edge/test_ggml_quant.py``).

Semantics of the Q8/Q4 ``gemv``: the kernel quantizes each activation row to int8 per weight
group (Q8_0-style, fp32 scale) and accumulates exact int32 group dot products scaled by
``d_w * d_x`` in fp32; the fallback multiplies by the exactly dequantized weight.  The two agree
to about 1e-2 relative (the activation quantization error, see ``tests/edge/test_quant.py``).

Nothing here reads environment variables: use ``configure(enabled=False)`` to disable the kernel
for the process, or ``gemv(..., force_fallback=True)`` per call.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import platform
import shutil
import sys
import sysconfig
import threading
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F

from .formats import QuantShapeError, QuantSpec, check_spec, dequantize, validate_packed
from .ggml import GGMLWeight, dequantize_ggml, narrow_ggml

__all__ = [
    "KernelConfig",
    "configure",
    "get_config",
    "available",
    "unavailable_reason",
    "isa",
    "load",
    "gemv",
    "gemv_fallback",
    "ggml_dequantize",
    "ggml_gemv",
    "ggml_gemv_fallback",
    "ggml_pack",
    "ggml_packed_bytes",
]

log = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = (
    "gemv.cpp",
    "decode.cpp",
    "gemv_kernels.h",
    "ggml_kernels.h",
    "pool.h",
    "splitk.h",
    "starlink_wire.h",
)
ISAS = ("native", "avx2", "portable")


@dataclass(frozen=True)
class KernelConfig:
    """How (and whether) to build the extension.

    enabled: ``False`` never builds/loads it; every call uses the PyTorch fallback.
    isa: ``"native"`` (``-march=native`` on x86, ``-mcpu=native`` on aarch64: the fastest code for
        this machine, may use AVX-VNNI/dot-product instructions), ``"avx2"`` (x86 only:
        ``-mavx2 -mfma -mf16c``, runs on any AVX2 CPU), ``"portable"`` (scalar C++ only).
    build_root: parent of the per-hash build directories (default ``~/.cache/lowband/kernels``).
    verbose: pass through to ``torch.utils.cpp_extension.load`` (prints compiler output).
    """

    enabled: bool = True
    isa: str = "native"
    build_root: Path | None = None
    verbose: bool = False


_lock = threading.Lock()
_config = KernelConfig()
_module: Any = None
_reason: str | None = None  # why the kernel is unavailable; None = not tried yet or loaded
_tried = False
_built: dict[str, Any] = {}  # extension name -> module (a variant is imported at most once)


def configure(**changes: Any) -> KernelConfig:
    """Change the process-wide ``KernelConfig`` (fields as keyword arguments); returns the new one.

    Changing anything resets the loader, so the next use loads (or builds) the matching variant.
    """
    global _config, _module, _reason, _tried
    if "isa" in changes and changes["isa"] not in ISAS:
        raise ValueError(f"isa must be one of {ISAS}, got {changes['isa']!r}")
    if changes.get("build_root") is not None:
        changes["build_root"] = Path(changes["build_root"])
    with _lock:
        new = replace(_config, **changes)
        if new != _config:
            _config, _module, _reason, _tried = new, None, None, False
        return _config


def get_config() -> KernelConfig:
    return _config


def _flags(cfg: KernelConfig) -> list[str]:
    machine = platform.machine().lower()
    x86 = machine in ("x86_64", "amd64", "i686", "i386")
    arm64 = machine in ("aarch64", "arm64")
    if cfg.isa == "portable":
        return ["-O3", "-DLOWBAND_QUANT_SCALAR"]
    if cfg.isa == "avx2":
        if not x86:
            raise RuntimeError(f"isa='avx2' needs an x86-64 machine, this is {machine}")
        return ["-O3", "-mavx2", "-mfma", "-mf16c"]
    if x86:
        return ["-O3", "-march=native"]
    if arm64:
        return ["-O3", "-mcpu=native"]
    return ["-O3"]  # other machines: the scalar path


def _openmp_flags() -> list[str]:
    """``-fopenmp`` on Linux: the kernels' ``at::parallel_for`` then runs on torch's own OpenMP
    threads (the extension's ``libgomp.so.1`` resolves to the copy the torch wheel loaded, so
    there is one thread pool, sized by ``torch.set_num_threads``, i.e. ``--threads``). Without it
    that header template runs serially; elsewhere ``csrc/pool.h``'s own pool stands in."""
    return ["-fopenmp"] if platform.system() == "Linux" else []


def _cpu_id() -> str:
    """Something that changes when -march=native would produce different code."""
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return platform.processor()
    keep = [
        line
        for line in text.splitlines()
        if line.split(":")[0].strip()
        in ("model name", "flags", "Features", "CPU part", "CPU implementer")
    ]
    return "\n".join(sorted(set(keep)))


def _build_dir(cfg: KernelConfig, flags: list[str]) -> tuple[str, Path]:
    h = hashlib.sha256()
    for name in SOURCES:
        h.update((CSRC / name).read_bytes())
    h.update(" ".join(flags).encode())
    h.update(f"{torch.__version__}|{sys.version}|{platform.machine()}".encode())
    # The build's command line names this checkout's sources and this environment's torch and
    # Python headers: two checkouts or venvs sharing one directory would each rewrite it and
    # make the other rebuild (ninja rebuilds on a changed command line), so each gets its own.
    h.update(f"{CSRC.resolve()}|{sys.prefix}".encode())
    if cfg.isa == "native":
        h.update(_cpu_id().encode())
    digest = h.hexdigest()[:16]
    root = cfg.build_root or Path.home() / ".cache" / "lowband" / "kernels"
    return f"lowband_quant_gemv_{digest}", root / digest


@contextlib.contextmanager
def _build_lock(build_dir: Path) -> Iterator[None]:
    """Serialise builds of one directory across processes with an OS lock that dies with its
    holder, and clear torch's own lock file under it.

    ``torch.utils.cpp_extension`` guards a build with a plain ``lock`` file and waits forever
    while it exists; a builder killed mid-build (a test timeout, Ctrl-C) leaves it behind and
    every later process hangs. Every lowband build of this directory takes the flock first,
    so while we hold it any ``lock`` file left there belongs to a dead builder."""
    with open(build_dir / ".lowband-build.lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            stale = build_dir / "lock"
            if stale.exists():
                log.warning("removing a stale build lock left by an interrupted build: %s", stale)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _ninja_on_path() -> None:
    """Put the ``ninja`` wheel's binary (a dependency of the ``edge`` extra) on PATH: torch
    builds extensions with whatever ``ninja`` PATH finds, and a virtualenv's ``bin`` is on PATH
    only while it is activated. A system ninja already on PATH is left first."""
    if shutil.which("ninja"):
        return
    try:
        import ninja
    except ImportError:
        return
    bin_dir = getattr(ninja, "BIN_DIR", None)
    if bin_dir and os.path.isfile(os.path.join(bin_dir, "ninja")):
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")


def missing_build_tools(include_dir: str | None = None, cxx: str | None = None) -> str | None:
    """Why the kernels cannot be compiled here (``None``: they can): Python's C headers and a
    C++ compiler, checked before a build so the reason names the package instead of ending a
    compiler error dump. Defaults: this interpreter's include directory and ``$CXX`` or ``c++``
    (what torch's extension builder runs)."""
    include_dir = include_dir or sysconfig.get_paths().get("include") or ""
    if not os.path.isfile(os.path.join(include_dir, "Python.h")):
        return (
            "Python's C headers are missing: install them to build the kernels (Debian, "
            f"Ubuntu, Raspberry Pi OS: apt install python3-dev); no Python.h in {include_dir!r}"
        )
    cxx = cxx or os.environ.get("CXX") or "c++"
    if shutil.which(cxx) is None:
        return f"no C++ compiler ({cxx!r} is not on PATH): install one (Debian: apt install g++)"
    return None


def load() -> Any:
    """The loaded extension module (building it if needed), or ``None`` if unavailable."""
    global _module, _reason, _tried
    if _tried:
        return _module
    with _lock:
        if _tried:
            return _module
        cfg = _config
        if not cfg.enabled:
            _reason = "disabled by configure(enabled=False)"
        else:
            try:
                from torch.utils import cpp_extension

                _ninja_on_path()
                if not cpp_extension.is_ninja_available():
                    raise RuntimeError("ninja is not installed")
                flags = [*_flags(cfg), *_openmp_flags()]
                name, build_dir = _build_dir(cfg, flags)
                build_dir.mkdir(parents=True, exist_ok=True)
                if name not in _built:
                    if not (build_dir / f"{name}.so").exists():  # a build: can it run here?
                        why = missing_build_tools()
                        if why is not None:
                            raise RuntimeError(why)
                    log.info(
                        "loading quantized GEMV kernel %s (compiles once, ~30 s) in %s",
                        name,
                        build_dir,
                    )
                    with _build_lock(build_dir):
                        _built[name] = cpp_extension.load(
                            name=name,
                            sources=[str(CSRC / "gemv.cpp"), str(CSRC / "decode.cpp")],
                            extra_cflags=flags,
                            extra_ldflags=_openmp_flags(),
                            extra_include_paths=[str(CSRC)],
                            build_directory=str(build_dir),
                            verbose=cfg.verbose,
                        )
                _module = _built[name]
                log.info("quantized GEMV kernel ready: %s", _module.isa())
            except Exception as e:  # noqa: BLE001 - any build/load failure means "use the fallback"
                _module = None
                msg = str(e).strip()
                _reason = f"{type(e).__name__}: {msg.splitlines()[0][:200] if msg else ''}"
                log.warning(
                    "quantized GEMV kernel unavailable, using the PyTorch fallback: %s\n%s",
                    _reason,
                    msg[-2000:],
                )
        _tried = True
        return _module


@contextlib.contextmanager
def serial() -> Iterator[None]:
    """Within the block this thread's kernel calls run on it alone, not on the pool (the same
    bits): for a model so small that a parallel section's wake-up costs more than the work it
    splits, e.g. a speculative draft model. Nothing changes where the extension is missing."""
    mod = load()
    if mod is None:
        yield
        return
    was = mod.set_serial(True)
    try:
        yield
    finally:
        mod.set_serial(was)


def available() -> bool:
    """Whether the C++ kernel is usable (builds/loads it on first call)."""
    return load() is not None


def unavailable_reason() -> str | None:
    """Why ``available()`` is False (``None`` if it is available)."""
    load()
    return _reason


def isa() -> str | None:
    """The SIMD path compiled into the loaded kernel (``"avx2+fma"``, ``"neon"``, ...), or None."""
    mod = load()
    return None if mod is None else mod.isa()


def gemv_fallback(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    bits: int,
    group: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """PyTorch path: ``F.linear(x, dequantize(W), bias)`` in fp32 (any device).

    Dequantizes ~1 MB of weight rows at a time (fp32) and multiplies each block, which keeps the
    temporaries cache-sized: ~15x faster than dequantizing a 2048x5632 weight in one go.
    """
    n = qweight.shape[0]
    k = qweight.shape[1] * (2 if bits == 4 else 1)
    spec = QuantSpec(bits, group, (n, k))
    validate_packed(spec, qweight, scales)
    x = x.to(torch.float32)
    bn = max(32, (1 << 18) // max(k, 1))
    if bn >= n:
        w = dequantize(spec, qweight, scales)
        y = F.linear(x, w)
    else:
        y = torch.empty(x.shape[:-1] + (n,), dtype=torch.float32, device=x.device)
        for n0 in range(0, n, bn):
            rows = min(bn, n - n0)
            w = dequantize(
                QuantSpec(bits, group, (rows, k)), qweight[n0 : n0 + rows], scales[n0 : n0 + rows]
            )
            y[..., n0 : n0 + rows] = F.linear(x, w)
    if bias is not None:
        y += bias.to(torch.float32)
    return y


def gemv(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    bits: int,
    group: int,
    bias: torch.Tensor | None = None,
    *,
    force_fallback: bool = False,
) -> torch.Tensor:
    """``y [M, N] = x [M, K] @ W^T (+ bias)`` in fp32 for a packed weight (see ``formats``).

    Uses the C++ kernel when loaded and everything is on the CPU, else ``gemv_fallback``.
    """
    check_spec(bits, group)
    k = qweight.shape[1] * (2 if bits == 4 else 1)
    if x.dim() != 2 or x.shape[1] != k:
        raise QuantShapeError(f"x must be [M, {k}] for this weight, got {tuple(x.shape)}")
    mod = None if force_fallback else load()
    if mod is None or x.device.type != "cpu" or qweight.device.type != "cpu":
        return gemv_fallback(x, qweight, scales, bits, group, bias)
    if x.dtype != torch.float32 or not x.is_contiguous():
        x = x.to(torch.float32).contiguous()
    if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()):
        bias = bias.to(torch.float32).contiguous()
    return mod.gemv(x, qweight, scales, bits, group, bias)


def ggml_dequantize(w: GGMLWeight, *, force_fallback: bool = False) -> torch.Tensor:
    """The fp32 ``[N, K]`` matrix: the C++ decoders when the kernel is loaded and the blocks are
    on the CPU (~100x faster), else the PyTorch reference ``dequantize_ggml``.  The two agree to
    fp32 rounding (C++ may fuse ``a * q + b`` into one FMA)."""
    mod = None if force_fallback else load()
    if mod is None or w.data.device.type != "cpu" or w.shape[0] * w.shape[1] == 0:
        return dequantize_ggml(w)
    return mod.ggml_dequantize(w.data.contiguous(), w.type.type_id, w.shape[1])


def ggml_gemv_fallback(
    x: torch.Tensor,
    w: GGMLWeight,
    bias: torch.Tensor | None = None,
    *,
    native_dequant: bool = False,
    chunk: int = 0,
) -> torch.Tensor:
    """Dequantize ~1 MB of rows at a time and ``F.linear`` each (exact fp32 activations): with
    ``native_dequant`` the rows are decoded by the C++ kernel when loaded (the prefill path of
    ``GGMLLinear``), else by the PyTorch reference. ``chunk``: split-K leaves of that many
    values, each multiplied on its own and added in :func:`split_k_sum`'s tree."""
    if 0 < chunk < w.shape[1]:
        return split_k_sum(
            x,
            w,
            bias,
            chunk,
            lambda xc, wc: ggml_gemv_fallback(xc, wc, native_dequant=native_dequant),
        )
    n, k = w.shape
    x = x.to(torch.float32)
    bn = max(32, (1 << 18) // max(k, 1))
    y = torch.empty(x.shape[:-1] + (n,), dtype=torch.float32, device=x.device)
    for n0 in range(0, n, bn):
        rows = narrow_ggml(w, 0, n0, min(bn, n - n0))
        deq = ggml_dequantize(rows, force_fallback=not native_dequant)
        y[..., n0 : n0 + rows.shape[0]] = F.linear(x, deq.to(x.device))
    if bias is not None:
        y += bias.to(torch.float32)
    return y


def ggml_pack(w: GGMLWeight) -> torch.Tensor | None:
    """The weight repacked for batches (``csrc/ggml_kernels.h``: the AVX-512 VNNI GEMM's
    interleaved layout, which a batch of rows otherwise unpacks on every call), or ``None``
    where there is none: no kernel, no AVX-512 VNNI GEMM in this build, not a K-quant. It
    costs 1.125 (Q4_K) to 1.5 (Q2_K) bytes per weight beside the blocks (which single rows
    keep reading); outputs are the same bits with or without it."""
    mod = load()
    if mod is None or w.data.device.type != "cpu" or w.shape[0] == 0:
        return None
    return mod.ggml_pack(w.data.contiguous(), w.type.type_id, w.shape[1])


def ggml_packed_bytes(w: GGMLWeight) -> int:
    """The bytes ``ggml_pack(w)`` would allocate (0 where it returns ``None``)."""
    mod = load()
    if mod is None or w.data.device.type != "cpu" or w.shape[0] == 0:
        return 0
    return int(mod.ggml_packed_bytes(w.type.type_id, w.shape[0], w.shape[1]))


def ggml_gemv(
    x: torch.Tensor,
    w: GGMLWeight,
    bias: torch.Tensor | None = None,
    *,
    force_fallback: bool = False,
    packed: torch.Tensor | None = None,
    chunk: int = 0,
) -> torch.Tensor:
    """``y [M, N] = x [M, K] @ W^T (+ bias)`` in fp32 for a ``GGMLWeight``: the C++ kernel when
    loaded and everything is on the CPU, else ``ggml_gemv_fallback``. ``packed``: the weight's
    ``ggml_pack`` layout (the same results, faster for batches; with ``chunk``, the leaves'
    layouts back to back). ``chunk``: split-K leaves of that many values (``split_k_sum``)."""
    k = w.shape[1]
    if x.dim() != 2 or x.shape[1] != k:
        raise QuantShapeError(f"x must be [M, {k}] for this weight, got {tuple(x.shape)}")
    mod = None if force_fallback else load()
    if mod is None or x.device.type != "cpu" or w.data.device.type != "cpu":
        return ggml_gemv_fallback(x, w, bias, chunk=chunk)
    if x.dtype != torch.float32 or not x.is_contiguous():
        x = x.to(torch.float32).contiguous()
    if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()):
        bias = bias.to(torch.float32).contiguous()
    return mod.ggml_gemv(x, w.data, w.type.type_id, bias, packed, chunk if 0 < chunk < k else 0)


def split_k_sum(
    x: torch.Tensor,
    w: GGMLWeight,
    bias: torch.Tensor | None,
    chunk: int,
    leaf: Callable[[torch.Tensor, GGMLWeight], torch.Tensor],
) -> torch.Tensor:
    """``x @ W^T (+ bias)`` as the C++ kernel's split-K (``csrc/splitk.h``): ``leaf`` on each
    run of ``chunk`` columns, the leaves added pairwise level by level ((l0 + l1) + (l2 + l3)),
    the bias last. The tree a tensor-parallel rank's run of leaves reproduces as a subtree."""
    k = w.shape[1]
    n = k // chunk
    if chunk <= 0 or k % chunk or n & (n - 1):
        raise QuantShapeError(f"chunk {chunk} must cut K={k} into a power of two of leaves")
    parts = [
        leaf(x[:, c * chunk : (c + 1) * chunk].contiguous(), narrow_ggml(w, 1, c * chunk, chunk))
        for c in range(n)
    ]
    while len(parts) > 1:
        parts = [parts[i] + parts[i + 1] for i in range(0, len(parts), 2)]
    y = parts[0]
    if bias is not None:
        y = y + bias.to(torch.float32)
    return y
