"""When each fragment is sent and applied: pure functions of the step counter.

Streaming DiLoCo (arXiv 2501.18512, §2.2-2.3) syncs fragment p every H inner steps, staggered by
H/P, and overlaps the all-reduce with τ further inner steps before applying it. Here, with
s = H/P, fragment p is *sent* after inner steps t = (p+1)·s + k·H (k = 0, 1, ...; k is the
fragment's *round*) and *applied* after step t + τ. That is the paper's offset p·H/P counted
from step s, so every fragment has trained for at least s steps before its first sync and P = 1
sends at t = H, 2H, ... exactly like plain DiLoCo.

Ordering and deadlock reasoning
-------------------------------
* Every worker derives its actions from the same pure function of the same step counter, so all
  workers issue the same collectives in the same order with the same tags (``frag/p/round``).
* τ < s (enforced by ``DilocoConfig``) means the sync of fragment p is applied before fragment
  p+1 is sent: at most one fragment is ever in flight, peak traffic is one fragment, and right
  after an apply nothing is in flight. The trainer puts its membership/quorum point there, so a
  membership change never strands a half-finished collective.
* Within one step the APPLY of the sync launched τ steps ago comes first, then the SEND of this
  step, then (only when τ = 0) its own APPLY. A worker waiting in APPLY at t+τ waits for
  collectives that every other worker launched at t, before reaching t+τ itself; by induction
  over steps no worker ever waits for a collective another worker has not yet been able to
  launch, so the schedule cannot deadlock.
* At the end of training the syncs launched in the last τ steps are drained (applied) in launch
  order (``drain_actions``) so the final model contains every launched sync.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from lowband.errors import ConfigError


class Kind(str, Enum):
    SEND = "send"  # compute this fragment's pseudo-gradient and launch its all-reduce
    APPLY = "apply"  # wait for it, outer step, merge into the local parameters


@dataclass(frozen=True)
class Action:
    kind: Kind
    fragment: int  # p in [0, P)
    round: int  # k: how many times this fragment was sent before


def _send_at(step: int, n_fragments: int, H: int) -> Action | None:
    """The SEND after inner step ``step`` (1-based count of completed steps), if any."""
    s = H // n_fragments
    if step < s or step % s:
        return None
    fragment = (step // s - 1) % n_fragments
    return Action(Kind.SEND, fragment, (step - (fragment + 1) * s) // H)


def fragment_actions(step: int, n_fragments: int, H: int, tau: int) -> list[Action]:
    """Actions to run after inner step ``step`` (steps are counted from 1), in order."""
    if step < 1:
        return []
    _check(n_fragments, H, tau)
    actions: list[Action] = []
    if tau > 0:
        launched = _send_at(step - tau, n_fragments, H)
        if launched is not None:
            actions.append(Action(Kind.APPLY, launched.fragment, launched.round))
    send = _send_at(step, n_fragments, H)
    if send is not None:
        actions.append(send)
        if tau == 0:
            actions.append(Action(Kind.APPLY, send.fragment, send.round))
    return actions


def drain_actions(total_steps: int, n_fragments: int, H: int, tau: int) -> list[Action]:
    """APPLYs of the syncs still in flight after the last step (launched in (T−τ, T])."""
    _check(n_fragments, H, tau)
    out: list[Action] = []
    for t in range(max(1, total_steps - tau + 1), total_steps + 1):
        send = _send_at(t, n_fragments, H)
        if send is not None and tau > 0:
            out.append(Action(Kind.APPLY, send.fragment, send.round))
    return out


def in_flight_after(step: int, n_fragments: int, H: int, tau: int) -> Action | None:
    """The sync launched but not yet applied once ``step``'s actions ran, if any."""
    _check(n_fragments, H, tau)
    for t in range(max(1, step - tau + 1), step + 1):
        send = _send_at(t, n_fragments, H)
        if send is not None and t + tau > step:
            return send
    return None


def syncs_launched(total_steps: int, n_fragments: int, H: int) -> int:
    """How many fragment syncs a run of ``total_steps`` launches."""
    return total_steps // (H // n_fragments)


def _check(n_fragments: int, H: int, tau: int) -> None:
    # Callers validate through DilocoConfig; this guards direct use of the pure functions.
    if n_fragments < 1 or H < 1 or H % n_fragments or not 0 <= tau < H // n_fragments:
        raise ConfigError(
            "schedule", f"invalid P={n_fragments} H={H} tau={tau}: need P | H and 0 <= tau < H/P"
        )
