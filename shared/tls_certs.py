"""A development certificate set for mutual TLS between baton's services (`baton certs`).

```
 out/ca.pem, ca-key.pem          the stack's CA (keep the key out of every image and pod)
 out/<service>.pem, -key.pem     one per service, signed by the CA, for server and client use;
                                 SAN: DNS baton-internal (the name every client checks: addresses
                                 may be pod IPs), the service's name, localhost, 127.0.0.1 and --host names
```

EC P-256 keys, SHA-256 signatures. For production, issue the same shape from your own CA
(cert-manager in Kubernetes): what the services check is "signed by ca.pem, SAN baton-internal".
"""

from __future__ import annotations

import datetime
import ipaddress
from collections.abc import Sequence
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

TLS_TARGET_NAME = "baton-internal"  # in every service certificate's SAN; what every client checks
CERT_SERVICES = ("router", "prefill", "decode", "kv_transfer", "encoder")  # decode serves the colocated role too


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "baton"),
                      x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def make_ca(days: int = 365) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(_name("baton dev CA")).issuer_name(_name("baton dev CA"))
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
            .sign(key, hashes.SHA256()))
    return cert, key


def make_leaf(ca: x509.Certificate, ca_key: ec.EllipticCurvePrivateKey, common_name: str,
              dns_names: Sequence[str], ip_addresses: Sequence[str] = (), days: int = 365,
              ) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """A certificate for server and client authentication, signed by `ca`."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    san = [x509.DNSName(n) for n in dns_names] + [x509.IPAddress(ipaddress.ip_address(a)) for a in ip_addresses]
    cert = (x509.CertificateBuilder().subject_name(_name(common_name)).issuer_name(ca.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.SubjectAlternativeName(san), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .sign(ca_key, hashes.SHA256()))
    return cert, key


def write_pair(out_dir: Path, stem: str, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> None:
    (out_dir / f"{stem}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path = out_dir / f"{stem}-key.pem"
    key_path.write_bytes(_pem_key(key))
    key_path.chmod(0o600)


def make_dev_certs(out_dir: Path, services: Sequence[str] = CERT_SERVICES, hosts: Sequence[str] = (),
                   days: int = 365) -> list[Path]:
    """Write a CA and one certificate per service into `out_dir`; the files written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    ca, ca_key = make_ca(days)
    write_pair(out_dir, "ca", ca, ca_key)
    ips = ["127.0.0.1", *(h for h in hosts if _is_ip(h))]
    for service in services:
        names = [TLS_TARGET_NAME, service, service.replace("_", "-"), "localhost", *(h for h in hosts if not _is_ip(h))]
        cert, key = make_leaf(ca, ca_key, service, list(dict.fromkeys(names)), ips, days)
        write_pair(out_dir, service, cert, key)
    return sorted(out_dir.iterdir())


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True
