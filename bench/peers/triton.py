"""NVIDIA Triton as the peer: the `tritonserver` binary shipped in nvidia-pytriton 0.7.0, in a
virtualenv of its own made from /usr/bin/python3.11, serving the same ONNX graph from a Python
callable with one ONNX Runtime thread (bench/peers/triton_ort/serve.py). Triton's dynamic
batcher (max batch 32) is tried at two queue delays; the report keeps the best. Same load
generator (V2 over gRPC), same pinning, same run as our server. Then the best delay and our
server run side by side, their load windows alternating (head_to_head).

Triton's Python-backend stub links the system libpython3.11 (Debian's): a virtualenv made from
another 3.11 build fails at model load (`'_thread.RLock' object has no attribute
'_recursion_count'`), hence /usr/bin/python3.11. A peer that cannot be set up or started is a
FAILED row with its reason, never the end of the run."""

from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path

from bench import h2load
from bench.harness import free_port
from bench.launcher import REPO_ROOT, Pinning, Service
from bench.payloads import SHM
from bench.report import (
    BESIDE_TRITON,
    H2LOAD,
    HEAD_TO_HEAD,
    HEAD_TO_HEAD_ROUNDS,
    MIXED,
    SEQS,
    round_name,
)
from bench.runner import Runner, log

HERE = Path(__file__).resolve().parent
SERVE = HERE / "triton_ort" / "serve.py"
CONSTRAINTS = HERE / "triton-constraints.txt"
VENV = REPO_ROOT / ".bench-venvs" / "triton"
INTERPRETER = Path("/usr/bin/python3.11")
PACKAGES = ("nvidia-pytriton==0.7.0", "onnxruntime==1.31.1")
MAX_BATCH_SIZE = 32
QUEUE_DELAYS_US = (0, 1000)
LENGTHS = (*SEQS, MIXED)


class PeerUnavailable(RuntimeError):
    """The peer could not be set up here; the message says why (it becomes the rows' reason)."""


def ensure_venv(venv: Path = VENV, interpreter: Path = INTERPRETER) -> Path:
    """Create (once per constraints file) the virtualenv and return its python."""
    if not interpreter.is_file():
        raise PeerUnavailable(
            f"{interpreter} not found: Triton's Python backend needs the system Python 3.11 "
            "(Debian: apt-get install python3.11 python3.11-venv)"
        )
    wanted = hashlib.sha256(
        CONSTRAINTS.read_bytes() + " ".join(PACKAGES).encode() + str(interpreter).encode()
    ).hexdigest()
    stamp, python = venv / ".installed", venv / "bin" / "python"
    if stamp.is_file() and stamp.read_text() == wanted and python.exists():
        return python
    log(f"creating {venv} from {interpreter} ({', '.join(PACKAGES)}); takes a minute or two")
    pip = [str(python), "-m", "pip", "install", "--quiet"]
    for step in (
        [str(interpreter), "-m", "venv", "--clear", str(venv)],
        [*pip, "--upgrade", "pip"],
        [*pip, "-c", str(CONSTRAINTS), *PACKAGES],
    ):
        try:
            done = subprocess.run(step, capture_output=True, text=True, timeout=1800)
        except (OSError, subprocess.SubprocessError) as err:
            raise PeerUnavailable(f"{' '.join(step[:3])} failed: {err}") from err
        if done.returncode != 0:
            tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
            raise PeerUnavailable(
                f"`{' '.join(step[:4])}` exited {done.returncode}: {' | '.join(tail)}"
            )
    stamp.write_text(wanted)
    return python


def config_name(queue_delay_us: int) -> str:
    return f"triton b={MAX_BATCH_SIZE} delay={queue_delay_us}us"


def serve_command(r: Runner, python: Path, queue_delay_us: int) -> tuple[list[str], int]:
    """The pinned command of one configuration, and the gRPC port it will listen on."""
    c = r.config
    return triton_command(python, c.pinning, c.model_path, c.model, c.embed_dim, queue_delay_us)


def triton_command(
    python: Path,
    pinning: Pinning,
    model_path: Path,
    model: str,
    embed_dim: int,
    queue_delay_us: int,
    max_queue_size: int = 0,
) -> tuple[list[str], int]:
    """Triton serving model_path as model, pinned, its batcher's queue bounded to
    max_queue_size requests (0: unbounded, Triton's default); and its gRPC port."""
    grpc_port = free_port()
    command = [
        *pinning.prefix(pinning.server_cpus),
        str(python),
        str(SERVE),
        "--model",
        str(model_path),
        "--name",
        model,
        "--embed-dim",
        str(embed_dim),
        "--threads",
        str(pinning.server_threads or 1),
        "--max-batch-size",
        str(MAX_BATCH_SIZE),
        "--max-queue-delay-us",
        str(queue_delay_us),
        "--grpc-port",
        str(grpc_port),
        "--http-port",
        str(free_port()),
        "--metrics-port",
        str(free_port()),
        *(["--max-queue-size", str(max_queue_size)] if max_queue_size else []),
    ]
    return command, grpc_port


def failed_rows(r: Runner, name: str, reason: str) -> None:
    r.keep_failed(group="peers", target="triton", name=name, seqs=LENGTHS, reason=reason)


def run(
    r: Runner,
    venv: Path = VENV,
    interpreter: Path = INTERPRETER,
    *,
    shm: bool = False,
    with_h2load: bool = False,
) -> None:
    """Each queue delay's server at every length; with shm, also V2 with the tensors in client
    shared memory (Triton's system shared-memory extension, on in Triton by default); with
    with_h2load, h2load rows of both servers while they are up side by side."""
    try:
        python = ensure_venv(venv, interpreter)
    except PeerUnavailable as err:
        failed_rows(r, "triton", str(err))
        return
    pinning = r.config.pinning
    for delay in QUEUE_DELAYS_US:
        name = config_name(delay)
        command, grpc_port = serve_command(r, python, delay)
        try:
            with Service(name, command, grpc_port=grpc_port, cwd=r.scratch) as service:
                service.wait_ready(r.config.ready_timeout_s, model=r.config.model)
                log(f"{name}: pid {service.pid} on {service.target}")
                for seq in LENGTHS:
                    r.load(
                        service,
                        group="peers",
                        target="triton",
                        name=name,
                        api="v2",
                        seq=seq,
                        pinning=pinning,
                    )
                for seq in SEQS if shm else ():
                    r.load(
                        service,
                        group="shm",
                        target="triton",
                        name=name,
                        api=SHM,
                        seq=seq,
                        pinning=pinning,
                    )
        except (RuntimeError, OSError) as err:
            failed_rows(r, name, short(str(err)))
    best = best_delay(r)
    if best is not None:
        head_to_head(r, python, best, with_h2load=with_h2load)


def best_delay(r: Runner) -> int | None:
    """The queue delay whose configuration served the most sequences/s at most lengths; a
    tie goes to the one with the larger sum of its shares of the best at each length."""
    score = {delay: [0, 0.0] for delay in QUEUE_DELAYS_US}
    for seq in LENGTHS:
        served = {
            delay: row["sequences_per_s"]
            for delay in QUEUE_DELAYS_US
            for row in r.rows
            if row["group"] == "peers"
            and row["name"] == config_name(delay)
            and row["seq"] == seq
            and row.get("sequences_per_s")
        }
        if not served:
            continue
        best = max(served.values())
        score[max(served, key=lambda delay: served[delay])][0] += 1
        for delay, value in served.items():
            score[delay][1] += value / best
    winner = max(score, key=lambda delay: tuple(score[delay]))
    return winner if score[winner][0] else None


def head_to_head(r: Runner, python: Path, delay: int, *, with_h2load: bool = False) -> None:
    """Our server (default flags) and Triton up together on the same pinned CPUs: a load
    window on one, then the same on the other, each length, for HEAD_TO_HEAD_ROUNDS rounds,
    who goes first swapping each round. Minutes apart, the same comparison moves with the
    host; windows next to each other meet the same host."""
    pinning = r.config.pinning
    name = config_name(delay)
    command, grpc_port = serve_command(r, python, delay)
    try:
        with (
            r.server("server", [], pinning) as ours,
            Service(name, command, grpc_port=grpc_port, cwd=r.scratch) as triton,
        ):
            triton.wait_ready(r.config.ready_timeout_s, model=r.config.model)
            log(f"side by side: our server pid {ours.pid}, {name} pid {triton.pid}")
            for round_ in range(1, HEAD_TO_HEAD_ROUNDS + 1):
                pair = [("server", "server", ours), ("triton", name, triton)]
                for seq in LENGTHS:
                    for target, who, service in pair if round_ % 2 else pair[::-1]:
                        r.load(
                            service,
                            group=HEAD_TO_HEAD,
                            target=target,
                            name=round_name(who, round_),
                            api="v2",
                            seq=seq,
                            pinning=pinning,
                        )
            if with_h2load:
                h2load_beside(r, ours, triton, name)
    except (RuntimeError, OSError) as err:
        r.note(f"side by side with {name} not measured: {short(str(err))}")


def h2load_beside(r: Runner, ours: Service, peer: Service, name: str) -> None:
    """h2load rows of our server and Triton, up together: each length and shape on one, then
    on the other, who goes first swapping each time."""
    if not r.h2load_ready():
        return
    pair = [(ours, "server", BESIDE_TRITON), (peer, "triton", name)]
    turn = 0
    for seq in SEQS:
        for shape in h2load.shapes(r.config.concurrency):
            for service, target, who in pair if turn % 2 == 0 else pair[::-1]:
                r.h2load_row(
                    service,
                    group=H2LOAD,
                    target=target,
                    name=who,
                    seq=seq,
                    shape=shape,
                    pinning=r.config.pinning,
                )
            turn += 1


def short(text: str, lines: int = 3) -> str:
    """The last few non-empty lines of an error (a server's log tail), on one line."""
    kept = [line.strip() for line in text.splitlines() if line.strip()][-lines:]
    return " | ".join(kept)[:400]
