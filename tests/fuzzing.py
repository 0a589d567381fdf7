"""Bounded fuzzing with hypothesis, shared by the fuzz tests of every parser a stranger's bytes
reach (issue 25; the tests are marked ``security``: tests/transport/test_fuzz_wire.py,
tests/edge/test_fuzz_parsers.py).

Each parser has one typed error for bad input; anything else escaping (TypeError, KeyError,
struct.error, UnicodeDecodeError, a numpy error) would end the thread that called it: a
transport's receive loop, an edge master's accept, a worker's control loop, a model load. Each
test runs a fixed number of examples (``max_examples``) under its pytest timeout, so a hang fails
too; hypothesis keeps no example database here, so a run is reproducible from its seed alone.
"""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

FUZZ = settings(
    max_examples=300,
    deadline=None,  # a shared 2-core machine: the pytest timeout bounds the whole run instead
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

# msgpack-able values, nested a little: what a peer can put in a metadata map.
LEAVES = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    # no subnormals: a library built with fast-math may have set flush-to-zero in this process
    | st.floats(allow_nan=True, allow_infinity=True, allow_subnormal=False)
    | st.text(max_size=20)
    | st.binary(max_size=20)
)
VALUES = st.recursive(
    LEAVES,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
