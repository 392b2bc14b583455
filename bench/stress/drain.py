"""Drain under load: SIGTERM while many callers are busy. Health must turn NOT_SERVING first,
every accepted request must complete (none lost), new calls must get UNAVAILABLE, and the
process must exit 0 within the grace period; a second SIGTERM during the drain changes
nothing (docs/batching.md, "Shutdown")."""

from __future__ import annotations

import asyncio
import signal
import time
from collections import Counter
from dataclasses import dataclass, replace

import numpy as np
from grpc_health.v1 import health_pb2_grpc

from bench.calls import UnaryCaller, open_channels
from bench.payloads import Payload, attend_body, v2_body
from bench.stress.common import Figures, ServerSpec, health_status

# The one answer that means "refused before it was accepted" (service/worker/batching/batcher.py);
# any other non-OK answer, UNAVAILABLE included (a connection closed under an accepted call:
# "Socket closed", "Connection reset"; the grace period ended; stopped before computing), is a
# lost request. Before, every UNAVAILABLE but two known details counted as a refusal.
REFUSAL_DETAIL = "server is not accepting requests"
SECOND_SIGNAL_LOG = "another shutdown signal: ignored"


@dataclass(frozen=True, kw_only=True)
class DrainConfig:
    server: ServerSpec
    api: str = "attention"
    model: str = "mha"
    embed_dim: int = 512
    seq: int = 64
    callers: int = 64
    channels: int = 8
    load_s: float = 3.0  # before the signal
    not_serving_s: float = 2.0
    grace_s: float = 30.0
    second_signal_after_s: float | None = 1.0  # after the first; None: only one signal
    call_timeout_s: float = 60.0


@dataclass(frozen=True)
class Call:
    issued: float
    done: float
    code: str
    detail: str


async def _caller(caller: UnaryCaller, body: bytes, calls: list[Call]) -> None:
    """Call until the first answer that is not OK, as a client with other replicas would."""
    while True:
        issued = time.perf_counter()
        outcome = await caller.call(Payload.of(body))
        calls.append(Call(issued, time.perf_counter(), outcome.code, outcome.detail))
        if outcome.code != "OK":
            return


async def _watch_health(
    stub: health_pb2_grpc.HealthStub, seen: list[tuple[float, str]], stop: asyncio.Event
) -> None:
    while not stop.is_set():
        status = await health_status(stub, timeout_s=2)
        seen.append((time.perf_counter(), status))
        if status == "UNAVAILABLE":
            return
        await asyncio.sleep(0.01)


async def _scenario(config: DrainConfig, service: object) -> Figures:
    process = service.process  # type: ignore[attr-defined]
    x = np.random.default_rng(0).standard_normal((1, config.seq, config.embed_dim), np.float32)
    body = (attend_body if config.api == "attention" else v2_body)(x, False, config.model)
    channels = open_channels(service.target, config.channels)  # type: ignore[attr-defined]
    calls: list[Call] = []
    health: list[tuple[float, str]] = []
    stop = asyncio.Event()
    try:
        callers = [UnaryCaller(ch, config.api, config.call_timeout_s) for ch in channels]
        watcher = asyncio.create_task(
            _watch_health(health_pb2_grpc.HealthStub(channels[0]), health, stop)
        )
        workers = [
            asyncio.create_task(_caller(callers[i % len(callers)], body, calls))
            for i in range(config.callers)
        ]
        await asyncio.sleep(config.load_s)
        signalled = time.perf_counter()
        process.send_signal(signal.SIGTERM)
        second_at = None
        if config.second_signal_after_s is not None:
            await asyncio.sleep(config.second_signal_after_s)
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                second_at = time.perf_counter() - signalled
        code = await asyncio.to_thread(process.wait, config.grace_s + 30)
        exited = time.perf_counter() - signalled
        await asyncio.wait_for(asyncio.gather(*workers), config.call_timeout_s)
        stop.set()
        await watcher
    finally:
        for channel in channels:
            await channel.close()
    return _figures(config, calls, health, signalled, exited, code, second_at)


def _first(times: list[float], since: float) -> float | None:
    return min(times) - since if times else None


def _figures(
    config: DrainConfig,
    calls: list[Call],
    health: list[tuple[float, str]],
    signalled: float,
    exited: float,
    exit_code: int,
    second_at: float | None,
) -> Figures:
    refused = [
        call for call in calls if call.code == "UNAVAILABLE" and REFUSAL_DETAIL in call.detail
    ]
    lost = [call for call in calls if call.code != "OK" and call not in refused]
    ok = [call for call in calls if call.code == "OK"]
    return {
        "callers": config.callers,
        "calls": len(calls),
        "ok": len(ok),
        "ok_completed_after_sigterm": sum(1 for call in ok if call.done > signalled),
        "refused_unavailable": len(refused),
        "lost": len(lost),
        "lost_codes": dict(Counter(call.code for call in lost)),
        "not_serving_after_s": _first([t for t, s in health if s == "NOT_SERVING"], signalled),
        "first_refusal_after_s": _first([call.done for call in refused], signalled),
        "last_ok_after_s": max((call.done for call in ok), default=signalled) - signalled,
        "second_sigterm_after_s": second_at,
        "exit_code": exit_code,
        "exit_after_s": exited,
        "grace_period_s": config.grace_s,
        "not_serving_period_s": config.not_serving_s,
    }


def failed_checks(figures: Figures, second_logged: bool) -> list[str]:
    not_serving = figures["not_serving_after_s"]
    refusal = figures["first_refusal_after_s"]
    checks = {
        "zero accepted requests lost": figures["lost"] == 0,
        "every caller ended at an UNAVAILABLE refusal": figures["refused_unavailable"]
        == figures["callers"],
        "health NOT_SERVING before the first refusal": not_serving is not None
        and refusal is not None
        and not_serving < refusal,
        "requests completed after SIGTERM (served while NOT_SERVING)": figures[
            "ok_completed_after_sigterm"
        ]
        > 0,
        "exit code 0": figures["exit_code"] == 0,
        "exit within the grace period": figures["exit_after_s"] <= figures["grace_period_s"],
        "a second SIGTERM is logged and ignored": figures["second_sigterm_after_s"] is None
        or second_logged,
    }
    return [name for name, passed in checks.items() if not passed]


def run(config: DrainConfig) -> Figures:
    flags = (
        "--shutdown-not-serving-s",
        str(config.not_serving_s),
        "--grace-period-s",
        str(config.grace_s),
    )
    spec = replace(config.server, flags=(*config.server.flags, *flags))
    service = spec.start("drain")
    try:
        figures = asyncio.run(_scenario(config, service))
    finally:
        service.stop()
    second_logged = any(SECOND_SIGNAL_LOG in line for line in service.lines)
    figures["second_sigterm_logged"] = second_logged
    figures["failed_checks"] = failed_checks(figures, second_logged)
    return figures
