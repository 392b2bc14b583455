"""Certificates made at run time (cryptography), a tiny model repository, and a server process
that is probed over TLS, for the TLS and connection tests."""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from export.pipeline import ExportRequest, run_export
from service.client import AttentionClient
from tests.harness.server_process import ServerProcess

SERVER_NAMES = ("localhost", "attention")
SERVER_IPS = ("127.0.0.1",)
CA_USAGE = x509.KeyUsage(
    digital_signature=True,
    key_cert_sign=True,
    crl_sign=True,
    content_commitment=False,
    key_encipherment=False,
    data_encipherment=False,
    key_agreement=False,
    encipher_only=False,
    decipher_only=False,
)


@dataclass(frozen=True)
class Pem:
    cert: bytes
    key: bytes

    def write(self, folder: Path, name: str) -> tuple[Path, Path]:
        """name.crt and name.key, each replaced by an atomic rename (as a Secret volume does)."""
        folder.mkdir(parents=True, exist_ok=True)
        paths = folder / f"{name}.crt", folder / f"{name}.key"
        for path, data in zip(paths, (self.cert, self.key), strict=True):
            part = path.with_suffix(path.suffix + ".part")
            part.write_bytes(data)
            os.replace(part, path)
        return paths


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


class Authority:
    """A self-signed CA that issues server and client certificates."""

    def __init__(self, name: str) -> None:
        self.key = ec.generate_private_key(ec.SECP256R1())
        now = dt.datetime.now(dt.UTC)
        self.cert = (
            x509.CertificateBuilder()
            .subject_name(_name(name))
            .issuer_name(_name(name))
            .public_key(self.key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(days=1))
            .not_valid_after(now + dt.timedelta(days=30))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(CA_USAGE, critical=True)
            .sign(self.key, hashes.SHA256())
        )
        self.pem = self.cert.public_bytes(serialization.Encoding.PEM)

    def write(self, folder: Path, name: str) -> Path:
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{name}.crt"
        path.write_bytes(self.pem)
        return path

    def issue(self, common_name: str, *, server: bool, expired: bool = False) -> Pem:
        """A leaf certificate: for a server (names and 127.0.0.1) or a client."""
        key = ec.generate_private_key(ec.SECP256R1())
        now = dt.datetime.now(dt.UTC)
        start, end = (
            (now - dt.timedelta(days=3), now - dt.timedelta(days=1))
            if expired
            else (now - dt.timedelta(hours=1), now + dt.timedelta(days=1))
        )
        usage = ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH
        builder = (
            x509.CertificateBuilder()
            .subject_name(_name(common_name))
            .issuer_name(self.cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(start)
            .not_valid_after(end)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        )
        if server:
            names: list[x509.GeneralName] = [x509.DNSName(n) for n in SERVER_NAMES]
            names += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in SERVER_IPS]
            builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
        cert = builder.sign(self.key, hashes.SHA256())
        return Pem(cert.public_bytes(serialization.Encoding.PEM), _key_pem(key))


def tiny_repository(base: Path) -> Path:
    """One small model (d=32, h=2) that a server loads in a moment; exported once per test
    session (base: pytest's base temporary folder) and shared by the modules that use it."""
    root = base / "tiny-models"
    done = base / "tiny-models.done"
    if not done.exists():
        run_export(ExportRequest(name="mha", embed_dim=32, num_heads=2, out=root, fused=False))
        done.touch()
    return root


def secure_ready(target: str, credentials: grpc.ChannelCredentials, timeout_s: float) -> None:
    """Poll the health service over TLS until SERVING."""
    with AttentionClient(target, credentials=credentials) as client:
        client.wait_until_serving(timeout_s)


class TlsServerProcess(ServerProcess):
    """A server started with TLS flags; readiness is polled over TLS with the given
    credentials (a client certificate too, under mutual TLS)."""

    def __init__(
        self,
        model_repository: Path,
        *flags: str,
        credentials: grpc.ChannelCredentials,
        http: bool = False,
    ) -> None:
        super().__init__(model_repository, *flags, http=http)
        self.credentials = credentials

    def wait_serving(self, timeout_s: float = 60) -> None:
        self.wait_bound(timeout_s)
        secure_ready(self.target, self.credentials, timeout_s)
