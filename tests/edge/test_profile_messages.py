"""The automatic split's answers (edge.profile): typed, and malformed ones refused by name."""

from __future__ import annotations

import pytest

from edge.profile import EchoReply, ProfileReport
from lowband.errors import ProtocolError


def test_answers_round_trip() -> None:
    assert EchoReply.from_wire(EchoReply(n=3).to_wire()) == EchoReply(n=3)
    report = ProfileReport(profile={"name": "w1", "memory_mb": 512.0})
    assert ProfileReport.from_wire(report.to_wire()) == report


@pytest.mark.parametrize(
    ("cls", "meta", "match"),
    [
        (EchoReply, {}, "'echo reply' message without its field 'n'"),
        (EchoReply, {"n": "3"}, "field 'n' must be int"),
        (ProfileReport, {"profile": [1, 2]}, "field 'profile' must be dict"),
        (ProfileReport, "profile", "must be a map"),
    ],
)
def test_malformed_answers_are_protocol_errors(cls: type, meta: object, match: str) -> None:
    with pytest.raises(ProtocolError, match=match):
        cls.from_wire(meta)
