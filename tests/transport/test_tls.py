"""TLS and mutual TLS on the gRPC port, end to end: both APIs and health over TLS, clients
without a good certificate refused, certificates reloaded without a restart, and bad files
refused at startup with a clear message."""

from __future__ import annotations

import os
import ssl
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import tritonclient.grpc as triton
import tritonclient.http as triton_http
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tritonclient.utils import InferenceServerException

from bench.harness import loopback_server, wait_for
from service import healthcheck
from service.client import AttentionClient, tls_options
from service.settings import load_settings
from service.transport.tls import TlsError, TlsFiles, channel_credentials, load_material, server_tls
from tests.harness.server_process import REPO_ROOT, child_pids
from tests.harness.tls_helpers import Authority, TlsServerProcess, tiny_repository

# Every server here runs with the gRPC gateway, then without it (the module's server
# fixtures take grpc_gateway; tests that start their own servers get it from this mark).
pytestmark = pytest.mark.usefixtures("grpc_gateway")

D = 32
REFUSED = (grpc.StatusCode.UNAVAILABLE,)


class Pki:
    """Files for every case: our CA, a stranger's CA, and the certificates they issued."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.ca = Authority("test CA")
        self.other_ca = Authority("someone else's CA")
        self.ca_file = self.ca.write(folder, "ca")
        self.other_ca_file = self.other_ca.write(folder, "other-ca")
        self.server_cert, self.server_key = self.ca.issue("server", server=True).write(
            folder, "server"
        )
        self.client = self.ca.issue("client", server=False).write(folder, "client")
        self.stranger = self.other_ca.issue("stranger", server=False).write(folder, "stranger")
        self.expired = self.ca.issue("expired", server=False, expired=True).write(folder, "expired")

    def server_flags(self, *, mutual: bool) -> tuple[str, ...]:
        flags = ("--tls-cert", str(self.server_cert), "--tls-key", str(self.server_key))
        return (*flags, "--tls-client-ca", str(self.ca_file)) if mutual else flags

    def credentials(self, client: tuple[Path, Path] | None = None) -> grpc.ChannelCredentials:
        cert, key = client if client else (None, None)
        return channel_credentials(self.ca_file, cert, key)


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_repository(tmp_path_factory.getbasetemp())


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return Pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def tls_server(repository: Path, pki: Pki, grpc_gateway: str) -> Iterator[TlsServerProcess]:
    server = TlsServerProcess(
        repository, *pki.server_flags(mutual=False), credentials=pki.credentials()
    )
    with server:
        yield server
    assert server.terminate() == 0, server.log


@pytest.fixture(scope="module")
def tls_rest_server(repository: Path, pki: Pki, grpc_gateway: str) -> Iterator[TlsServerProcess]:
    server = TlsServerProcess(
        repository, *pki.server_flags(mutual=False), credentials=pki.credentials(), http=True
    )
    with server:
        yield server
    assert server.terminate() == 0, server.log


@pytest.fixture(scope="module")
def mtls_server(repository: Path, pki: Pki, grpc_gateway: str) -> Iterator[TlsServerProcess]:
    server = TlsServerProcess(
        repository, *pki.server_flags(mutual=True), credentials=pki.credentials(pki.client)
    )
    with server:
        yield server
    assert server.terminate() == 0, server.log


def _embeddings(seq: int = 5) -> np.ndarray:
    return np.random.default_rng(0).standard_normal((seq, D), dtype=np.float32)


def _health(target: str, credentials: grpc.ChannelCredentials | None) -> int:
    channel = (
        grpc.secure_channel(target, credentials)
        if credentials is not None
        else grpc.insecure_channel(target)
    )
    with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return stub.Check(health_pb2.HealthCheckRequest(), timeout=5).status


# -- TLS --------------------------------------------------------------------------------------


def test_attention_service_over_tls(tls_server: TlsServerProcess, pki: Pki) -> None:
    with AttentionClient(tls_server.target, **tls_options(pki.ca_file)) as client:
        result = client.attend(_embeddings(), timeout_s=10)
    assert result.output.shape == (5, D)
    assert tls_server.log.count("gRPC port serves TLS;") == 1


def test_v2_api_over_tls_with_tritonclient(tls_server: TlsServerProcess, pki: Pki) -> None:
    client = triton.InferenceServerClient(
        tls_server.target, ssl=True, root_certificates=str(pki.ca_file)
    )
    assert client.is_server_live()
    assert client.is_model_ready("mha")
    x = _embeddings()[None]
    tensor = triton.InferInput("embeddings", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x)
    reply = client.infer("mha", [tensor])
    assert reply.as_numpy("output").shape == (1, 5, D)
    client.close()
    # The same client without TLS is refused (the port speaks only TLS).
    plain = triton.InferenceServerClient(tls_server.target)
    with pytest.raises(InferenceServerException):
        plain.is_server_live(client_timeout=3)
    plain.close()


def test_rest_over_tls_with_the_same_certificates(
    tls_rest_server: TlsServerProcess, pki: Pki
) -> None:
    url = tls_rest_server.http_url
    client = triton_http.InferenceServerClient(
        url,
        ssl=True,
        ssl_context_factory=lambda: ssl.create_default_context(cafile=str(pki.ca_file)),
    )
    assert client.is_server_live()
    x = _embeddings()[None]
    tensor = triton_http.InferInput("embeddings", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x, binary_data=True)
    reply = client.infer("mha", [tensor])
    grpc_reply = AttentionClient(tls_rest_server.target, **tls_options(pki.ca_file))
    np.testing.assert_allclose(
        reply.as_numpy("output"), grpc_reply.attend(x, timeout_s=10).output, atol=1e-6, rtol=0
    )
    grpc_reply.close()
    client.close()
    # Plain HTTP on the TLS port gets no answer, and a client that does not trust the CA
    # is refused in the handshake.
    with pytest.raises((ConnectionError, urllib.error.URLError)):  # closed, or reset
        urllib.request.urlopen(f"http://{url}/v2/health/live", timeout=5)
    with pytest.raises(urllib.error.URLError) as untrusted:
        urllib.request.urlopen(f"https://{url}/v2/health/live", timeout=5)
    assert isinstance(untrusted.value.reason, ssl.SSLCertVerificationError)


def test_health_over_tls_and_the_healthcheck_command(
    tls_server: TlsServerProcess, pki: Pki, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _health(tls_server.target, pki.credentials()) == health_pb2.HealthCheckResponse.SERVING
    flags = ["--target", tls_server.target, "--tls-ca", str(pki.ca_file)]
    assert healthcheck.main(flags) == 0
    assert capsys.readouterr().out.strip() == "SERVING"
    # Plaintext, or a CA that did not sign the server's certificate: unhealthy, exit 1.
    assert healthcheck.main(["--target", tls_server.target, "--timeout-s", "2"]) == 1
    stranger = [
        "--target",
        tls_server.target,
        "--tls-ca",
        str(pki.other_ca_file),
        "--timeout-s",
        "2",
    ]
    assert healthcheck.main(stranger) == 1
    # By IP address but checked against a name the certificate carries.
    by_name = [*flags, "--tls-server-name", "attention"]
    assert healthcheck.main(by_name) == 0


def test_client_cli_over_tls(tls_server: TlsServerProcess, pki: Pki) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "service.client",
            "--target",
            tls_server.target,
            "--tls-ca",
            str(pki.ca_file),
            "--seq",
            "4",
            "--requests",
            "3",
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert "3 requests in" in done.stdout


def test_plaintext_client_is_refused_and_metrics_stay_plain_http(
    tls_server: TlsServerProcess,
) -> None:
    with pytest.raises(grpc.RpcError) as refused:
        _health(tls_server.target, None)
    assert refused.value.code() in REFUSED
    assert tls_server.metric("attention_requests_total", api="attention") >= 1


# -- mutual TLS -------------------------------------------------------------------------------


def test_mutual_tls_accepts_a_client_certificate_from_the_ca(
    mtls_server: TlsServerProcess, pki: Pki
) -> None:
    with AttentionClient(mtls_server.target, **tls_options(pki.ca_file, *pki.client)) as client:
        assert client.attend(_embeddings(), timeout_s=10).output.shape == (5, D)
    as_text = tls_options(str(pki.ca_file), *(str(path) for path in pki.client))  # as documented
    with AttentionClient(mtls_server.target, **as_text) as client:
        assert client.attend(_embeddings(), timeout_s=10).output.shape == (5, D)
    assert "requires client certificates" in mtls_server.log
    cert, key = pki.client
    flags = ["--tls-ca", str(pki.ca_file), "--tls-cert", str(cert), "--tls-key", str(key)]
    assert healthcheck.main(["--target", mtls_server.target, *flags]) == 0


@pytest.mark.parametrize("who", ["no certificate", "another CA's", "expired"])
def test_mutual_tls_refuses_clients_without_a_good_certificate(
    mtls_server: TlsServerProcess, pki: Pki, who: str
) -> None:
    client = {"no certificate": None, "another CA's": pki.stranger, "expired": pki.expired}[who]
    with pytest.raises(grpc.RpcError) as refused:
        _health(mtls_server.target, pki.credentials(client))
    assert refused.value.code() in REFUSED, refused.value
    with (
        AttentionClient(mtls_server.target, credentials=pki.credentials(client)) as attention,
        pytest.raises(grpc.RpcError) as also_refused,
    ):
        attention.attend(_embeddings(), timeout_s=5)
    assert also_refused.value.code() in REFUSED


# -- rotation ---------------------------------------------------------------------------------


def test_certificate_files_replaced_are_served_without_a_restart(
    repository: Path, tmp_path: Path
) -> None:
    """As Kubernetes rotates a mounted Secret: the files are replaced under the server; new
    connections get the new certificate, the process never restarts."""
    old_ca, new_ca = Authority("old CA"), Authority("new CA")
    folder = tmp_path / "secret"
    cert, key = old_ca.issue("server", server=True).write(folder, "tls")
    old_trust = channel_credentials(old_ca.write(tmp_path, "old-ca"))
    new_trust = channel_credentials(new_ca.write(tmp_path, "new-ca"))
    flags = ("--tls-cert", str(cert), "--tls-key", str(key))
    with TlsServerProcess(repository, *flags, credentials=old_trust) as server:
        pids = child_pids(server)  # the same front end serves the new certificate
        assert _health(server.target, old_trust) == health_pb2.HealthCheckResponse.SERVING
        new_ca.issue("server", server=True).write(folder, "tls")

        def new_certificate_served() -> bool:
            try:
                return _health(server.target, new_trust) == health_pb2.HealthCheckResponse.SERVING
            except grpc.RpcError:
                return False

        wait_for(new_certificate_served, what="the new certificate")
        with pytest.raises(grpc.RpcError):  # the old CA no longer vouches for the server
            _health(server.target, old_trust)
        # A broken pair (the key of another certificate) is refused; the last good one stays.
        (folder / "tls.key").write_bytes(old_ca.issue("x", server=True).key)
        assert _health(server.target, new_trust) == health_pb2.HealthCheckResponse.SERVING
        assert child_pids(server) == pids
        assert server.process.poll() is None
        wait_for(lambda: "cannot be used" in server.log, what="the refusal logged")
        assert server.log.count("TLS certificate reloaded") == 1, server.log


def test_a_client_ca_replaced_is_trusted_for_new_connections(
    repository: Path, tmp_path: Path
) -> None:
    """Rotating the client CA (docs/security.md) takes effect on the next connection, on
    the gRPC port too with the gateway (which read it once, at start: clients of the old CA
    stayed accepted and the new CA's refused); a file copied in with an older modification
    time is a change too (it was not, for the gateway's certificate)."""
    server_ca, old_ca, new_ca = Authority("server CA"), Authority("old"), Authority("new")
    folder = tmp_path / "secret"
    cert, key = server_ca.issue("server", server=True).write(folder, "tls")
    client_ca = old_ca.write(folder, "client-ca")
    trust = server_ca.write(tmp_path, "server-ca")
    old_client = old_ca.issue("old client", server=False).write(tmp_path, "old-client")
    new_client = new_ca.issue("new client", server=False).write(tmp_path, "new-client")
    flags = ("--tls-cert", str(cert), "--tls-key", str(key), "--tls-client-ca", str(client_ca))

    def accepted(client: tuple[Path, Path]) -> bool:
        try:
            health = _health(server.target, channel_credentials(trust, *client))
            return health == health_pb2.HealthCheckResponse.SERVING
        except grpc.RpcError:
            return False

    old_trusted = channel_credentials(trust, *old_client)
    with TlsServerProcess(repository, *flags, credentials=old_trusted) as server:
        assert accepted(old_client)
        assert not accepted(new_client)
        stamp = client_ca.stat()
        staged = new_ca.write(tmp_path, "staged-ca")
        os.utime(staged, ns=(stamp.st_atime_ns, stamp.st_mtime_ns - 10**9))  # as cp -p
        os.replace(staged, client_ca)
        wait_for(lambda: accepted(new_client), what="the new client CA trusted")
        assert not accepted(old_client)


# -- configuration errors ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--tls-key", "k.pem"], "--tls-cert (ATTENTION_TLS_CERT) must be set with --tls-key"),
        (
            ["--tls-cert", "c.pem"],
            "--tls-key (ATTENTION_TLS_KEY) must be set with --tls-cert, but it is unset",
        ),
        (
            ["--tls-client-ca", "ca.pem"],
            "--tls-cert (ATTENTION_TLS_CERT) must be set with --tls-client-ca",
        ),
        (
            ["--max-connection-age-s", "-1"],
            "--max-connection-age-s (ATTENTION_MAX_CONNECTION_AGE_S) must be >= 0",
        ),
    ],
)
def test_incomplete_tls_settings_are_refused(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        load_settings(argv, {})
    assert message in capsys.readouterr().err


def test_tls_settings_read_the_environment() -> None:
    env = {
        "ATTENTION_TLS_CERT": "/s/tls.crt",
        "ATTENTION_TLS_KEY": "/s/tls.key",
        "ATTENTION_TLS_CLIENT_CA": "",
        "ATTENTION_MAX_CONNECTION_AGE_S": "60",
    }
    settings = load_settings([], env)
    assert (settings.tls_cert, settings.tls_key) == (Path("/s/tls.crt"), Path("/s/tls.key"))
    assert settings.tls_client_ca is None  # empty = off
    assert settings.max_connection_age_s == 60
    defaults = load_settings([], {})
    assert defaults.tls_cert is None
    assert defaults.max_connection_age_s == 300


def test_unusable_files_are_named_in_the_error(pki: Pki, tmp_path: Path) -> None:
    missing = tmp_path / "missing.crt"
    with pytest.raises(TlsError, match=r"cannot read the certificate \(--tls-cert\) .*missing"):
        server_tls(missing, pki.server_key, None)
    _, stranger_key = pki.stranger
    with pytest.raises(TlsError, match="are not a certificate and its key"):
        load_material(TlsFiles(pki.server_cert, stranger_key))
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate")
    with pytest.raises(TlsError, match="holds no PEM block"):
        server_tls(pki.server_cert, pki.server_key, garbage)
    with pytest.raises(TlsError, match="go together"):
        channel_credentials(pki.ca_file, pki.server_cert, None)
    from cryptography.hazmat.primitives import serialization

    key = serialization.load_pem_private_key(pki.server_key.read_bytes(), password=None)
    encrypted = tmp_path / "encrypted.key"
    encrypted.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.BestAvailableEncryption(b"pw"),
        )
    )
    with pytest.raises(TlsError, match=rf"\(--tls-key\) {encrypted} is encrypted"):
        load_material(TlsFiles(pki.server_cert, encrypted))


def test_server_with_an_unreadable_certificate_exits_with_a_clear_error(
    repository: Path, pki: Pki, tmp_path: Path
) -> None:
    missing = tmp_path / "secret" / "tls.key"
    done = subprocess.run(
        [
            *loopback_server(repository),
            "--tls-cert",
            str(pki.server_cert),
            "--tls-key",
            str(missing),
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1, done.stderr
    assert f"cannot start: cannot read the private key (--tls-key) {missing}" in done.stderr
    assert "No such file or directory" in done.stderr
    assert "listening" not in done.stderr  # refused before binding or loading a model
    assert "loading" not in done.stderr, done.stderr  # by the supervisor, before the worker


def test_a_client_ca_bundle_with_several_cas_and_utf8_comments(
    repository: Path, pki: Pki, tmp_path: Path
) -> None:
    """A bundle as curl's cacert.pem writes it (issuer comments in UTF-8 between the blocks):
    it loads (before: a TypeError from ssl's cadata, a traceback instead of a startup message),
    and a client of any CA in it is accepted, others are not."""
    bundle = tmp_path / "client-cas.pem"
    bundle.write_bytes(
        "# Issuer: CN=Főtanúsítvány (someone else's CA)\n".encode()
        + pki.other_ca_file.read_bytes()
        + "\n# Issuer: CN=test CA – ours\n".encode()
        + pki.ca_file.read_bytes()
    )
    load_material(TlsFiles(pki.server_cert, pki.server_key, bundle))
    third = Authority("a third CA")
    outsider = third.issue("outsider", server=False).write(tmp_path, "outsider")
    flags = (
        "--tls-cert",
        str(pki.server_cert),
        "--tls-key",
        str(pki.server_key),
        "--tls-client-ca",
        str(bundle),
    )
    with TlsServerProcess(repository, *flags, credentials=pki.credentials(pki.client)) as server:
        for client in (pki.client, pki.stranger):
            assert _health(server.target, pki.credentials(client)) == (
                health_pb2.HealthCheckResponse.SERVING
            )
        with pytest.raises(grpc.RpcError) as refused:
            _health(server.target, pki.credentials(outsider))
        assert refused.value.code() in REFUSED
        assert server.terminate() == 0, server.log


def test_files_written_in_place_are_refused_once_per_problem_then_reloaded(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """cp over a mounted file writes it in pieces; each piece is a change. Before, each
    refused change logged a warning (a dozen for one copy) and every handshake reread the
    files while they stayed bad."""
    ca = Authority("CA")
    cert, key = ca.issue("server", server=True).write(tmp_path, "tls")
    credentials = server_tls(cert, key, None)
    assert credentials is not None
    new = ca.issue("server", server=True)
    for end in range(100, len(new.cert), 100):  # the certificate, written 100 bytes at a time
        cert.write_bytes(new.cert[:end])
        assert credentials.fetch() is None
        assert credentials.fetch() is None  # the next handshake: nothing reread, nothing logged
    cert.write_bytes(new.cert)
    assert credentials.fetch() is None  # the new certificate with the old key
    key.write_bytes(new.key)
    assert credentials.fetch() is not None
    warnings = [r.getMessage() for r in caplog.records if "cannot be used" in r.getMessage()]
    assert 1 <= len(warnings) <= 3, warnings  # one per distinct problem
    assert len(set(warnings)) == len(warnings)
    assert credentials.reloads == 1
