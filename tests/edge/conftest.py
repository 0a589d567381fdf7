"""Shared set-up of the edge tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session", autouse=True)
def native_kernel() -> None:
    """Build (or find) the C++ kernels once, before any edge test runs.

    A fresh machine compiles them on first use, which takes minutes on two busy cores; without
    this the first test to load a model pays for it inside its own waits (a worker's 60 s
    answer, a server's start-up), and which test that is depends on the selection."""
    from edge.quant import kernel

    kernel.load()  # None when no compiler is available: the tests of the fallback run then
