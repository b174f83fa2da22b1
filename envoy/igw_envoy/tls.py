"""A local CA and a server certificate for the HTTPS listener when the user gives none.

Clients trust the CA file (`httpx.Client(verify=ca_cert)`), not the server
certificate, so the server certificate can be re-issued (new hosts, near
expiry) without clients changing anything. Files are replaced atomically
(write beside, rename): Envoy watches the directory and reloads the
certificate without a restart.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from igw_envoy.atomic import write_atomic

TLS_SUBDIR = "tls"
RELOAD_SUBDIR = "reload"
CA_CERT = "ca.pem"  # what clients trust
CA_KEY = "ca-key.pem"
SERVER_CERT = "server.pem"
SERVER_KEY = "server-key.pem"
DEFAULT_HOSTS = ("localhost", "127.0.0.1")
ALWAYS_HOSTS = ("localhost", "127.0.0.1", "::1")
CA_DAYS = 3650
SERVER_DAYS = 365
RENEW_BEFORE = dt.timedelta(days=30)


@dataclass(frozen=True)
class TlsFiles:
    """Where the listener's certificate material lives."""

    ca_cert: Path | None
    cert: Path
    key: Path


def generated_files(state_dir: Path) -> TlsFiles:
    """Where `ensure_self_signed` keeps its files; `ca_cert` is what clients must trust."""
    tls_dir = Path(state_dir) / TLS_SUBDIR
    return TlsFiles(tls_dir / CA_CERT, tls_dir / SERVER_CERT, tls_dir / SERVER_KEY)


def ensure_self_signed(state_dir: Path, hosts: Sequence[str] = DEFAULT_HOSTS) -> TlsFiles:
    """CA + server certificate under `state_dir/tls`, created or reused.

    Reused when present, readable, valid for 30 more days, signed by the CA
    and covering every requested host; otherwise the server certificate is
    re-issued from the existing CA (clients keep trusting it) and only a
    missing or expiring CA is replaced.
    """
    tls_dir = Path(state_dir) / TLS_SUBDIR
    tls_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    files = generated_files(state_dir)
    ca_key_path = tls_dir / CA_KEY
    ca = _load_pair(files.ca_cert, ca_key_path)
    if ca is None or not _fresh(ca[0]):
        ca = _new_ca()
        _write_key(ca_key_path, ca[1])
        write_atomic(files.ca_cert, _cert_pem(ca[0]))
    wanted = _all_hosts(hosts)
    server = _load_pair(files.cert, files.key)
    if server is None or not _server_ok(server[0], ca[0], wanted):
        issue_server_cert(files, ca, wanted)
    elif not reload_dir(tls_dir).is_dir():
        signal_reload(tls_dir)
    return files


def issue_server_cert(
    files: TlsFiles,
    ca: tuple[x509.Certificate, ec.EllipticCurvePrivateKey],
    hosts: Sequence[str],
) -> x509.Certificate:
    """Sign a fresh server certificate and swap it in (key first, then cert).

    Envoy validates that the pair matches before adopting it, so the brief
    moment between the two renames is skipped, never served.
    """
    key = ec.generate_private_key(ec.SECP256R1())
    ca_cert, ca_key = ca
    now = _now()
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name("inference-gateway"))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=SERVER_DAYS))
        .add_extension(x509.SubjectAlternativeName(_sans(hosts)), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_key_usage(server=True), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    _write_key(files.key, key)
    write_atomic(files.cert, _cert_pem(cert))
    signal_reload(files.cert.parent)
    return cert


def reload_dir(tls_dir: Path) -> Path:
    """The directory Envoy watches for the generated pair (see `signal_reload`)."""
    return Path(tls_dir) / RELOAD_SUBDIR


def signal_reload(tls_dir: Path) -> None:
    """Tell Envoy the generated key and certificate are both in place.

    The SDS secret of a generated certificate watches `tls/reload`, not `tls/`
    itself, so the two renames (key, then certificate) cause one reload after
    both, instead of a failed reload of a mismatched pair in between.
    """
    marker_dir = reload_dir(tls_dir)
    marker_dir.mkdir(mode=0o700, exist_ok=True)
    write_atomic(marker_dir / "generation", str(time.time_ns()).encode())


def load_ca(state_dir: Path) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey] | None:
    """The generated CA and its key, for re-issuing a server certificate."""
    tls_dir = Path(state_dir) / TLS_SUBDIR
    return _load_pair(tls_dir / CA_CERT, tls_dir / CA_KEY)


def _new_ca() -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = _name("inference-gateway local CA")
    now = _now()
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=CA_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_key_usage(server=False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return cert, key


def _key_usage(server: bool) -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=server,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=not server,
        crl_sign=not server,
        encipher_only=False,
        decipher_only=False,
    )


def _name(common_name: str) -> x509.Name:
    return x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "inference-gateway"),
            x509.NameAttribute(NameOID.COMMON_NAME, common_name),
        ]
    )


def _all_hosts(hosts: Sequence[str]) -> tuple[str, ...]:
    return tuple(dict.fromkeys([*ALWAYS_HOSTS, *hosts]))


def _sans(hosts: Sequence[str]) -> list[x509.GeneralName]:
    names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return names


def _covered_hosts(cert: x509.Certificate) -> set[str]:
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return set()
    ips = {str(ip) for ip in san.get_values_for_type(x509.IPAddress)}
    return ips | set(san.get_values_for_type(x509.DNSName))


def _server_ok(cert: x509.Certificate, ca: x509.Certificate, hosts: Sequence[str]) -> bool:
    wanted = {str(ipaddress.ip_address(h)) if is_ip(h) else h for h in hosts}
    if not _fresh(cert) or cert.issuer != ca.subject or not wanted <= _covered_hosts(cert):
        return False
    try:
        cert.verify_directly_issued_by(ca)
    except (InvalidSignature, ValueError, TypeError):
        return False
    return True


def is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _fresh(cert: x509.Certificate) -> bool:
    return cert.not_valid_after_utc - _now() > RENEW_BEFORE


def _now() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def _load_pair(
    cert_path: Path, key_path: Path
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey] | None:
    """A certificate and its EC key, or None if either is missing, unreadable or mismatched."""
    try:
        cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
        key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
    except (OSError, ValueError):
        return None
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        return None
    if key.public_key().public_numbers() != cert.public_key().public_numbers():
        return None
    return cert, key


def _cert_pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    write_atomic(path, pem, mode=0o600)
