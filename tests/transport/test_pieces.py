"""How buffers are cut into pieces for striping: :func:`transport.ops.piece_bytes`."""

from __future__ import annotations

import pytest
import torch

from transport import messages
from transport.ops import MIN_PIECE_BYTES, STRIPE_PIECES, piece_bytes

MiB = 1 << 20


@pytest.mark.parametrize("total", [1, 100_000, MiB, 4 * MiB, 16 * MiB, 63 * MiB, 64 * MiB, 1 << 30])
@pytest.mark.parametrize("chunk", [4096, 64 * 1024, MiB, 4 * MiB])
def test_pieces_are_within_the_chunk_and_many_enough(total, chunk):
    size = piece_bytes(total, chunk)
    assert size <= chunk
    assert size >= min(chunk, MIN_PIECE_BYTES)
    pieces = -(-total // size)
    if total >= STRIPE_PIECES * min(chunk, MIN_PIECE_BYTES):
        # a buffer big enough to be cut in 16 is, or its pieces are whole chunks
        assert pieces >= STRIPE_PIECES or size == chunk


def test_a_4_mib_message_leaves_on_16_connections_not_one():
    sends: list[tuple[int, int]] = []

    class _Op:
        def meta(self, **kw):
            return kw

        def send(self, host, dst, mtype, meta, payload, stripe, track):
            sends.append((stripe, sum(len(p) for p in payload)))

    x = torch.arange(MiB, dtype=torch.float32)  # 4 MiB: one chunk at the default chunk size
    messages.post_message(_Op(), None, 1, [x], None, chunk_bytes=4 * MiB)
    assert [s for s, _ in sends] == list(range(STRIPE_PIECES))
    assert {n for _, n in sends} == {4 * MiB // STRIPE_PIECES}
