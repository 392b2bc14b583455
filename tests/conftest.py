"""Shared fixtures: a model repository exported once per test session."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from export.pipeline import ExportRequest, ExportResult, run_export
from service.client import AttentionClient
from tests.harness.gateway_modes import GATEWAY_MODES, mode_id
from tests.harness.server_process import ServerProcess


@pytest.hookimpl(tryfirst=True)  # before -m deselects by mark
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A slow test marked gateway_off_heavy runs with the gateway in the default run and
    without it only in the heavy run, whichever fixture gives its gateway mode."""
    for item in items:
        if not item.get_closest_marker("gateway_off_heavy"):
            continue
        params = getattr(item, "callspec", None)
        modes = (
            {params.params.get(name) for name in ("grpc_gateway", "server")} if params else set()
        )
        if not modes & set(GATEWAY_MODES):
            raise pytest.UsageError(f"{item.nodeid}: gateway_off_heavy on a test without a mode")
        if "off" in modes:
            item.add_marker(pytest.mark.heavy)


# The gRPC port served by the native gateway, then by the Python front end itself: both must
# answer every call alike. A module opts in with
#     pytestmark = pytest.mark.usefixtures("grpc_gateway")
# and every server it starts (fixtures and tests alike) runs once in each mode
# (tests.harness.gateway_modes.OFF_WHEN_HEAVY: the second only in the heavy run).
@pytest.fixture(scope="module", params=GATEWAY_MODES, ids=mode_id)
def grpc_gateway(request: pytest.FixtureRequest) -> Iterator[str]:
    """The --grpc-gateway mode of every server this module starts (through the environment,
    which ServerProcess passes on)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("ATTENTION_GRPC_GATEWAY", request.param)
        yield request.param


@pytest.fixture(scope="session")
def model_repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """models/ with the default model (mha, d=512, h=8), a small one (two versions), a causal
    one and a float16 one."""
    root = tmp_path_factory.mktemp("models")
    run_export(ExportRequest(name="mha", embed_dim=512, num_heads=8, out=root))
    run_export(ExportRequest(name="small", embed_dim=64, num_heads=4, out=root))
    run_export(ExportRequest(name="small", embed_dim=64, num_heads=4, seed=7, out=root))
    run_export(ExportRequest(name="causal", embed_dim=32, num_heads=2, causal=True, out=root))
    run_export(ExportRequest(name="half", embed_dim=64, num_heads=4, dtype="float16", out=root))
    return root


@pytest.fixture(scope="session")
def small_export(tmp_path_factory: pytest.TempPathFactory) -> ExportResult:
    """A d=64, h=4 export for graph-level tests."""
    root = tmp_path_factory.mktemp("small-export")
    return run_export(ExportRequest(name="small", embed_dim=64, num_heads=4, out=root))


@pytest.fixture(scope="session", params=GATEWAY_MODES, ids=mode_id)
def server(model_repository: Path, request: pytest.FixtureRequest) -> Iterator[ServerProcess]:
    """One server with default settings (bar a short queue delay) for the read-only tests,
    its gRPC port served by the gateway, then by Python."""
    # Measured batch caps, as by default (ServerProcess turns them off for other tests).
    flags = ("--max-queue-delay-ms", "5", "--batch-cap-budget-s", "3")
    mode = {"ATTENTION_GRPC_GATEWAY": request.param}
    with ServerProcess(model_repository, *flags, env=mode) as process:
        yield process
    assert process.process.returncode == 0, process.log


@pytest.fixture
def client(server: ServerProcess) -> Iterator[AttentionClient]:
    with AttentionClient(server.target) as attention_client:
        yield attention_client


@pytest.fixture(scope="session")
def mha_repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """models/ with only the default model (mha, d=512, h=8): the receive and answer sizes of
    a real deployment, for the memory-bound tests."""
    root = tmp_path_factory.mktemp("mha-only")
    run_export(ExportRequest(name="mha", embed_dim=512, num_heads=8, out=root))
    return root
