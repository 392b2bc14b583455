"""The bound on answers nobody has read yet, and telling delivered answers from lost ones.

A client that never opens its HTTP/2 receive window (or, on REST, never reads its socket)
leaves every answer it asked for in this process's send buffers until its connection dies.
AnswerBudget bounds their sum: a call reserves its answer's estimated memory when it is
admitted (before computing, so a burst cannot overshoot), holds the real size once it is
serialized, and gives it back once gRPC has taken the answer's write (unary calls and stream
messages alike) or the call has ended. A call that does not fit is refused at once with
AnswersBacklogged (RESOURCE_EXHAUSTED). Each connection (gRPC's peer string: address and port)
may hold only its share, so one connection cannot take all.

The budget is per process: with several front-end processes, give each
max_undelivered_bytes // frontends (the one line where the budget is built) and the sum holds.

An answer counts as delivered once gRPC has taken the write of it (flow control lets a write
finish only as the client opens its window); a call that ends first (the client reset it or
closed its connection) is counted CANCELLED (service/frontend/rpc.py, streaming.py). gRPC
logs such an end as an ExecuteBatchError traceback when its last write or status fails;
GrpcDisconnectFilter makes that one debug line.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

from service.errors import AnswersBacklogged
from service.observability import metrics
from service.status_texts import ANSWERS_BACKLOGGED_BY_CONNECTION, ANSWERS_BACKLOGGED_BY_SERVER

GRPC_LOGGER = "grpc._cython.cygrpc"
# Memory an answer holds until written, per byte of it: the serialized bytes gRPC Python keeps
# for the write plus core's own copy (measured: 14 answers of 72 MiB held 2.0 GiB).
MEMORY_PER_ANSWER_BYTE = 2
_METHOD = re.compile(r"\[(.*)\]")


class AnswerBudget:
    """Bytes of answers reserved: computing, or computed and not yet delivered."""

    def __init__(self, max_bytes: int, max_bytes_per_connection: int) -> None:
        self.max_bytes = max_bytes
        self.max_bytes_per_connection = min(max_bytes_per_connection, max_bytes)
        self.total = 0
        self._by_peer: dict[str, int] = {}
        self._gauge = metrics.OncePerTurn(lambda: metrics.UNDELIVERED_BYTES.set(self.total))

    def reserve(self, peer: str, nbytes: int) -> Reservation:
        """Reserve nbytes for peer's answer, or raise AnswersBacklogged. An empty budget (and
        a connection holding nothing) still takes one answer of any legal size, so every
        legal call can be served by an otherwise idle server; legal sizes are bounded (the
        largest request's answer with its weights, and on REST a JSON answer by
        --max-json-answer-bytes, refused before it is reserved)."""
        held = self._by_peer.get(peer, 0)
        if self.total and self.total + nbytes > self.max_bytes:
            metrics.UNDELIVERED_REFUSALS.labels(metrics.Scope.SERVER).inc()
            raise AnswersBacklogged(
                ANSWERS_BACKLOGGED_BY_SERVER.format(
                    total=self.total, nbytes=nbytes, max_bytes=self.max_bytes
                )
            )
        if held and held + nbytes > self.max_bytes_per_connection:
            metrics.UNDELIVERED_REFUSALS.labels(metrics.Scope.CONNECTION).inc()
            raise AnswersBacklogged(
                ANSWERS_BACKLOGGED_BY_CONNECTION.format(
                    held=held, nbytes=nbytes, max_bytes_per_connection=self.max_bytes_per_connection
                )
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
        self._gauge.request()


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


class GrpcDisconnectFilter(logging.Filter):
    """On gRPC's logger: a call that lost its answer is one debug line, not a traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if error is None or type(error).__name__ != "ExecuteBatchError":
            return True
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
