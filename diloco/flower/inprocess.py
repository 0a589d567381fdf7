"""A Flower :class:`Grid` that delivers messages to ClientApp handlers in this process.

The same strategy code runs as with a SuperLink, minus processes and sockets: one
:class:`~flwr.app.Context` per node keeps ``Context.state`` across rounds as a SuperNode would.
Tests use it for multi-round runs and failure injection (a handler that raises becomes an
error reply, a node in ``silent`` never answers — a round timeout). It is serial and not a
simulation engine: use ``lowband flower local`` for a real deployment.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterable, Mapping

from flwr.app import Context, Error, Message, RecordDict
from flwr.common.constant import ErrorCode
from flwr.serverapp import Grid
from flwr.supercore.run import Run

logger = logging.getLogger(__name__)

Handler = Callable[[Message, Context], Message]


def ensure_task_identity(run_id: int = 1) -> None:
    """Flower (>= 1.4x) stamps new Messages with the current task's identity, which only a
    running ServerApp sets; give this process one so that a strategy can build messages here.
    Older Flower has no such identity and needs nothing."""
    try:
        from flwr.supercore.task_identity import TaskIdentity
    except ImportError:
        return
    if TaskIdentity._run_id is None:  # noqa: SLF001 - Flower exposes no "is set" query
        TaskIdentity.run_id = run_id
        TaskIdentity.node_id = 0
        TaskIdentity.task_id = 1


class InProcessGrid(Grid):
    """Nodes ``node_configs`` (node id -> node config) answering through ``handler``."""

    def __init__(
        self,
        handler: Handler,
        run_config: Mapping[str, Any],
        node_configs: Mapping[int, Mapping[str, Any]],
        *,
        run_id: int = 1,
    ) -> None:
        ensure_task_identity(run_id)
        self.handler = handler
        self.contexts = {
            n: Context(
                run_id=run_id,
                node_id=n,
                node_config=dict(c),
                state=RecordDict(),
                run_config=dict(run_config),
            )
            for n, c in node_configs.items()
        }
        self.silent: set[int] = set()  # nodes whose replies never arrive
        self.sent: list[Message] = []  # every instruction delivered, for inspection
        self._run: Run | None = None

    # ---- the part strategies use ---------------------------------------------------------------
    def get_node_ids(self) -> Iterable[int]:
        return list(self.contexts)

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> Iterable[Message]:
        replies = []
        for msg in messages:
            self.sent.append(msg)
            node = msg.metadata.dst_node_id
            if node not in self.contexts:
                replies.append(
                    Message(
                        Error(code=ErrorCode.NODE_UNAVAILABLE, reason=f"no node {node}"),
                        reply_to=msg,
                    )
                )
                continue
            try:
                reply = self.handler(msg, self.contexts[node])
            except Exception as exc:  # noqa: BLE001 - a ClientApp exception is an error reply
                logger.warning("node %d raised %r", node, exc)
                reply = Message(
                    Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=repr(exc)),
                    reply_to=msg,
                )
            if node not in self.silent:
                replies.append(reply)
        return replies

    # ---- the rest of the Grid interface --------------------------------------------------------
    def set_run(self, run: Run) -> None:
        self._run = run

    @property
    def run(self) -> Run:
        if self._run is None:
            raise RuntimeError("InProcessGrid has no Run; call set_run first")
        return self._run

    def create_message(
        self,
        content: RecordDict,
        message_type: str,
        dst_node_id: int,
        group_id: str,
        ttl: float | None = None,
    ) -> Message:
        return Message(
            content, dst_node_id=dst_node_id, message_type=message_type, group_id=group_id, ttl=ttl
        )

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        raise NotImplementedError("InProcessGrid only supports send_and_receive")

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        raise NotImplementedError("InProcessGrid only supports send_and_receive")
