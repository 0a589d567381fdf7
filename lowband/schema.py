"""Typed messages between processes: one frozen dataclass per message, one encode, one decode.

A message travels as a msgpack map of its fields (:meth:`Record.to_wire`; tuples become
lists). :meth:`Record.from_wire` turns such a map back into the message: every field must be
present (or have a default) and have its declared type, else :class:`ProtocolError` names the
message and the field; unknown keys are ignored (a newer sender may add fields with defaults).
Bounds a receiver must check before acting on a number (sizes, ports, list lengths) go in the
message's ``__post_init__``, which raises :class:`ProtocolError` through :meth:`Record.bad`.

The supported field types are what msgpack carries: ``bool``, ``int``, ``float`` (an int is a
valid float), ``str``, ``dict``, ``list[T]``, an :class:`enum.Enum` (as its value) and unions
with ``None``. Tensors never travel in
a message's map; they go beside it.

Used by the transport's control plane (``transport.control``) and the edge cluster's protocol
(``edge.cluster.protocol``); :func:`describe` writes the field table their docs show.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass
from enum import Enum
from typing import Any, ClassVar, Mapping, TypeVar, Union

from lowband.errors import ProtocolError

R = TypeVar("R", bound="Record")


@dataclass(frozen=True, kw_only=True)
class Record:
    """Base of every typed message; ``NAME`` is how errors and docs call it."""

    NAME: ClassVar[str] = ""
    TENSORS: ClassVar[str] = ""  # what travels beside the map, if anything

    def to_wire(self) -> dict[str, Any]:
        """The msgpack map: every field (lists, never tuples)."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            out[f.name] = list(v) if isinstance(v, tuple) else v.value if isinstance(v, Enum) else v
        return out

    @classmethod
    def from_wire(cls: type[R], meta: object) -> R:
        """``meta`` as this message; :class:`ProtocolError` when it is malformed."""
        if not isinstance(meta, dict):
            raise ProtocolError(f"a {cls.NAME!r} message must be a map, got {type(meta).__name__}")
        hints = hints_of(cls)
        kw: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            if f.name not in meta:
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                    raise ProtocolError(f"{cls.NAME!r} message without its field {f.name!r}")
                continue
            kw[f.name] = conform(cls.NAME, f.name, meta[f.name], hints[f.name])
        return cls(**kw)

    def bad(self, name: str, why: str) -> ProtocolError:
        """The error for field ``name`` out of its bounds (for ``__post_init__``)."""
        return ProtocolError(
            f"{self.NAME!r} message: field {name!r} {why}, got {getattr(self, name)!r:.80}"
        )


_HINTS: dict[type, dict[str, Any]] = {}


def hints_of(cls: type[Record]) -> dict[str, Any]:
    """The resolved field types of a message class (resolved once per class)."""
    hints = _HINTS.get(cls)
    if hints is None:
        hints = _HINTS[cls] = typing.get_type_hints(cls)
    return hints


def conform(what: str, name: str, value: Any, tp: Any) -> Any:
    """``value`` as type ``tp`` (an int is a valid float; a list is a list of its items)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for a in args:
            if a is not type(None):
                try:
                    return conform(what, name, value, a)
                except ProtocolError:
                    pass
    elif origin is list:
        if isinstance(value, (list, tuple)):
            return [conform(what, f"{name}[{i}]", v, args[0]) for i, v in enumerate(value)]
    elif isinstance(tp, type) and issubclass(tp, Enum):
        try:
            return tp(value)
        except (ValueError, TypeError):
            pass
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif isinstance(value, tp) and not (tp is int and isinstance(value, bool)):
        return value
    want = type_name(tp)
    if isinstance(tp, type) and issubclass(tp, Enum):
        want = "one of " + ", ".join(repr(m.value) for m in tp)
    raise ProtocolError(
        f"{what!r} message: field {name!r} must be {want}, got {type(value).__name__} {value!r:.80}"
    )


def type_name(tp: Any) -> str:
    """``tp`` as the docs write it (``list[int] | None``)."""
    if typing.get_origin(tp) in (Union, types.UnionType):
        return " | ".join(type_name(a) for a in typing.get_args(tp))
    if typing.get_origin(tp) is list:
        return f"list[{type_name(typing.get_args(tp)[0])}]"
    return "None" if tp is type(None) else tp.__name__


def describe(messages: Mapping[str, type[Record]], width: int = 9) -> str:
    """A field table of ``messages`` (name -> class), one message per line, wrapped at 88
    columns between fields, a ``+ tensors:`` line where something travels beside the map."""
    lines = []
    for label, cls in messages.items():
        hints = hints_of(cls)
        parts = [
            f"{f.name}: {type_name(hints[f.name])}"
            + (
                f" = {f.default!r}"
                if f.default is not dataclasses.MISSING
                else ""
                if f.default_factory is dataclasses.MISSING
                else f" = {f.default_factory()!r}"
            )
            for f in dataclasses.fields(cls)
        ]
        line = label
        for i, part in enumerate(parts):
            sep = "," if i < len(parts) - 1 else ""
            if len(line) > width and len(line) + len(part) > 88:  # break between fields only
                lines.append(line)
                line = ""
            line = f"{line:<{width}} {part}{sep}"
        lines.append(line)
        if cls.TENSORS:
            lines.append(f"{'':{width}} + tensors: {cls.TENSORS}")
    return "\n".join(lines)
