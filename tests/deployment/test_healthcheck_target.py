"""The image's HEALTHCHECK probes the port the server listens on, also when
ATTENTION_GRPC_PORT changes it at run time (before: 127.0.0.1:8001 was written into the
Dockerfile, so `-e ATTENTION_GRPC_PORT=9001` left a serving container 'unhealthy')."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from service import healthcheck
from service.settings import Settings

DOCKERFILE = Path(__file__).resolve().parents[2] / "Dockerfile"


def test_the_default_target_follows_attention_grpc_port(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ATTENTION_GRPC_PORT", "9001")
    assert healthcheck.build_parser().parse_args([]).target == "127.0.0.1:9001"
    monkeypatch.delenv("ATTENTION_GRPC_PORT")
    assert healthcheck.build_parser().parse_args([]).target == f"127.0.0.1:{Settings().grpc_port}"


def test_the_image_healthcheck_names_no_port() -> None:
    command = re.search(r"^HEALTHCHECK .*?CMD (.*)$", DOCKERFILE.read_text(), re.M | re.S)
    assert command is not None
    assert "--target" not in command.group(1), command.group(1)
