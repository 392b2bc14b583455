"""The two ways the gRPC port is served, which every gRPC test runs under (conftest's
grpc_gateway fixture): by the native gateway in front of the Python front end (on), and by the
Python front end itself (off, as where no gateway is built)."""

from __future__ import annotations

import pytest

GATEWAY_MODES = ("on", "off")


def mode_id(mode: str) -> str:
    return f"gateway-{mode}"


# For a slow test: the gateway in front in the default run, the Python front end alone only in
# the heavy run (pytest -m heavy), through the same fixture.
OFF_WHEN_HEAVY = pytest.mark.parametrize(
    "grpc_gateway",
    [
        pytest.param("on", id=mode_id("on")),
        pytest.param("off", id=mode_id("off"), marks=pytest.mark.heavy),
    ],
    indirect=True,
)
