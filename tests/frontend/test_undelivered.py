"""Answers nobody reads: clients with a 1-byte HTTP/2 receive window ask for the weights at
the defaults (d=512); the server's memory stays within --max-undelivered-bytes plus a small
margin, the calls past it get RESOURCE_EXHAUSTED at once, a well-behaved client is served
throughout, and every answer that was never delivered counts CANCELLED, not OK."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from bench.harness import wait_for
from service.catalog import BatchCaps, ModelRegistry, ModelSpec, ModelView
from service.client import AttentionClient, attend_request
from service.errors import AnswersBacklogged, ModelNotFound
from service.frontend.delivery import AnswerBudget
from service.frontend.v2_plane import V2Plane
from service.generated.inference import grpc_service_pb2 as v2
from service.settings import Settings
from tests.harness.h2_raw import RawGrpc
from tests.harness.server_process import ServerProcess, server_rss_bytes

# Every server here runs with the gRPC gateway, then without it (the module's server
# fixtures take grpc_gateway; tests that start their own servers get it from this mark).
pytestmark = pytest.mark.usefixtures("grpc_gateway")

ATTEND = "/attention.v1.AttentionService/Attend"
ATTEND_STREAM = "/attention.v1.AttentionService/AttendStream"
BUDGET = Settings.max_undelivered_bytes  # the defaults under test
MARGIN = 384 << 20  # request bodies, malloc arenas, the well-behaved client's calls, and
# the worker's memory for computing the held answers (measured over the whole process tree)
SEQUENCES = 8  # each slow call: 8 x 512 with weights, a 72 MiB answer


def test_the_budget_refuses_past_its_bound_and_per_connection() -> None:
    budget = AnswerBudget(100, 60)
    first = budget.reserve("a", 50)
    with pytest.raises(AnswersBacklogged, match="this connection"):
        budget.reserve("a", 20)
    second = budget.reserve("b", 40)
    with pytest.raises(AnswersBacklogged, match="--max-undelivered-bytes"):
        budget.reserve("c", 20)
    budget.reserve("c", 10).release()  # small calls pass while room remains
    first.release()
    first.release()  # twice is harmless
    second.release()
    assert budget.total == 0
    budget.reserve("a", 500).release()  # an empty budget takes one answer of any size


class _Served:
    """What V2Plane reads of its data plane to estimate an answer: the served set."""

    def __init__(self) -> None:
        spec = ModelSpec(
            name="mha",
            version=1,
            embed_dim=512,
            num_heads=8,
            causal=False,
            dtype=np.dtype("float32"),
            weights_sha256="",
            weights_source="",
        )
        view = ModelView("mha/1", spec, "CPUExecutionProvider", BatchCaps(((512, 32),)), True)
        self.models = ModelRegistry([view], "mha")


@pytest.mark.parametrize(("name", "version"), [("nope", ""), ("mha", "7"), ("mha", "01")])
def test_a_request_for_a_model_not_served_reserves_no_answer(name: str, version: str) -> None:
    """The estimate fails (the call then reserves nothing and answers NOT_FOUND): before, an
    unknown model's request took room in a held budget and was told RESOURCE_EXHAUSTED."""
    plane = V2Plane(_Served(), Settings(), lambda: True)
    request = v2.ModelInferRequest(model_name=name, model_version=version)
    request.inputs.add(name="embeddings", datatype="FP32", shape=[1, 4, 512])
    request.raw_input_contents.append(bytes(4 * 512 * 4))
    with pytest.raises(ModelNotFound):
        plane.answer_bytes(request)
    request.model_name, request.model_version = "mha", ""
    assert plane.answer_bytes(request) == 4 * 512 * 4


@pytest.fixture(scope="module")
def server(mha_repository: Path, grpc_gateway: str) -> Iterator[ServerProcess]:
    with ServerProcess(mha_repository) as process:
        yield process
    assert "Traceback" not in process.log, process.log


def _weights_call() -> bytes:
    x = np.random.default_rng(0).standard_normal((SEQUENCES, 512, 512), dtype=np.float32)
    return attend_request(x, return_attention_weights=True).SerializeToString()


def _gauges(server: ServerProcess) -> dict[str, float]:
    names = (
        "attention_undelivered_answer_bytes",
        "attention_inflight_requests",
        "attention_queue_depth_requests",
    )
    codes = {
        f"code {c}": server.metric("attention_requests_total", code=c)
        for c in ("OK", "CANCELLED", "RESOURCE_EXHAUSTED", "INTERNAL")
    }
    return {name: server.metric(name) for name in names} | codes


def _sequences_computed(server: ServerProcess) -> float:
    return server.metric("attention_batch_size_sequences_sum")


@pytest.mark.gateway_off_heavy
def test_slow_readers_stay_within_the_budget(server: ServerProcess) -> None:
    good = AttentionClient(server.target)
    x = np.random.default_rng(1).standard_normal((SEQUENCES, 512, 512), dtype=np.float32)
    good.attend(x, return_attention_weights=True)  # warm this path's allocations first
    before = server_rss_bytes(server)  # front ends and worker: where answers wait
    computed = _sequences_computed(server)
    refused = server.metric("attention_requests_total", code="RESOURCE_EXHAUSTED")
    message = _weights_call()
    slow = [RawGrpc(server.grpc_port, window=1, read=False) for _ in range(6)]
    calls = [(c, c.call(ATTEND, message)) for c in slow for _ in range(3)]
    try:

        def settled() -> bool:  # each call either refused or computed and held
            held = (_sequences_computed(server) - computed) / SEQUENCES
            gone = server.metric("attention_requests_total", code="RESOURCE_EXHAUSTED")
            return held + gone - refused >= len(calls)

        wait_for(
            settled,
            timeout_s=120,
            what=lambda: (
                "every slow call refused or computed; so far "
                f"{_sequences_computed(server) - computed} sequences computed, "
                f"{server.metric('attention_requests_total', code='RESOURCE_EXHAUSTED') - refused} "
                f"refused; {_gauges(server)}; {[c.ended_by for c in slow]}"
            ),
        )
        held = round((_sequences_computed(server) - computed) / SEQUENCES)
        held_bytes = server.metric("attention_undelivered_answer_bytes")
        growth = server_rss_bytes(server) - before
        assert 0 < held_bytes <= BUDGET
        assert growth <= BUDGET + MARGIN, f"RSS grew {growth >> 20} MiB"
        refusals = [c.replies[s] for c, s in calls if c.replies[s].headers.get("grpc-status")]
        assert refusals, "nothing was refused at the bound"
        assert all(r.headers["grpc-status"] == "8" for r in refusals)
        assert "--max-undelivered-bytes" in refusals[0].headers["grpc-message"]
        # A well-behaved client: calls without weights go through while room remains.
        small = np.zeros((2, 128, 512), dtype=np.float32)
        for _ in range(5):
            assert good.attend(small).output.shape == (2, 128, 512)
        with pytest.raises(grpc.RpcError) as full:
            good.attend(x, return_attention_weights=True)
        assert full.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        cancelled = server.metric("attention_requests_total", code="CANCELLED")
        ok = server.metric("attention_requests_total", code="OK")
    finally:
        for connection in slow:
            connection.close()
    wait_for(
        lambda: server.metric("attention_undelivered_answer_bytes") == 0,
        timeout_s=30,
        what="the budget given back after the slow clients left",
    )
    assert server.metric("attention_requests_total", code="CANCELLED") - cancelled == held
    assert server.metric("attention_requests_total", code="OK") == ok  # none of them OK
    assert good.attend(x, return_attention_weights=True).attention_weights.shape[0] == SEQUENCES
    good.close()


@pytest.mark.gateway_off_heavy
def test_slow_streams_share_the_same_budget(server: ServerProcess) -> None:
    before = server_rss_bytes(server)  # front ends and worker: where answers wait
    refusals = server.metric("attention_undelivered_refusals_total")
    message = _weights_call()
    slow = [RawGrpc(server.grpc_port, window=1, read=False) for _ in range(4)]
    try:
        streams = [(c, c.call(ATTEND_STREAM, message, end=False)) for c in slow for _ in range(3)]
        for connection, stream_id in streams:
            connection.send_message(stream_id, message)
        wait_for(
            lambda: server.metric("attention_undelivered_refusals_total") > refusals,
            timeout_s=120,
            what="a stream message refused at the bound",
        )
        wait_for(
            lambda: (
                server.metric("attention_queue_depth_requests") == 0
                and server.metric("attention_inflight_requests", api="attention_stream")
                <= server.metric("attention_undelivered_answer_bytes") / (2 * 72 << 20) + 1
            ),
            timeout_s=120,
            what="no stream message computing",
        )
        assert server.metric("attention_undelivered_answer_bytes") <= BUDGET
        growth = server_rss_bytes(server) - before
        assert growth <= BUDGET + MARGIN, f"RSS grew {growth >> 20} MiB"
    finally:
        for connection in slow:
            connection.close()
    wait_for(
        lambda: server.metric("attention_undelivered_answer_bytes") == 0,
        timeout_s=30,
        what="the budget given back after the slow streams left",
    )
