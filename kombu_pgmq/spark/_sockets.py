"""Which local process listens on a TCP port (Linux ``/proc``): what
:mod:`kombu_pgmq.spark.server` checks before it sends a job or a token to the local Spark
Connect server. Read-only; sockets are matched by inode (``/proc/net/tcp*`` rows and
``/proc/<pid>/fd`` links)."""

from __future__ import annotations

import ipaddress
import os
import sys
from pathlib import Path

__all__ = ["decode_address", "holder", "listeners", "reaches_localhost", "sockets_of"]

#: TCP tables of the network namespace (Linux); ``0A`` is the LISTEN state.
_TCP_TABLES = ("/proc/net/tcp", "/proc/net/tcp6")
_LISTEN = "0A"


def decode_address(hex_address: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """Address of a ``/proc/net/tcp*`` row: hex of 32-bit words in host byte order."""
    raw = bytes.fromhex(hex_address)
    if sys.byteorder == "little":
        raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return ipaddress.ip_address(raw)


def reaches_localhost(hex_address: str) -> bool:
    """Whether a connection to ``localhost`` (127.0.0.1 or ::1) can land on a socket bound
    to this address: loopback, a wildcard, or their IPv4-mapped IPv6 forms."""
    address = decode_address(hex_address)
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_loopback or address.is_unspecified


def listeners(port: int) -> list[tuple[int, int]] | None:
    """``(uid, socket inode)`` of every TCP socket listening on ``port`` where a client of
    ``localhost`` may connect; None where ``/proc/net/tcp*`` does not exist (not Linux)."""
    suffix = f":{port:04X}"
    found: list[tuple[int, int]] = []
    tables = 0
    for table in _TCP_TABLES:
        try:
            with open(table, encoding="ascii") as file:
                lines = file.read().splitlines()[1:]
        except OSError:
            continue
        tables += 1
        for line in lines:
            if suffix not in line:
                continue
            # sl local_address rem_address st tx:rx tr:when retrnsmt uid timeout inode
            fields = line.split()
            local, state = fields[1], fields[3]
            if state != _LISTEN or not local.endswith(suffix):
                continue
            if reaches_localhost(local.partition(":")[0]):
                found.append((int(fields[7]), int(fields[9])))
    return found if tables else None


def sockets_of(pid: int) -> dict[int, str]:
    """``{socket inode: /proc/<pid>/fd/<n>}`` of process ``pid`` (empty if it cannot be
    inspected)."""
    sockets: dict[int, str] = {}
    try:
        entries = list(os.scandir(f"/proc/{pid}/fd"))
    except OSError:
        return sockets
    for entry in entries:
        try:
            target = os.readlink(entry.path)
        except OSError:
            continue
        if target.startswith("socket:["):
            sockets[int(target[8:-1])] = entry.path
    return sockets


def holder(inode: int) -> int | None:
    """Pid of a process holding socket ``inode``, if one can be inspected (error path:
    walks every process)."""
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and inode in sockets_of(int(proc.name)):
            return int(proc.name)
    return None
