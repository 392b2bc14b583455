"""Run in a child process by test_service_lifecycle: health while warm-up is held back.

Prints, one per line: health before warm-up, the Attend status then, health after, Attend.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from service.app.server import AttentionServer
from service.generated.attention.v1 import attention_pb2 as pb
from service.generated.attention.v1 import attention_pb2_grpc
from service.settings import Settings
from service.worker.engine.registry import ModelRegistry


async def scenario(repository: Path) -> None:
    gate, warming = asyncio.Event(), asyncio.Event()
    server = AttentionServer(
        Settings(host="127.0.0.1", grpc_port=0, metrics_port=0, model_repository=repository)
    )
    real_warm_up = server._warm_up

    async def held_warm_up(registry: ModelRegistry) -> None:
        warming.set()  # ports are bound and health is NOT_SERVING by now
        await gate.wait()
        await real_warm_up(registry)

    server._warm_up = held_warm_up  # type: ignore[method-assign]
    starting = asyncio.create_task(server.start())
    await warming.wait()
    assert server.ports is not None
    x = np.ones((3, 64), np.float32)
    request = pb.AttendRequest(
        model="small", embeddings=pb.Tensor(shape=[3, 64], dtype=pb.FLOAT32, data=x.tobytes())
    )
    check = health_pb2.HealthCheckRequest(service="attention.v1.AttentionService")
    status = health_pb2.HealthCheckResponse.ServingStatus.Name
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.ports.grpc}") as channel:
        health = health_pb2_grpc.HealthStub(channel)
        stub = attention_pb2_grpc.AttentionServiceStub(channel)
        print(status((await health.Check(check)).status))
        try:
            await stub.Attend(request)
            print("OK")
        except grpc.aio.AioRpcError as err:
            print(err.code().name)
        gate.set()
        await starting
        print(status((await health.Check(check)).status))
        await stub.Attend(request)
        print("OK")
    await server.stop()


if __name__ == "__main__":
    asyncio.run(scenario(Path(sys.argv[1])))
