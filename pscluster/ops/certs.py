"""`pscluster certs`: a CA and one certificate per task of a cluster file, for TLS and mutual TLS.

    pscluster certs --cluster cluster.yaml --out tls/        # ca.pem, ps-0.pem/.key, ..., client.pem/.key

A cluster file need not list its workers (they register with the coordinator when they start), so a
`worker` certificate is always written: a worker without a `worker-<i>` of its own uses it. Likewise a
`ps` certificate: a PS that joins a running cluster (`pscluster ps --join`, docs/elastic.md) gets its task
index only from the coordinator, so it uses `ps` for the JoinPs call and for any index without a
`ps-<i>` (its role is `ps`, which mutual TLS checks; its host must be among the SANs: `--host`).

Every certificate is signed by the new CA and carries its task's role in the subject's common name
(`ps-0`, `worker-1`, `worker`, `coordinator`, `client`) and as a URI SAN `pscluster://role/<role>`, which is what
mutual TLS checks (pscluster/net/tls.py). Its IP and DNS SANs are every host of the cluster file plus
127.0.0.1 and localhost (and `--host` additions), so a client verifies a daemon by the address it
dials; and the DNS name `pscluster-<role>`, by which the coordinator verifies workers, whose
addresses are not known in advance (a Kubernetes Deployment, Ray actors). Keys are written with mode 0600. The CA key stays in the directory to sign more later; keep it
off the machines that run tasks (`--out` a directory you then copy from, or a Kubernetes Secret).
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import pathlib
from collections.abc import Iterable, Mapping
from typing import Any

from pscluster.errors import ConfigError
from pscluster.net.tls import ROLE_URI

ROLES = ("ps", "worker", "coordinator", "client")


def task_names(cluster: Mapping[str, Any], workers: int = 0) -> list[str]:
    """Certificate names of a cluster spec: ps-i, `ps` (shared by every PS without a certificate of its own:
    PS tasks the cluster file does not list join at any time), worker-i (at least `workers` of them), `worker`
    (likewise for workers), coordinator, client."""
    ps = list(cluster.get("ps", []) or [])
    listed = list(cluster.get("worker", []) or [])
    names = [f"ps-{i}" for i in range(len(ps))] + ["ps"]
    names += [f"worker-{i}" for i in range(max(len(listed), workers))]
    return names + ["worker", "coordinator", "client"]


def hosts_of(cluster: Mapping[str, Any], extra: Iterable[str] = ()) -> list[str]:
    """Every host named in the spec, plus loopback and extra ones, once each."""
    addresses: list[str] = []
    for value in cluster.values():
        addresses += [value] if isinstance(value, str) else list(value or [])
    hosts = [a.rpartition(":")[0] or a for a in addresses] + ["127.0.0.1", "localhost", *extra]
    return list(dict.fromkeys(h.strip("[]") for h in hosts if h))


def write_certs(out: pathlib.Path, names: list[str], hosts: list[str], days: int = 365) -> list[pathlib.Path]:
    """Create out/ca.pem, out/ca.key and out/<name>.pem/.key for each name; returns the files written.

    Raises:
        ConfigError: out exists and holds a CA already (nothing is overwritten).
    """
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    out.mkdir(parents=True, exist_ok=True)
    if (out / "ca.pem").exists():
        raise ConfigError(f"{out / 'ca.pem'} exists; choose an empty --out directory (certificates are never overwritten)")
    now = datetime.datetime.now(datetime.timezone.utc)
    valid = (now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=days))

    def key_file(path: pathlib.Path, key: ec.EllipticCurvePrivateKey) -> None:
        data = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                 serialization.NoEncryption())
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "pscluster"),
                         x509.NameAttribute(NameOID.COMMON_NAME, "pscluster CA")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(valid[0]).not_valid_after(valid[1])
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False, data_encipherment=False,
                                       key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
          .sign(ca_key, hashes.SHA256()))
    written = [out / "ca.pem", out / "ca.key"]
    (out / "ca.pem").write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    key_file(out / "ca.key", ca_key)
    sans: list[x509.GeneralName] = []
    for host in hosts:
        try:
            sans.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            sans.append(x509.DNSName(host))
    for name in names:
        role = name.split("-")[0]
        if role not in ROLES:
            raise ConfigError(f"certificate name {name!r}: the role must be one of {ROLES}")
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (x509.CertificateBuilder()
                .subject_name(x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "pscluster"),
                                         x509.NameAttribute(NameOID.COMMON_NAME, name)]))
                .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
                .not_valid_before(valid[0]).not_valid_after(valid[1])
                .add_extension(x509.SubjectAlternativeName([*sans, x509.DNSName(f"pscluster-{role}"),
                                                            x509.UniformResourceIdentifier(ROLE_URI + role)]),
                               critical=False)
                .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                               critical=False)
                .sign(ca_key, hashes.SHA256()))
        (out / f"{name}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        key_file(out / f"{name}.key", key)
        written += [out / f"{name}.pem", out / f"{name}.key"]
    return written
