"""The REST port under hostile or merely large requests, over real HTTP on loopback against a
real server (issue 36, items 2 to 7): JSON answers and bodies bounded and never coded on the
event loop (a concurrent health probe keeps answering), integers past Python's digit limit and
undecodable bodies refused with 400, restricted metadata by matched route, connection
timeouts, and every error aiohttp makes by itself as the V2 JSON error body."""

from __future__ import annotations

import functools
import gzip
import http.client
import json
import select
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as triton_grpc

from bench.stress.common import MIB, RssSampler
from service.frontend.rest.routes import ROUTES
from service.frontend.restricted import GROUPS
from tests.harness.server_process import ServerProcess, child_pids, in_mode, server_rss_bytes

D, H = 512, 8  # mha_repository's model, as deployed
JSON_REQUEST_BOUND = 24 << 20  # below the body limit (32 x 512 x 512 x 4 + 1 MiB)
JSON_ANSWER_BOUND = 64 << 20  # the default of --max-json-answer-bytes
IDLE_S, HEADER_TIMEOUT_S = 3.0, 1.0
HEADER, SECRET = "x-metadata-key", "metadata-Secret-7"
PROBE_STALL_S = 0.5  # a probe slower than this: the event loop was held (main: 2 s and more)
INFER = "/v2/models/mha/infer"


@pytest.fixture(scope="module")
def server(mha_repository: Path) -> Iterator[ServerProcess]:
    flags = (
        "--max-json-request-bytes",
        str(JSON_REQUEST_BOUND),
        "--max-connection-idle-s",
        str(IDLE_S),
        "--http-header-timeout-s",
        str(HEADER_TIMEOUT_S),
        "--restricted-api",
        f"metadata:{HEADER}={SECRET}",
    )
    with ServerProcess(mha_repository, *flags, http=True) as process:
        yield process
    assert process.process.returncode == 0, process.log


def _request(
    server: ServerProcess,
    method: str,
    path: str,
    body: bytes | None = None,
    headers: dict[str, str] | None = None,
) -> tuple[int, dict[str, str], bytes]:
    """(status, headers, body) of one request on a new connection, error statuses included."""
    request = urllib.request.Request(
        f"http://{server.http_url}{path}", data=body, headers=headers or {}, method=method
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as reply:
            return reply.status, dict(reply.headers), reply.read()
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), err.read()


def _error(headers: dict[str, str], raw: bytes) -> str:
    """The V2 error body's message; its type must be exactly application/json."""
    assert headers["Content-Type"] == "application/json", headers
    message = json.loads(raw)["error"]
    assert isinstance(message, str)
    assert message
    return message


class Probe:
    """GET /v2/health/live in a loop on one keep-alive connection, while something else runs:
    its slowest answer is how long the front end's event loop was held."""

    def __init__(self, server: ServerProcess) -> None:
        self._port = server.http_port
        self.latencies: list[float] = []
        self.failures: list[str] = []  # the thread's own failures, asserted by slowest_s
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        connection = http.client.HTTPConnection("127.0.0.1", self._port, timeout=120)
        try:
            while not self._done.is_set():
                started = time.monotonic()
                connection.request("GET", "/v2/health/live")
                answer = connection.getresponse().read()
                if answer != b'{"live": true}':
                    self.failures.append(f"the probe got {answer[:100]!r}")
                self.latencies.append(time.monotonic() - started)
                self._done.wait(0.01)
        except Exception as err:  # reported to the test by slowest_s
            self.failures.append(f"the probe failed: {err!r}")
        finally:
            connection.close()

    def __enter__(self) -> Probe:
        self._thread.start()
        # Probing before the request starts: a probe sent while the loop is held waits for
        # it, however short the request (a refusal can take milliseconds).
        give_up = time.monotonic() + 30
        while not self.latencies and not self.failures and time.monotonic() < give_up:
            time.sleep(0.005)
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join(30)

    @property
    def slowest_s(self) -> float:
        assert not self._thread.is_alive(), "the probe is still running (stuck in a request)"
        assert not self.failures, self.failures
        assert len(self.latencies) >= 2, "the probe must have run before and after the request"
        return max(self.latencies)


def _binary_infer(n: int, outputs: list[str], seq: int = 512) -> tuple[bytes, dict[str, str]]:
    """A legal infer body: [n, seq, 512] as a binary tensor, outputs asked for as JSON."""
    x = np.random.default_rng(n).standard_normal((n, seq, D), dtype=np.float32)
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": "embeddings",
                    "shape": list(x.shape),
                    "datatype": "FP32",
                    "parameters": {"binary_data_size": x.nbytes},
                }
            ],
            "outputs": [{"name": name} for name in outputs],
        }
    ).encode()
    return header + x.tobytes(), {"Inference-Header-Content-Length": str(len(header))}


def _json_infer(shape: list[int]) -> bytes:
    """An infer body of JSON numbers only ("0.5," each): ~4 bytes a value."""
    data = b"[" + b",".join([b"0.5"] * int(np.prod(shape))) + b"]"
    return (
        b'{"inputs":[{"name":"embeddings","shape":'
        + json.dumps(shape).encode()
        + b',"datatype":"FP32","data":'
        + data
        + b'}],"parameters":{"binary_data_output":true}}'
    )


# -- item 2: JSON answers and bodies, bounded and coded off the event loop -------------------


def test_a_json_answer_past_its_bound_is_refused_before_compute(server: ServerProcess) -> None:
    """The issue's case: [12, 512, 512] asking for the weights as JSON (~700 MB of text) once
    held the loop 10 s, took +1.5 GiB and had the front end killed by the watchdog."""
    frontends = {name: pid for name, pid in child_pids(server).items() if "frontend" in name}
    batches = server.metric("attention_batches_total")
    body, headers = _binary_infer(12, ["output", "attention_weights"])
    with Probe(server) as probe, RssSampler(server.pid, period_s=0.02) as memory:
        status, reply_headers, raw = _request(server, "POST", INFER, body, headers)
    assert status == 400, raw[:300]
    message = _error(reply_headers, raw)
    assert "as JSON would take up to 736100352 bytes" in message
    assert f"bound of {JSON_ANSWER_BOUND} bytes" in message
    assert "--max-json-answer-bytes" in message
    assert "binary_data" in message
    assert server.metric("attention_batches_total") == batches  # refused before compute
    assert memory.growth_mib < 64, memory.growth_mib  # the request's own 12 MiB, no answer
    assert probe.slowest_s < PROBE_STALL_S
    current = {name: pid for name, pid in child_pids(server).items() if "frontend" in name}
    assert current == frontends, "no front end was restarted"


def test_a_json_answer_within_its_bound_never_holds_the_loop(server: ServerProcess) -> None:
    """[1, 512, 512] with the weights, both as JSON: ~61 MB estimated, just under the default
    bound (main held the loop 2.3 s for it). Its memory stays within what the budget counts:
    twice the estimate (docs/security.md)."""
    body, headers = _binary_infer(1, ["output", "attention_weights"])
    with Probe(server) as probe, RssSampler(server.pid, period_s=0.02) as memory:
        status, reply_headers, raw = _request(server, "POST", INFER, body, headers)
    assert status == 200, raw[:300]
    assert reply_headers["Content-Type"] == "application/json"
    output, weights = json.loads(raw)["outputs"]
    assert output["shape"] == [1, 512, D]
    assert weights["shape"] == [1, H, 512, 512]
    rows = np.asarray(weights["data"], dtype=np.float32).reshape(-1, 512)
    np.testing.assert_allclose(rows.sum(axis=1), 1.0, atol=1e-4)  # softmax rows, all there
    assert probe.slowest_s < PROBE_STALL_S, probe.slowest_s
    estimate = (512 * D + H * 512 * 512) * 26
    assert memory.growth_mib * MIB < 2 * estimate, memory.growth_mib


def test_the_json_bound_counts_the_outputs_asked_for_alone(server: ServerProcess) -> None:
    """[16, 128, 512] asking for the weights alone: ~55 MB of JSON, under the bound; with the
    output (not asked for, not sent) it would be ~82 MB. Before: refused with 400, "the
    answer's output, attention_weights as JSON would take up to 81788928 bytes"."""
    body, headers = _binary_infer(16, ["attention_weights"], seq=128)
    status, _, raw = _request(server, "POST", INFER, body, headers)
    assert status == 200, raw[:300]
    (weights,) = json.loads(raw)["outputs"]
    assert weights["name"] == "attention_weights"
    assert weights["shape"] == [16, H, 128, 128]


def test_a_json_body_past_its_bound_is_refused(server: ServerProcess) -> None:
    body = _json_infer([30, 512, 512])  # 30 MiB of numbers: main held the loop 2 s, +1 GiB
    assert JSON_REQUEST_BOUND < len(body) < server_body_limit()
    status, headers, raw = _request(server, "POST", INFER, body)
    assert status == 413, raw[:300]
    message = _error(headers, raw)
    assert f"the request's JSON is {len(body)} bytes" in message
    assert f"bound of {JSON_REQUEST_BOUND} bytes" in message
    assert "--max-json-request-bytes" in message
    assert "binary_data_size" in message
    # Refused on its Content-Length, before a byte of it is sent.
    with socket.create_connection(("127.0.0.1", server.http_port), timeout=30) as sock:
        sock.sendall(
            f"POST {INFER} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nExpect: 100-continue\r\n\r\n".encode()
        )
        status, headers, raw = _read_answer(sock)
    assert status == 413
    assert "--max-json-request-bytes" in _error(headers, raw)


def server_body_limit() -> int:
    return 32 * 512 * D * 4 + (1 << 20)  # --max-batch-size x --max-seq-len x d, + envelope


def test_a_json_body_within_its_bound_never_holds_the_loop(server: ServerProcess) -> None:
    """20 MiB of JSON numbers, decoded in full (then refused for its batch of 40, so that no
    compute competes with the probe): main held the loop over a second."""
    body = _json_infer([40, 256, 512])
    assert 20 << 20 <= len(body) < JSON_REQUEST_BOUND
    with Probe(server) as probe:
        status, headers, raw = _request(server, "POST", INFER, body)
    assert status == 400, raw[:300]
    assert "40" in _error(headers, raw)
    assert probe.slowest_s < PROBE_STALL_S, probe.slowest_s


def test_nested_and_ragged_json_data(server: ServerProcess) -> None:
    """Data decoded in pieces reads as it did whole: nested rows, and ragged ones refused."""
    x = np.random.default_rng(3).standard_normal((2, 3, D)).astype(np.float32)
    tensor = {"name": "embeddings", "shape": [2, 3, D], "datatype": "FP32", "data": x.tolist()}
    status, _, raw = _request(server, "POST", INFER, json.dumps({"inputs": [tensor]}).encode())
    assert status == 200, raw[:300]
    flat = dict(tensor, data=x.ravel().tolist())
    _, _, flat_raw = _request(server, "POST", INFER, json.dumps({"inputs": [flat]}).encode())
    assert json.loads(raw)["outputs"] == json.loads(flat_raw)["outputs"]
    ragged = dict(tensor, data=[x[0].tolist(), x[1, :2].tolist()])
    status, headers, raw = _request(
        server, "POST", INFER, json.dumps({"inputs": [ragged]}).encode()
    )
    assert status == 400
    assert "not a regular array" in _error(headers, raw)


def test_numbers_the_datatype_cannot_hold_and_booleans_among_numbers_are_400(
    server: ServerProcess,
) -> None:
    """1e39 is a finite JSON number that FP32 cannot hold: refused as such (it read as a
    non-finite input, and numpy's overflow warning went to the log as a bare line); true
    among numbers is a boolean, as it is alone (numpy read it as 1.0)."""
    values = [0.5] * (4 * D)
    cases = {
        "outside FP32's range (such as 1e+39": [1e39, *values[1:]],
        "holds booleans": [True, *values[1:]],
    }
    for expected, data in cases.items():
        for shaped in (data, [[data[i : i + D] for i in range(0, 4 * D, D)]]):
            tensor = {"name": "embeddings", "shape": [1, 4, D], "datatype": "FP32", "data": shaped}
            body = json.dumps({"inputs": [tensor]}).encode()
            status, headers, raw = _request(server, "POST", INFER, body)
            assert status == 400, raw[:300]
            assert expected in _error(headers, raw), raw[:300]
    assert "Warning" not in server.log, server.log[-2000:]


# -- item 3: integers past Python's digit limit ----------------------------------------------

HUGE = "9" * 5000  # json.loads and int() refuse more than 4300 digits with a bare ValueError
HUGE_INTEGERS = [
    ("POST", INFER, '{"id": ' + HUGE + ', "inputs": []}', {}),
    (
        "POST",
        INFER,
        '{"inputs": [{"name": "embeddings", "shape": [1, 1, 512], '
        '"datatype": "FP32", "data": [' + HUGE + "]}]}",
        {},
    ),
    (
        "POST",
        "/v2/systemsharedmemory/region/r/register",
        '{"key": "/k", "offset": ' + HUGE + ', "byte_size": 4}',
        {},
    ),
    ("POST", "/v2/repository/index", '{"ready": ' + HUGE + "}", {}),
    ("POST", INFER, '{"inputs": []}', {"Inference-Header-Content-Length": HUGE}),
]


@pytest.mark.parametrize(
    ("method", "path", "body", "headers"),
    HUGE_INTEGERS,
    ids=["infer-id", "infer-data", "shm-register", "repository-index", "header-length"],
)
def test_integers_past_the_digit_limit_are_400(
    server: ServerProcess, method: str, path: str, body: str, headers: dict[str, str]
) -> None:
    status, reply_headers, raw = _request(server, method, path, body.encode(), headers)
    assert status == 400, raw[:300]
    message = _error(reply_headers, raw)
    assert "digits" in message or "Inference-Header-Content-Length" in message
    assert HUGE not in message


def test_a_register_offset_past_64_bits_is_400(server: ServerProcess) -> None:
    body = json.dumps({"key": "/k", "offset": 1 << 64, "byte_size": 4}).encode()
    status, headers, raw = _request(
        server, "POST", "/v2/systemsharedmemory/region/r/register", body
    )
    assert status == 400
    assert "offset, an integer from 0 to" in _error(headers, raw)


# -- item 4: bodies whose Content-Encoding does not decode -----------------------------------

BODY_ENDPOINTS = [
    INFER,
    "/v2/repository/index",
    "/v2/repository/models/mha/load",
    "/v2/repository/models/mha/unload",
    "/v2/systemsharedmemory/region/r/register",
]


@pytest.mark.parametrize("encoding", ["gzip", "deflate", "br"])
@pytest.mark.parametrize("path", BODY_ENDPOINTS)
def test_a_body_that_does_not_decode_is_400(
    server: ServerProcess, path: str, encoding: str
) -> None:
    status, headers, raw = _request(
        server, "POST", path, b'{"not": "compressed at all"}', {"Content-Encoding": encoding}
    )
    assert status == 400, raw[:300]
    message = _error(headers, raw)
    assert f"does not decode as its Content-Encoding '{encoding}' says" in message


def test_a_body_that_decodes_is_served(server: ServerProcess) -> None:
    status, _, raw = _request(
        server, "POST", "/v2/repository/index", gzip.compress(b"{}"), {"Content-Encoding": "gzip"}
    )
    assert status == 200, raw[:300]
    assert json.loads(raw)[0]["name"] == "mha"


# -- item 5: restricted metadata, by the matched route ---------------------------------------


def test_every_route_has_a_triton_group(server: ServerProcess) -> None:
    assert {group for _, _, _, group in ROUTES} <= set(GROUPS)
    status, _, raw = _request(server, "HEAD", "/v2/health/live")  # GET routes take HEAD too
    assert (status, raw) == (200, b"")


@pytest.mark.parametrize(
    "path", ["/v2/models/ready", "/v2/models/infer", "/v2/models/stats/versions/1", "/v2"]
)
def test_metadata_routes_need_the_key_whatever_the_model_is_called(
    server: ServerProcess, path: str
) -> None:
    """A model may be called "ready" or "infer": its metadata is still metadata (main took
    the path's tail for the group and answered 404 listing the models served)."""
    status, headers, raw = _request(server, "GET", path)
    assert status == 403, raw[:300]
    assert HEADER in _error(headers, raw)
    status, _, raw = _request(server, "GET", path, headers={HEADER: SECRET})
    assert status in (200, 404), raw[:300]


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/v2/models/nope/ready"),
        ("GET", "/v2/models/x%2Fready"),
        ("GET", "/v2/models/mha/versions/9/ready"),
        ("POST", "/v2/models/nope/infer"),
        ("GET", "/v2/models/nope/config"),
        ("GET", "/v2/models/nope/stats"),
    ],
)
def test_a_404_without_the_metadata_key_lists_no_models(
    server: ServerProcess, method: str, path: str
) -> None:
    status, headers, raw = _request(server, method, path, b"{}" if method == "POST" else None)
    assert status in (403, 404), raw[:300]
    message = _error(headers, raw)
    assert "['mha']" not in message
    assert "this server serves" not in message
    assert "available versions" not in message


def test_a_404_with_the_metadata_key_lists_them_but_ready_never_does(
    server: ServerProcess,
) -> None:
    key = {HEADER: SECRET}
    status, headers, raw = _request(server, "POST", "/v2/models/nope/infer", b"{}", key)
    assert status == 404
    assert "this server serves ['mha']" in _error(headers, raw)
    status, headers, raw = _request(server, "GET", "/v2/models/nope/ready", headers=key)
    assert status == 404
    assert "serves" not in _error(headers, raw)  # as gRPC's ModelReady: only "not ready"


@pytest.fixture(scope="module")
def grpc_server(server: ServerProcess, grpc_gateway: str) -> Iterator[ServerProcess]:
    """The server in each gateway mode, for its gRPC call (REST is the Python front end's in
    both)."""
    with in_mode(server, grpc_gateway) as process:
        yield process


def test_grpc_model_ready_says_false_for_a_model_not_served(grpc_server: ServerProcess) -> None:
    client = triton_grpc.InferenceServerClient(grpc_server.target)
    assert client.is_model_ready("nope") is False
    client.close()


# -- item 6: connection timeouts --------------------------------------------------------------


def _closed_within(sock: socket.socket, timeout_s: float) -> float:
    """Seconds until the server closed sock (reading whatever it sent first)."""
    started = time.monotonic()
    sock.settimeout(timeout_s)
    while sock.recv(65536):
        pass
    return time.monotonic() - started


def test_a_silent_connection_is_closed_at_the_header_deadline(server: ServerProcess) -> None:
    with socket.create_connection(("127.0.0.1", server.http_port), timeout=30) as sock:
        took = _closed_within(sock, 15)
    assert took < HEADER_TIMEOUT_S + 3, took


def test_headers_sent_a_byte_at_a_time_get_408(server: ServerProcess) -> None:
    request = f"GET /v2/health/live HTTP/1.1\r\nHost: x\r\nX-Padding: {'p' * 200}\r\n\r\n"
    with socket.create_connection(("127.0.0.1", server.http_port), timeout=30) as sock:
        started = time.monotonic()
        for byte in request.encode():
            sock.sendall(bytes([byte]))
            readable, _, _ = select.select([sock], [], [], 0.1)  # a byte every 0.1 s
            if readable:
                break
        status, headers, raw = _read_answer(sock)
        took = time.monotonic() - started
    assert status == 408, raw
    assert "--http-header-timeout-s" in _error(headers, raw)
    assert took < HEADER_TIMEOUT_S + 3, took


def test_an_idle_connection_is_closed_after_the_idle_timeout(server: ServerProcess) -> None:
    with socket.create_connection(("127.0.0.1", server.http_port), timeout=30) as sock:
        sock.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n")
        status, _, raw = _read_answer(sock)
        assert (status, raw) == (200, b'{"live": true}')
        took = _closed_within(sock, 30)
    # The idle timeout, not the header deadline: no byte of a next request came.
    assert IDLE_S - 0.5 < took < IDLE_S + 5, took


# -- item 7: errors aiohttp makes by itself, as JSON ------------------------------------------

MARK = "EchoMark"  # must not come back in an answer
PARSER_REFUSALS = [
    (
        "both-lengths",
        400,
        f"POST {INFER} HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\n"
        f"Transfer-Encoding: chunked\r\nX-{MARK}: 1\r\n\r\n0\r\n\r\n",
    ),
    (
        "two-lengths",
        400,
        f"POST {INFER} HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n"
        f"Content-Length: 2\r\nX-{MARK}: 1\r\n\r\n{{}}",
    ),
    ("long-header", 431, f"GET /v2 HTTP/1.1\r\nHost: x\r\nX-{MARK}: {'h' * 9000}\r\n\r\n"),
    (
        "many-headers",
        431,
        "GET /v2 HTTP/1.1\r\nHost: x\r\n"
        + "".join(f"X-{MARK}-{i}: 1\r\n" for i in range(200))
        + "\r\n",
    ),
    ("long-url", 414, f"GET /v2/models/{MARK}{'u' * 9000} HTTP/1.1\r\nHost: x\r\n\r\n"),
    ("bad-method", 400, f"G{MARK}(T /v2 HTTP/1.1\r\nHost: x\r\n\r\n"),
    (
        "unknown-expect",
        417,
        f"POST {INFER} HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nExpect: {MARK}\r\n\r\n",
    ),
]


def _read_answer(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    sock.settimeout(30)
    reply = http.client.HTTPResponse(sock)
    reply.begin()
    return reply.status, dict(reply.getheaders()), reply.read()


@pytest.mark.parametrize(
    ("status", "request_text"),
    [(status, text) for _, status, text in PARSER_REFUSALS],
    ids=[name for name, _, _ in PARSER_REFUSALS],
)
def test_parser_refusals_are_json_errors(
    server: ServerProcess, status: int, request_text: str
) -> None:
    with socket.create_connection(("127.0.0.1", server.http_port), timeout=30) as sock:
        sock.sendall(request_text.encode())
        got, headers, raw = _read_answer(sock)
    assert got == status, raw[:300]
    message = _error(headers, raw)
    assert MARK not in message  # the parser's own messages quoted the request


ANSWERS: list[tuple[str, str, Callable[[], bytes | None], dict[str, str]]] = [
    ("GET", "/v2/health/live", lambda: None, {}),
    ("GET", "/v2/models/mha", lambda: None, {HEADER: SECRET}),
    ("GET", "/v2/nothing-here", lambda: None, {}),
    ("POST", "/v2/repository/index", lambda: b"{}", {}),
    ("POST", INFER, lambda: b"{bad", {}),
]


@pytest.mark.parametrize(("method", "path", "body", "headers"), ANSWERS)
def test_every_json_answer_is_typed_exactly_application_json(
    server: ServerProcess,
    method: str,
    path: str,
    body: Callable[[], bytes | None],
    headers: dict[str, str],
) -> None:
    """The KServe SDK shows an error's text only for exactly application/json (aiohttp's
    json_response adds "; charset=utf-8")."""
    _, reply_headers, raw = _request(server, method, path, body(), headers)
    assert reply_headers["Content-Type"] == "application/json"
    json.loads(raw)


# -- round 3: a compressed body the endpoint does not read ------------------------------------


@functools.cache
def _brotli_bomb(gib: int) -> bytes:
    """A few KB of brotli that inflate to gib GiB of zeros."""
    import brotli

    compressor = brotli.Compressor(quality=5)
    zeros = b"\0" * (64 << 20)
    return b"".join(compressor.process(zeros) for _ in range(gib * 16)) + compressor.finish()


@pytest.mark.parametrize(
    ("method", "path", "status"),
    [
        ("GET", "/v2/health/live", 200),
        ("POST", "/v2/nothing-here", 404),
        ("POST", "/v2/models/mha", 405),
    ],
)
def test_an_unread_compressed_body_is_never_inflated(
    server: ServerProcess, method: str, path: str, status: int
) -> None:
    """aiohttp's lingering close read and discarded a body the handler had not read, for up to
    10 s, inflating it on the event loop: 6 KB of brotli held the loop until the watchdog
    killed the front end. The connection closes after the answer instead."""
    frontends = {name: pid for name, pid in child_pids(server).items() if "frontend" in name}
    bomb = _brotli_bomb(3)
    assert len(bomb) < 64 << 10
    head = (
        f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Encoding: br\r\n"
        f"Content-Length: {len(bomb)}\r\n\r\n"
    )
    with Probe(server) as probe:
        with socket.create_connection(("127.0.0.1", server.http_port), timeout=30) as sock:
            sock.sendall(head.encode() + bomb)
            got, _, raw = _read_answer(sock)
            took = _closed_within(sock, 20)
        time.sleep(0.5)
    assert got == status, raw[:300]
    assert took < 2, f"the connection stayed open {took:.1f} s after its answer"
    assert probe.slowest_s < PROBE_STALL_S, probe.slowest_s
    current = {name: pid for name, pid in child_pids(server).items() if "frontend" in name}
    assert current == frontends, "no front end was restarted"
    assert "sent no heartbeat" not in server.log


def test_refused_big_json_bodies_do_not_pile_up_in_memory(server: ServerProcess) -> None:
    """An exception raised on the codec thread held, through its traceback, the frame that
    awaited it, whose future held the exception: a cycle that kept the decoded body (hundreds
    of MiB) until a full collection. Ten refused 16 KB gzip bodies took the front end to
    4.5 GB; each body's memory (here about 170 MiB of floats) must be free once it is
    answered."""
    items = (20 << 20) // 4
    body = b'{"pad":[' + b"0.5," * (items - 1) + b'0.5],"inputs":5}'
    assert len(body) < JSON_REQUEST_BOUND
    compressed = gzip.compress(body, 9)
    headers = {"Content-Encoding": "gzip"}
    status, reply_headers, raw = _request(server, "POST", INFER, compressed, headers)
    assert status == 400, raw[:300]
    assert "expected a list" in _error(reply_headers, raw)
    base = server_rss_bytes(server)  # after one: the allocator's arenas are warm
    for _ in range(6):
        status, _, raw = _request(server, "POST", INFER, compressed, headers)
        assert status == 400, raw[:300]
    growth = server_rss_bytes(server) - base
    # One decoded body is ~170 MiB (5 million floats and the list): one kept fails this.
    assert growth < 150 << 20, f"the server grew {growth >> 20} MiB"


def _tensor_body(data: bytes, parameters: bytes = b"", outputs: bytes = b"") -> bytes:
    return (
        b'{"inputs":[{"name":"embeddings","shape":[32,512,511],"datatype":"FP32",'
        + parameters
        + b'"data":'
        + data
        + b"}]"
        + outputs
        + b"}"
    )


def _many(item: bytes, nbytes: int = 16 << 20) -> bytes:
    return b",".join([item] * (nbytes // (len(item) + 1)))


def _names(template: bytes, nbytes: int = 16 << 20) -> bytes:
    return b",".join(template % i for i in range(nbytes // (len(template) + 2)))


NUMBER_FREE = [
    ("empty-lists", lambda: _tensor_body(b"[" + _many(b"[]") + b"]"), "without numbers"),
    ("nulls", lambda: _tensor_body(b"[" + _many(b"null") + b"]"), "without numbers"),
    ("strings", lambda: _tensor_body(b"[" + _many(b'""') + b"]"), "strings"),
    ("objects", lambda: _tensor_body(b"[" + _many(b"{}") + b"]"), "objects"),
    # UTF-16 moves the scan's quotes (U+2200 is the bytes 00 22) off json.loads' strings.
    (
        "utf-16",
        lambda: (
            '{"id":"\u2200",' + _tensor_body(b"[" + _many(b"[]", 8 << 20) + b"]").decode()[1:]
        ).encode("utf-16-le"),
        "expected UTF-8",
    ),
    ("lists-then-numbers", lambda: _tensor_body(b"[" + _many(b"[]") + b",[1]]"), "without numbers"),
    (
        "input-parameters",
        lambda: _tensor_body(b"[0]", b'"parameters":{' + _names(b'"p%07d":1') + b"},"),
        "strings",
    ),
    (
        "request-parameters",
        lambda: b'{"parameters":{' + _names(b'"p%07d":1') + b'},"inputs":[]}',
        "strings",
    ),
    (
        "outputs",
        lambda: _tensor_body(b"[0]", outputs=b',"outputs":[' + _many(b'{"name":"output"}') + b"]"),
        "strings",
    ),
    (
        "inputs",
        lambda: b'{"inputs":[' + _many(b'{"name":"e","shape":[1],"data":[0]}') + b"]}",
        "strings",
    ),
    (
        "shape",
        lambda: b'{"inputs":[{"name":"e","shape":[' + _many(b"1") + b'],"data":[0]}]}',
        "at most 64",
    ),
]


@pytest.mark.parametrize(
    ("body", "expected"),
    [(body, expected) for _, body, expected in NUMBER_FREE],
    ids=[name for name, _, _ in NUMBER_FREE],
)
def test_json_the_byte_bound_allows_never_holds_the_loop(
    server: ServerProcess, body: Callable[[], bytes], expected: str
) -> None:
    """JSON without numbers gave json.loads no hook to give the GIL back at (millions of
    empty lists held the loop seconds), and counts the byte bound does not limit (a million
    parameters, outputs, inputs) were processed on the loop: refused, the loop free."""
    raw_body = body()
    assert INLINE_LIMIT < len(raw_body) < JSON_REQUEST_BOUND
    with Probe(server) as probe:
        status, headers, raw = _request(server, "POST", INFER, raw_body)
    assert probe.slowest_s < PROBE_STALL_S, probe.slowest_s
    assert status == 400, raw[:300]
    assert expected in _error(headers, raw)


INLINE_LIMIT = 64 << 10


def _input(parameters: dict[str, object] | None = None) -> dict[str, object]:
    return {
        "name": "embeddings",
        "shape": [1, 1, D],
        "datatype": "FP32",
        "data": [0.5] * D,
        "parameters": parameters or {},
    }


MANY = {f"p{i}": 1 for i in range(65)}
COUNTED = [
    (
        "request-parameters",
        INFER,
        {"parameters": MANY, "inputs": [_input()]},
        "request parameters has 65 entries",
    ),
    ("input-parameters", INFER, {"inputs": [_input(MANY)]}, "parameters has 65 entries"),
    ("inputs", INFER, {"inputs": [_input()] * 65}, "inputs has 65 entries"),
    (
        "outputs",
        INFER,
        {"inputs": [_input()], "outputs": [{"name": "output"}] * 65},
        "outputs has 65 entries",
    ),
    (
        "output-parameters",
        INFER,
        {"inputs": [_input()], "outputs": [{"name": "output", "parameters": MANY}]},
        "parameters has 65 entries",
    ),
    ("shape", INFER, {"inputs": [dict(_input(), shape=[1] * 65)]}, "shape has 65 entries"),
    (
        "load-parameters",
        "/v2/repository/models/mha/load",
        {"parameters": MANY},
        "parameters has 65 entries",
    ),
    ("log-settings", "/v2/logging", MANY, "request has 65 entries"),
]


@pytest.mark.parametrize(
    ("path", "body", "expected"),
    [(path, body, expected) for _, path, body, expected in COUNTED],
    ids=[name for name, _, _, _ in COUNTED],
)
def test_counts_past_their_bound_are_400(
    server: ServerProcess, path: str, body: dict[str, object], expected: str
) -> None:
    status, headers, raw = _request(server, "POST", path, json.dumps(body).encode())
    assert status == 400, raw[:300]
    message = _error(headers, raw)
    assert expected in message
    assert "at most 64" in message


@pytest.mark.parametrize("value", [b"\xff", b"metadata-Secret-7\xff", b"\xc3\x28", b"\xed\xa0\x80"])
def test_a_key_header_that_is_not_utf8_is_403(server: ServerProcess, value: bytes) -> None:
    """A restricted API's key header holding bytes that are not UTF-8 (aiohttp decodes them
    with surrogateescape) is a wrong key like any other: 403, no 500 and no traceback."""
    with socket.create_connection(("127.0.0.1", server.http_port), timeout=30) as sock:
        sock.sendall(
            b"GET /v2 HTTP/1.1\r\nHost: x\r\n" + HEADER.encode() + b": " + value + b"\r\n\r\n"
        )
        status, headers, raw = _read_answer(sock)
    assert status == 403, raw[:300]
    assert "with a wrong value in the header" in _error(headers, raw)
    assert "Traceback" not in server.log


@pytest.mark.parametrize(
    "start",
    [
        b"Content-Length: 100\r\n\r\n{",
        b"Transfer-Encoding: chunked\r\n\r\n1\r\n{\r\n",
        b"Content-Length: 100\r\nExpect: 100-continue\r\n\r\n",
    ],
    ids=["short-body", "unfinished-chunks", "expect-then-nothing"],
)
def test_a_body_that_stops_coming_gets_408(server: ServerProcess, start: bytes) -> None:
    """Headers, then part of a body (or none) and silence: the connection stayed open for
    ever, its handler waiting."""
    with socket.create_connection(("127.0.0.1", server.http_port), timeout=30) as sock:
        began = time.monotonic()
        sock.sendall(b"POST /v2/repository/index HTTP/1.1\r\nHost: x\r\n" + start)
        status, headers, raw = _read_answer(sock)
        if status == 100:  # the interim answer to Expect: the final one follows
            status, headers, raw = _read_answer(sock)
        took = _closed_within(sock, 15) + time.monotonic() - began
    assert status == 408, raw[:300]
    assert "--http-header-timeout-s" in _error(headers, raw)
    assert took < HEADER_TIMEOUT_S + 3, took


def test_a_transfer_coding_other_than_chunked_is_501(server: ServerProcess) -> None:
    """RFC 9112's answer to a transfer coding not understood. Before: "gzip, chunked" had its
    chunks read and their gzip bytes parsed as JSON (400, "not UTF-8")."""
    body = gzip.compress(b'{"inputs": []}')
    chunked = f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\n"
    with socket.create_connection(("127.0.0.1", server.http_port), timeout=30) as sock:
        sock.sendall(
            f"POST {INFER} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            "Transfer-Encoding: gzip, chunked\r\n\r\n".encode()
            + chunked
        )
        status, headers, raw = _read_answer(sock)
        _closed_within(sock, 15)
    assert status == 501, raw[:300]
    assert "Transfer-Encoding 'gzip' is not supported" in _error(headers, raw)


def test_a_pipelined_partial_request_gets_408(server: ServerProcess) -> None:
    """A whole request and the start of the next in one packet, then silence: the header
    deadline was never armed for the second (its bytes came before the first was answered),
    and the connection stayed open."""
    with socket.create_connection(("127.0.0.1", server.http_port), timeout=30) as sock:
        began = time.monotonic()
        sock.sendall(
            b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\nGET /v2/health/live HTTP/1.1\r\nHo"
        )
        status, _, raw = _read_answer(sock)
        assert (status, raw) == (200, b'{"live": true}')
        status, headers, raw = _read_answer(sock)
        took = time.monotonic() - began
    assert status == 408, raw[:300]
    assert "--http-header-timeout-s" in _error(headers, raw)
    assert took < HEADER_TIMEOUT_S + 1.5, took  # not the idle timeout (IDLE_S)


@pytest.mark.parametrize(
    ("parameters", "where"),
    [
        ({"binary_data_output": "true"}, None),
        ({"binary_data_output": 1}, None),
        (None, {"binary_data": "no"}),
        (None, {"binary_data": 0}),
    ],
)
def test_binary_flags_that_are_not_booleans_are_400(
    server: ServerProcess, parameters: dict[str, object] | None, where: dict[str, object] | None
) -> None:
    """ "binary_data": "no" was taken as true, "binary_data_output": "true" as false."""
    body: dict[str, object] = {"inputs": [_input()]}
    if parameters is not None:
        body["parameters"] = parameters
    if where is not None:
        body["outputs"] = [{"name": "output", "parameters": where}]
    status, headers, raw = _request(server, "POST", INFER, json.dumps(body).encode())
    assert status == 400, raw[:300]
    assert "expected true or false" in _error(headers, raw)


def test_a_json_length_past_the_body_is_400(server: ServerProcess) -> None:
    body = b'{"inputs": []}'
    status, headers, raw = _request(
        server, "POST", INFER, body, {"Inference-Header-Content-Length": str(100 << 20)}
    )
    assert status == 400, raw[:300]
    assert f"at most the body's {len(body)}" in _error(headers, raw)


def test_a_405_says_what_is_allowed(server: ServerProcess) -> None:
    status, headers, raw = _request(server, "DELETE", "/v2/health/live")
    assert status == 405, raw[:300]
    assert "GET" in headers["Allow"]
    _error(headers, raw)


def test_no_inputs_names_none(server: ServerProcess) -> None:
    status, headers, raw = _request(server, "POST", INFER, b'{"inputs": []}')
    assert status == 400, raw[:300]
    message = _error(headers, raw)
    assert "got 0" in message
    assert "got 0:" not in message


def test_a_client_gone_mid_body_leaves_no_error_in_the_log(server: ServerProcess) -> None:
    """A client that closes its connection while its body is still coming is an everyday
    event, not this server's error: no ERROR record, no traceback; the next call is served."""
    header = b'{"inputs":[{"name":"embeddings","shape":[1,16,512],"datatype":"FP32","data":['
    for declared, sent in [(200_000, 1_000), (200_000, 100_000), (5_000, 10)]:
        with socket.create_connection(("127.0.0.1", server.http_port), timeout=30) as sock:
            sock.sendall(
                b"POST /v2/models/mha/infer HTTP/1.1\r\nHost: x\r\n"
                b"Content-Type: application/json\r\n"
                + f"Content-Length: {declared}\r\n\r\n".encode()
                + header
                + b"0.5," * (sent // 4)
            )
    status, _, raw = _request(server, "POST", "/v2/models/mha/infer", _json_infer([1, 4, 512]))
    assert status == 200, raw[:300]
    # A record the same process logs after those connections went: what they logged, if
    # anything, is in the log before it.
    _request(server, "POST", "/v2/repository/models/mha/load", b"{}")
    deadline = time.monotonic() + 30
    while "REST load of model" not in server.log:
        assert time.monotonic() < deadline, server.log[-3000:]
        time.sleep(0.05)
    assert "never retrieved" not in server.log, server.log[-3000:]
    assert "ConnectionResetError" not in server.log
