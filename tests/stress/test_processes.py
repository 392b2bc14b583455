"""The process picture under faults: a worker or front end killed under load never leaves a
call hanging; the supervisor restarts it, and exits non-zero when restarts keep failing."""

from __future__ import annotations

import os
import signal
import tempfile
import time
from pathlib import Path

import grpc
import numpy as np
import pytest

from bench.harness import wait_for
from service.app import run_dir
from service.generated.attention.v1 import attention_pb2 as pb
from service.generated.attention.v1 import attention_pb2_grpc
from tests.harness.gateway_modes import OFF_WHEN_HEAVY
from tests.harness.server_process import ServerProcess, child_pids, worker_pid

# A worker, front end or supervisor that dies, hangs or is cancelled mid-call: the gateway
# has code of its own for each, so every test runs with it in front and without it.
pytestmark = pytest.mark.usefixtures("grpc_gateway")

D = 64
# Requests park in the queue (a long batch delay), so they are surely in flight at the kill.
PARKED = ("--max-queue-delay-ms", "60000", "--max-batch-size", "64", "--batch-cap-budget-s", "0")


def _request(seq: int = 4) -> pb.AttendRequest:
    x = np.ones((seq, D), np.float32)
    return pb.AttendRequest(
        model="small", embeddings=pb.Tensor(shape=[seq, D], dtype=pb.FLOAT32, data=x.tobytes())
    )


def _queued(server: ServerProcess, at_least: int) -> None:
    server.wait_metric("attention_queue_depth_requests", at_least)


def test_a_killed_worker_fails_calls_in_flight_at_once_and_comes_back(
    model_repository: Path, figures
) -> None:
    with ServerProcess(model_repository, *PARKED) as server:
        channel = grpc.insecure_channel(server.target)
        stub = attention_pb2_grpc.AttentionServiceStub(channel)
        parked = [stub.Attend.future(_request(), timeout=60) for _ in range(8)]
        _queued(server, 8)
        old = worker_pid(server)
        killed_at = time.monotonic()
        os.kill(old, signal.SIGKILL)
        for call in parked:  # each ends by itself, long before its 60 s deadline
            call.exception(timeout=max(0.0, killed_at + 10 - time.monotonic()))
        ended_s = time.monotonic() - killed_at
        codes = [call.code() for call in parked]
        assert all(call.done() for call in parked), "calls in flight hung after the worker died"
        assert codes == [grpc.StatusCode.UNAVAILABLE] * 8
        assert "worker stopped while this request was in flight" in parked[0].details()
        wait_for(lambda: worker_pid(server) != old, what="a new worker")
        server.wait_serving(timeout_s=120)
        full = np.ones((64, 4, D), np.float32)  # a whole batch: it does not wait to fill
        answer = stub.Attend(
            pb.AttendRequest(
                model="small",
                embeddings=pb.Tensor(shape=list(full.shape), dtype=pb.FLOAT32, data=full.tobytes()),
            ),
            timeout=60,
        )
        assert list(answer.output.shape) == [64, 4, D]
        channel.close()
        assert server.terminate() == 0, server.log
    figures(
        {
            "calls in flight at the kill": 8,
            "ended UNAVAILABLE after (s)": round(ended_s, 3),
            "served again": "yes",
            "exit code": 0,
        }
    )
    assert ended_s < 5


def test_a_killed_front_end_is_restarted_while_the_other_serves(
    model_repository: Path, figures
) -> None:
    flags = ("--frontends", "2", "--batch-cap-budget-s", "0")
    with ServerProcess(model_repository, *flags) as server:
        old = child_pids(server)
        os.kill(old["frontend-0"], signal.SIGKILL)
        # Its gateway dies with it (PDEATHSIG). Until they have exited, connections the kernel
        # queued on their listening socket are reset: how many depends on the machine's load.
        killed = [pid for name, pid in old.items() if name.startswith("frontend-0")]
        for pid in killed:
            wait_for(lambda pid=pid: _gone(pid), timeout_s=30, what=f"killed {pid} exiting")
        served = failed = 0
        # New connections reach the surviving front end (or the restarted one) at once.
        give_up = time.monotonic() + 60
        while child_pids(server)["frontend-0"] == old["frontend-0"] or served < 20:
            assert time.monotonic() < give_up, server.log
            channel = grpc.insecure_channel(server.target)
            try:
                attention_pb2_grpc.AttentionServiceStub(channel).Attend(_request(), timeout=10)
                served += 1
            except grpc.RpcError:
                failed += 1
            finally:
                channel.close()
        assert child_pids(server)["worker"] == old["worker"]  # the worker was left alone
        assert server.terminate() == 0, server.log
    figures({"calls on new connections after the kill": served + failed, "failed": failed})
    assert failed <= 2  # at most a connection caught mid-restart


def test_a_worker_that_keeps_dying_ends_the_server_non_zero(model_repository: Path) -> None:
    server = ServerProcess(model_repository, "--batch-cap-budget-s", "0", "--max-restarts", "1")
    try:
        server.wait_serving()
        first = worker_pid(server)
        os.kill(first, signal.SIGKILL)
        wait_for(lambda: worker_pid(server) != first, what="a restarted worker")
        server.wait_serving(timeout_s=120)
        os.kill(worker_pid(server), signal.SIGKILL)
        assert server.process.wait(60) == 1
        assert "restarts within" in server.log
    finally:
        server.kill()
    for pid in child_pids(server).values():  # no child outlives the supervisor
        wait_for(lambda pid=pid: _gone(pid), timeout_s=30, what=f"child {pid} exiting")


def test_children_exit_with_the_supervisor_even_when_it_is_killed(model_repository: Path) -> None:
    server = ServerProcess(model_repository, "--batch-cap-budget-s", "0", "--frontends", "2")
    try:
        server.wait_serving()
        pids = child_pids(server)
        owned = _run_dirs_of(server.process.pid)
        assert len(owned) == 1, owned
        server.process.kill()
        server.process.wait(10)
        for pid in pids.values():
            wait_for(lambda pid=pid: _gone(pid), timeout_s=30, what=f"child {pid} exiting")
    finally:
        server.kill()
    # Nobody was left to remove its run directory; the next supervisor's sweep does.
    assert owned[0].exists()
    assert owned[0] in run_dir.sweep(owned[0].parent)
    assert not owned[0].exists()


def _run_dirs_of(supervisor_pid: int) -> list[Path]:
    parent = Path(tempfile.gettempdir())
    return [
        marker.parent
        for marker in parent.glob(run_dir.PREFIX + "*/" + run_dir.OWNER_FILE)
        if marker.read_text().split()[0] == str(supervisor_pid)
    ]


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split()[2] == "Z"  # a zombie has exited
    except FileNotFoundError:
        return True


@OFF_WHEN_HEAVY  # ~4 s a mode (the watchdog's 2 s and a restart)
def test_a_hung_worker_is_killed_by_the_watchdog_and_restarted(
    model_repository: Path, grpc_gateway: str
) -> None:
    """SIGSTOP stands in for a worker whose event loop hangs: its calls fail, not wait."""
    flags = (*PARKED, "--watchdog-timeout-s", "2")
    with ServerProcess(model_repository, *flags) as server:
        channel = grpc.insecure_channel(server.target)
        stub = attention_pb2_grpc.AttentionServiceStub(channel)
        parked = [stub.Attend.future(_request(), timeout=60) for _ in range(4)]
        _queued(server, 4)
        old = worker_pid(server)
        stopped_at = time.monotonic()
        os.kill(old, signal.SIGSTOP)
        for call in parked:
            call.exception(timeout=30)
        ended_s = time.monotonic() - stopped_at
        assert [call.code() for call in parked] == [grpc.StatusCode.UNAVAILABLE] * 4
        assert 1.5 < ended_s < 15  # after the watchdog's 2 s, long before the 60 s deadline
        assert "sent no heartbeat" in server.log
        wait_for(lambda: worker_pid(server) != old, what="a new worker")
        server.wait_serving(timeout_s=120)
        assert server.metric("attention_process_restarts_total", process="worker") == 1
        channel.close()


def test_a_cancel_read_with_its_request_drops_it_before_compute(model_repository: Path) -> None:
    """A request and its cancel that reach the worker in one read (it was stopped while both
    were sent): dropped, never computed."""
    with ServerProcess(model_repository, "--batch-cap-budget-s", "0") as server:
        channel = grpc.insecure_channel(server.target)
        stub = attention_pb2_grpc.AttentionServiceStub(channel)
        before = server.metric("attention_batch_size_sequences_sum")
        dropped = server.metric("attention_requests_dropped_total")
        worker = worker_pid(server)
        os.kill(worker, signal.SIGSTOP)
        try:
            calls = [stub.Attend.future(_request()) for _ in range(10)]  # no deadline
            wait_for(
                lambda: server.metric("attention_inflight_requests") >= 10,
                timeout_s=30,
                what="in flight",
            )
            for call in calls:
                call.cancel()
            # The front end has seen every cancel (and sent it on) once its calls have ended.
            wait_for(
                lambda: server.metric("attention_inflight_requests") == 0,
                timeout_s=30,
                what="ended",
            )
        finally:
            os.kill(worker, signal.SIGCONT)
        server.wait_metric("attention_requests_dropped_total", dropped + 10)
        assert server.metric("attention_batch_size_sequences_sum") == before
        channel.close()
