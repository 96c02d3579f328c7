"""Which TCP sockets listen on this machine, and whether an address is loopback."""

from __future__ import annotations

import re
import subprocess


def listening() -> set[tuple[str, str]]:
    """(address, process:pid) of every listening TCP socket on this machine."""
    out = subprocess.run(["ss", "-tlnpH"], capture_output=True, text=True, check=True).stdout
    found = set()
    for line in out.splitlines():
        fields = line.split()
        proc = re.search(r'\(\("([^"]+)",pid=(\d+)', line)
        found.add((fields[3], proc.group(1) + ":" + proc.group(2) if proc else "?"))
    return found


def is_loopback(address: str) -> bool:
    """True for 127.x.y.z and ::1 (also as IPv4-mapped IPv6) with any port."""
    host = address.rpartition(":")[0].strip("[]")
    return host in ("::1", "::ffff:127.0.0.1") or host.startswith("127.") or host.startswith("::ffff:127.")
