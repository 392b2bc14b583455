"""The bound on answers nobody has read yet, and telling delivered answers from lost ones.

A client that never opens its HTTP/2 receive window leaves every answer it asked for in this
process's send buffers until its connection dies. AnswerBudget bounds their sum: a call
reserves its answer's estimated size when it is admitted (before computing, so a burst cannot
overshoot), holds the real size once it is serialized, and gives it back when gRPC reports the
call finished (unary: its done callback) or the stream message written. A call that does not
fit is refused at once with AnswersBacklogged (RESOURCE_EXHAUSTED). Each connection (gRPC's
peer string: address and port) may hold only its share, so one connection cannot take all.

The budget is per process: with several front-end processes, give each
max_undelivered_bytes // frontends (the one line where the budget is built) and the sum holds.

gRPC reports an answer it could not deliver (the client reset the call, or its connection
closed, after the handler returned) only by logging an ExecuteBatchError traceback on its own
logger, from the call's task. GrpcDisconnectFilter turns that traceback into one debug line
and marks the call's Delivery (a context variable of that task) as lost, so the requests
counter shows CANCELLED for it instead of OK.
"""

from __future__ import annotations

import contextvars
import logging
import re
from dataclasses import dataclass, field

from service.errors import AnswersBacklogged
from service.observability import metrics

GRPC_LOGGER = "grpc._cython.cygrpc"
_METHOD = re.compile(r"\[(.*)\]")


class AnswerBudget:
    """Bytes of answers reserved: computing, or computed and not yet delivered."""

    def __init__(self, max_bytes: int, max_bytes_per_connection: int) -> None:
        self.max_bytes = max_bytes
        self.max_bytes_per_connection = min(max_bytes_per_connection, max_bytes)
        self.total = 0
        self._by_peer: dict[str, int] = {}

    def reserve(self, peer: str, nbytes: int) -> Reservation:
        """Reserve nbytes for peer's answer, or raise AnswersBacklogged. An empty budget (and
        a connection holding nothing) still takes one answer of any size, so every legal
        call can be served by an otherwise idle server."""
        held = self._by_peer.get(peer, 0)
        if self.total and self.total + nbytes > self.max_bytes:
            metrics.UNDELIVERED_REFUSALS.labels("server").inc()
            raise AnswersBacklogged(
                f"answers computed for clients but not yet read by them hold {self.total} "
                f"bytes, and this one needs about {nbytes} more than the server's bound of "
                f"{self.max_bytes} (--max-undelivered-bytes) allows; retry shortly, or ask "
                "for less (no attention weights)"
            )
        if held and held + nbytes > self.max_bytes_per_connection:
            metrics.UNDELIVERED_REFUSALS.labels("connection").inc()
            raise AnswersBacklogged(
                f"this connection has {held} bytes of answers it has not read yet; this one "
                f"needs about {nbytes} more than its share of {self.max_bytes_per_connection} "
                "(--max-undelivered-bytes-per-connection): read the answers, or spread the "
                "calls over more connections"
            )
        reservation = Reservation(self, peer)
        reservation.resize(nbytes)
        return reservation

    def _change(self, peer: str, change: int) -> None:
        self.total += change
        held = self._by_peer.get(peer, 0) + change
        if held > 0:
            self._by_peer[peer] = held
        else:
            self._by_peer.pop(peer, None)
        metrics.UNDELIVERED_BYTES.set(self.total)


@dataclass
class Reservation:
    """One answer's bytes in the budget; resize() to its real size, release() once done."""

    budget: AnswerBudget
    peer: str
    nbytes: int = 0

    def resize(self, nbytes: int) -> None:
        """Hold nbytes from now on (never refused: the answer exists already)."""
        self.budget._change(self.peer, nbytes - self.nbytes)
        self.nbytes = nbytes

    def release(self) -> None:
        """Give the bytes back; calling it again does nothing."""
        self.resize(0)


@dataclass
class Delivery:
    """Whether gRPC delivered one unary call's answer (see GrpcDisconnectFilter)."""

    lost: bool = False
    method: str = field(default="")


_CALL: contextvars.ContextVar[Delivery | None] = contextvars.ContextVar(
    "attention_delivery", default=None
)


def track_delivery() -> Delivery:
    """A Delivery for the unary call running in this task; read it in the done callback."""
    delivery = Delivery()
    _CALL.set(delivery)
    return delivery


class GrpcDisconnectFilter(logging.Filter):
    """On gRPC's logger: a call that lost its answer is one debug line, and marked lost."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if error is None or type(error).__name__ != "ExecuteBatchError":
            return True
        delivery = _CALL.get()
        if delivery is not None:
            delivery.lost = True
        found = _METHOD.search(record.getMessage())
        record.msg = "%s: the call ended (client reset or disconnect) before its answer was sent"
        record.args = (found.group(1) if found else "a call",)
        record.exc_info = record.exc_text = None
        record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)


def install_disconnect_filter() -> None:
    """Once per process, before the server starts."""
    logger = logging.getLogger(GRPC_LOGGER)
    if not any(isinstance(f, GrpcDisconnectFilter) for f in logger.filters):
        logger.addFilter(GrpcDisconnectFilter())
