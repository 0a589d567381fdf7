"""Who the peers of an epoch are and where to send to them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lowband.comm import Membership


@dataclass
class PeerTable:
    """Addresses and CURVE keys of the peers of one epoch, as the coordinator announced them."""

    membership: Membership
    addrs: tuple[str, ...]
    keys: tuple[str | None, ...]
    locals: tuple[list[str] | None, ...] = ()
    relayed: tuple[bool, ...] = ()
    """Per peer: it cannot be dialled, so links into it go through the coordinator's relay."""
    index: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.index = {p: r for r, p in enumerate(self.membership.peers)}


def data_address(mine: list[str] | None, addr: str, theirs: Any) -> str:
    """Where to send to a peer: its Unix socket when it offers one on this host (and network
    namespace), else its TCP address."""
    if (
        mine is not None
        and isinstance(theirs, list)
        and len(theirs) >= 2
        and theirs[0] == mine[0]
        and theirs[1]
    ):
        return theirs[1]
    return addr
