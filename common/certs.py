"""TLS material for both runtimes and SuperNode authentication keys, made with ``cryptography``.

Flower deployment: ``graphfl certs DIR`` writes a self-signed CA (``ca.crt``/``ca.key``), a server certificate
for the SuperLink (``server.pem``/``server.key``) whose subjectAltName covers 127.0.0.1, ::1,
localhost and any ``--host`` given, and optionally ECDSA P-384 key pairs in OpenSSH format for
SuperNode authentication (``keys/node_I``, ``keys/node_I.pub``; FLOWER_NOTES.md §3c).
EC keys take milliseconds, not the seconds of 4096-bit RSA.

p2p network: one CA; each peer ``i`` has a key and a certificate signed by that CA with common
name and DNS name ``peer-<i>`` (plus the peer's IP/host as a SAN). A peer accepts an inbound
connection only from a certificate signed by the network CA whose common name is the peer id
the caller claims; the caller checks that the callee presents ``peer-<j>`` for the neighbour
``j`` it dialled. :func:`generate_network_certs` writes such a CA and per-peer certificates; for
production, use your own PKI with the same naming.

Private keys are created with mode 0600 (never world-readable, not even for a moment).
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from graphfl.common.config import ConfigError

if TYPE_CHECKING:
    from cryptography import x509
    from cryptography.hazmat.primitives.asymmetric import ec

# ``cryptography`` is imported inside the functions that make keys and certificates: a peer only
# reads PEM files (gRPC does the TLS), and the import costs ~0.1-0.2 s per process (docs/p2p.md).

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServerTlsFiles:
    """Paths of the files Flower's processes need (SuperLink certificate, key and the CA)."""

    ca_cert: Path
    server_cert: Path
    server_key: Path


@dataclass(frozen=True)
class PeerTlsFiles:
    """Paths of the network CA certificate and one peer's certificate and key (PEM)."""

    ca: Path
    cert: Path
    key: Path

    def read(self) -> tuple[bytes, bytes, bytes]:
        """The three files' bytes; a missing file is a :class:`ConfigError` naming it."""
        out = []
        for what, p in (("CA certificate", self.ca), ("certificate", self.cert), ("private key", self.key)):
            if not Path(p).is_file():
                raise ConfigError(f"TLS {what} not found: {p}")
            out.append(Path(p).read_bytes())
        return out[0], out[1], out[2]


def write_secret(path: Path, data: bytes) -> None:
    """Write ``data`` to a file created with mode 0600 (an existing file is truncated and re-moded)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, data)
    finally:
        os.close(fd)


def write_private_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    """PEM (PKCS#8, unencrypted), readable by the owner only (created 0600)."""
    from cryptography.hazmat.primitives import serialization

    write_secret(path, key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                         serialization.NoEncryption()))


def write_cert(path: Path, cert: x509.Certificate) -> None:
    """PEM certificate (public)."""
    from cryptography.hazmat.primitives import serialization

    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def _name(cn: str) -> x509.Name:
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _san(hosts: list[str]) -> x509.SubjectAlternativeName:
    from cryptography import x509

    entries: list[x509.GeneralName] = []
    for host in hosts:
        try:
            entries.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            entries.append(x509.DNSName(host))
    return x509.SubjectAlternativeName(entries)


def make_ca(common_name: str = "graphfl-ca", days: int = 365) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    """A self-signed CA: ``(key, certificate)`` (every function here returns keys first)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name)).issuer_name(_name(common_name))
        .public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                     content_commitment=False, key_encipherment=False, data_encipherment=False,
                                     key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
        .sign(key, hashes.SHA256())
    )
    return key, cert


def issue_cert(
    ca_key: ec.EllipticCurvePrivateKey, ca_cert: x509.Certificate, common_name: str, hosts: list[str],
    server: bool = True, client: bool = False, days: int = 365,
) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    """A leaf certificate signed by the CA, valid for ``hosts`` (IPs or DNS names)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID

    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.UTC)
    usages = ([ExtendedKeyUsageOID.SERVER_AUTH] if server else []) + ([ExtendedKeyUsageOID.CLIENT_AUTH] if client else [])
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name)).issuer_name(ca_cert.subject)
        .public_key(key.public_key()).serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5)).not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_san(hosts), critical=False)
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    return key, cert


def default_hosts(extra: list[str] | None = None) -> list[str]:
    """Loopback names plus ``extra`` (deduplicated, order kept)."""
    hosts = ["127.0.0.1", "::1", "localhost"]
    for h in extra or []:
        if h and h not in hosts:
            hosts.append(h)
    return hosts


def generate_tls(out_dir: str | Path, hosts: list[str] | None = None, days: int = 365) -> ServerTlsFiles:
    """Write ``ca.crt``, ``ca.key``, ``server.pem``, ``server.key`` into ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ca_key, ca_cert = make_ca(days=days)
    srv_key, srv_cert = issue_cert(ca_key, ca_cert, "graphfl-superlink", default_hosts(hosts), days=days)
    files = ServerTlsFiles(out / "ca.crt", out / "server.pem", out / "server.key")
    write_cert(files.ca_cert, ca_cert)
    write_private_key(out / "ca.key", ca_key)
    write_cert(files.server_cert, srv_cert)
    write_private_key(files.server_key, srv_key)
    return files


def generate_node_keys(out_dir: str | Path, count: int, first: int = 0) -> list[tuple[Path, Path]]:
    """ECDSA P-384 key pairs (OpenSSH format) for SuperNode authentication: ``node_I``, ``node_I.pub``."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    pairs = []
    for i in range(first, first + count):
        key = ec.generate_private_key(ec.SECP384R1())
        priv, pub = out / f"node_{i}", out / f"node_{i}.pub"
        write_secret(priv, key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                             serialization.NoEncryption()))
        pub.write_bytes(key.public_key().public_bytes(serialization.Encoding.OpenSSH,
                                                      serialization.PublicFormat.OpenSSH) + b"\n")
        pairs.append((priv, pub))
    return pairs


def peer_name(peer_id: int) -> str:
    """Common name / DNS SAN of peer ``peer_id``'s certificate."""
    return f"peer-{peer_id}"


def write_ca(out_dir: Path, name: str = "graphfl-p2p-ca", days: int = 365) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    """Create ``ca.crt`` / ``ca.key`` in ``out_dir``; returns ``(key, certificate)`` like :func:`make_ca`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    key, cert = make_ca(name, days=days)
    write_cert(out_dir / "ca.crt", cert)
    write_private_key(out_dir / "ca.key", key)
    return key, cert


def make_peer_cert(
    out_dir: Path, peer_id: int, ca_key: ec.EllipticCurvePrivateKey, ca_cert: x509.Certificate,
    hosts: tuple[str, ...] = ("127.0.0.1", "localhost"), days: int = 365,
) -> PeerTlsFiles:
    """Create ``peer-<id>.crt`` / ``.key`` signed by the CA, for server *and* client use
    (mutual TLS); SANs: ``peer-<id>`` plus ``hosts``.
    """
    name = peer_name(peer_id)
    key, cert = issue_cert(ca_key, ca_cert, name, [name, *hosts], server=True, client=True, days=days)
    crt, kf = out_dir / f"{name}.crt", out_dir / f"{name}.key"
    write_cert(crt, cert)
    write_private_key(kf, key)
    return PeerTlsFiles(out_dir / "ca.crt", crt, kf)


def generate_network_certs(out_dir: str | Path, num_peers: int, hosts: tuple[str, ...] = ("127.0.0.1", "localhost"),
                           days: int = 365) -> Path:
    """Write ``ca.crt``/``ca.key`` and ``peer-<i>.crt``/``.key`` for ``i < num_peers``; returns ``out_dir``."""
    out = Path(out_dir)
    ca_key, ca_cert = write_ca(out, days=days)
    for i in range(num_peers):
        make_peer_cert(out, i, ca_key, ca_cert, hosts, days=days)
    logger.info("wrote a CA and %d peer certificates to %s", num_peers, out)
    return out
