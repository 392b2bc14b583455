"""--max-padding-ratio over real gRPC: on a CPU, auto keeps a batch's padding at 0.05 at most,
so requests of clearly different lengths run apart while equal ones still share a batch; a
number given is the bound, on any device."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np
import pytest

from service.generated.attention.v1 import attention_pb2 as pb
from service.generated.attention.v1 import attention_pb2_grpc
from service.worker.engine.onnx_model import CPU
from tests.harness.providers import serving_provider
from tests.harness.server_process import ServerProcess

D = 64  # the "small" model
# Both requests of a pair wait for each other: a batch closes at two, or after the delay.
PAIRED = ("--max-queue-delay-ms", "3000", "--max-batch-size", "2", "--batch-cap-budget-s", "0")


def _request(seq: int) -> pb.AttendRequest:
    x = np.random.default_rng(seq).standard_normal((seq, D), dtype=np.float32)
    return pb.AttendRequest(
        model="small", embeddings=pb.Tensor(shape=[seq, D], dtype=pb.FLOAT32, data=x.tobytes())
    )


def _batch_sizes(server: ServerProcess, lengths: tuple[int, int]) -> list[int]:
    """Send the two requests at once; the batch size each answer reports."""
    with grpc.insecure_channel(server.target) as channel:
        stub = attention_pb2_grpc.AttentionServiceStub(channel)
        with ThreadPoolExecutor(2) as pool:
            answers = list(pool.map(lambda seq: stub.Attend(_request(seq), timeout=30), lengths))
    return [answer.timing.batch_size for answer in answers]


@pytest.mark.skipif(serving_provider() != CPU, reason="auto is 0.05 where models run on a CPU")
def test_auto_on_a_cpu_runs_lengths_apart_once_padding_passes_five_percent(
    model_repository: Path,
) -> None:
    with ServerProcess(model_repository, *PAIRED) as server:
        assert _batch_sizes(server, (20, 20)) == [2, 2]  # equal lengths: no padding
        assert _batch_sizes(server, (20, 19)) == [2, 2]  # 1 of 40 positions padded: 0.025
        assert _batch_sizes(server, (20, 18)) == [2, 2]  # 2 of 40: 0.05, the bound itself
        assert _batch_sizes(server, (20, 16)) == [1, 1]  # 4 of 40: 0.1, beyond 0.05
        padded = server.metric("attention_batch_padding_ratio_sum", model="small")
        assert padded == pytest.approx(0.025 + 0.05)  # the two padded batches' ratios
    assert "pads at most 0.05 of its positions (--max-padding-ratio auto)" in server.log


def test_a_ratio_given_is_the_bound(model_repository: Path) -> None:
    with ServerProcess(model_repository, *PAIRED, "--max-padding-ratio", "0.2") as server:
        assert _batch_sizes(server, (20, 16)) == [2, 2]  # 4 of 40 positions padded: 0.1
        assert _batch_sizes(server, (20, 8)) == [1, 1]  # 12 of 40: 0.3, beyond 0.2
    assert "pads at most 0.2 of its positions (--max-padding-ratio 0.2)" in server.log
