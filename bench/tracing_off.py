"""What tracing costs a request while it is off: the request path's own tracing calls, timed.

A whole-server A/B cannot show it (two servers differ by more than the run-to-run spread), so
this times the calls a front end makes for each request when tracing is off, in the order it
makes them, and the report sets them against the front end's measured CPU per request.
"""

from __future__ import annotations

import time

import grpc

from service.frontend.rpc import end_span, start_span
from service.observability import tracing

CALLS = 200_000


def hooks_cpu_us(calls: int = CALLS) -> float:
    """CPU microseconds per request of the tracing calls on a request's path, tracing off."""
    if tracing.enabled():
        raise RuntimeError("tracing is on in this process; the figure is for tracing off")
    ok = grpc.StatusCode.OK
    no_tags: tuple[tuple[int, int, int], ...] = ()
    started = time.process_time()
    for _ in range(calls):
        span = start_span("v2", "ModelInfer", None)  # type: ignore[arg-type]  # unread when off
        tag = tracing.current_tag()  # admission
        tracing.enabled()  # admission: batch spans only when on
        tracing.tag_numbers(tag)  # the INFER message
        tracing.tags_from_numbers(no_tags)  # the DONE message
        end_span(span, ok)
    return (time.process_time() - started) / calls * 1e6
