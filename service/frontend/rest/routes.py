"""The V2 REST endpoints: each reads its path and body, calls the V2Plane, writes JSON."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from aiohttp import web

from service.errors import InvalidInput, ShuttingDown
from service.frontend.delivery import MEMORY_PER_ANSWER_BYTE, Reservation
from service.frontend.rest.codec import (
    BINARY_TYPE,
    HEADER_LENGTH,
    JSON_TYPE,
    InferBody,
    decode_infer,
    encode_infer,
    json_object,
    message_json,
)
from service.frontend.v2_plane import V2Plane

if TYPE_CHECKING:
    from service.frontend.rest.app import RestFrontend


class _NoDeadline:
    """V2 REST carries no deadline (Triton's timeout parameter is refused, as on gRPC)."""

    def time_remaining(self) -> float | None:
        return None


NO_DEADLINE = _NoDeadline()
# A float in a JSON answer: a double's repr (17 significant digits, sign, point, exponent), ",".
JSON_BYTES_PER_VALUE = 26
UNDELIVERED = "attention.undelivered"  # request key: the client left while its answer was written


def not_ready() -> ShuttingDown:
    return ShuttingDown("server is not ready (starting up or shutting down); retry elsewhere")


def _model(request: web.Request) -> tuple[str, str]:
    return request.match_info["model"], request.match_info.get("version", "")


def _parameter_names(body: dict[str, Any], what: str) -> list[str]:
    parameters = body.get("parameters", {})
    if not isinstance(parameters, dict):
        raise InvalidInput(f"{what} parameters is not a JSON object; expected one")
    return list(parameters)


class _Endpoints:
    def __init__(self, plane: V2Plane, frontend: RestFrontend) -> None:
        self.plane, self.frontend = plane, frontend

    async def live(self, request: web.Request) -> web.Response:
        return web.json_response({"live": True})

    async def ready(self, request: web.Request) -> web.Response:
        if not self.plane.is_ready():
            raise not_ready()
        return web.json_response({"ready": True})

    async def server_metadata(self, request: web.Request) -> web.Response:
        return web.json_response(message_json(self.plane.server_metadata()))

    async def model_metadata(self, request: web.Request) -> web.Response:
        return web.json_response(message_json(self.plane.model_metadata(*_model(request))))

    async def model_ready(self, request: web.Request) -> web.Response:
        model = self.plane.registry.resolve(*_model(request))  # unknown: 404
        if not self.plane.is_ready():
            raise not_ready()
        return web.json_response(
            {"name": model.spec.name, "version": str(model.spec.version), "ready": True}
        )

    async def model_config(self, request: web.Request) -> web.Response:
        config = self.plane.model_config(*_model(request)).config
        return web.json_response(message_json(config))

    async def model_stats(self, request: web.Request) -> web.Response:
        name, version = _model(request)
        return web.json_response(message_json(await self.plane.statistics(name, version)))

    async def all_stats(self, request: web.Request) -> web.Response:
        return web.json_response(message_json(await self.plane.statistics("", "")))

    async def infer(self, request: web.Request) -> web.StreamResponse:
        name, version = _model(request)
        self.plane.registry.resolve(name, version)  # an unknown model is a 404 whatever the body
        body = decode_infer(
            await self.frontend.body(request), request.headers.get(HEADER_LENGTH), name, version
        )
        held = self._reserve(request, body)
        try:
            inferred = await self.plane.infer(body.request, NO_DEADLINE)
            spec = inferred.model.spec
            try:
                parts, header_length = encode_infer(
                    body, spec.name, spec.version, inferred.names, inferred.result, inferred.refs
                )
                # Joined now: the answer's arrays may live in shared memory, freed by release().
                payload = b"".join(parts)
            finally:
                inferred.result.release()
            if held is not None:
                held.resize(MEMORY_PER_ANSWER_BYTE * len(payload))
            response = web.StreamResponse(
                headers={"Content-Type": JSON_TYPE if header_length is None else BINARY_TYPE}
            )
            if header_length is not None:
                response.headers[HEADER_LENGTH] = str(header_length)
            response.content_length = len(payload)
            await response.prepare(request)
            try:
                # Returns once the transport has taken all but its high-water mark: a client
                # that does not read holds the answer in the budget until it does, or goes.
                await response.write(payload)
                await response.write_eof()
            except ConnectionError:  # gone while its answer was written: never delivered
                request[UNDELIVERED] = True
            return response
        finally:
            if held is not None:
                held.release()

    def _reserve(self, request: web.Request, body: InferBody) -> Reservation | None:
        """The answer's estimated memory in the undelivered-answers budget, or
        AnswersBacklogged (429) now, before computing it. An output answered as JSON takes
        up to JSON_BYTES_PER_VALUE characters a value."""
        answers = self.frontend.answers
        if answers is None:
            return None
        try:
            sizes = self.plane.answer_sizes(body.request)
        except Exception:  # a malformed request: the plane says what is wrong with it
            sizes = {}
        estimate = sum(
            nbytes
            if body.binary_outputs.get(name, body.binary_default)
            else nbytes // itemsize * JSON_BYTES_PER_VALUE
            for name, (nbytes, itemsize) in sizes.items()
        )
        peer = request.transport.get_extra_info("peername") if request.transport else None
        return answers.reserve(f"rest:{peer}", MEMORY_PER_ANSWER_BYTE * estimate)

    async def repository_index(self, request: web.Request) -> web.Response:
        body = json_object(await self.frontend.body(request), "the index request", empty_ok=True)
        ready = body.get("ready", False)
        if not isinstance(ready, bool):
            raise InvalidInput(f"ready is {ready!r:.40}; expected true or false")
        index = await self.plane.repository_index("", ready=ready)
        return web.json_response(message_json(index)["models"])

    async def load(self, request: web.Request) -> web.Response:
        body = json_object(await self.frontend.body(request), "the load request", empty_ok=True)
        names = _parameter_names(body, "the load request's")
        await self.plane.load("", request.match_info["model"], names)
        return web.json_response({})

    async def unload(self, request: web.Request) -> web.Response:
        body = json_object(await self.frontend.body(request), "the unload request", empty_ok=True)
        names = _parameter_names(body, "the unload request's")
        await self.plane.unload("", request.match_info["model"], names)
        return web.json_response({})

    # The system shared-memory extension: the shared-memory group of --restricted-api.
    async def shm_status(self, request: web.Request) -> web.Response:
        status = await self.plane.shm_status(request.match_info.get("region", ""))
        regions = sorted(status.regions.values(), key=lambda region: region.name)
        return web.json_response([message_json(region) for region in regions])

    async def shm_register(self, request: web.Request) -> web.Response:
        body = json_object(await self.frontend.body(request), "the register request")
        key = body.get("key")
        if not isinstance(key, str):
            raise InvalidInput("the register request needs key, a string")
        counts = []
        for what in ("offset", "byte_size"):
            value = body.get(what, 0 if what == "offset" else None)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise InvalidInput(f"the register request needs {what}, an integer >= 0")
            counts.append(value)
        await self.plane.shm_register(request.match_info["region"], key, counts[0], counts[1])
        return web.json_response({})

    async def shm_unregister(self, request: web.Request) -> web.Response:
        await self.plane.shm_unregister(request.match_info.get("region", ""))
        return web.json_response({})


def add_routes(app: web.Application, plane: V2Plane, frontend: RestFrontend) -> None:
    """Triton's paths; each model path also with /versions/{version}."""
    e = _Endpoints(plane, frontend)
    app.router.add_get("/v2/health/live", e.live)
    app.router.add_get("/v2/health/ready", e.ready)
    app.router.add_get("/v2", e.server_metadata)
    app.router.add_get("/v2/models/stats", e.all_stats)  # before {model} would take "stats"
    for model in ("/v2/models/{model}", "/v2/models/{model}/versions/{version}"):
        app.router.add_get(model, e.model_metadata)
        app.router.add_get(f"{model}/ready", e.model_ready)
        app.router.add_get(f"{model}/config", e.model_config)
        app.router.add_get(f"{model}/stats", e.model_stats)
        app.router.add_post(f"{model}/infer", e.infer)
    app.router.add_post("/v2/repository/index", e.repository_index)
    app.router.add_post("/v2/repository/models/{model}/load", e.load)
    app.router.add_post("/v2/repository/models/{model}/unload", e.unload)
    shm = "/v2/systemsharedmemory"
    app.router.add_get(f"{shm}/status", e.shm_status)
    app.router.add_get(shm + "/region/{region}/status", e.shm_status)
    app.router.add_post(shm + "/region/{region}/register", e.shm_register)
    app.router.add_post(f"{shm}/unregister", e.shm_unregister)
    app.router.add_post(shm + "/region/{region}/unregister", e.shm_unregister)
