"""TLS material and SuperNode authentication keys, generated with ``cryptography``.

``graphfl certs DIR`` writes a self-signed CA (``ca.crt``/``ca.key``), a server certificate
for the SuperLink (``server.pem``/``server.key``) whose subjectAltName covers 127.0.0.1, ::1,
localhost and any ``--host`` given, and optionally ECDSA P-384 key pairs in OpenSSH format for
SuperNode authentication (``keys/node_I``, ``keys/node_I.pub``; FLOWER_NOTES.md §3c).
EC keys take milliseconds, not the seconds of 4096-bit RSA.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class TlsFiles:
    """Paths of the files Flower's processes need."""

    ca_cert: Path
    server_cert: Path
    server_key: Path


def write_private_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    """PEM (PKCS#8, unencrypted), readable by the owner only."""
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))
    path.chmod(0o600)


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _san(hosts: list[str]) -> x509.SubjectAlternativeName:
    entries: list[x509.GeneralName] = []
    for host in hosts:
        try:
            entries.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            entries.append(x509.DNSName(host))
    return x509.SubjectAlternativeName(entries)


def make_ca(common_name: str = "graphfl-ca", days: int = 365) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.timezone.utc)
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
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.timezone.utc)
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
    hosts = ["127.0.0.1", "::1", "localhost"]
    for h in extra or []:
        if h and h not in hosts:
            hosts.append(h)
    return hosts


def generate_tls(out_dir: str | Path, hosts: list[str] | None = None, days: int = 365) -> TlsFiles:
    """Write ``ca.crt``, ``ca.key``, ``server.pem``, ``server.key`` into ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ca_key, ca_cert = make_ca(days=days)
    srv_key, srv_cert = issue_cert(ca_key, ca_cert, "graphfl-superlink", default_hosts(hosts), days=days)
    files = TlsFiles(out / "ca.crt", out / "server.pem", out / "server.key")
    files.ca_cert.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    write_private_key(out / "ca.key", ca_key)
    files.server_cert.write_bytes(srv_cert.public_bytes(serialization.Encoding.PEM))
    write_private_key(files.server_key, srv_key)
    return files


def generate_node_keys(out_dir: str | Path, count: int, first: int = 0) -> list[tuple[Path, Path]]:
    """ECDSA P-384 key pairs (OpenSSH format) for SuperNode authentication: ``node_I``, ``node_I.pub``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    pairs = []
    for i in range(first, first + count):
        key = ec.generate_private_key(ec.SECP384R1())
        priv, pub = out / f"node_{i}", out / f"node_{i}.pub"
        priv.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                           serialization.NoEncryption()))
        priv.chmod(0o600)
        pub.write_bytes(key.public_key().public_bytes(serialization.Encoding.OpenSSH,
                                                      serialization.PublicFormat.OpenSSH) + b"\n")
        pairs.append((priv, pub))
    return pairs
