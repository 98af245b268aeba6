"""TLS material for mutual authentication between peers.

A network has one CA; each peer ``i`` has a key and a certificate signed by that CA with
common name and DNS name ``peer-<i>`` (plus the peer's IP/host as a SAN). A peer accepts an
inbound connection only from a certificate signed by the network CA, and only if the
certificate's common name is the peer id the caller claims; the caller checks that the callee
presents ``peer-<j>`` for the neighbour ``j`` it dialled.

:func:`generate_network_certs` writes a CA and per-peer certificates with the ``cryptography``
package (EC P-256, seconds for hundreds of peers). For production, use your own PKI with the
same naming.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from graphfl.common.config import ConfigError

logger = logging.getLogger(__name__)


def peer_name(peer_id: int) -> str:
    """Common name / DNS SAN of peer ``peer_id``'s certificate."""
    return f"peer-{peer_id}"


@dataclass(frozen=True)
class TlsFiles:
    """Paths of the CA certificate and this peer's certificate and key (PEM)."""

    ca: Path
    cert: Path
    key: Path

    def read(self) -> tuple[bytes, bytes, bytes]:
        out = []
        for what, p in (("CA certificate", self.ca), ("certificate", self.cert), ("private key", self.key)):
            if not Path(p).is_file():
                raise ConfigError(f"TLS {what} not found: {p}")
            out.append(Path(p).read_bytes())
        return out[0], out[1], out[2]


def _write_cert(cert, path: Path) -> None:
    from cryptography.hazmat.primitives import serialization

    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def make_ca(out_dir: Path, name: str = "graphfl-p2p-ca", days: int = 365):
    """Create ``ca.crt`` / ``ca.key`` in ``out_dir``; returns ``(cert, key)`` objects.

    The certificate itself comes from :func:`graphfl.deploy.certs.make_ca` (shared with the
    Flower deployment's TLS material).
    """
    from graphfl.deploy import certs

    out_dir.mkdir(parents=True, exist_ok=True)
    key, cert = certs.make_ca(name, days=days)
    _write_cert(cert, out_dir / "ca.crt")
    certs.write_private_key(out_dir / "ca.key", key)
    return cert, key


def make_peer_cert(out_dir: Path, peer_id: int, ca_cert, ca_key, hosts: tuple[str, ...] = ("127.0.0.1", "localhost"), days: int = 365) -> TlsFiles:
    """Create ``peer-<id>.crt`` / ``.key`` signed by the CA, for server *and* client use
    (mutual TLS); SANs: ``peer-<id>`` plus ``hosts``."""
    from graphfl.deploy import certs

    name = peer_name(peer_id)
    key, cert = certs.issue_cert(ca_key, ca_cert, name, [name, *hosts], server=True, client=True, days=days)
    crt, kf = out_dir / f"{name}.crt", out_dir / f"{name}.key"
    _write_cert(cert, crt)
    certs.write_private_key(kf, key)
    return TlsFiles(out_dir / "ca.crt", crt, kf)


def generate_network_certs(out_dir: str | Path, num_peers: int, hosts: tuple[str, ...] = ("127.0.0.1", "localhost")) -> Path:
    """Write ``ca.crt``/``ca.key`` and ``peer-<i>.crt``/``.key`` for ``i < num_peers``; returns ``out_dir``."""
    out = Path(out_dir)
    ca_cert, ca_key = make_ca(out)
    for i in range(num_peers):
        make_peer_cert(out, i, ca_cert, ca_key, hosts)
    logger.info("wrote a CA and %d peer certificates to %s", num_peers, out)
    return out
