"""A throwaway PgBouncer in front of a PostgreSQL server, for tests and benchmarks.

:class:`PgBouncer` writes ``pgbouncer.ini`` and a userlist into a temp dir of its own,
starts ``/usr/sbin/pgbouncer`` (Debian's ``pgbouncer`` package) on a free TCP port of
127.0.0.1, waits until it accepts connections, and on :meth:`PgBouncer.stop` (or leaving
the ``with`` block) stops it and removes the temp dir::

    with PgBouncer("postgresql://postgres@127.0.0.1:5432/postgres", default_pool_size=2) as pb:
        pooled = pb.url("kpt_mydb")          # postgresql://postgres@127.0.0.1:<port>/kpt_mydb
        pooled = pb.pooled_url(direct_url)   # the same database and user, through PgBouncer

Target: any server a libpq URL or ``key=value`` DSN reaches over TCP
(``127.0.0.1:5432``) or a unix socket directory (``?host=/tmp/.../run``: the suite's
embedded PostgreSQL, :mod:`tests.support.pgserver`). Every database of the target is
reachable (``databases = * = host=... port=...``); clients log in with the target's user
(``auth_type = trust``; the target must trust that user too, as the suite's servers do).

Pooling: ``pool_mode = transaction`` by default, ``default_pool_size`` server connections
per (database, user) pair, ``max_client_conn`` clients (default 1000),
``server_reset_query`` empty (transaction mode never runs it anyway). Give a *small*
``default_pool_size`` (2) and more clients than that, so server connections really are
shared and any reliance on session state (a prepared statement, a ``SET``) fails.

PgBouncer refuses to run as root: as root it is started with ``-u postgres`` if that
user exists, else ``-u embedded_postgres`` (the user :mod:`tests.support.pgserver`
creates); its files are readable by that user.

Works from ``benchmarks/`` too (``sys.path`` holding the repository root): it imports
nothing of the test suite but :mod:`tests.support.pgserver`'s helpers.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import quote

import psycopg
from psycopg.conninfo import conninfo_to_dict

__all__ = [
    "BINARY",
    "BUILT",
    "PgBouncer",
    "PgBouncerMissing",
    "available",
    "prepared_binary",
    "version",
]

#: Where Debian's ``pgbouncer`` package installs the program.
BINARY = os.environ.get("KOMBU_PGMQ_PGBOUNCER", "/usr/sbin/pgbouncer")
#: Where ``.ci/build-pgbouncer`` installs a PgBouncer that keeps prepared statements
#: (1.24.1, from Debian's source: Debian 12 ships 1.18, which has none): as root, and not.
BUILT = (
    Path("/opt/kombu_pgmq/pgbouncer-1.24.1/bin/pgbouncer"),
    Path.home() / ".cache" / "kombu_pgmq" / "pgbouncer-1.24.1" / "bin" / "pgbouncer",
)
_START_TIMEOUT_S = 20.0


def version(binary: str) -> tuple[int, ...] | None:
    """The version of the PgBouncer at ``binary`` (``pgbouncer --version``), or None."""
    try:
        out = subprocess.run(
            [binary, "--version"], capture_output=True, text=True, timeout=10, check=False
        ).stdout
    except OSError:
        return None
    words = out.split()
    if len(words) < 2 or words[0] != "PgBouncer":
        return None
    return tuple(int(p) for p in words[1].split(".") if p.isdigit())


def prepared_binary() -> str | None:
    """A PgBouncer that keeps protocol-level prepared statements (>= 1.21): the program
    ``$KOMBU_PGMQ_PGBOUNCER_PREPARED`` names, else :data:`BINARY` if new enough, else
    :data:`BUILT`; None when there is none here."""
    for candidate in (os.environ.get("KOMBU_PGMQ_PGBOUNCER_PREPARED"), BINARY, *map(str, BUILT)):
        if candidate and shutil.which(candidate) and (version(candidate) or (0,)) >= (1, 21):
            return candidate
    return None


class PgBouncerMissing(RuntimeError):
    """The pgbouncer program is not installed (tests skip with this message)."""


def available(binary: str = BINARY) -> str | None:
    """None when PgBouncer (``binary``) can be started here, else why not (a skip
    reason)."""
    if shutil.which(binary) is None:
        return (
            f"pgbouncer is not installed ({binary} missing): apt-get install pgbouncer, or "
            "set KOMBU_PGMQ_PGBOUNCER to its path"
        )
    return None


def _run_user() -> str | None:
    """The system user PgBouncer runs as (None: the current one, when not root)."""
    if os.geteuid() != 0:
        return None
    import pwd

    for user in ("postgres", "embedded_postgres"):
        try:
            pwd.getpwnam(user)
            return user
        except KeyError:
            continue
    from tests.support.pgserver import _server_user

    return _server_user()  # creates embedded_postgres


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class PgBouncer:
    """One PgBouncer process in front of ``target`` (see the module docstring).

    Arguments:
        target: libpq URL or ``key=value`` DSN of the PostgreSQL server (its host, port
            and user are used; its database name is the default of :meth:`url`).
        pool_mode: ``transaction`` (default), ``session`` or ``statement``.
        default_pool_size: server connections per (database, user) pair.
        max_client_conn: most client connections.
        settings: more ``[pgbouncer]`` settings (``{"max_prepared_statements": "0"}``).
        users: more user names clients may log in as (the target's user always may).
        binary: the program (default :data:`BINARY`).

    Raises (on :meth:`start`):
        PgBouncerMissing: the program is not installed.
        RuntimeError: it did not start (the message holds its log).
    """

    def __init__(
        self,
        target: str,
        *,
        pool_mode: str = "transaction",
        default_pool_size: int = 2,
        max_client_conn: int = 1000,
        settings: Mapping[str, Any] | None = None,
        users: tuple[str, ...] = (),
        binary: str = BINARY,
    ) -> None:
        self.binary = binary
        params = {k: str(v) for k, v in conninfo_to_dict(target).items() if v is not None}
        self.target_host = params.get("host") or "/var/run/postgresql"
        self.target_port = params.get("port") or "5432"
        self.user = params.get("user") or "postgres"
        self.dbname = params.get("dbname") or "postgres"
        self.pool_mode = pool_mode
        self.default_pool_size = default_pool_size
        self.max_client_conn = max_client_conn
        self.settings = dict(settings or {})
        self.users = (self.user, *[u for u in users if u != self.user])
        self.port = 0
        self.dir: Path | None = None
        self._proc: subprocess.Popen[bytes] | None = None

    # -- URLs ------------------------------------------------------------------------------

    def url(self, dbname: str | None = None, user: str | None = None) -> str:
        """``postgresql://`` URL of database ``dbname`` (default: the target's) through
        this PgBouncer, as ``user`` (default: the target's)."""
        who = quote(user or self.user, safe="")
        return f"postgresql://{who}@127.0.0.1:{self.port}/{quote(dbname or self.dbname, safe='')}"

    def pooled_url(self, direct: str) -> str:
        """The URL reaching the database (and user) of ``direct`` through PgBouncer."""
        params = conninfo_to_dict(direct)
        return self.url(str(params.get("dbname") or self.dbname), params.get("user"))

    @property
    def admin_url(self) -> str:
        """URL of PgBouncer's admin console (``SHOW POOLS``...; simple queries only)."""
        return self.url("pgbouncer")

    def show(self, what: str) -> list[dict[str, Any]]:
        """Rows of ``SHOW <what>`` on the admin console (``POOLS``, ``SERVERS``...)."""
        with psycopg.connect(self.admin_url, autocommit=True) as conn:
            cur = psycopg.ClientCursor(conn)
            cur.execute(f"SHOW {what}")
            names = [c.name for c in cur.description or ()]
            return [dict(zip(names, row, strict=True)) for row in cur.fetchall()]

    # -- lifetime ---------------------------------------------------------------------------

    def _ini(self, directory: Path) -> str:
        users = ", ".join(self.users)
        settings = {
            "listen_addr": "127.0.0.1",
            "listen_port": str(self.port),
            "unix_socket_dir": str(directory),
            "auth_type": "trust",
            "auth_file": str(directory / "userlist.txt"),
            "admin_users": users,
            "stats_users": users,
            "pool_mode": self.pool_mode,
            "default_pool_size": str(self.default_pool_size),
            "min_pool_size": "0",
            "reserve_pool_size": "0",
            "max_client_conn": str(self.max_client_conn),
            "server_reset_query": "",
            "ignore_startup_parameters": "extra_float_digits",
            "pidfile": str(directory / "pgbouncer.pid"),
            "log_connections": "0",
            "log_disconnections": "0",
            **{k: str(v) for k, v in self.settings.items()},
        }
        lines = [
            "[databases]",
            f"* = host={self.target_host} port={self.target_port}",
            "",
            "[pgbouncer]",
            *[f"{key} = {value}" for key, value in settings.items()],
            "",
        ]
        return "\n".join(lines)

    def start(self) -> PgBouncer:
        """Write the configuration, start PgBouncer, wait until it accepts connections."""
        reason = available(self.binary)
        if reason is not None:
            raise PgBouncerMissing(reason)
        user = _run_user()
        directory = Path(tempfile.mkdtemp(prefix="kpt_pgbouncer_"))
        self.dir = directory
        self.port = _free_port()
        (directory / "userlist.txt").write_text("".join(f'"{u}" ""\n' for u in self.users))
        ini = directory / "pgbouncer.ini"
        ini.write_text(self._ini(directory))
        directory.chmod(0o755)
        if user is not None:
            for path in (directory, *directory.iterdir()):
                shutil.chown(path, user, user)
        cmd = [self.binary, *(["-u", user] if user is not None else []), str(ini)]
        log = open(directory / "pgbouncer.log", "wb")  # noqa: SIM115 - the process keeps it
        with log:
            self._proc = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT
            )
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + _START_TIMEOUT_S
        last: Exception | None = None
        while time.monotonic() < deadline:
            proc = self._proc
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"pgbouncer exited with {proc.returncode}:\n{self.log()}")
            try:
                with psycopg.connect(self.url(), connect_timeout=2, autocommit=True) as conn:
                    conn.execute("SELECT 1")
                return
            except psycopg.Error as exc:
                last = exc
                time.sleep(0.05)
        raise RuntimeError(
            f"pgbouncer did not accept connections within {_START_TIMEOUT_S:g} s ({last}):\n"
            f"{self.log()}"
        )

    def log(self) -> str:
        """PgBouncer's log so far."""
        if self.dir is None:
            return ""
        with contextlib.suppress(OSError):
            return (self.dir / "pgbouncer.log").read_text(errors="replace")
        return ""

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def stop(self) -> None:
        """Stop PgBouncer (SIGTERM, then SIGKILL after 10 s) and remove its temp dir."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        directory, self.dir = self.dir, None
        if directory is not None:
            shutil.rmtree(directory, ignore_errors=True)

    def __enter__(self) -> PgBouncer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
