"""Typed clients for AttentionService, and a CLI: python -m service.client --help."""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from service.generated.attention.v1 import attention_pb2 as pb
from service.generated.attention.v1 import attention_pb2_grpc
from service.transport.codec import decode_tensor, encode_tensor
from service.transport.tls import TlsError, add_tls_arguments, channel_credentials, tls_requested

# Responses with attention weights are large (h * seq^2 floats per sequence).
CHANNEL_OPTIONS = [("grpc.max_receive_message_length", -1), ("grpc.max_send_message_length", -1)]


@dataclass(frozen=True)
class AttendResult:
    output: np.ndarray
    attention_weights: np.ndarray | None
    model: str
    model_version: str
    request_id: str
    queue_us: int
    compute_us: int
    batch_size: int


def attend_request(
    embeddings: np.ndarray,
    *,
    model: str = "",
    model_version: str = "",
    return_attention_weights: bool = False,
    request_id: str = "",
) -> pb.AttendRequest:
    return pb.AttendRequest(
        model=model,
        model_version=model_version,
        embeddings=encode_tensor(embeddings),
        return_attention_weights=return_attention_weights,
        request_id=request_id,
    )


def attend_result(response: pb.AttendResponse) -> AttendResult:
    weights = (
        decode_tensor(response.attention_weights, "attention_weights")
        if response.HasField("attention_weights")
        else None
    )
    return AttendResult(
        output=decode_tensor(response.output, "output"),
        attention_weights=weights,
        model=response.model,
        model_version=response.model_version,
        request_id=response.request_id,
        queue_us=response.timing.queue_us,
        compute_us=response.timing.compute_us,
        batch_size=response.timing.batch_size,
    )


@dataclass(frozen=True)
class AttendError:
    """One streamed request that failed: the status the unary call would have raised."""

    request_id: str
    code: grpc.StatusCode
    message: str


# What attend_stream takes per request: embeddings, or (embeddings, fields) where fields are
# attend_request's keywords (model, model_version, return_attention_weights, request_id).
StreamItem = np.ndarray | tuple[np.ndarray, Mapping[str, Any]]
STATUS_BY_NUMBER = {code.value[0]: code for code in grpc.StatusCode}


def stream_request(index: int, item: StreamItem, defaults: Mapping[str, Any]) -> pb.AttendRequest:
    """A request without a request_id gets its position in the stream, so answers match."""
    embeddings, fields = (item, {}) if isinstance(item, np.ndarray) else item
    merged = {**defaults, **fields}
    merged["request_id"] = merged.get("request_id") or str(index)
    return attend_request(embeddings, **merged)


class StreamRequests:
    """A stream's requests, built as gRPC asks for them. An item that cannot be sent (an
    InvalidInput, a float64 array) or an error of the caller's own iterable ends the
    requests there: the ones sent before it are still answered, and then failure is raised
    (gRPC would end the call, answers and all, as UNKNOWN or a cancellation)."""

    def __init__(self, defaults: Mapping[str, Any]) -> None:
        self._defaults = defaults
        self.failure: Exception | None = None

    def of(self, items: Iterable[StreamItem]) -> Iterator[pb.AttendRequest]:
        try:
            for index, item in enumerate(items):
                yield stream_request(index, item, self._defaults)
        except Exception as err:
            self.failure = err

    async def of_async(
        self, items: Iterable[StreamItem] | AsyncIterable[StreamItem]
    ) -> AsyncIterator[pb.AttendRequest]:
        if not isinstance(items, AsyncIterable):
            for request in self.of(items):
                yield request
            return
        index = 0
        try:
            async for item in items:
                yield stream_request(index, item, self._defaults)
                index += 1
        except Exception as err:
            self.failure = err

    def raise_failure(self) -> None:
        if self.failure is not None:
            raise self.failure


def stream_result(response: pb.AttendStreamResponse) -> AttendResult | AttendError:
    if response.HasField("error"):
        code = STATUS_BY_NUMBER.get(response.error.code, grpc.StatusCode.UNKNOWN)
        return AttendError(response.request_id, code, response.error.message)
    return attend_result(response.response)


def channel_options(
    load_balancing: str | None, tls_server_name: str | None = None
) -> list[tuple[str, Any]]:
    """round_robin with a dns:/// target spreads calls over every pod of a headless Service;
    tls_server_name: the name to check the server's certificate against, when the target's
    host is not in it (an IP address, 127.0.0.1 inside a pod)."""
    extra = [("grpc.lb_policy_name", load_balancing)] if load_balancing else []
    if tls_server_name:
        extra.append(("grpc.ssl_target_name_override", tls_server_name))
    return [*CHANNEL_OPTIONS, *extra]


def tls_options(
    ca: str | Path | None = None,
    cert: str | Path | None = None,
    key: str | Path | None = None,
    server_name: str | None = None,
) -> dict[str, Any]:
    """Keywords for the clients' constructors: credentials (TLS; with cert and key, mutual
    TLS) and tls_server_name. ca None = the system's trusted roots. Paths, or strings."""
    ca_path, cert_path, key_path = (None if p is None else Path(p) for p in (ca, cert, key))
    return {
        "credentials": channel_credentials(ca_path, cert_path, key_path),
        "tls_server_name": server_name,
    }


class AttentionClient:
    """Blocking client. Use as a context manager, or call close(). credentials (see
    tls_options) make it a TLS channel; without them it is plaintext."""

    def __init__(
        self,
        target: str,
        *,
        load_balancing: str | None = None,
        credentials: grpc.ChannelCredentials | None = None,
        tls_server_name: str | None = None,
    ) -> None:
        options = channel_options(load_balancing, tls_server_name)
        self._channel = (
            grpc.secure_channel(target, credentials, options=options)
            if credentials is not None
            else grpc.insecure_channel(target, options=options)
        )
        self._stub = attention_pb2_grpc.AttentionServiceStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    def __enter__(self) -> AttentionClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    def attend(
        self, embeddings: np.ndarray, *, timeout_s: float | None = None, **fields: Any
    ) -> AttendResult:
        """embeddings [seq, d] or [n, seq, d]; fields: model, model_version,
        return_attention_weights, request_id."""
        response = self._stub.Attend(attend_request(embeddings, **fields), timeout=timeout_s)
        return attend_result(response)

    def attend_stream(
        self, requests: Iterable[StreamItem], *, timeout_s: float | None = None, **defaults: Any
    ) -> Iterator[AttendResult | AttendError]:
        """Send requests on one AttendStream call; yield each answer as it completes (match
        them by request_id). defaults: fields for every request; timeout_s: the whole stream."""
        outgoing = StreamRequests(defaults)
        call = self._stub.AttendStream(outgoing.of(requests), timeout=timeout_s)
        try:
            for response in call:
                yield stream_result(response)
        finally:
            call.cancel()  # the caller stopped early: the server drops what is still queued
        outgoing.raise_failure()

    def get_model(self, model: str = "") -> pb.ModelInfo:
        return self._stub.GetModel(pb.GetModelRequest(model=model))

    def list_models(self) -> list[pb.ModelInfo]:
        return list(self._stub.ListModels(pb.ListModelsRequest()).models)

    def is_serving(self, service: str = "") -> bool:
        try:
            reply = self._health.Check(health_pb2.HealthCheckRequest(service=service), timeout=2)
        except grpc.RpcError:
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    def wait_until_serving(self, timeout_s: float = 60.0) -> None:
        """Poll the health service until SERVING; TimeoutError after timeout_s."""
        give_up = time.monotonic() + timeout_s
        while not self.is_serving():
            if time.monotonic() > give_up:
                raise TimeoutError(f"server not SERVING after {timeout_s}s")
            time.sleep(0.05)


class AsyncAttentionClient:
    """asyncio client for many concurrent calls on one channel."""

    def __init__(
        self,
        target: str,
        *,
        load_balancing: str | None = None,
        credentials: grpc.ChannelCredentials | None = None,
        tls_server_name: str | None = None,
    ) -> None:
        options = channel_options(load_balancing, tls_server_name)
        self._channel = (
            grpc.aio.secure_channel(target, credentials, options=options)
            if credentials is not None
            else grpc.aio.insecure_channel(target, options=options)
        )
        self._stub = attention_pb2_grpc.AttentionServiceStub(self._channel)

    async def __aenter__(self) -> AsyncAttentionClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._channel.close()

    async def attend(
        self, embeddings: np.ndarray, *, timeout_s: float | None = None, **fields: Any
    ) -> AttendResult:
        response = await self._stub.Attend(attend_request(embeddings, **fields), timeout=timeout_s)
        return attend_result(response)

    async def attend_stream(
        self,
        requests: Iterable[StreamItem] | AsyncIterable[StreamItem],
        *,
        timeout_s: float | None = None,
        **defaults: Any,
    ) -> AsyncIterator[AttendResult | AttendError]:
        """AttentionClient.attend_stream for asyncio; requests may also be an async iterable."""
        outgoing = StreamRequests(defaults)
        call = self._stub.AttendStream(outgoing.of_async(requests), timeout=timeout_s)
        try:
            async for response in call:
                yield stream_result(response)
        finally:
            call.cancel()
        outgoing.raise_failure()


# -- CLI ------------------------------------------------------------------------------------


def _count(minimum: int) -> Callable[[str], int]:
    """An argparse type: an integer of at least minimum, so 0 requests or a negative length
    is refused with a usage error instead of crashing or hanging later."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    return parse


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m service.client",
        description="Send embeddings to an AttentionService and print what came back.",
    )
    parser.add_argument("--target", default="127.0.0.1:8001", help="host:port of the server")
    parser.add_argument("--model", default="", help="model name (default: the server's)")
    parser.add_argument("--model-version", default="", help="version (default: newest)")
    parser.add_argument("--npy", type=Path, help="embeddings [seq, d] or [n, seq, d] from a .npy")
    parser.add_argument("--seq", type=_count(1), default=16, help="random input: sequence length")
    parser.add_argument(
        "--n", type=_count(1), default=1, help="random input: sequences per request"
    )
    parser.add_argument("--weights", action="store_true", help="ask for attention weights")
    parser.add_argument("--requests", type=_count(1), default=1, help="requests to send")
    parser.add_argument("--concurrency", type=_count(1), default=1, help="requests in flight")
    parser.add_argument("--timeout-s", type=float, default=30.0, help="per-request deadline")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--plot", type=Path, help="with --weights: heatmap PNG of the first answer, one per head"
    )
    parser.add_argument(
        "--tokens", help="labels for --plot: the sequence's tokens, space-separated"
    )
    parser.add_argument("--save", type=Path, help="save the first answer (output, weights) as .npz")
    add_tls_arguments(parser)
    args = parser.parse_args(argv)
    if args.plot is not None and not args.weights:
        parser.error("--plot draws the attention weights: add --weights")
    try:
        args.tls = client_tls(args)
    except TlsError as err:
        parser.error(str(err))
    return args


def client_tls(args: argparse.Namespace) -> dict[str, Any]:
    """The clients' TLS keywords from add_tls_arguments' flags; {} = plaintext."""
    if not tls_requested(args):
        return {}
    return tls_options(args.tls_ca, args.tls_cert, args.tls_key, args.tls_server_name)


def _input(args: argparse.Namespace, embed_dim: int) -> np.ndarray:
    if args.npy is not None:
        return np.load(args.npy).astype(np.float32)
    rng = np.random.default_rng(args.seed)
    shape = (args.seq, embed_dim) if args.n == 1 else (args.n, args.seq, embed_dim)
    return rng.standard_normal(shape, dtype=np.float32)


async def _load(
    args: argparse.Namespace, embeddings: np.ndarray
) -> list[tuple[float, AttendResult]]:
    gate = asyncio.Semaphore(args.concurrency)
    async with AsyncAttentionClient(args.target, **args.tls) as client:

        async def one(index: int) -> tuple[float, AttendResult]:
            async with gate:
                started = time.perf_counter()
                result = await client.attend(
                    embeddings,
                    model=args.model,
                    model_version=args.model_version,
                    return_attention_weights=args.weights,
                    request_id=f"cli-{uuid.uuid4().hex[:8]}-{index}",
                    timeout_s=args.timeout_s,
                )
                return time.perf_counter() - started, result

        return await asyncio.gather(*(one(i) for i in range(args.requests)))


def _summary(results: list[tuple[float, AttendResult]], wall_s: float) -> str:
    latencies_ms = sorted(seconds * 1000 for seconds, _ in results)
    first = results[0][1]
    weights = first.attention_weights
    batches = Counter(result.batch_size for _, result in results)
    lines = [
        f"model {first.model} version {first.model_version}: output {list(first.output.shape)} "
        f"{first.output.dtype}, attention_weights "
        f"{list(weights.shape) if weights is not None else 'not asked'}",
        f"{len(results)} requests in {wall_s:.3f}s = {len(results) / wall_s:.1f} req/s; latency ms "
        f"p50 {statistics.median(latencies_ms):.2f} p99 "
        f"{latencies_ms[min(len(latencies_ms) - 1, int(0.99 * len(latencies_ms)))]:.2f}",
        f"server: queue us mean {statistics.mean(r.queue_us for _, r in results):.0f}, compute us "
        f"mean {statistics.mean(r.compute_us for _, r in results):.0f}; requests by batch size "
        f"{dict(sorted(batches.items()))}",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    with AttentionClient(args.target, **args.tls) as client:
        try:
            info = client.get_model(args.model)
        except grpc.RpcError as err:
            print(f"error: {err.code().name}: {err.details()}", file=sys.stderr)
            return 1
    embeddings = _input(args, info.versions[0].embed_dim)
    started = time.perf_counter()
    try:
        results = asyncio.run(_load(args, embeddings))
    except grpc.RpcError as err:
        print(f"error: {err.code().name}: {err.details()}", file=sys.stderr)
        return 1
    print(_summary(results, time.perf_counter() - started))
    _keep(args, results[0][1])
    return 0


def _keep(args: argparse.Namespace, result: AttendResult) -> None:
    """--save and --plot, from the first answer (its first sequence for the plot)."""
    weights = result.attention_weights
    if args.save is not None:
        arrays: dict[str, Any] = {"output": result.output}
        if weights is not None:
            arrays["attention_weights"] = weights
        np.savez(args.save, **arrays)
        print(f"saved {', '.join(arrays)} to {args.save}")
    if args.plot is not None and weights is not None:
        from service.plot import plot_attention  # matplotlib: only when plotting

        tokens = args.tokens.split() if args.tokens else None
        first = weights if weights.ndim == 3 else weights[0]
        plot_attention(
            first, args.plot, tokens=tokens, title=f"{result.model} version {result.model_version}"
        )
        print(f"wrote {args.plot} ({first.shape[0]} heads)")


if __name__ == "__main__":
    sys.exit(main())
