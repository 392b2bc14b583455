"""Dynamic batcher: one queue per (model version, wants-weights), one supervised scheduler,
compute slots per model version under a global cap.

A batch closes when its queue holds max_batch_size sequences or its oldest request has
waited max_queue_delay; while a version's compute slots are busy its queues keep filling, so
load turns into larger batches instead of longer queues of small ones. Each model version
has its own slots, so a small model never waits behind another model's large batch.
A request leaves the queue the moment its caller goes away or its deadline passes, so dead
requests never hold queue room (by count or by bytes) that a live one could use.

The hot path has no per-request asyncio machinery: a request is a plain Ticket whose answer
is a callback, called once, in the turn its batch ends; the scheduler is a callback run at
most once per loop turn (never a task woken through an event), and one timer stands for the
whole batcher (the next queue due or deadline to pass), not one per request.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import math
import os
import threading
import time
from collections import defaultdict, deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from service.catalog import BatchCaps
from service.errors import DeadlineExpired, NonFiniteOutput, QueueFull, ShuttingDown
from service.ipc.status_page import QueueFill
from service.memory.budget import (
    IDLE_TRIM_AFTER_S,
    TRIM_AFTER_BATCH_BYTES,
    batch_memory_bytes,
    is_large_batch,
    release_free_memory,
)
from service.observability import metrics
from service.status_texts import NOT_ACCEPTING
from service.worker.batching.live_caps import LiveCaps
from service.worker.batching.policy import choose_batch, merge, padding_ratio, split
from service.worker.batching.protocol import (
    AnswerWriter,
    BatchFailed,
    BatchLimits,
    Result,
    Runner,
    ended_at_deadline,
)
from service.worker.batching.statistics import InferenceStatistics

log = logging.getLogger(__name__)
# Loop turns from bytes on a front end's socket to a request in its queue: the turn whose
# poll finds them queues the read callback behind the yielding task, the next runs it (the
# link's protocol dispatches in its read callback: no task in between).
TURNS_TO_TAKE_IN = 2
MAX_YIELDS = 4  # yields before a batch below its cap, while each one brought requests in
# While yields bring nothing in (one caller at a time), a lone request runs without one; every
# this many such requests one yields anyway, to notice that load has come back.
PROBE_EVERY = 8
GRAPHS = {False: "output", True: "output+attention_weights"}


# A ticket's life: in its queue, in a computing batch, answered (its callback was called).
QUEUED, COMPUTING, ANSWERED = 0, 1, 2


class SchedulerFailed(ShuttingDown):
    """The batch scheduler died; this replica computes nothing more (UNAVAILABLE: retry
    on another one)."""


# Where a request's answer is written ([n, seq, d] output, [n, h, seq, seq] weights or None):
# arrays in the front end's shared memory, or writers into a client's region, so the answer
# is copied once, where the batch computes.
Target = np.ndarray | AnswerWriter
Targets = tuple[Target, Target | None]


@dataclass(eq=False)
class _Queue:
    runner: Runner
    with_weights: bool
    items: deque[Ticket] = field(default_factory=deque)
    rows: int = 0  # sequences queued: the items' n, summed as they come and go
    # Its latest batch's cost per sequence and longest sequence: predicts the next one's.
    seconds_per_sequence: float | None = None
    measured_length: int = 0

    def sequences(self) -> int:
        return self.rows


# Called exactly once with a request's outcome: its Result, or the error that ends it
# (asyncio.CancelledError when it was withdrawn before compute).
Answer = Callable[["Result | BaseException"], None]


@dataclass(eq=False, slots=True)
class Ticket:
    """One queued request, as the batcher holds it."""

    embeddings: np.ndarray  # [n, seq, d]
    answer: Answer
    enqueued_at: float
    deadline: float | None
    queue: _Queue
    state: int = QUEUED
    tag: object = None  # the caller's, handed back to every traced request of its batch
    into: Targets | None = None  # where its output (and weights) are written once computed
    # Whether the caller has gone without withdrawing yet (a future's done-callback not yet
    # run): the scheduler then drops it instead of computing it.
    abandoned: Callable[[], bool] | None = None


@dataclass(frozen=True)
class _Computed:
    parts: list[tuple[np.ndarray, np.ndarray | None]]
    finite: list[bool]
    compute_s: float
    cost_s: float  # by the batcher's cost clock: what live caps compare
    padding: float


def _place(part: np.ndarray, target: Target | None) -> np.ndarray:
    """The part, contiguous: copied into its target when there is one."""
    if target is None:
        return np.ascontiguousarray(part)
    if part is target:  # the runner wrote it there
        return target
    if isinstance(target, np.ndarray):
        np.copyto(target, part)
        return target
    target.write(part)
    return part


def _compute(
    runner: Runner,
    arrays: Sequence[np.ndarray],
    with_weights: bool,
    targets: Sequence[Targets | None],
    cost_clock: Callable[[], float],
) -> _Computed:
    """Merge, ONNX Runtime, split (into the targets given), finiteness of each part: on a
    compute thread, or on the event loop's for a short CPU batch (compute_short_batches_inline)."""
    started, cost_started = time.monotonic(), cost_clock()
    embeddings, mask = merge(arrays)
    in_place = _in_place(targets)
    if in_place is None:
        output, weights = runner.run(embeddings, mask, with_weights)
    else:
        output, weights = runner.run(embeddings, mask, with_weights, into=in_place)
    shapes = [(a.shape[0], a.shape[1]) for a in arrays]
    # A batch of one is merged as itself: its output is its part, nothing to split.
    pieces = [(output, weights)] if len(arrays) == 1 else split(output, weights, shapes)
    # Copied here, with the batch: the padded slices would otherwise be copied while encoding
    # (or into shared memory), on an event loop that every other call waits for.
    parts = []
    for (out, w), into in zip(pieces, targets, strict=True):
        out_into, w_into = into if into is not None else (None, None)
        parts.append((_place(out, out_into), None if w is None else _place(w, w_into)))
    # Finite inputs can still overflow the model's arithmetic; such a part is never an OK.
    finite = [_all_finite(out) and (w is None or _all_finite(w)) for out, w in parts]
    padding = (
        0.0 if len(shapes) == 1 else padding_ratio([s[0] for s in shapes], [s[1] for s in shapes])
    )
    if is_large_batch(embeddings, with_weights, weights):
        del embeddings, mask, output, weights
        release_free_memory()
    return _Computed(
        parts, finite, time.monotonic() - started, cost_clock() - cost_started, padding
    )


def _in_place(targets: Sequence[Targets | None]) -> tuple[np.ndarray, np.ndarray | None] | None:
    """Where a batch of one's answer goes when all of it goes to shared memory as arrays:
    the runner may write it there itself. None for a batch of many, or a client's region."""
    if len(targets) != 1 or targets[0] is None:
        return None
    output, weights = targets[0]
    if isinstance(output, np.ndarray) and (weights is None or isinstance(weights, np.ndarray)):
        return output, weights
    return None


def _all_finite(values: np.ndarray) -> bool:
    """Whether every value is finite. A float32 or float64 sum is NaN or infinite when any
    value is, so a finite sum settles it in one pass with no temporary array (the common
    case); a sum that is not finite (a non-finite value, or finite ones that overflowed)
    then looks at each value."""
    if values.dtype.itemsize >= 4 and math.isfinite(np.add.reduce(values, axis=None)):
        return True
    return bool(np.isfinite(values).all())


def _sequences(batch: Sequence[Ticket]) -> int:
    return sum(ticket.embeddings.shape[0] for ticket in batch)


def _longest(batch: Sequence[Ticket]) -> int:
    return max(ticket.embeddings.shape[1] for ticket in batch)


class Batcher:
    """Use start(), then queue() (or submit()) from request handlers; drain() then stop() on
    shutdown."""

    def __init__(
        self,
        limits: BatchLimits,
        statistics: InferenceStatistics | None = None,
        *,
        on_failure: Callable[[BaseException], None] | None = None,
        on_caps: Callable[[Runner, BatchCaps], None] | None = None,
    ) -> None:
        self._limits = limits
        self._on_caps = on_caps
        self._live: dict[Runner, LiveCaps] = {}
        self.statistics = statistics or InferenceStatistics()
        self._on_failure = on_failure
        # Keyed by the runner object, not its key: a reloaded version (same key) gets queues of
        # its own, so a batch never mixes the old and the new files.
        self._queues: dict[tuple[Runner, bool], _Queue] = {}
        self._settle_waiters: list[asyncio.Future[None]] = []
        self._pending = 0
        self._arrivals = 0  # requests ever queued: tells whether a yield brought any in
        self._pending_bytes = 0
        self._depth_gauges = metrics.OncePerTurn(self._publish_depth)
        self._queued_high_bytes = 0  # most bytes queued at once since memory was last trimmed
        self._batched_bytes = 0  # batch_memory_bytes of every batch computed (only grows)
        self._trimmed_at = 0  # _batched_bytes when memory was last trimmed
        self._idle_trim: asyncio.TimerHandle | None = None
        self._running = 0
        self._running_by_key: dict[str, int] = defaultdict(int)
        self._accepting = False
        self._started = False
        self._flushing = False  # close batches at once instead of waiting for them to fill
        self._failure: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pass_due = False  # a scheduling pass is queued on the loop (or yielding)
        self._pass_handle: asyncio.Handle | None = None  # the queued pass (not a yield's)
        self._yields = 0  # yields made for arrivals before the batch now due
        self._arrivals_seen = 0
        self._yield_pays = True  # the latest yield brought requests in
        self._unprobed = 0  # lone requests run without a yield since the last one
        self._published_depth = (-1, -1)
        self._timer: asyncio.TimerHandle | None = None  # the next queue due or deadline
        self._timer_at = 0.0  # on the loop's clock
        self._deadlines = 0  # queued tickets with a deadline
        self._next_deadline = float("inf")  # no queued deadline is earlier (monotonic)
        self._idle = asyncio.Event()
        self._idle.set()
        self._tasks: set[asyncio.Future[Any]] = set()  # batches, trims
        self._computing: set[Ticket] = set()
        self._batches = itertools.count(1)
        self._executor = ThreadPoolExecutor(
            max_workers=limits.max_inflight_batches, thread_name_prefix="batch-compute"
        )
        self._inline_up_to_s = 0.0
        self._cost_clock: Callable[[], float] = time.monotonic
        self._on_fill: Callable[[int, int], None] | None = None

    def time_costs_with(self, clock: Callable[[], float]) -> None:
        """The clock whose difference over a batch's computation is the cost that live caps
        compare (default: wall time). time.thread_time when ONNX Runtime computes on the
        calling thread alone: then other processes sharing the core (the front ends) do not
        count in a batch's cost, and they made a batch of 8 at seq 128 look as cheap as one
        of 2 when it costs 11 % more CPU per sequence."""
        self._cost_clock = clock

    def publish_fill(self, publish: Callable[[int, int], None]) -> None:
        """Call publish(requests, bytes) with the queue's fill after every change (the
        worker's status page, which front ends read to refuse at the edge)."""
        self._on_fill = publish
        publish(self._pending, self._pending_bytes)

    def compute_short_batches_inline(self, up_to_s: float) -> None:
        """Compute a batch predicted to take at most up_to_s on the event loop's own thread
        (0: never), when no other batch is computing. On CPU the hand-off to a compute thread
        and back costs more than a short batch saves by leaving the loop free: measured on
        one core at seq 16, 1083 -> 1176-1287 requests/s (seq 128 within run-to-run noise).
        Longer batches, and every batch on a GPU (whose work overlaps the loop's), run on a
        compute thread."""
        self._inline_up_to_s = up_to_s

    def bound_padding(self, max_padding_ratio: float) -> None:
        """The most padding a batch of different lengths may carry from now on (0..1)."""
        self._limits = replace(self._limits, max_padding_ratio=max_padding_ratio)

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._started = True
        self._accepting = True
        self._kick()

    def refuse_new(self) -> None:
        """From now on submit() answers UNAVAILABLE; what is queued is still computed."""
        self._accepting = False

    def queue(
        self,
        runner: Runner,
        embeddings: np.ndarray,
        answer: Answer,
        *,
        with_weights: bool,
        deadline: float | None = None,
        tag: object = None,
        into: Targets | None = None,
    ) -> Ticket:
        """Queue [n, seq, d] embeddings now; answer(outcome) is called once, on this loop,
        with their share of a batch (a Result) or the error that ended them. Raises the
        refusal (QueueFull, ShuttingDown, SchedulerFailed) instead of queueing.

        deadline is on the time.monotonic() clock; past it the request is never computed.
        tag (small, plain data; e.g. a trace's span ids) goes to the batch's tagged requests
        in Result.batch_tags: the batch's first tagged request (its leader) gets every tag of
        the batch, each other tagged request the leader's alone, an untagged one none (a
        batch of B tagged requests so carries 2B - 1 tags, not B squared). into: arrays
        of the answer's shapes that the answer is written into (the Result then holds them);
        the caller keeps them valid until answered, also after withdraw() returned False.
        """
        self._admit(embeddings.nbytes)
        key = (runner, with_weights)
        queue = self._queues.get(key)
        if queue is None:
            queue = self._queues[key] = _Queue(runner, with_weights)
        ticket = Ticket(embeddings, answer, time.monotonic(), deadline, queue, tag=tag, into=into)
        if deadline is not None:
            self._deadlines += 1
            if deadline < self._next_deadline:
                self._next_deadline = deadline
        queue.items.append(ticket)
        queue.rows += embeddings.shape[0]
        self._arrivals += 1
        self._count(1, embeddings.nbytes)
        self._kick()
        return ticket

    def run_alone(
        self,
        runner: Runner,
        embeddings: np.ndarray,
        answer: Answer,
        *,
        with_weights: bool,
        deadline: float | None = None,
        tag: object = None,
        into: Targets | None = None,
    ) -> bool:
        """Compute a request now, in this turn, when the scheduling pass would start it at
        once as a batch of one: nothing is queued or computing, no queue delay is set (or
        the request fills its batch), no yield for arrivals is due (_yield_for_arrivals), its
        deadline has not passed, and its queue's latest cost says the batch is short
        (compute_short_batches_inline). It skips the queue and the pass; its answer, metrics
        and statistics are a batch of one's. False when it cannot: queue() it instead (which
        then refuses, or queues it). Once it may, it raises what queue() refuses with.

        Every line of Python on a lone request's path runs with cold caches (ONNX Runtime's
        run evicts them): measured one request at a time on one core, the queue and the
        pass cost 25-30 us of the 550 us the worker spent per request."""
        # Never on a GPU (no batch computes inline there): the first test costs nothing.
        if not self._inline_up_to_s or self._pending or self._running or self._flushing:
            return False
        if not self._started:  # stopped, or its scheduler failed: queue() refuses it
            return False
        queue = self._queues.get((runner, with_weights))
        now = time.monotonic()
        if queue is None or (deadline is not None and deadline <= now):
            return False
        n, seq = embeddings.shape[0], embeddings.shape[1]
        below_cap = n < self._cap(queue, seq)
        if below_cap and (
            self._limits.max_queue_delay_s > 0 or self._yield_pays or self._unprobed >= PROBE_EVERY
        ):
            return False  # the pass waits, or yields first to take in arrivals
        if not self._short(queue, n, seq):
            return False
        self._admit(embeddings.nbytes)
        ticket = Ticket(embeddings, answer, now, deadline, queue, COMPUTING, tag, into)
        if below_cap:
            self._unprobed += 1  # as a lone request the pass starts without a yield
        self._arrivals += 1
        self._running += 1
        self._running_by_key[runner.key] += 1
        self._computing.add(ticket)
        try:
            self._compute_here(queue, [ticket])
        except Exception as err:  # what the pass would meet (a failure while failing a batch)
            self._scheduler_failed(err)
            _settle(ticket, SchedulerFailed("this server's batch scheduler failed; retry"))
        finally:
            # Nothing was queued before it, nor meanwhile (no read happens during the run),
            # so what _ended does after a batch is left out on purpose: the queue's fill
            # and its status page, the idle state, settle() waiters (none wait while nothing
            # is queued or computing), the memory trim after a backlog, the next pass. Only
            # the later look for an idle trim is kept (a test of two ints, mostly).
            self._computing.discard(ticket)
            self._running -= 1
            self._running_by_key[runner.key] -= 1
            self._batched_bytes += batch_memory_bytes(embeddings.nbytes, with_weights)
            if self._idle_trim is None and self._churned_enough():
                self._trim_when_idle_later()
        return True

    def enqueue(
        self,
        runner: Runner,
        embeddings: np.ndarray,
        *,
        with_weights: bool,
        deadline: float | None = None,
        tag: object = None,
        into: Targets | None = None,
    ) -> asyncio.Future[Result]:
        """queue() with a future for its answer: cancelling the future withdraws the request
        (dropped before compute while it is queued)."""
        future: asyncio.Future[Result] = asyncio.get_running_loop().create_future()
        ticket = self.queue(
            runner,
            embeddings,
            functools.partial(_resolve, future),
            with_weights=with_weights,
            deadline=deadline,
            tag=tag,
            into=into,
        )
        ticket.abandoned = future.done
        future.add_done_callback(functools.partial(self._abandoned, ticket))
        return future

    async def submit(
        self,
        runner: Runner,
        embeddings: np.ndarray,
        *,
        with_weights: bool,
        deadline: float | None = None,
        tag: object = None,
    ) -> Result:
        """Queue [n, seq, d] embeddings and wait for their share of a batch (see queue)."""
        return await self.enqueue(
            runner, embeddings, with_weights=with_weights, deadline=deadline, tag=tag
        )

    def withdraw(self, ticket: Ticket) -> bool:
        """The caller is gone: drop its request if it is still queued (answered with
        asyncio.CancelledError, now) and say True; False when it is already answered, or its
        batch is computing, which will still write into its targets and then answer."""
        if ticket.state != QUEUED:
            return False
        self._unqueue(ticket)
        self._dropped(ticket, self._cancel_reason(ticket))
        _settle(ticket, asyncio.CancelledError())
        self._kick()
        return True

    def _abandoned(self, ticket: Ticket, future: asyncio.Future[Result]) -> None:
        # The caller went away (cancelled, or gRPC cancelled it at its deadline): free its
        # place now, not when the scheduler next looks.
        if future.cancelled():
            self.withdraw(ticket)

    def _admit(self, nbytes: int) -> None:
        limits = self._limits
        if self._failure is not None:
            raise SchedulerFailed("this server's batch scheduler failed; retry on another replica")
        if not self._accepting:
            raise ShuttingDown(NOT_ACCEPTING)
        fill = QueueFill(
            self._pending, self._pending_bytes, limits.max_queue_size, limits.max_queue_bytes
        )
        refusal = fill.refusal(nbytes)  # the rule front ends apply at the edge, by the page
        if refusal is not None:
            raise QueueFull(refusal)

    async def on_every_thread(self, call: Callable[[], object], timeout_s: float = 600) -> None:
        """Run call once on each compute thread, one thread at a time, before batches run
        (warm-up: CUDA keeps per-thread handles, so each thread pays its first run now)."""
        threads = self._limits.max_inflight_batches
        barrier, lock = threading.Barrier(threads), threading.Lock()

        def once() -> None:
            barrier.wait(timeout_s)  # each task holds its own thread until all have one
            with lock:
                call()

        loop = asyncio.get_running_loop()
        await asyncio.gather(*(loop.run_in_executor(self._executor, once) for _ in range(threads)))

    async def drain(self) -> None:
        """Compute every queued request without waiting for batches to fill; return when idle."""
        self._flushing = True
        self._kick()
        await self._idle.wait()

    async def stop(self, timeout_s: float | None = None) -> None:
        """Stop scheduling; anything still queued fails with UNAVAILABLE. Batches still
        computing after timeout_s are left to their threads (ONNX Runtime cannot be
        interrupted), so a shutdown is not held up by them."""
        self._accepting = False
        self._started = False
        self._set_timer(None)
        if self._idle_trim is not None:
            self._idle_trim.cancel()
        self.fail_queued(ShuttingDown("server stopped before computing it"))
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=timeout_s)
        self._executor.shutdown(wait=timeout_s is None, cancel_futures=True)

    async def settle(self, runner: Runner) -> None:
        """Return once none of runner's requests is queued or computing, then forget its
        queues, so an unloaded model is referenced from here no more. The caller has stopped
        new requests from reaching runner first."""
        loop = asyncio.get_running_loop()
        while self._holds(runner):
            waiter: asyncio.Future[None] = loop.create_future()
            self._settle_waiters.append(waiter)
            await waiter
        for key in [key for key, queue in self._queues.items() if queue.runner is runner]:
            del self._queues[key]
        self._live.pop(runner, None)

    def _holds(self, runner: Runner) -> bool:
        return any(queue.items for queue in self._queues.values() if queue.runner is runner) or any(
            ticket.queue.runner is runner for ticket in self._computing
        )

    # -- queue accounting -------------------------------------------------------------------

    def _count(self, requests: int, nbytes: int) -> None:
        self._pending += requests
        self._pending_bytes += nbytes
        if self._pending_bytes > self._queued_high_bytes:
            self._queued_high_bytes = self._pending_bytes
        self._depth_gauges.request()
        if self._on_fill is not None and (requests or nbytes):
            self._on_fill(self._pending, self._pending_bytes)
        if self._pending == 0 and self._running == 0:
            self._idle.set()
            self._trim_after_backlog()
            self._trim_when_idle_later()
        else:
            self._idle.clear()
        if self._settle_waiters:
            waiters, self._settle_waiters = self._settle_waiters, []
            for waiter in waiters:  # each settle() looks again
                if not waiter.done():
                    waiter.set_result(None)

    def _publish_depth(self) -> None:
        depth = (self._pending, self._pending_bytes)
        if depth == self._published_depth:
            return  # back where it was by the turn's end (a request queued and taken)
        self._published_depth = depth
        metrics.QUEUE_DEPTH.set(depth[0])
        metrics.QUEUE_BYTES.set(depth[1])

    def _trim_after_backlog(self) -> None:
        """Idle after a backlog: hand the freed request buffers back to the kernel. Hundreds of
        queued requests leave their freed buffers spread over malloc's arenas, which it keeps
        (measured: RSS stayed ~1.1 GiB above its level before a 3x overload of seq-128
        requests once the queue had drained)."""
        if self._queued_high_bytes < TRIM_AFTER_BATCH_BYTES or not self._started:
            return
        self._queued_high_bytes = 0
        self._trimmed_at = self._batched_bytes
        self._release_free_memory()

    def _trim_when_idle_later(self) -> None:
        """Idle after batches that computed TRIM_AFTER_BATCH_BYTES since the last trim
        (counted by batch_memory_bytes): look again in IDLE_TRIM_AFTER_S, and hand malloc's
        free pages back if no batch ended meanwhile. Batches below the large-batch size leave
        their buffers in the heap for reuse (service/memory/malloc.py), up to glibc's trim
        threshold per arena (measured: the worker's RSS swung 112-141 MiB between rounds of
        20 requests of [64, 512] with weights, and grew 127 to 154 MiB over five lone
        [7, 128, 512] with weights); an idle worker keeps none of that."""
        if self._idle_trim is not None or not self._churned_enough() or not self._started:
            return
        self._idle_trim = asyncio.get_running_loop().call_later(
            IDLE_TRIM_AFTER_S, self._trim_if_idle, self._batched_bytes
        )

    def _churned_enough(self) -> bool:
        return self._batched_bytes - self._trimmed_at >= TRIM_AFTER_BATCH_BYTES

    def _trim_if_idle(self, batched_bytes: int) -> None:
        self._idle_trim = None
        if self._pending or self._running or batched_bytes != self._batched_bytes:
            self._trim_when_idle_later()  # busy meanwhile: look again later
            return
        if not self._churned_enough():
            return  # trimmed meanwhile (after a backlog)
        self._trimmed_at = self._batched_bytes
        self._release_free_memory()

    def _release_free_memory(self) -> None:
        """malloc_trim on a compute thread (one pass over the heap: off the event loop)."""
        try:
            trim = asyncio.get_running_loop().run_in_executor(self._executor, release_free_memory)
        except RuntimeError:  # stopped: the executor takes no more work, and the process exits
            return
        self._tasks.add(trim)
        trim.add_done_callback(self._tasks.discard)

    def _unqueue(self, ticket: Ticket) -> None:
        """Take a queued ticket out of its queue (the caller moves it on: computing or
        answered)."""
        ticket.state = COMPUTING
        if ticket.deadline is not None:
            self._deadlines -= 1
        queue = ticket.queue
        queue.items.remove(ticket)
        queue.rows -= ticket.embeddings.shape[0]
        self._count(-1, -ticket.embeddings.nbytes)

    def _dropped(self, ticket: Ticket, reason: str) -> None:
        waited = time.monotonic() - ticket.enqueued_at
        metrics.DROPPED.labels(ticket.queue.runner.label, reason).inc()
        self.statistics.record_failure(ticket.queue.runner.key, waited)

    @staticmethod
    def _cancel_reason(ticket: Ticket) -> str:
        # The client's deadline timer fires first (protocol.ended_at_deadline); before, 40%
        # of 600 calls that expired in the queue were counted as cancelled.
        remaining = None if ticket.deadline is None else ticket.deadline - time.monotonic()
        return "deadline" if ended_at_deadline(remaining) else "cancelled"

    def _expire_due(self, now: float) -> None:
        """Answer DEADLINE_EXCEEDED to every queued request whose deadline has passed."""
        if not self._deadlines or now < self._next_deadline:
            return
        earliest = float("inf")
        for queue in list(self._queues.values()):
            for ticket in [t for t in queue.items if t.deadline is not None]:
                assert ticket.deadline is not None
                if ticket.deadline > now:
                    earliest = min(earliest, ticket.deadline)
                    continue
                self._unqueue(ticket)
                self._dropped(ticket, "deadline")
                waited = now - ticket.enqueued_at
                _settle(
                    ticket,
                    DeadlineExpired(
                        f"deadline passed after {waited:.3f}s in the queue, before compute; "
                        "allow more time or lower the load"
                    ),
                )
        self._next_deadline = earliest

    def fail_queued(self, error: Exception) -> None:
        """Fail every request still waiting (not those computing) with error."""
        for queue in self._queues.values():
            for ticket in list(queue.items):
                self._unqueue(ticket)
                _settle(ticket, error)

    # -- scheduling -------------------------------------------------------------------------

    def _kick(self) -> None:
        """Run a scheduling pass in the loop's next turn (once, however often asked)."""
        if self._pass_due or not self._started:
            return
        assert self._loop is not None
        self._pass_due = True
        self._pass_handle = self._loop.call_soon(self._pass)

    def run_due(self) -> None:
        """Run the pass that queue() asked for now, in this turn: a front end's link calls
        it once it has queued every request of one read, so they batch together and a lone
        request starts without waiting for another turn of the loop."""
        handle = self._pass_handle
        if handle is not None:
            handle.cancel()
            self._pass()

    def _pass(self) -> None:
        self._pass_due = False
        self._pass_handle = None
        if not self._started:
            return
        try:
            if not self._pending:  # nothing queued (a batch ended, the last one withdrawn)
                self._yields = 0
                self._set_timer(None)
                return
            now = time.monotonic()
            self._expire_due(now)
            queue, wait_s = self._ready_queue(now)
            if queue is not None and self._below_cap(queue) and self._yield_for_arrivals():
                return
            self._yields = 0
            wait_s = self._launch_ready(queue, wait_s)
            if self._deadlines:
                until_deadline = self._next_deadline - time.monotonic()
                wait_s = until_deadline if wait_s is None else min(wait_s, until_deadline)
            self._set_timer(wait_s)
        except Exception as err:
            self._scheduler_failed(err)

    def _scheduler_failed(self, error: Exception) -> None:
        log.error("batch scheduler failed; failing queued requests", exc_info=error)
        self._failure = error
        self._accepting = False
        self._started = False
        self._set_timer(None)
        self.fail_queued(SchedulerFailed("this server's batch scheduler failed; retry"))
        if self._on_failure is not None:
            self._on_failure(error)

    def _set_timer(self, wait_s: float | None) -> None:
        """One timer for the whole batcher: a pass when the next queue is due or the next
        deadline passes (None: none needed; a new request or a finished batch kicks)."""
        loop = self._loop
        if wait_s is None or loop is None:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            return
        at = loop.time() + max(0.0, wait_s)
        if self._timer is not None:
            if self._timer_at <= at:
                return  # it fires first; that pass sets the next
            self._timer.cancel()
        self._timer, self._timer_at = loop.call_at(at, self._on_timer), at

    def _on_timer(self) -> None:
        self._timer = None
        self._kick()

    def _below_cap(self, queue: _Queue) -> bool:
        """Whether the next batch to start, from this ready queue, would be smaller than its
        cap."""
        if self._flushing or self._running >= self._limits.max_inflight_batches:
            return False
        return queue.sequences() < self._cap(queue, queue.items[0].embeddings.shape[1])

    def _yield_for_arrivals(self) -> bool:
        """Before starting a batch below its cap, give the CPU away and take in what arrived
        meanwhile (again, up to MAX_YIELDS times, while each yield brought requests in);
        True when it yielded (the pass then runs again TURNS_TO_TAKE_IN turns later).
        Where the front ends share this worker's core they run only when it yields; without
        this, each request arrived alone and became a batch of one (measured on one core at
        seq 16: 1.3 sequences per batch, 6.0 with it, and 40% more requests/s). While
        yields bring nothing in (one caller at a time), a lone request starts without one;
        every PROBE_EVERY-th yields anyway, and one that brings requests in turns them on."""
        if self._yields:
            self._yield_pays = self._arrivals != self._arrivals_seen
            if not self._yield_pays or self._yields >= MAX_YIELDS:
                return False
        elif not self._yield_pays and self._pending == 1 and self._unprobed < PROBE_EVERY:
            self._unprobed += 1  # one caller at a time: nothing would come in
            return False
        self._unprobed = 0
        self._yields += 1
        self._arrivals_seen = self._arrivals
        os.sched_yield()
        assert self._loop is not None
        self._pass_due = True  # arrivals meanwhile do not queue another pass
        self._loop.call_soon(self._after_turns, TURNS_TO_TAKE_IN - 1)
        return True

    def _after_turns(self, turns: int) -> None:
        assert self._loop is not None
        if turns > 0:
            self._loop.call_soon(self._after_turns, turns - 1)
        else:
            self._pass()

    def _launch_ready(self, queue: _Queue | None, wait_s: float | None) -> float | None:
        """Start every batch that is ready (queue: the first, found by _ready_queue) and has
        a free slot; else how long until one is due (None: until kicked)."""
        while self._running < self._limits.max_inflight_batches:
            if queue is None:
                return wait_s
            batch = self._take(queue)
            if not batch:
                queue, wait_s = self._ready_queue(time.monotonic())
                continue
            if self._is_short(queue, batch):
                # Here, in this turn: a task would cost the batch another turn of the loop.
                # Then another pass, which lets arrivals in before the next.
                self._run_inline(queue, batch)
                return None
            task = asyncio.ensure_future(self._run(queue, batch))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            queue, wait_s = self._ready_queue(time.monotonic())
        return None  # every slot is busy; a finishing batch kicks the scheduler

    def _ready_queue(self, now: float) -> tuple[_Queue | None, float | None]:
        """The ready queue with the oldest head among versions with a free slot, else how
        long until one becomes ready."""
        ready: _Queue | None = None
        wait_s: float | None = None
        per_model = self._limits.max_inflight_batches_per_model
        for queue in self._queues.values():
            if not queue.items or self._running_by_key[queue.runner.key] >= per_model:
                continue
            head = queue.items[0]
            due = head.enqueued_at + self._limits.max_queue_delay_s
            if (
                self._flushing
                or due <= now
                or queue.sequences() >= self._cap(queue, head.embeddings.shape[1])
            ):
                if ready is None or head.enqueued_at < ready.items[0].enqueued_at:
                    ready = queue
            else:
                wait_s = due - now if wait_s is None else min(wait_s, due - now)
        return ready, wait_s

    def _cap(self, queue: _Queue, longest_seq: int) -> int:
        """Most sequences worth batching at this length: the measured cap, within the limit."""
        caps = self._caps_of(queue.runner)
        if isinstance(caps, LiveCaps):
            # Only output-only batches report their cost, so only they may try another size.
            cap = caps.cap_for(longest_seq, exploring=not queue.with_weights)
        else:
            cap = caps.cap_for(longest_seq)
        return min(self._limits.max_batch_size, cap)

    def _caps_of(self, runner: Runner) -> BatchCaps | LiveCaps:
        """The runner's caps: measured at warm-up, then following live costs when enabled."""
        if not self._limits.live_caps:
            return runner.batch_caps
        live = self._live.get(runner)
        if live is None:
            live = self._live[runner] = LiveCaps(
                runner.batch_caps,
                self._limits.max_batch_size,
                on_change=functools.partial(self._caps_changed, runner),
            )
        return live

    def _caps_changed(self, runner: Runner, caps: BatchCaps) -> None:
        log.info("%s batch caps follow measured costs: %s", runner.key, caps.describe())
        if self._on_caps is not None:
            self._on_caps(runner, caps)

    def _take(self, queue: _Queue) -> list[Ticket]:
        for ticket in [t for t in queue.items if t.abandoned is not None and t.abandoned()]:
            # Cancelled, its done-callback not yet run: drop it here, never compute it.
            self.withdraw(ticket)
        items = queue.items
        if not items:
            return []
        if len(items) == 1:
            chosen = [items[0]]  # the lone request: nothing to choose
        else:
            chosen = [
                items[i]
                for i in choose_batch(
                    [ticket.embeddings.shape[0] for ticket in items],
                    [ticket.embeddings.shape[1] for ticket in items],
                    max_sequences=self._limits.max_batch_size,
                    max_padding=self._limits.max_padding_ratio,
                    cap_for=functools.partial(self._cap, queue),
                    group_by_length=self._limits.group_by_length,
                )
            ]
        # Counted as running before it leaves the queue: drain() never sees a false idle, and
        # settle() never sees a version as idle while its batch is between queue and thread.
        self._running += 1
        self._running_by_key[queue.runner.key] += 1
        self._computing.update(chosen)
        for ticket in chosen:
            self._unqueue(ticket)
        return chosen

    def _work(self, queue: _Queue, batch: list[Ticket]) -> Callable[[], _Computed]:
        return functools.partial(
            _compute,
            queue.runner,
            [ticket.embeddings for ticket in batch],
            queue.with_weights,
            [ticket.into for ticket in batch],
            self._cost_clock,
        )

    def _run_inline(self, queue: _Queue, batch: list[Ticket]) -> None:
        """A short batch, on the event loop's own thread, now."""
        try:
            self._compute_here(queue, batch)
        finally:
            self._ended(queue, batch)

    def _compute_here(self, queue: _Queue, batch: list[Ticket]) -> None:
        """Compute and answer the batch on this thread; a failure is the batch's alone."""
        started = time.monotonic()
        try:
            computed = self._work(queue, batch)()
        except Exception as err:
            self._failed(queue, batch, err, started)
        else:
            try:
                self._computed(queue, batch, computed, started)
            except Exception as err:  # never the scheduler's end: this batch's alone
                self._failed(queue, batch, err, started)

    async def _run(self, queue: _Queue, batch: list[Ticket]) -> None:
        """A batch on a compute thread, the loop free meanwhile."""
        started = time.monotonic()
        loop = asyncio.get_running_loop()
        try:
            computed = await loop.run_in_executor(self._executor, self._work(queue, batch))
        except Exception as err:
            self._failed(queue, batch, err, started)
        else:
            try:
                self._computed(queue, batch, computed, started)
            except Exception as err:  # never the scheduler's end: this batch's alone
                self._failed(queue, batch, err, started)
        finally:
            self._ended(queue, batch)

    def _computed(
        self, queue: _Queue, batch: list[Ticket], computed: _Computed, started: float
    ) -> None:
        queue.seconds_per_sequence = computed.compute_s / _sequences(batch)
        queue.measured_length = _longest(batch)
        self._deliver(queue, batch, computed, started)

    def _failed(self, queue: _Queue, batch: list[Ticket], err: Exception, started: float) -> None:
        runner = queue.runner
        log.error("batch of %d requests on %s failed", len(batch), runner.key, exc_info=err)
        metrics.BATCH_FAILURES.labels(runner.label).inc()
        self.statistics.record_failure(runner.key, time.monotonic() - started, len(batch))
        for ticket in batch:
            failure = BatchFailed(f"batch on {runner.described} failed")
            failure.__cause__ = err
            _settle(ticket, failure)

    def _ended(self, queue: _Queue, batch: list[Ticket]) -> None:
        self._computing.difference_update(batch)
        embeddings_bytes = sum(ticket.embeddings.nbytes for ticket in batch)
        self._batched_bytes += batch_memory_bytes(embeddings_bytes, queue.with_weights)
        self._running -= 1
        self._running_by_key[queue.runner.key] -= 1
        self._count(0, 0)
        self._kick()

    def _is_short(self, queue: _Queue, batch: list[Ticket]) -> bool:
        """Whether the batch may compute on the loop: it is the only batch computing, and
        its predicted time is within the bound. The prediction scales the queue's latest cost
        per sequence by length: with the square of it for a longer batch (attention's scores
        grow so), linearly for a shorter one, so it errs long, towards a compute thread."""
        if self._running > 1:
            return False
        return self._short(queue, _sequences(batch), _longest(batch))

    def _short(self, queue: _Queue, sequences: int, longest: int) -> bool:
        """Whether a batch of these sequences, the longest this long, is predicted short."""
        per_sequence = queue.seconds_per_sequence
        if per_sequence is None or not self._inline_up_to_s:
            return False
        stretch = longest / max(1, queue.measured_length)
        predicted = per_sequence * sequences * (stretch**2 if stretch > 1 else stretch)
        return predicted <= self._inline_up_to_s

    def _deliver(
        self, queue: _Queue, batch: list[Ticket], computed: _Computed, started: float
    ) -> None:
        runner, label = queue.runner, queue.runner.label
        sequences = _sequences(batch)
        metrics.batches_counter(label, GRAPHS[queue.with_weights]).inc()
        metrics.batch_size(label).observe(sequences)
        metrics.padding_ratio(label).observe(computed.padding)
        metrics.compute_duration(label).observe(computed.compute_s)
        caps = self._caps_of(runner)
        # Caps are measured on the output-only graph; a batch with weights runs another.
        if isinstance(caps, LiveCaps) and not queue.with_weights:
            caps.observe(_longest(batch), sequences, computed.cost_s)
        succeeded = []
        succeeded_sequences = 0
        batch_id = next(self._batches)
        # Tags go to the requests that get an answer (a compute span): finite, still awaited.
        tagged = [
            ticket
            for ticket, finite in zip(batch, computed.finite, strict=True)
            if ticket.tag is not None and finite and ticket.state != ANSWERED
        ]
        tags = tuple(ticket.tag for ticket in tagged)
        leader = tagged[0] if tagged else None
        others = {id(ticket) for ticket in tagged[1:]}
        queue_durations = metrics.queue_duration(label)
        for ticket, (output, weights), finite in zip(
            batch, computed.parts, computed.finite, strict=True
        ):
            queue_s = started - ticket.enqueued_at
            queue_durations.observe(queue_s)
            if not finite:
                metrics.NONFINITE_OUTPUTS.labels(label).inc()
                self.statistics.record_failure(runner.key, queue_s + computed.compute_s)
                _settle(
                    ticket,
                    NonFiniteOutput(
                        f"the result of {runner.described} for these embeddings holds NaN or inf: "
                        "their values are too large for the model's arithmetic; scale them "
                        "down"
                    ),
                )
                continue
            succeeded.append(queue_s)
            succeeded_sequences += ticket.embeddings.shape[0]
            if ticket.state != ANSWERED:
                _settle(
                    ticket,
                    Result(
                        output,
                        weights,
                        queue_s,
                        computed.compute_s,
                        sequences,
                        started_at=started,
                        padding=computed.padding,
                        batch_id=batch_id,
                        batch_tags=(
                            tags if ticket is leader else tags[:1] if id(ticket) in others else ()
                        ),
                    ),
                )
        self.statistics.record_batch(
            runner.key, sequences, succeeded, computed.compute_s, succeeded_sequences
        )


def _settle(ticket: Ticket, outcome: Result | BaseException) -> None:
    """Answer a ticket, once: a later outcome (a batch ending after a withdraw that came too
    late) is dropped."""
    if ticket.state == ANSWERED:
        return
    ticket.state = ANSWERED
    ticket.answer(outcome)


def _resolve(future: asyncio.Future[Result], outcome: Result | BaseException) -> None:
    """A ticket's answer, into the future enqueue() gave its caller."""
    if future.done():
        return
    if isinstance(outcome, asyncio.CancelledError):
        future.cancel()
    elif isinstance(outcome, BaseException):
        future.set_exception(outcome)
    else:
        future.set_result(outcome)
