"""The NEON kernels on arm64 (Raspberry Pi 4/5, phones), under qemu user emulation.

The cheap part of ``scripts/arm64_check.py`` that CI can afford: ``edge/quant/csrc/selftest.cpp``
cross-compiled to a static aarch64 binary (Debian's ``g++-aarch64-linux-gnu``, else the
``ziglang`` package's clang) and run under ``qemu-aarch64-static`` for an ARMv8-A CPU (Pi 4:
NEON without SDOT) and an ARMv8.2-A+dotprod CPU (Pi 5). The self-test compares the kernels with
a double-precision evaluation of their integer semantics and exits non-zero on a mismatch.
Skipped, with the reason, where the emulator or a cross compiler is missing.
"""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

CSRC = Path(__file__).resolve().parents[2] / "edge" / "quant" / "csrc"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

# CPU profile -> (gcc -march, zig -mcpu, the ISA the self-test must report)
PROFILES = {
    "armv8-a": ("armv8-a", "generic", "neon"),
    "armv8.2-a+dotprod": ("armv8.2-a+dotprod", "generic+dotprod", "neon+dotprod"),
}


def _cross_compiler(profile: str) -> list[str] | None:
    march, mcpu, _ = PROFILES[profile]
    gxx = shutil.which("aarch64-linux-gnu-g++")
    if gxx is not None:
        return [gxx, "-std=c++17", "-O2", "-static", f"-march={march}"]
    if importlib.util.find_spec("ziglang") is not None:
        target = ["-target", "aarch64-linux-musl", f"-mcpu={mcpu}"]
        return [sys.executable, "-m", "ziglang", "c++", *target, "-std=c++17", "-O2", "-static"]
    return None


@pytest.mark.parametrize("profile", list(PROFILES))
def test_neon_selftest_under_qemu(tmp_path: Path, profile: str) -> None:
    qemu = shutil.which("qemu-aarch64-static")
    if qemu is None:
        pytest.skip("qemu-aarch64-static not installed (apt-get install qemu-user-static)")
    cc = _cross_compiler(profile)
    if cc is None:
        pytest.skip(
            "no aarch64 cross compiler (apt-get install g++-aarch64-linux-gnu, "
            "or pip install ziglang)"
        )
    exe = tmp_path / "selftest"
    subprocess.run(
        [*cc, f"-I{CSRC}", str(CSRC / "selftest.cpp"), "-o", str(exe)],
        check=True,
        timeout=240,
    )
    assert exe.read_bytes()[:20].hex().endswith("b700"), "not an aarch64 ELF"  # e_machine 183
    p = subprocess.run([qemu, str(exe)], capture_output=True, text=True, timeout=120)
    m = re.search(r"isa=(\S+) cases=(\d+) fails=(\d+) worst_rel=(\S+)", p.stdout)
    assert m is not None, p.stdout + p.stderr
    assert p.returncode == 0, p.stdout[-2000:]
    assert m[1] == PROFILES[profile][2]
    assert int(m[2]) > 100 and int(m[3]) == 0
