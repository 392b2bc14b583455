"""The worker process: model registry, batcher, ONNX Runtime sessions and model control,
serving the front ends that connect to its socket."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from service.catalog import BatchCaps, ModelView
from service.errors import ModelNotFound, NotSupported, ShuttingDown
from service.ipc import messages
from service.ipc.records import Models, Welcome
from service.ipc.slab import Slab
from service.ipc.status_page import StatusPage, page_path
from service.memory.budget import default_queue_bytes, memory_limit_bytes
from service.observability import metrics
from service.settings import Settings
from service.worker.batching.batcher import Batcher
from service.worker.batching.policy import AUTO_MAX_PADDING_CPU, AUTO_MAX_PADDING_GPU
from service.worker.batching.protocol import BatchLimits
from service.worker.client_regions import ClientRegions
from service.worker.controller import build_controller
from service.worker.engine.model_control import ModelController
from service.worker.engine.onnx_model import CPU, CUDA, OnnxModel, choose_providers, warm_up_shapes
from service.worker.engine.registry import ModelRegistry
from service.worker.links import FrontendLink, LinkListener
from service.worker_socket import socket_path

log = logging.getLogger(__name__)
# Longest a batch may hold up the event loop (heartbeats, control calls, reads): shorter
# batches compute on its own thread (Batcher.compute_short_batches_inline).
INLINE_BATCH_S = 0.05
FRONT_ENDS_LATE_S = 1.0  # in the drain: how long past its end the worker waits for front ends


class StartupError(RuntimeError):
    """The worker cannot serve anything; the message says why."""


def queue_bytes(settings: Settings) -> int:
    """--max-queue-bytes, or its default derived from the memory this process may use."""
    return settings.max_queue_bytes or default_queue_bytes(memory_limit_bytes())


def served_rows(models: list[OnnxModel], *, ready: bool) -> list[metrics.ServedRow]:
    """What attention_model_ready and attention_engine_info show (the supervisor serves them)."""
    return [(m.spec.name, str(m.spec.version), m.provider, ready) for m in models]


class WorkerServer:
    """start() loads, warms and listens; stop() waits for the front ends to go."""

    def __init__(
        self,
        settings: Settings,
        run_dir: Path,
        report_served: Callable[[list[metrics.ServedRow]], None] = lambda rows: None,
    ) -> None:
        self._settings = settings
        self._report_served = report_served
        # Versions withdrawn but still finishing their queued work: front ends whose snapshot
        # still names them may send more, which are served, not refused, until they settle.
        self._retiring: dict[str, OnnxModel] = {}
        self.socket_path = socket_path(run_dir)
        self.registry: ModelRegistry[OnnxModel] = ModelRegistry([], settings.default_model)
        self._links: set[FrontendLink] = set()
        self._link_tasks: set[asyncio.Task[None]] = set()
        self._all_gone = asyncio.Event()
        self._poller: asyncio.Task[None] | None = None
        self._flushing: asyncio.Future[None] | None = None
        self.ready = False
        self.draining = False
        limit_bytes = queue_bytes(settings)
        log.info(
            "queue bounds: %d requests, %d bytes of embeddings",
            settings.max_queue_size,
            limit_bytes,
        )
        self.batcher = Batcher(
            BatchLimits(
                max_batch_size=settings.max_batch_size,
                max_queue_delay_s=settings.max_queue_delay_s,
                max_queue_size=settings.max_queue_size,
                # Until start() knows where the models run (auto: by device).
                max_padding_ratio=settings.padding_ratio(AUTO_MAX_PADDING_CPU),
                group_by_length=settings.length_grouping == "on",
                max_inflight_batches=settings.max_inflight_batches,
                max_inflight_batches_per_model=settings.max_inflight_batches_per_model,
                max_queue_bytes=limit_bytes,
                # With no measured caps (budget 0) only --max-batch-size bounds a batch.
                live_caps=settings.live_batch_caps == "on" and settings.batch_cap_budget_s > 0,
            ),
            on_failure=self._on_batcher_failure,
            on_caps=self._caps_changed,
        )
        # The queue's fill, where front ends and gateways read it to refuse at the edge.
        self.status_page = StatusPage(
            page_path(run_dir), max_queue_size=settings.max_queue_size, max_queue_bytes=limit_bytes
        )
        self.batcher.publish_fill(self.status_page.publish)
        self.models: ModelController | None = None
        # Client shared memory (Triton's system shared-memory extension): one registry for
        # every front end, so a region registered through one is usable through all.
        self.regions = (
            ClientRegions(
                max_regions=settings.max_client_shared_memory_regions,
                max_bytes=settings.max_client_shared_memory_bytes,
            )
            if settings.client_shared_memory == "on"
            else None
        )
        # One thread reads inputs from client regions, for every front end: the loop stays
        # free, and reads queue there rather than in memory.
        self._region_reader = ThreadPoolExecutor(1, thread_name_prefix="region-read")
        self._listener = LinkListener(self.socket_path, self._serve_link, self._make_link)

    async def start(self) -> None:
        settings = self._settings
        try:
            providers = choose_providers(settings.provider)
        except RuntimeError as err:
            raise StartupError(str(err)) from err
        on_cpu = providers[0] == CPU
        padding = settings.padding_ratio(AUTO_MAX_PADDING_CPU if on_cpu else AUTO_MAX_PADDING_GPU)
        self.batcher.bound_padding(padding)
        log.info(
            "a batch of different lengths pads at most %g of its positions "
            "(--max-padding-ratio %s)",
            padding,
            settings.max_padding_ratio,
        )
        if on_cpu:
            self.batcher.compute_short_batches_inline(INLINE_BATCH_S)
            if settings.intra_op_threads == 1:
                # ONNX Runtime computes on the calling thread alone: its CPU time is a
                # batch's cost, whoever else shares the core.
                self.batcher.time_costs_with(time.thread_time)
        await self._load_models(providers)
        # Front ends connect once the served set is known: they size their limits from it.
        await self._listener.start()
        await self._warm_up()
        await self.batcher.start()
        self.ready = True
        self._changed()
        if settings.model_control_mode == "poll":
            assert self.models is not None
            self._poller = asyncio.create_task(
                self.models.poll_forever(settings.repository_poll_s), name="repository-poll"
            )
        log.info(
            "worker ready: serving %s (--model-control-mode %s, --version-policy %s)",
            self.registry.names(),
            settings.model_control_mode,
            settings.version_policy,
        )

    async def _load_models(self, providers: list[str]) -> None:
        settings = self._settings
        self.models = build_controller(
            settings, providers, self.registry, settle=self._settle, changed=self._changed
        )
        try:
            await self.models.start(settings.load_model)
        except ModelNotFound as err:
            raise StartupError(str(err)) from err
        if not self.registry.names() and settings.model_control_mode == "none":
            raise StartupError(
                f"no servable model under {settings.model_repository} (expected "
                "<name>/<version>/model.onnx; run `python -m export` or `make export`)"
            )
        fell_back = [m.key for m in self.registry.all() if CUDA in providers and m.provider != CUDA]
        if fell_back and settings.provider == "cuda":
            raise StartupError(
                f"--provider cuda, but ONNX Runtime put {fell_back} on {CPU}: are the CUDA 13 / "
                "cuDNN 9 libraries installed (pip install 'onnxruntime-gpu[cuda,cudnn]')?"
            )
        for key in fell_back:
            log.warning("%s runs on %s although a GPU is present", key, CPU)
        if not self.registry.names():
            log.warning(
                "no model loaded yet (--model-control-mode %s)", settings.model_control_mode
            )

    async def _warm_up(self) -> None:
        settings = self._settings
        largest = (settings.max_batch_size, settings.max_seq_len)
        for model in self.registry.all():
            # On the threads that will run its batches (CUDA keeps per-thread handles), at the
            # largest shape first on CUDA; then the fused graph is timed against the unfused.
            shapes = warm_up_shapes(model.provider, *largest)
            await self.batcher.on_every_thread(functools.partial(model.warm_up, shapes))
            choice = await asyncio.to_thread(model.choose_output_graph, *largest)
            log.info("%s: %s", model.key, choice)
            caps = await asyncio.to_thread(
                model.measure_batch_caps,
                max_batch_size=settings.max_batch_size,
                max_seq_len=settings.max_seq_len,
                budget_s=settings.batch_cap_budget_s,
            )
            log.info(
                "%s batch caps (%s): %s",
                model.key,
                "measured" if settings.batch_cap_budget_s > 0 else "not measured",
                caps.describe(),
            )

    async def _settle(self, model: OnnxModel) -> None:
        """Until none of a withdrawn version's requests is queued or computing, counting
        those front ends sent before they learnt of the withdrawal."""
        self._retiring[model.key] = model
        try:
            await asyncio.gather(*(link.sync() for link in list(self._links)))
            await self.batcher.settle(model)
        finally:
            if self._retiring.get(model.key) is model:
                del self._retiring[model.key]

    def resolve(self, key: str) -> OnnxModel:
        """The version a front end named by key (name/version): served, or still retiring."""
        name, _, version = key.partition("/")
        try:
            return self.registry.resolve(name, version)
        except ModelNotFound:
            retiring = self._retiring.get(key)
            if retiring is None:
                raise
            return retiring

    # -- front ends --------------------------------------------------------------------------

    def _make_link(self, name: str, slab: Slab) -> FrontendLink:
        return FrontendLink(
            name,
            slab,
            resolve=self.resolve,
            batcher=self.batcher,
            call=self._control,
            regions=self.regions,
            region_reader=self._region_reader,
        )

    async def _serve_link(self, link: FrontendLink) -> None:
        self._links.add(link)
        self._all_gone.clear()
        link.send(self._snapshot(Welcome))
        log.info("front end %s connected", link.name)
        try:
            await link.serve()
        finally:
            self._links.discard(link)
            if not self._links:
                self._all_gone.set()

    def _snapshot(self, kind: type[Models] = Models) -> Models:
        """The served set as front ends see it: a Welcome first on a link, then Models."""
        views = tuple(ModelView.of(model) for model in self.registry.all())
        return kind(views, ready=self.ready, default_model=self.registry.default_model)

    def _changed(self) -> None:
        """The served set (or readiness) changed: metrics, then every front end."""
        self._report_served(served_rows(self.registry.all(), ready=self.ready))
        snapshot = self._snapshot()
        for link in self._links:
            link.send(snapshot)

    def _caps_changed(self, runner: object, caps: BatchCaps) -> None:
        """GetModel and ModelConfig show the caps in force: tell the front ends."""
        if isinstance(runner, OnnxModel):
            runner.batch_caps = caps
            self._changed()

    def _on_batcher_failure(self, error: BaseException) -> None:
        """The scheduler died: nothing more can be computed here, so say so to front ends."""
        self.ready = False
        self._changed()

    async def _control(self, op: str, args: dict[str, Any]) -> Any:
        """A front end's control call (statistics, repository index, load, unload)."""
        log.debug("control call %s", op)
        if op == "flush":
            # A front end refuses new calls: batches close at once from now on, so what it
            # accepted is not left waiting for a batch to fill.
            if self._flushing is None:
                self._flushing = asyncio.ensure_future(self.batcher.drain())
            return None
        if op == "statistics":
            return {
                key: messages.stats_to_json(self.batcher.statistics.snapshot(key))
                for key in args["keys"]
            }
        if op.startswith("shm_"):
            return await self._shm_call(op, args)
        controller = self.models
        assert controller is not None
        if op == "index":
            entries = await controller.index(ready_only=bool(args.get("ready_only")))
            return [messages.index_to_json(entry) for entry in entries]
        if op in ("load", "unload"):
            if self.draining:
                raise ShuttingDown("the server is shutting down; no model loads or unloads")
            log.info("%s of model %r asked by %s", op, args["name"], args.get("peer", "?"))
            change = controller.load if op == "load" else controller.unload
            await change(str(args["name"]))
            return None
        raise ValueError(f"unknown control call {op!r}")

    async def _shm_call(self, op: str, args: dict[str, Any]) -> Any:
        if self.regions is None:  # the front ends refuse first; a mismatch is not served
            raise NotSupported("client shared memory is off on this server")
        name = str(args["name"])
        if op == "shm_register":
            self.regions.register(
                name, str(args["key"]), int(args["offset"]), int(args["byte_size"])
            )
            log.debug(
                "client shared-memory region %r registered (key %r, %d bytes)",
                name,
                args["key"],
                int(args["byte_size"]),
            )
            return None
        if op == "shm_unregister":
            await self.regions.unregister(name)
            return None
        if op == "shm_status":
            return [[r.name, r.key, r.offset, r.byte_size] for r in self.regions.status(name)]
        raise ValueError(f"unknown control call {op!r}")

    # -- shutdown -----------------------------------------------------------------------------

    async def stop(self, grace_period_s: float) -> None:
        """Freeze the served set, serve the front ends until they have all gone (they drain
        first), then stop the batcher. Within grace_period_s."""
        deadline = time.monotonic() + grace_period_s
        self.draining = True
        if self._poller is not None:
            self._poller.cancel()
        if self.models is not None:
            self.models.close()
        if self._links:
            # The front ends answer what is left as the grace period ends, and then leave: one
            # whose event loop runs late is waited for a little longer, so that its requests
            # get its answer, not this process's (the supervisor kills stragglers later still).
            outlast = deadline + FRONT_ENDS_LATE_S - time.monotonic()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._all_gone.wait(), max(0.0, outlast))
        self._listener.close()
        if self._flushing is not None:
            self._flushing.cancel()
        self.batcher.refuse_new()
        self.batcher.fail_queued(ShuttingDown("the server stopped before computing it; retry"))
        await self.batcher.stop(timeout_s=max(0.0, deadline - time.monotonic()))
        self._region_reader.shutdown(wait=False, cancel_futures=True)
        if self.regions is not None:
            self.regions.close()
        self.status_page.publish(0, 0)  # nothing queued here any more
        log.info("worker stopped")
