"""Test certificates, generated per test run (trustme), never checked in."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import trustme


@dataclass(frozen=True)
class Pki:
    ca: Path  # the cluster's CA certificate
    cert: Path  # one certificate every component uses (names: pdserve, 127.0.0.1, localhost)
    key: Path
    rogue_cert: Path  # the same names, signed by another CA
    rogue_key: Path

    def flags(self) -> tuple[str, ...]:
        return ("--tls-cert", str(self.cert), "--tls-key", str(self.key), "--tls-ca", str(self.ca))


def make_pki(out: Path) -> Pki:
    out.mkdir(parents=True, exist_ok=True)
    ca, rogue_ca = trustme.CA(), trustme.CA()
    leaf = ca.issue_cert("pdserve", "127.0.0.1", "localhost")
    rogue = rogue_ca.issue_cert("pdserve", "127.0.0.1", "localhost")
    ca.cert_pem.write_to_path(str(out / "ca.pem"))
    leaf.cert_chain_pems[0].write_to_path(str(out / "cert.pem"))
    leaf.private_key_pem.write_to_path(str(out / "key.pem"))
    rogue.cert_chain_pems[0].write_to_path(str(out / "rogue-cert.pem"))
    rogue.private_key_pem.write_to_path(str(out / "rogue-key.pem"))
    return Pki(
        out / "ca.pem",
        out / "cert.pem",
        out / "key.pem",
        out / "rogue-cert.pem",
        out / "rogue-key.pem",
    )
