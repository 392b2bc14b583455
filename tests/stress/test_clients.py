"""Clients that vanish, and malformed requests at volume over both APIs (bench/stress)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from bench.stress import fuzz, vanish
from bench.stress.common import ServerSpec
from tests.harness.gateway_modes import OFF_WHEN_HEAVY
from tests.harness.server_process import ServerProcess


@OFF_WHEN_HEAVY  # ~14 s a mode; ServerSpec's server takes the mode from the environment
def test_vanished_calls_are_dropped_before_compute_and_leave_nothing(
    model_repository: Path, tmp_path: Path, figures, grpc_gateway: str
) -> None:
    """Hundreds of calls expire in the queue, are cancelled there, or leave with their stream:
    the dropped counter counts each, none is computed, the queue empties, memory plateaus,
    and a valid request after each round is right."""
    shutil.copytree(model_repository / "mha", tmp_path / "mha")
    config = vanish.VanishConfig(
        server=ServerSpec(repository=tmp_path, measure_caps=False),
        rounds=4,
        per_wave=150,
        streams=4,
        per_stream=20,
        check_batch=256,
        deadline_s=2.0,
        rss_tolerance_mib=96.0,
    )
    result = vanish.run(config)
    figures(result)
    assert result["failed_checks"] == [], result
    assert result["vanished_calls"] == 4 * (2 * 150 + 4 * 20)


@pytest.mark.gateway_off_heavy
@pytest.mark.parametrize("count", [400])
def test_malformed_requests_get_documented_statuses(
    server: ServerProcess, figures, count: int
) -> None:
    """Property-based malformed requests over both APIs (and bytes that do not parse), a valid
    request after each; python -m bench.stress fuzz --fuzz-requests 10000 is the long run."""
    result = fuzz.run(
        server.target,
        served=["causal", "half", "mha", "small"],
        model="small",
        embed_dim=64,
        requests=count,
    )
    figures(result)
    assert result["failed_checks"] == [], result["violation_examples"]
    assert result["requests_sent"] >= count * 0.9
