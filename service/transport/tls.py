"""TLS for the gRPC port: credentials from PEM files, reloaded when the files change.

Kubernetes rotates a mounted Secret by swapping a symlink, so the files change under a running
server. gRPC asks for the certificate configuration before every TLS handshake; the fetcher
answers from a stat() of the three files and rereads them only when one changed. A half-written
or mismatched pair is refused (logged once) and the previous certificate stays in use.
"""

from __future__ import annotations

import argparse
import logging
import ssl
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

log = logging.getLogger(__name__)

Stamp = tuple[tuple[int, int, int], ...]


class TlsError(ValueError):
    """A certificate, key or CA file that cannot be used; the message names the file."""


@dataclass(frozen=True)
class TlsFiles:
    """PEM files: the server's certificate chain and key, and optionally the CA that must have
    signed every client's certificate (mutual TLS)."""

    cert: Path
    key: Path
    client_ca: Path | None = None


@dataclass(frozen=True)
class _Material:
    cert: bytes
    key: bytes
    client_ca: bytes | None


def _no_password(key: Path) -> Callable[[], bytes]:
    """ssl's password callback for key: none is given, so an encrypted key is refused."""

    def refuse() -> bytes:
        raise TlsError(
            f"the private key (--tls-key) {key} is encrypted; give an unencrypted key "
            "(a mounted Secret)"
        )

    return refuse


def _read(path: Path, what: str) -> bytes:
    try:
        data = path.read_bytes()
    except OSError as err:
        raise TlsError(f"cannot read the {what} {path}: {err.strerror or err}") from err
    if b"-----BEGIN" not in data:
        raise TlsError(f"the {what} {path} holds no PEM block")
    return data


def load_material(files: TlsFiles) -> _Material:
    """Read and check the files: the key must match the certificate, the CA must parse."""
    cert = _read(files.cert, "certificate (--tls-cert)")
    key = _read(files.key, "private key (--tls-key)")
    client_ca = None if files.client_ca is None else _read(files.client_ca, "client CA")
    check = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        check.load_cert_chain(files.cert, files.key, password=_no_password(files.key))
    except ssl.SSLError as err:
        raise TlsError(
            f"--tls-cert {files.cert} and --tls-key {files.key} are not a certificate and its "
            f"key: {err.reason or err}"
        ) from err
    if files.client_ca is not None:
        try:
            # By path, not cadata=: a bundle's text between PEM blocks may be UTF-8 (curl's
            # cacert.pem names issuers in comments), which cadata refuses with a TypeError.
            check.load_verify_locations(cafile=files.client_ca)
        except ssl.SSLError as err:
            raise TlsError(
                f"--tls-client-ca {files.client_ca} is not a PEM CA certificate: "
                f"{err.reason or err}"
            ) from err
    # The check read the paths again: had they changed meanwhile, the bytes could differ.
    if (
        files.cert.read_bytes() != cert
        or files.key.read_bytes() != key
        or (files.client_ca is not None and files.client_ca.read_bytes() != client_ca)
    ):
        raise TlsError(f"{files.cert}, {files.key} or the client CA changed while being read")
    return _Material(cert, key, client_ca)


def _stamp(files: TlsFiles) -> Stamp:
    paths = [files.cert, files.key] + ([files.client_ca] if files.client_ca else [])
    stamps = []
    for path in paths:
        info = path.stat()  # follows the symlink a Secret volume swaps
        stamps.append((info.st_mtime_ns, info.st_size, info.st_ino))
    return tuple(stamps)


def _configuration(material: _Material) -> grpc.ServerCertificateConfiguration:
    return grpc.ssl_server_certificate_configuration(
        [(material.key, material.cert)], root_certificates=material.client_ca
    )


def _ssl_context(files: TlsFiles, sni_callback: Any) -> ssl.SSLContext:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(files.cert, files.key, password=_no_password(files.key))
    if files.client_ca is not None:
        context.load_verify_locations(cafile=files.client_ca)
        context.verify_mode = ssl.CERT_REQUIRED
    context.sni_callback = sni_callback
    return context


class _HttpsContexts:
    """An SSLContext whose SNI callback (run in every handshake, SNI sent or not) swaps in a
    context built from the files when their stat() changed."""

    def __init__(self, files: TlsFiles) -> None:
        self.files = files
        self.stamp = _stamp_or_none(files)
        self.base = self.current = _ssl_context(files, self.pick)

    def pick(self, connection: ssl.SSLObject, server_name: str | None, _: ssl.SSLContext) -> None:
        stamp = _stamp_or_none(self.files)
        if stamp is not None and stamp != self.stamp:
            self.stamp = stamp
            try:
                load_material(self.files)  # the same checks as the gRPC reload
                self.current = _ssl_context(self.files, self.pick)
                log.info("HTTPS certificate reloaded from %s", self.files.cert)
            except (TlsError, OSError, ssl.SSLError) as err:
                log.warning(
                    "TLS files changed but cannot be used for HTTPS (%s); keeping the "
                    "current certificate",
                    err,
                )
        if self.current is not self.base:
            connection.context = self.current


class ReloadingCredentials:
    """Server credentials whose certificate follows its files; build once, then server()."""

    def __init__(self, files: TlsFiles) -> None:
        self.files = files
        self.reloads = 0
        self._lock = threading.Lock()
        self._stamp = _stamp_or_none(files)
        self._initial = _configuration(load_material(files))  # TlsError: a startup error
        self._refused: str | None = None  # the problem last logged, until a good reload
        self._refused_stamp: Stamp | None = None

    @property
    def mutual(self) -> bool:
        return self.files.client_ca is not None

    def server(self) -> grpc.ServerCredentials:
        return grpc.dynamic_ssl_server_credentials(
            self._initial, self.fetch, require_client_authentication=self.mutual
        )

    def ssl_context(self) -> ssl.SSLContext:
        """The same certificate for an HTTPS server (REST); a handshake after the files
        changed gets the new ones, as on gRPC (a pair that cannot be used keeps the old)."""
        return _HttpsContexts(self.files).base

    def fetch(self) -> grpc.ServerCertificateConfiguration | None:
        """gRPC's callback before each handshake: a new configuration, or None = unchanged."""
        try:
            with self._lock:
                return self._fetch_locked()
        except Exception:  # an exception here would fail the handshake; keep serving
            log.exception("TLS certificate reload failed; keeping the current certificate")
            return None

    def _fetch_locked(self) -> grpc.ServerCertificateConfiguration | None:
        stamp = _stamp_or_none(self.files)
        if stamp is None or stamp in (self._stamp, self._refused_stamp):
            return None  # unchanged, or refused already: not reread before every handshake
        try:
            material = load_material(self.files)
        except TlsError as err:
            # Once per problem, not per connection or per write: a file copied in place changes
            # (and is refused) many times while it is written.
            if str(err) != self._refused:
                log.warning(
                    "TLS files changed but cannot be used (%s); keeping the current "
                    "certificate until they are fixed",
                    err,
                )
                self._refused = str(err)
            self._refused_stamp = stamp
            return None
        self._stamp, self._refused = stamp, None
        self.reloads += 1
        log.info("TLS certificate reloaded from %s (reload %d)", self.files.cert, self.reloads)
        return _configuration(material)


def _stamp_or_none(files: TlsFiles) -> Stamp | None:
    try:
        return _stamp(files)
    except OSError:
        return None  # mid-rotation a file may be missing for a moment: try again next time


def channel_credentials(
    ca: Path | None = None, cert: Path | None = None, key: Path | None = None
) -> grpc.ChannelCredentials:
    """Client credentials: trust ca (None = the system's roots); cert and key for mutual TLS."""
    if (cert is None) != (key is None):
        raise TlsError("--tls-cert and --tls-key go together (a client certificate and its key)")
    return grpc.ssl_channel_credentials(
        root_certificates=None if ca is None else _read(ca, "CA certificate (--tls-ca)"),
        private_key=None if key is None else _read(key, "private key (--tls-key)"),
        certificate_chain=None if cert is None else _read(cert, "certificate (--tls-cert)"),
    )


def server_tls(
    cert: Path | None, key: Path | None, client_ca: Path | None
) -> ReloadingCredentials | None:
    """From the settings' --tls-cert/--tls-key/--tls-client-ca: None = plaintext; TlsError
    when a file cannot be used."""
    if cert is None or key is None:
        return None
    return ReloadingCredentials(TlsFiles(cert, key, client_ca))


def add_tls_arguments(parser: argparse.ArgumentParser) -> None:
    """The clients' flags: --tls-ca, --tls-cert, --tls-key, --tls-server-name."""
    group = parser.add_argument_group("TLS (any of these turns it on; default plaintext)")
    group.add_argument("--tls-ca", type=Path, help="PEM CA to trust (default: system roots)")
    group.add_argument("--tls-cert", type=Path, help="PEM client certificate (mutual TLS)")
    group.add_argument("--tls-key", type=Path, help="PEM private key of --tls-cert")
    group.add_argument(
        "--tls-server-name",
        help="name to check the server's certificate against (default: the target's host)",
    )


def tls_requested(args: argparse.Namespace) -> bool:
    return any(
        value is not None
        for value in (args.tls_ca, args.tls_cert, args.tls_key, args.tls_server_name)
    )
