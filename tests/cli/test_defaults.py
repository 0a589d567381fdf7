"""Every default the command line shows is the library's: a flag's default equals the field of
the config it fills (the parser is built without importing torch or ZeroMQ, so it cannot read
them itself; this test keeps the two equal)."""

from __future__ import annotations

import argparse
import inspect
from typing import Any, Iterator

import pytest

from cli import build_parser


def _parsers(p: argparse.ArgumentParser, path: str = "lowband") -> Iterator[tuple[str, Any]]:
    yield path, p
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _parsers(sub, f"{path} {name}")


def _library_defaults() -> dict[str, Any]:
    from edge.embeddings import POOLINGS, EmbeddingConfig
    from edge.engine import Engine
    from edge.launch import BatchConfig, edge_transport
    from transport.config import ZmqConfig

    engine = inspect.signature(Engine.__init__).parameters
    assert engine["prefill_chunk"].default == BatchConfig().prefill_chunk
    assert engine["decode_stall"].default == BatchConfig().decode_stall
    assert edge_transport().register_timeout == ZmqConfig().register_timeout
    assert POOLINGS == ("mean", "last", "cls")  # the --pooling choices
    return {
        "pooling": EmbeddingConfig().pooling,
        "connections": ZmqConfig().connections,
        "register_timeout": ZmqConfig().register_timeout,
        "prefill_chunk": BatchConfig().prefill_chunk,
        "decode_stall": BatchConfig().decode_stall,
    }


@pytest.mark.timeout(60)
def test_flag_defaults_are_the_configs() -> None:
    want = _library_defaults()
    seen: dict[str, list[str]] = {k: [] for k in want}
    wrong = []
    for path, parser in _parsers(build_parser()):
        for action in parser._actions:
            if action.dest in want:
                seen[action.dest].append(path)
                if action.default != want[action.dest]:
                    wrong.append(
                        f"{path} --{action.dest}: {action.default!r} != {want[action.dest]!r}"
                    )
    assert wrong == []
    assert all(seen.values()), (
        f"flags no command has any more: {[k for k, v in seen.items() if not v]}"
    )
