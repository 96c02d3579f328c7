"""Say plainly when a daemon's port is taken, before gRPC or a socket server reports it its own way.

gRPC's C core logs a raw `add_port.cc` line to stderr and returns port 0 when a bind fails; a daemon
then only knew "cannot listen". `check_free` binds the port first, as gRPC and the framed servers do
(SO_REUSEADDR, so a port left in TIME_WAIT by a restarted daemon counts as free), and raises a
ConfigError naming the port and the host; the probe's socket is closed before the real bind.
"""

from __future__ import annotations

import errno
import socket

from pscluster.errors import ConfigError


def in_use(host: str, port: int, what: str) -> ConfigError:
    """The error for a port another process listens on."""
    return ConfigError(f"port {port} on {host} is in use ({what}): another process listens there; stop it, "
                       "or give this task another port")


def check_free(address: str, what: str) -> None:
    """Raise ConfigError if host:port (port 0 picks one: never busy) is taken; other bind errors are left
    to the real bind, which names them."""
    host, _, port_text = address.rpartition(":")
    host = host.strip("[]")
    if not port_text.isdigit() or int(port_text) == 0:
        return
    port = int(port_text)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise in_use(host, port, what) from None
