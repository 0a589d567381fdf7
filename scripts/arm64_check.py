#!/usr/bin/env python3
"""lowband's edge runtime on arm64 (Raspberry Pi 4/5, phones) under qemu user emulation.

Needs root, qemu-user-static and mmdebstrap or debootstrap (Debian packages); on an x86 host:

    python scripts/arm64_check.py                      # build/reuse the root, install, check
    python scripts/arm64_check.py --record benchmarks/results/arm64-check.json

1. An arm64 Debian bookworm root (``mmdebstrap``, else ``debootstrap --foreign`` and its second
   stage under qemu-aarch64-static), cached in ``--root`` outside the checkout: python3, venv,
   pip and g++ from Debian (ninja comes with the edge extra).
2. Inside it, the checkout installed as the README tells a Pi user: a venv, then
   ``pip install -c constraints.txt '.[edge]'`` with the constraint file's torch pin replaced by
   ``torch==2.9.1``: PyPI's CPU build for aarch64 (constraints.txt pins the x86 release the
   tests run against, whose wheel here is x86 only).
3. Inside it: the kernel self-test (``edge/quant/csrc/selftest.cpp``) compiled natively for
   ARMv8-A (Pi 4, NEON without SDOT) and ARMv8.2-A+dotprod (Pi 5); the runtime's own build of
   its C++ extension (``kernel.load()``, which must report a NEON ISA); and a parity check: a
   tiny random Llama (written on the host with ``save_pretrained``) quantized to Q8 and Q4 by
   lowband on each side, greedy tokens and logits on arm64 against the x86 host.

Emulation is 10-50x slower than a board: every figure here is about correctness, never speed.
Prints one JSON line last; exits 1 if a check failed.

``python scripts/arm64_check.py parity --fp32 DIR --work DIR --out FILE`` is the parity worker
that runs on both sides (imports the installed lowband, not this checkout).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterator

REPO = Path(__file__).resolve().parent.parent
SUITE = "bookworm"
MIRROR = "http://deb.debian.org/debian"
PACKAGES = ("python3", "python3-venv", "python3-pip", "python3-dev", "g++")
ARM_TORCH = "torch==2.9.1"  # PyPI's aarch64 CPU build (constraints.txt's pin is x86 only here)
GUEST_SRC = "/opt/lowband-src"
GUEST_VENV = "/opt/lowband-venv"
GUEST_WORK = "/tmp/lowband-arm64"
GUEST_ENV = {
    "PATH": f"{GUEST_VENV}/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "HOME": "/root",
    "LANG": "C.UTF-8",
    "MAX_JOBS": "2",  # torch's extension build: this host has 2 cores
    "PIP_DISABLE_PIP_VERSION_CHECK": "1",
    "PIP_DEFAULT_TIMEOUT": "180",
    # pip trusts its own bundle, not the system's: point it at the host's CA certificates,
    # copied in by mounted(), so a host that reaches PyPI through a TLS proxy works here too.
    "PIP_CERT": "/etc/ssl/certs/lowband-host-ca.crt",
    "SSL_CERT_FILE": "/etc/ssl/certs/lowband-host-ca.crt",
}
HOST_CA = Path("/etc/ssl/certs/ca-certificates.crt")
# Parity model: small enough for qemu, wide enough for Q4/Q8 groups of 32 on every linear.
MODEL = dict(
    vocab_size=256,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)
INIT_STD = 0.2  # larger than GPT's 0.02 so the greedy choice has a real margin
PROMPT = [1, 17, 42, 99, 7, 200, 3, 64]
NEW_TOKENS = 16
VARIANTS = {"f32": None, "q8": 8, "q4": 4}
# Max |logit difference| allowed, relative to the largest |logit|. fp32 differs only by the
# order of fp32 sums (x86 vs NEON vectors, BLAS); the quantized kernels quantize activations
# to int8 per group of 32 from those fp32 values, so one flipped rounding moves a logit by a
# step of the activation scale (~1e-2 relative, the kernel's documented bound).
TOLERANCE = {"f32": 1e-4, "q8": 2e-2, "q4": 2e-2}


class CheckFailed(RuntimeError):
    """A step of the check failed; the message says which and why."""


def log(msg: str) -> None:
    print(f"[arm64-check {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def run(cmd: list[str], *, timeout: float, **kw: Any) -> subprocess.CompletedProcess[str]:
    """Run ``cmd``, raising :class:`CheckFailed` with its output's tail on failure."""
    log("$ " + " ".join(cmd))
    try:
        p = subprocess.run(cmd, text=True, capture_output=True, timeout=timeout, **kw)
    except subprocess.TimeoutExpired as exc:
        raise CheckFailed(f"timed out after {timeout:.0f} s: {' '.join(cmd)}") from exc
    if p.returncode != 0:
        tail = (p.stdout + p.stderr)[-3000:]
        raise CheckFailed(f"exit {p.returncode}: {' '.join(cmd)}\n{tail}")
    return p


# ---------------------------------------------------------------------------------------------
# Host set-up: binfmt_misc, the arm64 root, mounts.


def ensure_binfmt() -> str:
    """Make the kernel run aarch64 ELF files through qemu-aarch64-static; returns its path."""
    qemu = shutil.which("qemu-aarch64-static")
    if qemu is None:
        raise CheckFailed("qemu-aarch64-static not found: apt-get install qemu-user-static")
    mnt = Path("/proc/sys/fs/binfmt_misc")
    if not (mnt / "register").exists():
        run(["mount", "-t", "binfmt_misc", "binfmt_misc", str(mnt)], timeout=30)
    if not (mnt / "qemu-aarch64").exists():
        if shutil.which("update-binfmts") is None:
            raise CheckFailed("qemu-aarch64 is not registered: apt-get install binfmt-support")
        run(["update-binfmts", "--enable", "qemu-aarch64"], timeout=30)
    status = (mnt / "qemu-aarch64").read_text()
    if not status.startswith("enabled"):
        raise CheckFailed(f"binfmt qemu-aarch64 is not enabled:\n{status}")
    return qemu


def build_root(root: Path, qemu: str) -> None:
    """Debian bookworm arm64 into ``root`` (via ``root.partial`` so a half-built root is never
    taken for a cached one)."""
    part = root.with_name(root.name + ".partial")
    shutil.rmtree(part, ignore_errors=True)
    part.parent.mkdir(parents=True, exist_ok=True)
    include = ",".join(PACKAGES + ("ca-certificates",))
    if shutil.which("mmdebstrap"):
        cmd = ["mmdebstrap", "--mode=root", "--arch=arm64", "--variant=apt"]
        run([*cmd, f"--include={include}", SUITE, str(part), MIRROR], timeout=3600)
    elif shutil.which("debootstrap"):
        cmd = ["debootstrap", "--arch=arm64", "--foreign", "--variant=minbase"]
        run([*cmd, f"--include={include}", SUITE, str(part), MIRROR], timeout=3600)
        # The second stage runs arm64 binaries: binfmt hands them to qemu from the host, but
        # older registrations without the F flag need the interpreter inside the root.
        shutil.copy(qemu, part / "usr/bin/qemu-aarch64-static")
        run(["chroot", str(part), "/debootstrap/debootstrap", "--second-stage"], timeout=3600)
    else:
        raise CheckFailed("neither mmdebstrap nor debootstrap: apt-get install mmdebstrap")
    (part / ".lowband-root").write_text(json.dumps({"suite": SUITE, "packages": PACKAGES}))
    shutil.rmtree(root, ignore_errors=True)
    part.rename(root)


def ensure_root(root: Path, qemu: str) -> bool:
    """Build the root unless a complete one with the same packages is cached; True if built."""
    marker = root / ".lowband-root"
    want = {"suite": SUITE, "packages": list(PACKAGES)}
    if marker.exists() and json.loads(marker.read_text()) == want:
        log(f"reusing the arm64 root {root}")
        return False
    log(f"building an arm64 {SUITE} root in {root} (several minutes under qemu)")
    build_root(root, qemu)
    marker.write_text(json.dumps(want))
    return True


@contextlib.contextmanager
def mounted(root: Path) -> Iterator[None]:
    """/proc, /sys, /dev bound into the root, the host's resolv.conf and CA certificates (pip
    needs PyPI)."""
    done: list[Path] = []
    try:
        for src in ("/proc", "/sys", "/dev"):
            dst = root / src.lstrip("/")
            dst.mkdir(exist_ok=True)
            if not os.path.ismount(dst):
                run(["mount", "--rbind", src, str(dst)], timeout=30)
                run(["mount", "--make-rslave", str(dst)], timeout=30)
                done.append(dst)
        shutil.copy("/etc/resolv.conf", root / "etc/resolv.conf")
        if not HOST_CA.exists():
            raise CheckFailed(f"{HOST_CA} not found: apt-get install ca-certificates")
        shutil.copy(HOST_CA, root / "etc/ssl/certs/lowband-host-ca.crt")
        yield
    finally:
        for dst in reversed(done):
            subprocess.run(["umount", "-R", "-l", str(dst)], check=False, timeout=60)


def guest(
    root: Path, script: str, *, timeout: float, cwd: str = "/tmp"
) -> subprocess.CompletedProcess[str]:
    """Run a shell script inside the arm64 root (every binary through qemu)."""
    env = [f"{k}={v}" for k, v in GUEST_ENV.items()]
    cmd = ["chroot", str(root), "/usr/bin/env", "-i", *env, "/bin/sh", "-ec", f"cd {cwd}; {script}"]
    return run(cmd, timeout=timeout)


def copy_checkout(root: Path) -> None:
    """The working tree (tracked files and untracked ones git does not ignore) into the root."""
    dst = root / GUEST_SRC.lstrip("/")
    shutil.rmtree(dst, ignore_errors=True)
    dst.mkdir(parents=True)
    files = run(["git", "ls-files", "-z", "-co", "--exclude-standard"], cwd=REPO, timeout=60)
    for name in files.stdout.split("\0"):
        src = REPO / name
        if name and src.is_file():
            (dst / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / name)


# ---------------------------------------------------------------------------------------------
# The checks inside the root.


def install(root: Path) -> str:
    """venv + ``pip install -c constraints '.[edge]'`` the way the README says; torch version."""
    pins = (REPO / "constraints.txt").read_text().splitlines()
    pins = [ARM_TORCH if re.match(r"torch\s*==", p) else p for p in pins]
    if ARM_TORCH not in pins:
        pins.append(ARM_TORCH)
    (root / "tmp/constraints-arm64.txt").write_text("\n".join(pins) + "\n")
    guest(
        root,
        f"[ -x {GUEST_VENV}/bin/python ] || python3 -m venv {GUEST_VENV}; "
        "pip uninstall -q -y lowband || true; "
        "pip install -q -c /tmp/constraints-arm64.txt '.[edge]'",
        cwd=GUEST_SRC,
        timeout=3600,
    )
    p = guest(
        root,
        "python -c 'import torch, platform; print(platform.machine(), torch.__version__)'",
        timeout=900,
    )
    machine, version = p.stdout.split()[-2:]
    if machine != "aarch64":
        raise CheckFailed(f"the root's python runs as {machine}, not aarch64")
    return version


def selftest(root: Path) -> dict[str, dict[str, Any]]:
    """selftest.cpp compiled by the root's g++ for a Pi 4 (ARMv8-A) and a Pi 5 (+dotprod)."""
    out = {}
    csrc = f"{GUEST_SRC}/edge/quant/csrc"
    for name, march in (("armv8-a", "armv8-a"), ("armv8.2-a+dotprod", "armv8.2-a+dotprod")):
        exe = f"/tmp/lowband-selftest-{march.replace('+', '_')}"
        p = guest(
            root,
            f"g++ -std=c++17 -O2 -march={march} -I{csrc} {csrc}/selftest.cpp -o {exe} && {exe}",
            timeout=1800,
        )
        m = re.search(r"isa=(\S+) cases=(\d+) fails=(\d+) worst_rel=(\S+)", p.stdout)
        if m is None:
            raise CheckFailed(f"selftest {march}: no summary line in {p.stdout[-500:]!r}")
        res: dict[str, Any] = {"isa": m[1], "cases": int(m[2]), "fails": int(m[3])}
        res["worst_rel"] = float(m[4])
        if not m[1].startswith("neon") or res["fails"]:
            raise CheckFailed(f"selftest {march}: {res}")
        out[name] = res
    return out


def kernel(root: Path) -> str:
    """The runtime builds its own extension (``torch.utils.cpp_extension``, -mcpu=native)."""
    p = guest(
        root,
        'python -c "from edge.quant import kernel; print(kernel.load(), kernel.isa())"',
        timeout=3600,
    )
    last = p.stdout.strip().splitlines()[-1] if p.stdout.strip() else ""
    isa = last.split()[-1] if last else ""
    if last.startswith("None") or not isa.startswith("neon"):
        raise CheckFailed(f"kernel did not build with NEON: {(p.stdout + p.stderr)[-1500:]}")
    return isa


def make_model(fp32: Path) -> None:
    """The tiny random Llama both sides quantize, written with lowband's ``save_pretrained``."""
    from lowband.models.config import ModelConfig
    from lowband.models.llama import LlamaForCausalLM, init_weights
    from lowband.models.weights import save_pretrained

    model = LlamaForCausalLM(ModelConfig(**MODEL)).eval()  # type: ignore[arg-type]
    init_weights(model, std=INIT_STD, seed=7)
    save_pretrained(model, fp32)


def compare(ref: dict[str, Any], arm: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per variant: same quantized bytes, same greedy tokens, logits within ``TOLERANCE``."""
    out = {}
    for v in VARIANTS:
        a, b = ref["variants"][v], arm["variants"][v]
        scale = max(abs(x) for step in a["logits"] for x in step)
        diff = max(
            abs(x - y)
            for sa, sb in zip(a["logits"], b["logits"], strict=True)
            for x, y in zip(sa, sb, strict=True)
        )
        res = {
            "same_quantized_bytes": a["sha256"] == b["sha256"],
            "same_greedy_tokens": a["tokens"] == b["tokens"],
            "tokens": len(a["tokens"]),
            "max_abs_logit_diff": float(f"{diff:.3g}"),
            "max_abs_logit": float(f"{scale:.3g}"),
            "tolerance_rel": TOLERANCE[v],
            "min_greedy_margin_x86": float(f"{a['min_margin']:.3g}"),
            "fastpath_arm64": b["fastpath"],
        }
        res["ok"] = bool(
            res["same_quantized_bytes"]
            and res["same_greedy_tokens"]
            and diff <= TOLERANCE[v] * scale
            and b["fastpath"] == a["fastpath"]
        )
        out[v] = res
    return out


def parity(root: Path) -> dict[str, Any]:
    """x86 reference on the host, the same run inside the root; compared here."""
    work = root / GUEST_WORK.lstrip("/")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    make_model(work / "fp32")
    me = str(Path(__file__).resolve())
    worker = ["parity", "--fp32", str(work / "fp32"), "--work", str(work / "x86")]
    run([sys.executable, me, *worker, "--out", str(work / "x86.json")], timeout=900)
    guest(
        root,
        f"python {GUEST_SRC}/scripts/arm64_check.py parity --fp32 {GUEST_WORK}/fp32 "
        f"--work {GUEST_WORK}/arm64 --out {GUEST_WORK}/arm64.json",
        timeout=3600,
    )
    ref = json.loads((work / "x86.json").read_text())
    arm = json.loads((work / "arm64.json").read_text())
    if arm["machine"] != "aarch64":
        raise CheckFailed(f"the parity worker ran as {arm['machine']}")
    res = {"x86_isa": ref["isa"], "arm64_isa": arm["isa"], "variants": compare(ref, arm)}
    res["ok"] = all(v["ok"] for v in res["variants"].values())
    return res


# ---------------------------------------------------------------------------------------------
# The parity worker (host and guest).


def greedy(model: Any, prompt: list[int], n: int) -> tuple[list[int], list[list[float]], float]:
    """Greedy decode through the runtime's own runner (prefill, then one-token steps that the
    compiled decode step serves); the tokens, every step's logits, the smallest top-2 margin."""
    from edge.engine import LocalRunner

    runner = LocalRunner(model)
    logits = runner.forward(prompt, 0)
    tokens: list[int] = []
    steps: list[list[float]] = []
    margin = float("inf")
    for _ in range(n):
        top = logits.topk(2).values
        margin = min(margin, float(top[0] - top[1]))
        steps.append([float(x) for x in logits])
        tokens.append(int(logits.argmax()))
        logits = runner.forward([tokens[-1]], len(prompt) + len(tokens) - 1)
    return tokens, steps, margin


def parity_worker(fp32: Path, work: Path, out: Path) -> None:
    import torch

    from edge import fastpath
    from edge.formats.quantized_checkpoint import QuantConfig, quantize_checkpoint
    from edge.quant import kernel as qkernel
    from edge.shardio import load_shard

    torch.set_num_threads(1)  # same summation order run to run
    variants = {}
    for name, bits in VARIANTS.items():
        d = (
            fp32
            if bits is None
            else quantize_checkpoint(fp32, work / name, QuantConfig(bits=bits, group=32))
        )
        digest = hashlib.sha256((Path(d) / "model.safetensors").read_bytes()).hexdigest()
        model = load_shard(d).model
        tokens, logits, margin = greedy(model, PROMPT, NEW_TOKENS)
        variants[name] = {
            "sha256": digest,
            "fastpath": fastpath.active(model),
            "tokens": tokens,
            "logits": logits,
            "min_margin": margin,
        }
    info = {"machine": platform.machine(), "torch": torch.__version__, "isa": qkernel.isa()}
    out.write_text(json.dumps({**info, "variants": variants}))


# ---------------------------------------------------------------------------------------------


def check(root: Path) -> dict[str, Any]:
    summary: dict[str, Any] = {"ok": False, "root": str(root), "steps_s": {}}
    t_all = time.monotonic()

    def step(name: str, fn: Any, *args: Any) -> Any:
        t0 = time.monotonic()
        value = fn(*args)
        summary["steps_s"][name] = round(time.monotonic() - t0, 1)
        return value

    try:
        qemu = step("binfmt", ensure_binfmt)
        summary["root_built"] = step("root", ensure_root, root, qemu)
        step("copy_checkout", copy_checkout, root)
        with mounted(root):
            summary["torch"] = step("pip_install", install, root)
            summary["selftest"] = step("selftest", selftest, root)
            summary["kernel_isa"] = step("kernel_build", kernel, root)
            summary["parity"] = step("parity", parity, root)
        summary["ok"] = summary["parity"]["ok"]
    except CheckFailed as exc:
        summary["error"] = str(exc).splitlines()[0][:300]
        log(f"FAILED: {exc}")
    summary["duration_s"] = round(time.monotonic() - t_all, 1)
    return summary


def record(path: Path, summary: dict[str, Any], argv: list[str]) -> None:
    commit = subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=REPO, text=True, capture_output=True, check=True
    ).stdout.strip()
    doc = {
        "benchmark": "scripts.arm64_check",
        "title": "arm64 (Raspberry Pi / phone) correctness under qemu: kernel self-test, "
        "extension build, Q8/Q4 parity with x86",
        "command": " ".join(["python", "scripts/arm64_check.py", *argv]),
        "commit": commit,
        "date": datetime.now(timezone.utc).replace(microsecond=0).isoformat(),
        "machine": "x86 host, qemu-aarch64 user emulation (Debian bookworm arm64 root); "
        "2-core VM shared with other jobs",
        "modelled": False,
        "result": summary,
    }
    path.write_text(json.dumps(doc, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd")
    ap.add_argument("--root", type=Path, default=Path("/var/cache/lowband-arm64") / SUITE)
    ap.add_argument("--record", type=Path, help="also write a benchmarks/results JSON file")
    w = sub.add_parser("parity", help="the parity worker (run by the check on both sides)")
    w.add_argument("--fp32", type=Path, required=True)
    w.add_argument("--work", type=Path, required=True)
    w.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    if args.cmd == "parity":
        parity_worker(args.fp32, args.work, args.out)
        return 0
    if os.geteuid() != 0:
        ap.error("needs root (chroot, mount, debootstrap)")
    summary = check(args.root.resolve())
    if args.record is not None:
        record(args.record, summary, argv)
    print(json.dumps(summary, separators=(",", ":")))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
