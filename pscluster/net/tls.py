"""TLS and mutual TLS for every channel: gRPC credentials and `ssl` contexts from one set of files.

Settings name a directory written by `pscluster certs` (`tls_dir`: ca.pem and <task>.pem/.key, where a
task is ps-<i> (else the shared `ps`: a PS that joined), worker-<i> (else the shared `worker`), coordinator, or client for any other program) or
the three files explicitly. With `require_client_cert`, every daemon also asks its peers for a certificate of the
same CA and checks the peer's role (the `pscluster://role/<role>` SAN, or the common name's prefix)
against what the call may do: a worker's certificate cannot submit closures (only the coordinator's
or a client's can), workers run closures only for a coordinator or client, a PS serves workers, the
coordinator and clients. The cluster token is checked as well, over the encrypted channel.
"""

from __future__ import annotations

import functools
import pathlib
import ssl
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import grpc

from pscluster.config import Settings
from pscluster.errors import ConfigError

ROLE_URI = "pscluster://role/"
ANY_CLIENT = frozenset({"worker", "coordinator", "client"})
# (service, method) -> roles allowed; "*" is the service's default
ALLOWED: dict[str, dict[str, frozenset[str]]] = {
    # replicas: 2: only a PS forwards updates to its backups, only the coordinator (or an operator's client) sets
    # roles and freezes a shard that moves; a PS asks its backup's Status for the bulk port its forwards go to
    "pscluster.ParameterServer": {"Replicate": frozenset({"ps"}), "SetRoles": frozenset({"coordinator", "client"}),
                                  "FreezeShard": frozenset({"coordinator", "client"}),
                                  "Status": ANY_CLIENT | {"ps"}, "*": ANY_CLIENT},
    "pscluster.Worker": {"*": frozenset({"coordinator", "client"})},
    "pscluster.Coordinator": {"Register": frozenset({"worker"}), "Heartbeat": frozenset({"worker"}),
                              "JoinPs": frozenset({"ps"}),  # a PS the cluster file does not list (--join)
                              "Status": ANY_CLIENT, "*": frozenset({"coordinator", "client"})},
}
WORKER_NAME = "pscluster-worker"  # every worker certificate's DNS SAN: workers are verified by role, not address
BULK_ROLES = ANY_CLIENT | {"ps"}  # a PS's framed tensor port (a PS forwards updates to its backups there)
CLOSURE_ROLES = frozenset({"coordinator", "client"})  # a worker's framed closure port


@dataclass(frozen=True)
class TlsFiles:
    """The CA, this task's certificate and key, and whether peers must present a certificate."""

    ca: pathlib.Path
    cert: pathlib.Path
    key: pathlib.Path
    require_client_cert: bool


def task_name(settings: Settings) -> str:
    """The certificate name of this process: ps-<i>, worker-<i>, coordinator, or client (an evaluator too)."""
    if settings.task_type in ("ps", "worker"):
        return f"{settings.task_type}-{settings.task_index}"
    return "coordinator" if settings.task_type == "coordinator" else "client"


def files(settings: Settings) -> TlsFiles | None:
    """This process's TLS files from settings, or None without TLS.

    Raises:
        ConfigError: a file is missing or unreadable.
    """
    if settings.tls_dir is None and settings.tls_ca_file is None:
        return None
    base, name = settings.tls_dir, task_name(settings)
    if base is not None and settings.task_type in ("ps", "worker") and not (base / f"{name}.pem").is_file() \
            and (base / f"{settings.task_type}.pem").is_file():
        # the certificate every worker (PS) may use: workers a cluster file does not list, PS tasks that join
        name = settings.task_type
    ca = settings.tls_ca_file or (base / "ca.pem" if base else None)
    cert = settings.tls_cert_file or (base / f"{name}.pem" if base else None)
    key = settings.tls_key_file or (base / f"{name}.key" if base else None)
    if ca is None or cert is None or key is None:
        raise ConfigError("TLS needs tls_ca_file, tls_cert_file and tls_key_file (or tls_dir holding them)")
    for what, path in (("CA", ca), ("certificate", cert), ("key", key)):
        if not path.is_file():
            raise ConfigError(f"TLS {what} file {path} does not exist (pscluster certs --cluster FILE --out DIR "
                              f"writes ca.pem and {name}.pem/.key"
                              + (f", and {settings.task_type}.pem/.key for any {settings.task_type})"
                                 if settings.task_type in ("ps", "worker") else ")"))
    return TlsFiles(ca, cert, key, settings.require_client_cert)


@functools.lru_cache(maxsize=16)
def _read(path: pathlib.Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read TLS file {path}: {exc.strerror}") from exc


def server_credentials(tls: TlsFiles) -> grpc.ServerCredentials:
    """gRPC server credentials (client certificates required with require_client_cert)."""
    return grpc.ssl_server_credentials([(_read(tls.key), _read(tls.cert))], root_certificates=_read(tls.ca),
                                       require_client_auth=tls.require_client_cert)


def channel_credentials(tls: TlsFiles) -> grpc.ChannelCredentials:
    """gRPC channel credentials: verify the server by the CA, present this task's certificate."""
    return grpc.ssl_channel_credentials(root_certificates=_read(tls.ca), private_key=_read(tls.key),
                                        certificate_chain=_read(tls.cert))


def server_context(tls: TlsFiles) -> ssl.SSLContext:
    """An ssl context for a framed port."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    # No TLS 1.3 session tickets: they arrive after the handshake, wake a client's idle reader (the
    # coordinator's per-connection reply reader) with no reply to read, and leave it in a timed recv
    # that fails a closure dispatched there later. Connections are long-lived: resumption buys nothing.
    ctx.num_tickets = 0
    ctx.load_cert_chain(str(tls.cert), str(tls.key))
    if tls.require_client_cert:
        ctx.verify_mode = ssl.CERT_REQUIRED
        ctx.load_verify_locations(str(tls.ca))
    return ctx


def client_context(tls: TlsFiles) -> ssl.SSLContext:
    """An ssl context for connecting to framed ports (the server's address must be in its certificate)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_verify_locations(str(tls.ca))
    ctx.load_cert_chain(str(tls.cert), str(tls.key))
    return ctx


def role_from_names(common_name: str, sans: list[str]) -> str:
    """A peer's role: its pscluster://role/ SAN, else its common name up to the first '-'."""
    for san in sans:
        if san.startswith(ROLE_URI):
            return san[len(ROLE_URI):]
    return common_name.split("-")[0]


def role_of_peercert(cert: dict[str, Any] | None) -> str:
    """The role in a certificate as `ssl.SSLSocket.getpeercert()` gives it ('' without one)."""
    if not cert:
        return ""
    cn = next((value for rdn in cert.get("subject", ()) for key, value in rdn if key == "commonName"), "")
    return role_from_names(cn, [value for kind, value in cert.get("subjectAltName", ()) if kind == "URI"])


def role_of_context(context: grpc.ServicerContext) -> str:
    """The role of a gRPC call's peer ('' without a client certificate)."""
    auth: Mapping[str, Iterable[bytes]] = context.auth_context()  # type: ignore[assignment]  # values are lists
    cn = b"".join(auth.get("x509_common_name", [])).decode(errors="replace")
    sans = [s.decode(errors="replace") for s in auth.get("x509_subject_alternative_name", [])]
    return role_from_names(cn, sans) if cn or sans else ""


def allowed(method: str) -> frozenset[str]:
    """Roles that may call a gRPC method ('/pscluster.Service/Method')."""
    service, _, name = method.strip("/").partition("/")
    rules = ALLOWED.get(service, {})
    return rules.get(name, rules.get("*", frozenset()))
