"""Fuzzing at volume: property-based malformed requests over both APIs (AttentionService
Attend and V2 ModelInfer, typed fields and bytes that do not parse at all), each followed by
a valid request whose answer must equal the first one's. Every malformed request must get a
documented status with a message and no traceback; the count is reported.

The strategies are hypothesis's, so the same cases run as a bounded pytest property test
and, with --requests 10000, as the long run."""

from __future__ import annotations

import math
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st

from bench.calls import CHANNEL_OPTIONS
from bench.payloads import METHODS
from service.generated.attention.v1 import attention_pb2 as pb
from service.generated.inference import grpc_service_pb2 as v2

# docs/api.md, "Errors": what a malformed request may get (OK when a case happens to be valid).
# UNIMPLEMENTED: a call that names an encoding the server does not take (gRPC's own refusal,
# by default: --grpc-compression).
DOCUMENTED = frozenset({"INVALID_ARGUMENT", "NOT_FOUND", "RESOURCE_EXHAUSTED", "UNIMPLEMENTED"})
HUGE_DIMS = [0, 2**31, 2**62, 2**63 - 1]
# Strings that str.isdigit() accepts: superscripts, other scripts' digits, thousands of them.
DIGIT_STRINGS = st.text(alphabet="0123456789²³¹١٢３４", min_size=1, max_size=30) | st.just(
    "9" * 5000
)
FILLS = [0.0, 1.0, math.nan, math.inf, 1e30]


def _models(served: list[str]) -> st.SearchStrategy[str]:
    """Mostly served names (so the cases reach validation), else unknown or odd ones."""
    known = st.sampled_from(["", *served])
    return st.one_of(known, known, known, st.just("nope"), st.text(max_size=300))


def _versions() -> st.SearchStrategy[str]:
    return st.one_of(
        st.just(""), st.just(""), st.sampled_from(["1", "2"]), st.text(max_size=30), DIGIT_STRINGS
    )


@st.composite
def attend_requests(draw: st.DrawFn, served: list[str]) -> bytes:
    """AttendRequest with arbitrary shapes (zero, negative, huge), dtypes, byte counts,
    values, model names, versions and request ids."""
    shape = draw(st.lists(st.one_of(st.integers(-2, 70), st.sampled_from(HUGE_DIMS)), max_size=5))
    dtype = draw(st.integers(0, 4))  # raw enum numbers: unknown ones too
    elements = math.prod(shape) if shape and all(d >= 0 for d in shape) else 0
    itemsize = 2 if dtype == pb.FLOAT16 else 4
    size = max(0, min(elements * itemsize, 1 << 20) + draw(st.integers(-8, 8)))
    data = np.full(size // 4 + 1, draw(st.sampled_from(FILLS)), np.float32).tobytes()[:size]
    return pb.AttendRequest(
        model=draw(_models(served)),
        model_version=draw(_versions()),
        request_id=draw(st.text(max_size=300)),
        embeddings=pb.Tensor(shape=shape, dtype=dtype, data=data),  # type: ignore[arg-type]
        return_attention_weights=draw(st.booleans()),
    ).SerializeToString()


@st.composite
def v2_requests(draw: st.DrawFn, served: list[str]) -> bytes:
    """ModelInferRequest with arbitrary input names, datatypes, shapes, raw or typed
    contents, requested outputs, models, versions and parameters."""
    shape = draw(st.lists(st.one_of(st.integers(-1, 40), st.sampled_from([0, 2**62])), max_size=4))
    elements = math.prod(shape) if shape and all(d >= 0 for d in shape) else 0
    request = v2.ModelInferRequest(
        model_name=draw(_models(served)), model_version=draw(_versions())
    )
    parameter = draw(st.sampled_from(["", "binary_data_output", "priority", "timeout"]))
    if parameter:
        request.parameters[parameter].int64_param = 1
    tensor = request.inputs.add(
        name=draw(st.sampled_from(["embeddings", "x", ""])),
        datatype=draw(st.sampled_from(["FP32", "FP16", "FP64", "INT8", "BYTES", ""])),
        shape=shape,
    )
    for output in draw(
        st.lists(st.sampled_from(["output", "attention_weights", "nope"]), max_size=3)
    ):
        request.outputs.add(name=output)
    extra = draw(st.integers(-4, 4))
    if draw(st.booleans()):
        request.raw_input_contents.append(b"\0" * max(0, min(elements * 4, 1 << 20) + extra))
    else:
        tensor.contents.fp32_contents.extend([0.5] * max(0, min(elements, 1 << 18) + extra))
    return request.SerializeToString()


def cases(served: list[str]) -> st.SearchStrategy[tuple[str, bytes]]:
    """(api, request bytes): typed cases for either API, or bytes that may not parse."""
    return st.one_of(
        st.tuples(st.just("attention"), attend_requests(served)),
        st.tuples(st.just("v2"), v2_requests(served)),
        st.tuples(st.sampled_from(["attention", "v2"]), st.binary(max_size=512)),
    )


@dataclass
class FuzzReport:
    sent: int = 0
    codes: Counter[str] = field(default_factory=Counter)  # "api code"
    violations: list[str] = field(default_factory=list)
    valid_checks: int = 0
    valid_wrong: int = 0

    def figures(self, seconds: float) -> dict[str, Any]:
        ok = sum(n for key, n in self.codes.items() if key.endswith(" OK"))
        return {
            "requests_sent": self.sent,
            "malformed_answered_documented_status": self.sent - ok - len(self.violations),
            "valid_by_chance_ok": ok,
            "by_api_and_code": dict(sorted(self.codes.items())),
            "violations": len(self.violations),
            "violation_examples": self.violations[:5],
            "valid_checks": self.valid_checks,
            "valid_checks_wrong": self.valid_wrong,
            "duration_s": seconds,
        }


class Checker:
    """A valid request on each API and its first answer; later answers must equal it."""

    def __init__(self, channel: grpc.Channel, model: str, embed_dim: int) -> None:
        x = np.random.default_rng(3).standard_normal((1, 5, embed_dim), np.float32)
        attend = pb.AttendRequest(
            model=model, embeddings=pb.Tensor(shape=[5, embed_dim], data=x.tobytes())
        )
        infer = v2.ModelInferRequest(model_name=model, raw_input_contents=[x.tobytes()])
        infer.inputs.add(name="embeddings", datatype="FP32", shape=list(x.shape))
        self._calls = {
            "attention": (
                channel.unary_unary(METHODS["attention"]),
                attend.SerializeToString(),
                lambda reply: pb.AttendResponse.FromString(reply).output.data,
            ),
            "v2": (
                channel.unary_unary(METHODS["v2"]),
                infer.SerializeToString(),
                lambda reply: v2.ModelInferResponse.FromString(reply).raw_output_contents[0],
            ),
        }
        self._expected = {api: self._answer(api) for api in self._calls}

    def _answer(self, api: str) -> np.ndarray:
        rpc, body, output = self._calls[api]
        return np.frombuffer(output(rpc(body, timeout=60)), np.float32)

    def right(self, api: str) -> bool:
        try:
            got = self._answer(api)
        except grpc.RpcError:
            return False
        return got.shape == self._expected[api].shape and bool(
            np.allclose(got, self._expected[api], rtol=1e-5, atol=1e-6)
        )


def run(
    target: str,
    *,
    served: list[str],
    model: str,
    embed_dim: int,
    requests: int,
    seed_value: int = 0,
) -> dict[str, Any]:
    """Send about `requests` malformed requests (hypothesis's count), a valid one after each."""
    report = FuzzReport()
    started = time.monotonic()
    with grpc.insecure_channel(target, options=CHANNEL_OPTIONS) as channel:
        checker = Checker(channel, model, embed_dim)
        rpcs = {api: channel.unary_unary(METHODS[api]) for api in ("attention", "v2")}

        @seed(seed_value)
        @settings(
            max_examples=requests,
            database=None,
            deadline=None,
            phases=[Phase.generate],
            suppress_health_check=list(HealthCheck),
        )
        @given(case=cases(served))
        def one(case: tuple[str, bytes]) -> None:
            api, body = case
            report.sent += 1
            try:
                rpcs[api](body, timeout=60)
                code, details = "OK", ""
            except grpc.RpcError as err:
                code, details = err.code().name, err.details() or ""  # type: ignore[attr-defined]
            report.codes[f"{api} {code}"] += 1
            if code != "OK" and (code not in DOCUMENTED or not details or "Traceback" in details):
                report.violations.append(f"{api} {code}: {details[:200]!r}")
            check_api = "attention" if report.sent % 2 else "v2"
            report.valid_checks += 1
            report.valid_wrong += not checker.right(check_api)

        one()
    figures = report.figures(time.monotonic() - started)
    figures["failed_checks"] = [
        name
        for name, passed in {
            "every malformed request got a documented status": not report.violations,
            "every valid request after one was right": report.valid_wrong == 0,
        }.items()
        if not passed
    ]
    return figures
