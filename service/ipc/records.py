"""The control messages between a front end (or gateway) and the worker: one typed record per
kind. service/ipc/codec.py turns them into the wire's bytes and back; nothing else builds or
reads the wire's keys.

Records are dataclasses with slots, not frozen: measured in the worker loop's terms (build
and pack an INFER, unpack it and read every field the worker reads; the same for a DONE), on
one CPU, `taskset -c 1 python -m bench.ipc_records` (best of 7 x 100k, two runs):

    per message, us          INFER       DONE
    dict (one-letter keys)   2.6         0.9-1.1
    dataclass(slots=True)    1.9-2.0     0.7-0.8
    frozen dataclass         3.5-3.8     2.0-2.2   (__init__ goes through object.__setattr__)
    NamedTuple               2.1-2.3     1.0
    class with __slots__     1.7-1.8     0.7-0.8   (the dataclass's own code, by hand)

msgspec, which vLLM uses for the same job, is not a dependency here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from service.catalog import ModelView
from service.dataplane import RegionRef

# A traced request's span as plain numbers: W3C trace id, span id, flags.
TraceTag = tuple[int, int, int]


@dataclass(slots=True)
class ClientTensor:
    """A tensor in a client's shared-memory region, and its dtype as the client wrote it
    (numpy's name, e.g. "<f4")."""

    ref: RegionRef
    dtype: str


@dataclass(slots=True)
class ErrorText:
    """Why the worker refused a request or a call: the error's kind (a name in messages.
    ERRORS, or "Internal") and the message a client may see."""

    kind: str
    message: str


# -- the first message on a link ------------------------------------------------------------


@dataclass(slots=True)
class Hello:
    """A front end (or gateway) introduces itself; its slab's descriptor comes with it."""

    name: str
    pid: int


# -- front end -> worker ---------------------------------------------------------------------


@dataclass(slots=True)
class InferRequest:
    """Compute one request: its input and answers by slab offset, or, for a tensor in a
    client's region, by reference (then the offset is None)."""

    request_id: int
    model_key: str  # name/version
    with_weights: bool
    shape: tuple[int, ...]  # [n, seq, d]; the worker refuses any other
    dtype: str  # the model's, numpy's name ("<f4")
    deadline: float | None  # time.monotonic(); None: none
    input_offset: int | None = None
    output_offset: int | None = None
    weights_offset: int | None = None  # only with weights
    tag: TraceTag | None = None
    input_ref: ClientTensor | None = None
    output_ref: ClientTensor | None = None
    weights_ref: ClientTensor | None = None


@dataclass(slots=True)
class Cancel:
    """The caller went away: drop the request if it is not computed yet."""

    request_id: int


@dataclass(slots=True)
class Call:
    """A control call (statistics, index, load, unload, flush, shm_*): its arguments are
    JSON values, by name."""

    call_id: int
    op: str
    args: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class Synced:
    """The answer to Sync: every request sent before it has arrived."""

    sync_id: int


# -- worker -> front end ---------------------------------------------------------------------


@dataclass(slots=True)
class Done:
    """A request's answers are in its regions; how it was computed."""

    request_id: int
    queue_s: float
    compute_s: float
    batch_size: int  # sequences
    started_at: float  # the batch's start, time.monotonic()
    padding: float  # the batch's padding ratio
    batch_id: int
    tags: tuple[TraceTag, ...] = ()  # a traced batch's: see Batcher.enqueue


@dataclass(slots=True)
class Fail:
    """A request was refused or failed; nothing more is written into its regions."""

    request_id: int
    error: ErrorText


@dataclass(slots=True)
class Reply:
    """A control call's result (a JSON value), or why it failed."""

    call_id: int
    result: Any = None
    error: ErrorText | None = None


@dataclass(slots=True)
class Sync:
    """The worker asks before it retires a withdrawn version: the answer (Synced) follows
    every request the front end sent before it, so once it arrives they all have."""

    sync_id: int


@dataclass(slots=True)
class Models:
    """The served set changed (or readiness did): every version, as front ends see it."""

    models: tuple[ModelView, ...]
    ready: bool
    default_model: str


@dataclass(slots=True)
class Welcome(Models):
    """The served set, first on every link."""


ToWorker = InferRequest | Cancel | Call | Synced
ToFrontend = Done | Fail | Reply | Sync | Models
Message = ToWorker | ToFrontend
