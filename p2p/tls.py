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

import datetime as _dt
import ipaddress
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


def _name(cn: str):
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _key():
    from cryptography.hazmat.primitives.asymmetric import ec

    return ec.generate_private_key(ec.SECP256R1())


def _write_key(key, path: Path) -> None:
    from cryptography.hazmat.primitives import serialization

    path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    path.chmod(0o600)


def _write_cert(cert, path: Path) -> None:
    from cryptography.hazmat.primitives import serialization

    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def make_ca(out_dir: Path, name: str = "graphfl-p2p-ca", days: int = 365):
    """Create ``ca.crt`` / ``ca.key`` in ``out_dir``; returns ``(cert, key)`` objects."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes

    out_dir.mkdir(parents=True, exist_ok=True)
    key = _key()
    now = _dt.datetime.now(_dt.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(name))
        .issuer_name(_name(name))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _dt.timedelta(minutes=5))
        .not_valid_after(now + _dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(True, False, False, False, False, True, True, False, False), critical=True
        )
        .sign(key, hashes.SHA256())
    )
    _write_cert(cert, out_dir / "ca.crt")
    _write_key(key, out_dir / "ca.key")
    return cert, key


def make_peer_cert(out_dir: Path, peer_id: int, ca_cert, ca_key, hosts: tuple[str, ...] = ("127.0.0.1", "localhost"), days: int = 365) -> TlsFiles:
    """Create ``peer-<id>.crt`` / ``.key`` signed by the CA (client and server use)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.x509.oid import ExtendedKeyUsageOID

    key = _key()
    now = _dt.datetime.now(_dt.timezone.utc)
    sans: list[x509.GeneralName] = [x509.DNSName(peer_name(peer_id))]
    for h in hosts:
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            sans.append(x509.DNSName(h))
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(peer_name(peer_id)))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _dt.timedelta(minutes=5))
        .not_valid_after(now + _dt.timedelta(days=days))
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    crt, kf = out_dir / f"{peer_name(peer_id)}.crt", out_dir / f"{peer_name(peer_id)}.key"
    _write_cert(cert, crt)
    _write_key(key, kf)
    return TlsFiles(out_dir / "ca.crt", crt, kf)


def generate_network_certs(out_dir: str | Path, num_peers: int, hosts: tuple[str, ...] = ("127.0.0.1", "localhost")) -> Path:
    """Write ``ca.crt``/``ca.key`` and ``peer-<i>.crt``/``.key`` for ``i < num_peers``; returns ``out_dir``."""
    out = Path(out_dir)
    ca_cert, ca_key = make_ca(out)
    for i in range(num_peers):
        make_peer_cert(out, i, ca_cert, ca_key, hosts)
    logger.info("wrote a CA and %d peer certificates to %s", num_peers, out)
    return out
