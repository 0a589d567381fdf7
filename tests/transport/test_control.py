"""The typed control plane (transport.control): round trips, malformed maps, the doc table.

ARCHITECTURE.md's copy of the table is checked by tests/test_docs.py."""

from __future__ import annotations

import textwrap

import pytest

from lowband.errors import AuthError, IncompatiblePeer, ProtocolError, VersionMismatch
from transport import control, wire
from transport.control import Refusal
from transport.wire import MsgType

SAMPLES: list[control.ControlMsg] = [
    control.Register(addr="tcp://*:5", signature="s", chunk=4 << 20, local=["h", "", ""]),
    control.Registered(heartbeat_interval=2.0, relay=7000),
    control.Refused(kind=Refusal.INCOMPATIBLE, reason="other run"),
    control.Heartbeat(),
    control.HeartbeatAck(),
    control.Quorum(min_world=2),
    control.QuorumCancel(),
    control.MembershipUpdate(
        epoch=3, rank=1, peers=["a", "b"], addrs=["x", "y"], keys=[None, None], joined=["b"]
    ),
    control.PeersLost(peers=["a"], epoch=3, reason="left", left=True),
    control.Leave(),
    control.Suspect(peer="a"),
]


def test_every_message_type_below_16_but_relay_has_one_class() -> None:
    assert set(control.CONTROL) == {t for t in MsgType if t < 12}
    assert {type(m) for m in SAMPLES} == set(control.CONTROL.values())


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: m.NAME)
def test_round_trip_through_the_wire(msg: control.ControlMsg) -> None:
    frames = [bytes(f) for f in control.pack(msg)]
    got = control.parse(wire.unpack(frames, max_payload_bytes=0))
    assert got == msg


def test_what_older_peers_send_still_parses() -> None:
    # REGISTER as peers before the typed schema built it: no last_epoch, no meta
    old = {"addr": "tcp://127.0.0.1:1", "signature": "", "chunk": 4 << 20, "key": None}
    reg = control.Register.from_wire(old)
    assert reg.last_epoch == -1 and reg.meta == {} and reg.token == ""
    # REGISTERED without a relay leaves the key out (an older peer reads it only if present)
    assert "relay" not in control.Registered(heartbeat_interval=1.0).to_wire()
    assert control.Refused.from_wire({"kind": "expelled"}).kind is Refusal.EXPELLED


@pytest.mark.parametrize(
    ("cls", "meta", "match"),
    [
        (control.Register, {"signature": "", "chunk": 1}, "without its field 'addr'"),
        (control.Register, {"addr": 1, "signature": "", "chunk": 1}, "'addr' must be str"),
        (control.Register, {"addr": "a", "signature": "", "chunk": 0}, "'chunk' must be in"),
        (control.Register, {"addr": "a", "signature": "", "chunk": True}, "'chunk' must be int"),
        (control.Register, {"addr": "a", "signature": "", "chunk": 1, "key": "k"}, "40-char"),
        (control.Register, {"addr": "a", "signature": "", "chunk": 1, "local": ["h"]}, "local"),
        (control.Register, {"addr": "a", "signature": "", "chunk": 1, "meta": []}, "'meta'"),
        (control.Registered, {"heartbeat_interval": float("nan")}, "finite"),
        (control.Registered, {"heartbeat_interval": 1, "relay": 70000}, "TCP port"),
        (control.Refused, {"kind": "bored"}, "one of 'auth'"),
        (control.Quorum, {"min_world": 0}, "'min_world' must be in"),
        (control.Quorum, {"min_world": "2"}, "'min_world' must be int"),
        (control.Suspect, {"peer": None}, "'peer' must be str"),
        (control.PeersLost, {"peers": ["a", 3]}, r"'peers\[1\]' must be str"),
        (
            control.MembershipUpdate,
            {"epoch": 0, "rank": 2, "peers": ["a", "b"], "addrs": ["x", "y"], "keys": [None]},
            "'rank' must be in",
        ),
        (
            control.MembershipUpdate,
            {"epoch": 0, "rank": 0, "peers": ["a", "b"], "addrs": ["x", "y"], "keys": [None]},
            "'keys' must hold one entry per peer",
        ),
        (
            control.MembershipUpdate,
            {"epoch": 0, "rank": 0, "peers": ["a"], "addrs": ["x"], "keys": [None], "relayed": [1]},
            r"'relayed' must be list\[bool\] \| None",
        ),
    ],
)
def test_malformed_maps_are_protocol_errors_naming_the_field(
    cls: type[control.ControlMsg], meta: object, match: str
) -> None:
    with pytest.raises(ProtocolError, match=match):
        cls.from_wire(meta)


def test_a_map_is_required_and_data_types_are_not_control() -> None:
    with pytest.raises(ProtocolError, match="must be a map"):
        control.Heartbeat.from_wire([1, 2])
    with pytest.raises(ProtocolError, match="unexpected CHUNK on the control channel"):
        control.parse(wire.Message(MsgType.CHUNK, {}, [], []))


def test_refusals_become_the_typed_errors() -> None:
    assert isinstance(Refusal.AUTH.error("x"), AuthError)
    assert isinstance(Refusal.INCOMPATIBLE.error("x"), IncompatiblePeer)
    assert isinstance(Refusal.VERSION.error("x"), VersionMismatch)
    err = Refusal.DUPLICATE.error("")
    assert type(err) is ProtocolError and "duplicate" in str(err)


def test_the_module_docstring_table_is_generated_from_the_code() -> None:
    table = textwrap.indent(control.describe(), "    ")
    assert table in (control.__doc__ or ""), f"update transport/control.py's docstring:\n{table}"
