"""The first contact between a front end (or gateway) and the worker: a hello with the
slab's descriptor. A hello that goes wrong is refused cleanly, closes what did arrive, and
the front end backs off instead of spinning on a worker that refuses it."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from service.frontend.worker_client import WorkerClient
from service.ipc import channel
from service.ipc.records import Hello
from service.ipc.slab import Slab


def _open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_a_hello_and_its_slab_descriptor_arrive_together() -> None:
    sender, receiver = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    slab = Slab.create(1 << 16, "attention-test")
    slab_dtype = np.dtype("<u4")
    slab.array(0, (4,), slab_dtype)[:] = [1, 2, 3, 4]
    with sender, receiver:
        channel.send_hello(sender, Hello(name="frontend-9", pid=os.getpid()), [slab.fd])
        hello, fds = channel.receive_hello(receiver)
    attached = Slab.attach(fds[0])
    assert hello == Hello(name="frontend-9", pid=os.getpid())
    assert list(attached.array(0, (4,), slab_dtype)) == [1, 2, 3, 4]
    attached.close()
    slab.close()


def test_a_malformed_hello_is_refused_and_its_descriptor_closed() -> None:
    sender, receiver = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    slab = Slab.create(1 << 16, "attention-test")
    before = _open_descriptors()
    with sender, receiver:
        socket.send_fds(sender, [b"\x05\x00\x00\x00{}"], [slab.fd])  # header says 5, body 2
        with pytest.raises(ValueError, match="header says 5"):
            channel.receive_hello(receiver)
        assert _open_descriptors() == before  # the descriptor that arrived is closed again
    slab.close()


def test_a_hello_whose_descriptor_the_kernel_dropped_names_the_open_file_limit() -> None:
    # In a child: its open-file limit is lowered so the kernel cannot install the descriptor.
    code = textwrap.dedent(
        """
        import os, resource, socket
        from service.ipc import channel
        from service.ipc.records import Hello
        from service.ipc.slab import Slab
        sender, receiver = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        slab = Slab.create(1 << 16, "attention-test")
        channel.send_hello(sender, Hello(name="frontend-0", pid=os.getpid()), [slab.fd])
        lowest_free = os.open(os.devnull, os.O_RDONLY)  # the number the next one would get
        os.close(lowest_free)
        _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (lowest_free, hard))  # no new descriptor
        try:
            channel.receive_hello(receiver)
        except ValueError as err:
            print(err)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert "descriptors were dropped by the kernel (open-file limit" in done.stdout, done


def test_a_front_end_refused_before_its_welcome_backs_off_instead_of_spinning(
    tmp_path: Path,
) -> None:
    """A worker socket that takes each connection and closes it at once (as a worker does
    after a failed handshake): the front end's tries must slow down, not spin."""

    async def run() -> int:
        accepted = 0

        async def refuse(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            nonlocal accepted
            accepted += 1
            writer.close()

        path = tmp_path / "worker.sock"
        server = await asyncio.start_unix_server(refuse, path=str(path))
        client = WorkerClient(path, "frontend-0", 1 << 20)
        client.start()
        await asyncio.sleep(1.5)  # the span whose tries are counted
        await client.close()
        server.close()
        return accepted

    tries = asyncio.run(run())
    # Backing off from 50 ms, doubling: 6 or 7 tries in 1.5 s. Spinning: thousands.
    assert 2 <= tries <= 12, tries
