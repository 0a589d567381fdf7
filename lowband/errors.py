"""Typed errors shared by every lowband package.

Callers branch on the type, users read the message: every message says what went wrong and,
where there is one, what to do about it.
"""

from __future__ import annotations


class LowbandError(Exception):
    """Base class of all lowband errors."""


class ConfigError(LowbandError, ValueError):
    """A configuration value is invalid. The message names the field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class ProtocolError(LowbandError):
    """A peer sent bytes that are not a valid lowband message (bad magic, version, shape, size)."""


class VersionMismatch(ProtocolError):
    """A peer speaks another wire-protocol version."""


class AuthError(LowbandError):
    """Authentication failed (bad token, unknown CURVE key)."""


class IncompatiblePeer(LowbandError):
    """A peer was refused at join: its run signature (model shapes, config) differs from the
    group's."""


class TransportTimeout(LowbandError, TimeoutError):
    """An operation did not complete within its deadline. The peers may still be alive."""


class PeerLost(LowbandError):
    """A peer taking part in an operation died or left. Survivors may retry on the next epoch."""

    def __init__(self, message: str, *, peers: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.peers = peers


class CommClosed(LowbandError):
    """The communicator was closed (by this process) while the operation was pending."""


class CorruptWeights(LowbandError):
    """Weights on disk are damaged (bad checksum, truncated file) or do not match the model config.

    Raised before serving starts (or before a damaged block is used), never after a wrong answer.
    """


class ChatTemplateError(LowbandError):
    """A chat could not be rendered: the messages are malformed, or the model's chat template
    refused them (its ``raise_exception``) or failed on them. A server answers 400."""
