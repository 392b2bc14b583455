"""The records of sampled calls the gateway sends its front end: byte for byte the file in
tests/golden/, which the Go gateway's tests (service/gateway/tracing_test.go) write and read
the same (the traced INFER and DONE: test_codec.py)."""

from __future__ import annotations

import pytest

from service.frontend.gateway_spans import SpanSink, gateway_call
from service.ipc import span_record
from service.observability import tracing
from tests.ipc.test_codec import DONE_TRACED, GOLDEN, SPAN_ID, TRACE_ID

CALLER = 0xF067AA0BA902B7
RECORD = span_record.SpanRecord(
    trace_id=TRACE_ID,
    span_id=SPAN_ID,
    parent_span_id=CALLER,
    parent_flags=1,
    received_ns=1_700_000_000_123_456_789,
    answered_ns=1_700_000_000_125_456_789,
    code=0,
    model_version=1,
    sequences=2,
    length=16,
    method="inference.GRPCInferenceService/ModelInfer",
    model="mha",
    trace_state="congo=t61rcWkgMzE",
    done=DONE_TRACED,
)


def test_the_golden_record_reads_back_as_written() -> None:
    framed = (GOLDEN / "span-record.bin").read_bytes()
    assert span_record.pack(RECORD) == framed
    (length,) = span_record.LENGTH.unpack_from(framed)
    assert length == len(framed) - span_record.LENGTH.size
    assert span_record.unpack(framed[span_record.LENGTH.size :]) == RECORD


@pytest.mark.parametrize("cut", [1, 40, 90])
def test_a_short_or_long_record_is_refused(cut: int) -> None:
    body = (GOLDEN / "span-record.bin").read_bytes()[span_record.LENGTH.size :]
    with pytest.raises(ValueError, match="span record"):
        span_record.unpack(body[:-cut])
    with pytest.raises(ValueError, match="span record"):
        span_record.unpack(body + b"x" * cut)


def test_a_record_gives_the_spans_the_attributes_of_the_python_path() -> None:
    call = gateway_call(RECORD)
    assert call.name == "inference.GRPCInferenceService/ModelInfer"
    assert (call.code, call.error) == ("OK", False)
    assert dict(call.attributes) == {
        "rpc.system": "grpc",
        "rpc.service": "inference.GRPCInferenceService",
        "rpc.method": "ModelInfer",
        "rpc.grpc.status_code": 0,
        "attention.model": "mha",
        "attention.model_version": 1,
        "attention.sequences": 2,
        "attention.sequence_length": 16,
    }
    assert call.batch == tracing.Batch(
        queue_s=0.002,
        compute_s=0.0005,
        started_at=811.25,
        batch_size=6,
        padding=0.125,
        batch_id=9,
        tags=(tracing.Tag(TRACE_ID, SPAN_ID, 1), tracing.Tag(1, 2**64 - 1, 0)),
    )
    failed = gateway_call(span_record.SpanRecord(**{**RECORD.__dict__, "code": 13, "done": None}))
    assert (failed.code, failed.error, failed.batch) == ("INTERNAL", True, None)


def test_a_malformed_record_is_skipped_and_the_next_one_read() -> None:
    """A record whose body is bad (its length sound) loses only itself: the stream goes on."""
    good = (GOLDEN / "span-record.bin").read_bytes()
    body = good[span_record.LENGTH.size :]
    bad = span_record.LENGTH.pack(len(body)) + bytes([99]) + body[1:]  # an unknown version
    with pytest.raises(ValueError, match="version"):
        span_record.unpack(bad[span_record.LENGTH.size :])
    buffer = bytearray(bad + good + good[:10])  # and the start of a third
    assert SpanSink._records(buffer) == len(bad) + len(good)
