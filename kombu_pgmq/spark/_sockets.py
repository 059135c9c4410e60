"""Which local process listens on a TCP port: what :mod:`kombu_pgmq.spark.server` checks
before it sends a job or a token to the local Spark Connect server. Read-only; through
psutil (``psutil.net_connections``: Linux, macOS, the BSDs, Windows).

Listing every process's sockets may need privileges (macOS: root); where it is refused,
:func:`listeners` returns None and the caller falls back to :func:`held_by` (the sockets of
one process of the user's own)."""

from __future__ import annotations

import errno
import ipaddress
import os
import socket
from collections.abc import Iterable
from typing import Any, NamedTuple

from ..errors import ConfigurationError, SparkServerError

__all__ = [
    "ListeningSocket",
    "fd_link",
    "held_by",
    "hold_ipv6_loopback",
    "listeners",
    "owner",
    "reaches_localhost",
]


class ListeningSocket(NamedTuple):
    """A TCP socket listening on a port: ``pid`` of a process holding it (None: a process
    this user cannot inspect, another user's), its file descriptor there (-1: unknown),
    its local address (``"127.0.0.1"``, ``"::"``...)."""

    pid: int | None
    fd: int
    address: str


def reaches_localhost(address: str) -> bool:
    """Whether a connection to ``localhost`` (127.0.0.1 or ::1) can land on a socket bound
    to ``address`` (text, as ``"127.0.0.1"`` or ``"::ffff:127.0.0.1"``): loopback, a
    wildcard, or their IPv4-mapped IPv6 forms."""
    ip = ipaddress.ip_address(address.partition("%")[0])  # no IPv6 zone ("fe80::1%eth0")
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback or ip.is_unspecified


def _psutil() -> Any:
    """The psutil module (a dependency of the ``spark`` extra).

    Raises:
        ConfigurationError: psutil is not installed.
    """
    try:
        import psutil
    except ImportError as exc:
        raise ConfigurationError(
            "psutil is not installed (the local Spark Connect server's port check lists "
            "sockets with it): pip install 'kombu-pgmq-transport[spark]'"
        ) from exc
    return psutil


def _listening(
    connections: Iterable[Any], port: int, pid: int | None = None
) -> list[ListeningSocket]:
    """``pid``: of the process whose connections these are (they do not name it)."""
    psutil = _psutil()
    return [
        ListeningSocket(c.pid if pid is None else pid, c.fd, c.laddr.ip)
        for c in connections
        if c.status == psutil.CONN_LISTEN
        and c.laddr
        and c.laddr.port == port
        and reaches_localhost(c.laddr.ip)
    ]


def listeners(port: int) -> list[ListeningSocket] | None:
    """Every TCP socket listening on ``port`` where a client of ``localhost`` may connect
    (IPv4 and IPv6); None where this process may not list the system's sockets
    (``psutil.AccessDenied``: macOS without root). Cost: every process's descriptors are
    read (~50 ms on 2 cores under gVisor with ~300 sockets)."""
    psutil = _psutil()
    try:
        return _listening(psutil.net_connections(kind="tcp"), port)
    except psutil.AccessDenied:
        return None


def held_by(pid: int, port: int) -> list[ListeningSocket] | None:
    """The sockets of :func:`listeners` that process ``pid`` holds; None if it cannot be
    inspected (gone, or another user's)."""
    psutil = _psutil()
    try:
        return _listening(psutil.Process(pid).net_connections(kind="tcp"), port, pid)
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None


def fd_link(pid: int, fd: int) -> tuple[str, str] | None:
    """``("/proc/<pid>/fd/<fd>", "socket:[<inode>]")``: what a later check reads again
    (one readlink) to know the process still holds that socket. None where there is no
    ``/proc`` (not Linux) or the descriptor is gone."""
    if fd < 0:
        return None
    path = f"/proc/{pid}/fd/{fd}"
    try:
        return path, os.readlink(path)
    except OSError:
        return None


def owner(pid: int | None) -> str:
    """``"uid 1000, pid 123"`` of a listener's process, as far as it can be inspected."""
    if pid is None:
        return "a process of another user"
    psutil = _psutil()
    try:
        return f"uid {psutil.Process(pid).uids().real}, pid {pid}"
    except (psutil.NoSuchProcess, psutil.AccessDenied, AttributeError):
        return f"pid {pid}"


def hold_ipv6_loopback(port: int, fix: str) -> socket.socket | None:
    """A socket bound (not listening) to ``[::1]:port``, for the server to inherit and keep.

    A client of ``localhost`` may try ``::1`` before 127.0.0.1 (``/etc/hosts``); while the
    server holds this address no other process can listen there, so connections to it are
    refused and go on to 127.0.0.1. None without IPv6 (then nobody can listen there).
    ``fix``: the end of the error message (how to free or change the port).

    Raises:
        SparkServerError: another process holds ``[::1]:port``.
    """
    try:
        sock = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
    except OSError:
        return None
    try:
        sock.bind(("::1", port))
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise SparkServerError(
                f"port {port} on this host is taken on [::1] by another process (clients "
                f"of localhost may connect there): the local Spark server is not started. "
                f"{fix}"
            ) from exc
        return None
    return sock
