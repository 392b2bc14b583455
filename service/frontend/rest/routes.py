"""The V2 REST endpoints: each reads its path and body, calls the V2Plane, writes JSON."""

from __future__ import annotations

import logging
from collections import deque
from typing import TYPE_CHECKING, Any

from aiohttp import web

from service.errors import InvalidInput, ModelNotFound, NotSupported, ServingError, ShuttingDown
from service.frontend.delivery import MEMORY_PER_ANSWER_BYTE, Reservation
from service.frontend.rest.answer import encode_infer
from service.frontend.rest.codec import (
    BINARY_TYPE,
    HEADER_LENGTH,
    JSON_TYPE,
    MAX_PARAMETERS,
    InferBody,
    counted,
    decode_infer,
    json_object,
    json_response,
    message_json,
)
from service.frontend.v2_plane import Inferred, V2Plane
from service.observability import logs
from service.text import shown

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from service.frontend.rest.app import RestFrontend


class _NoDeadline:
    """V2 REST carries no deadline of its own: only a request's timeout parameter
    (v2_codec.TIMEOUT_PARAMETER), which the V2 plane applies on both protocols."""

    def time_remaining(self) -> float | None:
        return None


NO_DEADLINE = _NoDeadline()
MODEL = "/v2/models/{model}"
SHM = "/v2/systemsharedmemory"
CUDA_SHM = "/v2/cudasharedmemory"
CUDA_SHM_UNSUPPORTED = (
    "CUDA shared memory is not supported by this server; system shared memory is "
    "(/v2/systemsharedmemory/..., with --client-shared-memory on)"
)
# Triton's paths: (method, path, endpoint, --restricted-api group as Triton groups its HTTP
# endpoints). Each model path also with /versions/{version}. Restrictions go by the route a
# request matched, never by the path's text (a model may be named "ready" or "infer").
ROUTES: tuple[tuple[str, str, str, str], ...] = (
    ("GET", "/v2/health/live", "live", "health"),
    ("GET", "/v2/health/ready", "ready", "health"),
    ("GET", "/v2", "server_metadata", "metadata"),
    ("GET", "/v2/models/stats", "all_stats", "statistics"),  # before {model} takes "stats"
    *(
        route
        for model in (MODEL, MODEL + "/versions/{version}")
        for route in (
            ("GET", model, "model_metadata", "metadata"),
            ("GET", f"{model}/ready", "model_ready", "health"),
            ("GET", f"{model}/config", "model_config", "model-config"),
            ("GET", f"{model}/stats", "model_stats", "statistics"),
            ("POST", f"{model}/infer", "infer", "inference"),
        )
    ),
    ("POST", "/v2/repository/index", "repository_index", "model-repository"),
    ("POST", "/v2/repository/models/{model}/load", "load", "model-repository"),
    ("POST", "/v2/repository/models/{model}/unload", "unload", "model-repository"),
    ("GET", f"{SHM}/status", "shm_status", "shared-memory"),
    ("GET", SHM + "/region/{region}/status", "shm_status", "shared-memory"),
    ("POST", SHM + "/region/{region}/register", "shm_register", "shared-memory"),
    ("POST", f"{SHM}/unregister", "shm_unregister", "shared-memory"),
    ("POST", SHM + "/region/{region}/unregister", "shm_unregister", "shared-memory"),
    # Triton's CUDA shared-memory extension: known, and answered 501 (gRPC: UNIMPLEMENTED).
    ("GET", f"{CUDA_SHM}/status", "cuda_shm", "shared-memory"),
    ("GET", CUDA_SHM + "/region/{region}/status", "cuda_shm", "shared-memory"),
    ("POST", CUDA_SHM + "/region/{region}/register", "cuda_shm", "shared-memory"),
    ("POST", f"{CUDA_SHM}/unregister", "cuda_shm", "shared-memory"),
    ("POST", CUDA_SHM + "/region/{region}/unregister", "cuda_shm", "shared-memory"),
    ("GET", "/v2/logging", "log_settings", "logging"),
    ("POST", "/v2/logging", "update_log_settings", "logging"),
)
GROUP_OF_ROUTE = {path: group for _, path, _, group in ROUTES}
INT64_MAX = (1 << 63) - 1
# A float in a JSON answer: a double's repr (17 significant digits, sign, point, exponent), ",".
JSON_BYTES_PER_VALUE = 26
UNDELIVERED = "attention.undelivered"  # request key: the client left while its answer was written


def not_ready() -> ShuttingDown:
    return ShuttingDown("server is not ready (starting up or shutting down); retry elsewhere")


def unknown_model(request: web.Request, why_no_list: str) -> str:
    """A 404's message naming the model (and version) asked for, but not the models served."""
    name, version = request.match_info.get("model", ""), request.match_info.get("version", "")
    asked = shown(name) + (f" version {shown(version)}" if version else "")
    return f"no model {asked} is served here; {why_no_list}"


def _model(request: web.Request) -> tuple[str, str]:
    return request.match_info["model"], request.match_info.get("version", "")


def _parameter_names(body: dict[str, Any], what: str) -> list[str]:
    parameters = body.get("parameters", {})
    if not isinstance(parameters, dict):
        raise InvalidInput(f"{what} parameters is not a JSON object; expected one")
    counted(parameters, MAX_PARAMETERS, f"{what} parameters")
    return list(parameters)


class _Endpoints:
    def __init__(self, plane: V2Plane, frontend: RestFrontend) -> None:
        self.plane, self.frontend = plane, frontend

    async def live(self, request: web.Request) -> web.Response:
        return json_response({"live": True})

    async def ready(self, request: web.Request) -> web.Response:
        if not self.plane.is_ready():
            raise not_ready()
        return json_response({"ready": True})

    async def server_metadata(self, request: web.Request) -> web.Response:
        return json_response(message_json(self.plane.server_metadata()))

    async def model_metadata(self, request: web.Request) -> web.Response:
        return json_response(message_json(self.plane.model_metadata(*_model(request))))

    async def model_ready(self, request: web.Request) -> web.Response:
        try:
            model = self.plane.registry.resolve(*_model(request))
        except ModelNotFound:  # 404, saying no more than gRPC's ModelReady (false)
            raise ModelNotFound(unknown_model(request, "so it is not ready")) from None
        if not self.plane.is_ready():
            raise not_ready()
        return json_response(
            {"name": model.spec.name, "version": str(model.spec.version), "ready": True}
        )

    async def model_config(self, request: web.Request) -> web.Response:
        config = self.plane.model_config(*_model(request)).config
        return json_response(message_json(config))

    async def model_stats(self, request: web.Request) -> web.Response:
        name, version = _model(request)
        return json_response(message_json(await self.plane.statistics(name, version)))

    async def all_stats(self, request: web.Request) -> web.Response:
        return json_response(message_json(await self.plane.statistics("", "")))

    async def infer(self, request: web.Request) -> web.StreamResponse:
        name, version = _model(request)
        self.plane.registry.resolve(name, version)  # an unknown model is a 404 whatever the body
        raw = await self.frontend.body(request, binary_follows=True)
        header = request.headers.get(HEADER_LENGTH)
        body = await self.frontend.off_loop(
            len(raw), lambda: decode_infer(raw, header, name, version)
        )
        logs.REQUEST_ID.set(body.request.id)  # for what this request logs (the wrapper resets it)
        estimate = self._json_answer_bounded(body)
        held = self._reserve(request, estimate)
        try:
            inferred = await self.plane.infer(body.request, NO_DEADLINE)
            # Copied out (result may live in shared memory, freed by release()), off the loop
            # when large.
            chunks, header_length = await self.frontend.off_loop(
                estimate, lambda: _encoded(body, inferred), then=inferred.result.release
            )
            return await self._send(request, deque(chunks), header_length, held)
        finally:
            if held is not None:
                held.release()

    async def _send(
        self,
        request: web.Request,
        chunks: deque[bytes],
        header_length: int | None,
        held: Reservation | None,
    ) -> web.StreamResponse:
        """The answer, a chunk at a time; the budget holds what is not yet written."""
        remaining = sum(len(chunk) for chunk in chunks)
        if held is not None:
            held.resize(MEMORY_PER_ANSWER_BYTE * remaining)
        response = web.StreamResponse(
            headers={"Content-Type": JSON_TYPE if header_length is None else BINARY_TYPE}
        )
        if header_length is not None:
            response.headers[HEADER_LENGTH] = str(header_length)
        response.content_length = remaining
        await response.prepare(request)
        try:
            while chunks:
                chunk = chunks.popleft()
                # Returns once the transport has taken all but its high-water mark: a client
                # that does not read holds the rest of its answer in the budget until it
                # does, or goes.
                await response.write(chunk)
                remaining -= len(chunk)
                if held is not None:
                    held.resize(MEMORY_PER_ANSWER_BYTE * remaining)
            await response.write_eof()
        except ConnectionError:  # gone while its answer was written: never delivered
            request[UNDELIVERED] = True
        return response

    def _json_answer_bounded(self, body: InferBody) -> int:
        """The answer's estimated size, before computing it (JSON outputs at up to
        JSON_BYTES_PER_VALUE characters a value); InvalidInput when its JSON would pass
        --max-json-answer-bytes."""
        try:
            sizes = self.plane.answer_sizes(body.request)
        except ServingError:  # a malformed request: the plane says what is wrong with it
            sizes = {}
        as_json = {
            name: nbytes // itemsize * JSON_BYTES_PER_VALUE
            for name, (nbytes, itemsize) in sizes.items()
            if not body.binary_outputs.get(name, body.binary_default)
        }
        json_bytes, bound = sum(as_json.values()), self.frontend.max_json_answer_bytes
        if json_bytes > bound:
            raise InvalidInput(
                f"the answer's {', '.join(as_json)} as JSON would take up to {json_bytes} bytes, "
                f"above this server's bound of {bound} bytes for a JSON answer "
                '(--max-json-answer-bytes); ask for binary outputs: "binary_data": true in '
                "each output's parameters, or \"binary_data_output\": true in the request's "
                "parameters (tritonclient.http: InferRequestedOutput(name, binary_data=True))"
            )
        binary_bytes = sum(nbytes for name, (nbytes, _) in sizes.items() if name not in as_json)
        return json_bytes + binary_bytes

    def _reserve(self, request: web.Request, estimate: int) -> Reservation | None:
        """The answer's estimated memory in the undelivered-answers budget, or
        AnswersBacklogged (429) now, before computing it."""
        answers = self.frontend.answers
        if answers is None:
            return None
        peer = request.transport.get_extra_info("peername") if request.transport else None
        return answers.reserve(f"rest:{peer}", MEMORY_PER_ANSWER_BYTE * estimate)

    async def _json_body(
        self, request: web.Request, what: str, *, empty_ok: bool = False
    ) -> dict[str, Any]:
        raw = await self.frontend.body(request)
        return await self.frontend.off_loop(
            len(raw), lambda: json_object(raw, what, empty_ok=empty_ok)
        )

    async def repository_index(self, request: web.Request) -> web.Response:
        body = await self._json_body(request, "the index request", empty_ok=True)
        ready = body.get("ready", False)
        if not isinstance(ready, bool):
            raise InvalidInput(f"ready is {ready!r:.40}; expected true or false")
        index = await self.plane.repository_index("", ready=ready)
        return json_response(message_json(index)["models"])

    async def load(self, request: web.Request) -> web.Response:
        body = await self._json_body(request, "the load request", empty_ok=True)
        names = _parameter_names(body, "the load request's")
        model, who = request.match_info["model"], _asked_by(request)
        log.info("REST load of model %s asked by %s", shown(model), who)
        await self.plane.load("", model, names, who)
        return json_response({})

    async def unload(self, request: web.Request) -> web.Response:
        body = await self._json_body(request, "the unload request", empty_ok=True)
        names = _parameter_names(body, "the unload request's")
        model, who = request.match_info["model"], _asked_by(request)
        log.info("REST unload of model %s asked by %s", shown(model), who)
        await self.plane.unload("", model, names, who)
        return json_response({})

    # The system shared-memory extension: the shared-memory group of --restricted-api.
    async def shm_status(self, request: web.Request) -> web.Response:
        status = await self.plane.shm_status(request.match_info.get("region", ""))
        regions = sorted(status.regions.values(), key=lambda region: region.name)
        return json_response([message_json(region) for region in regions])

    async def shm_register(self, request: web.Request) -> web.Response:
        body = await self._json_body(request, "the register request")
        key = body.get("key")
        if not isinstance(key, str):
            raise InvalidInput("the register request needs key, a string")
        counts = []
        for what in ("offset", "byte_size"):
            value = body.get(what, 0 if what == "offset" else None)
            if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= INT64_MAX:
                raise InvalidInput(
                    f"the register request needs {what}, an integer from 0 to {INT64_MAX}"
                )
            counts.append(value)
        await self.plane.shm_register(request.match_info["region"], key, counts[0], counts[1])
        return json_response({})

    async def shm_unregister(self, request: web.Request) -> web.Response:
        await self.plane.shm_unregister(request.match_info.get("region", ""))
        return json_response({})

    async def cuda_shm(self, request: web.Request) -> web.Response:
        raise NotSupported(CUDA_SHM_UNSUPPORTED)

    # Triton's logging extension: the logging group of --restricted-api.
    async def log_settings(self, request: web.Request) -> web.Response:
        return json_response(self.plane.log_settings())

    async def update_log_settings(self, request: web.Request) -> web.Response:
        changes = await self._json_body(request, "the log settings request")
        counted(changes, MAX_PARAMETERS, "the log settings request")
        return json_response(self.plane.update_log_settings(changes, _asked_by(request)))


def _asked_by(request: web.Request) -> str:
    """Who sent request, as the audit lines name a caller (the client's own words, escaped)."""
    return f"peer {shown(str(request.remote or 'unknown'))}"


def _encoded(body: InferBody, inferred: Inferred) -> tuple[list[bytes], int | None]:
    spec = inferred.model.spec
    return encode_infer(
        body, spec.name, spec.version, inferred.names, inferred.result, inferred.refs
    )


def group_of(request: web.Request) -> str | None:
    """The --restricted-api group of the route request matched; None when none did."""
    resource = request.match_info.route.resource
    return None if resource is None else GROUP_OF_ROUTE[resource.canonical]


def add_routes(app: web.Application, plane: V2Plane, frontend: RestFrontend) -> None:
    """ROUTES, served by their endpoints."""
    endpoints = _Endpoints(plane, frontend)
    for method, path, endpoint, _ in ROUTES:
        handler = getattr(endpoints, endpoint)
        if method == "GET":
            app.router.add_get(path, handler)  # and HEAD, as aiohttp's add_get does
        else:
            app.router.add_route(method, path, handler)
