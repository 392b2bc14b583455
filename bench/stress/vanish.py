"""Clients that vanish: waves of calls whose deadline passes in the queue, calls cancelled
while queued, and streams cancelled with requests queued. Every one must be dropped before
compute (counted in attention_requests_dropped_total), the queue must empty (depth and
bytes back to 0), memory must not grow, and a valid request after each round must still get
the right answer.

The server parks requests (a long queue delay, a large batch bound), so nothing is computed
unless a test asks: a dropped request is then exactly one that never reached a batch. The
valid check fills a batch on its own (max_batch_size sequences, with weights: its own queue)."""

from __future__ import annotations

import asyncio
import statistics
import time
from collections import Counter
from dataclasses import dataclass, replace
from typing import Any

import grpc
import numpy as np

from bench.calls import CHANNEL_OPTIONS
from bench.harness import wait_for
from bench.launcher import Service
from bench.payloads import METHODS, attend_body, v2_body, with_id
from bench.stress.common import Figures, ServerSpec, metric, rss_mib
from service.generated.attention.v1 import attention_pb2 as pb


@dataclass(frozen=True, kw_only=True)
class VanishConfig:
    server: ServerSpec
    model: str = "mha"
    embed_dim: int = 512
    seq: int = 64
    rounds: int = 6
    per_wave: int = 400  # unary calls per wave (half AttentionService, half V2)
    streams: int = 8
    per_stream: int = 25
    deadline_s: float = 1.0
    check_batch: int = 1024  # the server's --max-batch-size: the valid check's own batch
    rss_tolerance_mib: float = 64.0

    def parked_flags(self) -> tuple[str, ...]:
        # No measured batch caps: a cap (8 sequences at seq 64, say) would close batches.
        return (
            "--max-queue-delay-ms",
            "600000",
            "--max-batch-size",
            str(self.check_batch),
            "--max-queue-size",
            "100000",
            "--batch-cap-budget-s",
            "0",
        )


def _bodies(config: VanishConfig) -> dict[str, bytes]:
    x = np.random.default_rng(1).standard_normal((1, config.seq, config.embed_dim), np.float32)
    return {"attention": attend_body(x, False, config.model), "v2": v2_body(x, False, config.model)}


def _check_request(config: VanishConfig) -> pb.AttendRequest:
    x = np.random.default_rng(2).standard_normal(
        (config.check_batch, 2, config.embed_dim), np.float32
    )
    return pb.AttendRequest(
        model=config.model,
        embeddings=pb.Tensor(shape=list(x.shape), dtype=pb.FLOAT32, data=x.tobytes()),
        return_attention_weights=True,
    )


class Round:
    def __init__(self, channel: grpc.aio.Channel, config: VanishConfig, url: str) -> None:
        self.channel, self.config, self.url = channel, config, url
        self.bodies = _bodies(config)
        self.codes: Counter[str] = Counter()

    def _depth(self) -> float:
        return metric(self.url, "attention_queue_depth_requests")

    async def _queued(self, count: int) -> None:
        """Until count requests wait in the queue (they must be queued to be dropped)."""
        await asyncio.to_thread(wait_for, lambda: self._depth() >= count, what="requests queued")

    async def _empty(self) -> None:
        """Until the last wave's drops are done: a cancel reaches the server after the client
        has moved on, and its requests would otherwise count as this wave's."""
        await asyncio.to_thread(wait_for, lambda: self._depth() == 0, what="the queue empty")

    def _unary(self, index: int, timeout_s: float) -> Any:
        api = "attention" if index % 2 == 0 else "v2"
        return self.channel.unary_unary(METHODS[api])(self.bodies[api], timeout=timeout_s)

    async def expire(self) -> int:
        calls = [self._unary(i, self.config.deadline_s) for i in range(self.config.per_wave)]
        for call in calls:
            self.codes[f"deadline wave {await _code(call)}"] += 1
        return len(calls)

    async def cancel(self) -> int:
        await self._empty()
        calls = [self._unary(i, 600) for i in range(self.config.per_wave)]
        await self._queued(len(calls))
        for call in calls:
            call.cancel()
        for call in calls:
            self.codes[f"cancel wave {await _code(call)}"] += 1
        return len(calls)

    async def abandon_streams(self) -> int:
        await self._empty()
        body = self.bodies["attention"]
        calls = [
            self.channel.stream_stream(METHODS["attention_stream"])(timeout=600)
            for _ in range(self.config.streams)
        ]
        for call in calls:
            for i in range(self.config.per_stream):
                await call.write(with_id(body, "attention", str(i).encode()))
        total = self.config.streams * self.config.per_stream
        await self._queued(total)
        for call in calls:
            call.cancel()
        return total


async def _code(call: Any) -> str:
    try:
        await call
    except grpc.aio.AioRpcError as err:
        return err.code().name
    except asyncio.CancelledError:
        return "CANCELLED"
    return "OK"


def _dropped(url: str) -> dict[str, float]:
    """The dropped counter by reason, and the request counter by the matching code."""
    return {
        **{
            reason: metric(url, "attention_requests_dropped_total", reason=reason)
            for reason in ("deadline", "cancelled")
        },
        **{
            f"requests_total {code}": metric(url, "attention_requests_total", code=code)
            for code in ("DEADLINE_EXCEEDED", "CANCELLED")
        },
    }


async def _scenario(config: VanishConfig, service: Service) -> Figures:
    url = service.metrics_url
    options = [*CHANNEL_OPTIONS]
    async with grpc.aio.insecure_channel(service.target, options=options) as channel:
        check = channel.unary_unary(
            METHODS["attention"],
            request_serializer=pb.AttendRequest.SerializeToString,
            response_deserializer=pb.AttendResponse.FromString,
        )
        request = _check_request(config)
        expected = (await check(request, timeout=120)).output.data
        before = _dropped(url)
        computed_before = metric(url, "attention_batches_total", graph="output")
        rounds = Round(channel, config, url)
        vanished, rss, checks_right, drained = 0, [], 0, []
        for _ in range(config.rounds):
            vanished += await rounds.expire()
            vanished += await rounds.cancel()
            vanished += await rounds.abandon_streams()
            drained.append(
                await asyncio.to_thread(
                    wait_for,
                    lambda: (
                        metric(url, "attention_queue_depth_requests") == 0
                        and metric(url, "attention_queue_bytes") == 0
                    ),
                    what="the queue emptying",
                )
            )
            answer = await check(request, timeout=120)
            checks_right += answer.output.data == expected
            await asyncio.sleep(0.5)  # the trim after a drained backlog runs on its own thread
            rss.append(rss_mib(service.pid))
        after = _dropped(url)
    dropped = {reason: after[reason] - before[reason] for reason in after}
    return {
        "vanished_calls": vanished,
        "per_round": {
            "deadline_unary": config.per_wave,
            "cancelled_unary": config.per_wave,
            "in_cancelled_streams": config.streams * config.per_stream,
        },
        "dropped_metric": dropped,
        "dropped_total": dropped["deadline"] + dropped["cancelled"],
        # Expired on the way (before gRPC handed them to the server): never queued or counted.
        "never_reached_the_server": vanished - dropped["deadline"] - dropped["cancelled"],
        "computed_without_weights": metric(url, "attention_batches_total", graph="output")
        - computed_before,
        "client_codes": dict(rounds.codes),
        "queue_empty_after_round_s_max": max(drained),
        "queue_depth_end": metric(url, "attention_queue_depth_requests"),
        "queue_bytes_end": metric(url, "attention_queue_bytes"),
        "valid_checks_right": f"{checks_right}/{config.rounds}",
        "rss_after_first_round_mib": rss[0],
        "rss_after_last_round_mib": rss[-1],
        "rss_max_mib": max(rss),
        "rss_by_round_mib": [round(mib, 1) for mib in rss],
        "rss_plateau_growth_mib": _plateau_growth(rss),
    }


def _plateau_growth(rss: list[float]) -> float:
    """Median RSS of the later half of the rounds less that of the earlier half (MiB): a
    trend, not the single samples, which swing by ~100 MiB with malloc's free lists."""
    half = max(1, len(rss) // 2)
    return statistics.median(rss[half:] or rss[-1:]) - statistics.median(rss[:half])


def failed_checks(figures: Figures, config: VanishConfig) -> list[str]:
    checks = {
        "at least 95% of the vanished calls reached the queue and were dropped there": figures[
            "dropped_total"
        ]
        >= 0.95 * figures["vanished_calls"],
        "none of them computed": figures["computed_without_weights"] == 0,
        "the dropped counter and the request counter tell one story": (
            figures["dropped_metric"]["deadline"]
            == figures["dropped_metric"]["requests_total DEADLINE_EXCEEDED"]
            and figures["dropped_metric"]["cancelled"]
            == figures["dropped_metric"]["requests_total CANCELLED"]
        ),
        "queue depth and bytes back to 0": figures["queue_depth_end"] == 0
        and figures["queue_bytes_end"] == 0,
        "a valid request after each round is right": figures["valid_checks_right"]
        == f"{config.rounds}/{config.rounds}",
        f"RSS plateau: later rounds' median within {config.rss_tolerance_mib:g} MiB of earlier": (
            _plateau_growth(figures["rss_by_round_mib"]) <= config.rss_tolerance_mib
        ),
    }
    return [name for name, passed in checks.items() if not passed]


def run(config: VanishConfig) -> Figures:
    spec = replace(config.server, flags=(*config.server.flags, *config.parked_flags()))
    service = spec.start("vanish")
    try:
        started = time.monotonic()
        figures = asyncio.run(_scenario(config, service))
        figures["duration_s"] = time.monotonic() - started
        figures["server_alive"] = service.process.poll() is None
    finally:
        service.stop()
    figures["failed_checks"] = failed_checks(figures, config)
    return figures
