"""TLS for pdserve's gRPC ports: mutual TLS between the services, server-only TLS on the
router's public port (clients authenticate with API keys there).

Internal certificates all carry one name (``server_name``, default ``pdserve``) that channels
check instead of the peer's address, so pods on changing IPs need no per-address certificate.
Servers read their certificate again when its file changes (cert-manager renewals take effect
on the next handshake). Clients do too: ``ChannelPool`` opens new channels with the new files
once they change and lets calls on the old ones finish (``pdserve/common/channels.py``).
"""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

import grpc

DEFAULT_SERVER_NAME = "pdserve"


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class TlsConfig:
    cert_file: str  # this component's certificate chain (PEM)
    key_file: str  # its private key (PEM)
    ca_file: str | None = None  # the CA internal peers' certificates must chain to
    server_name: str = DEFAULT_SERVER_NAME  # the name internal certificates carry

    def __post_init__(self) -> None:
        for name in ("cert_file", "key_file", "ca_file"):
            path = getattr(self, name)
            if path is not None and not Path(path).is_file():
                raise ValueError(f"tls: {name} {path} is not a file")
        if not self.server_name:
            raise ValueError("tls: server_name must not be empty")

    def _read(self) -> tuple[bytes, bytes, bytes | None]:
        ca = Path(self.ca_file).read_bytes() if self.ca_file else None
        return Path(self.key_file).read_bytes(), Path(self.cert_file).read_bytes(), ca

    def mtimes(self) -> tuple[int, ...]:
        """The files' modification times: a change means new certificates to load."""
        files = [self.cert_file, self.key_file, *([self.ca_file] if self.ca_file else [])]
        return tuple(os.stat(f).st_mtime_ns for f in files)

    def server_credentials(self, require_client_auth: bool) -> grpc.ServerCredentials:
        """``require_client_auth``: every peer must present a certificate from ``ca_file``
        (internal ports); False for the router's public port."""
        if require_client_auth and self.ca_file is None:
            raise ValueError("tls: an internal port needs --tls-ca to verify its peers")
        key, cert, ca = self._read()
        seen = [self.mtimes()]

        def fetch() -> grpc.ServerCertificateConfiguration | None:
            mtimes = self.mtimes()
            if mtimes == seen[0]:
                return None  # unchanged: keep the current configuration
            seen[0] = mtimes
            key, cert, ca = self._read()
            return grpc.ssl_server_certificate_configuration([(key, cert)], ca)

        initial = grpc.ssl_server_certificate_configuration([(key, cert)], ca)
        return grpc.dynamic_ssl_server_credentials(
            initial, fetch, require_client_authentication=require_client_auth
        )

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """A client of an internal port: verifies the server against ``ca_file`` and presents
        this component's own certificate."""
        if self.ca_file is None:
            raise ValueError("tls: calling internal ports needs --tls-ca")
        key, cert, ca = self._read()
        return grpc.ssl_channel_credentials(ca, key, cert)

    def channel_options(self) -> list[tuple[str, str]]:
        return [("grpc.ssl_target_name_override", self.server_name)]


def add_port(
    server: grpc.aio.Server, bind: str, tls: TlsConfig | None, require_client_auth: bool = True
) -> int:
    """Binds ``server`` to ``bind`` (host:port), with TLS when configured (internal ports
    require client certificates); the bound port. Raises ``OSError`` when it cannot bind."""
    if tls is None:
        port = server.add_insecure_port(bind)
    else:
        port = server.add_secure_port(bind, tls.server_credentials(require_client_auth))
    if port == 0:
        raise OSError(f"could not bind {bind}")
    return int(port)
