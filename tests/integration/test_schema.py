"""Schema bootstrap: SQL-only path, extension path, concurrency, version checks."""

from __future__ import annotations

import threading
import uuid

import psycopg
import pytest

from kombu_pgmq import schema
from kombu_pgmq._db.queries import migrations
from kombu_pgmq.errors import UnsupportedPgmqVersion
from tests.support import containers, pginstalls

from .helpers import sql


def bundled_version() -> str:
    from pgmq.install import get_embedded_sql_version

    return get_embedded_sql_version()


def installed_pgmq_version() -> str:
    """The PGMQ the test databases and the extension server hold (``tox -e pgmq-sql-*``:
    another release's)."""
    return pginstalls.pgmq_sql()[0]


def test_sql_only_install_on_empty_database(empty_db_dsn):
    info = schema.bootstrap(empty_db_dsn)
    assert info.method == "install_sql"
    assert info.pgmq_version == bundled_version()
    assert info.applied == tuple(m.version for m in migrations())
    assert sql(empty_db_dsn, "SELECT count(*) FROM pg_extension WHERE extname = 'pgmq'") == [(0,)]
    again = schema.bootstrap(empty_db_dsn)
    assert (again.method, again.applied) == ("sql", ())
    assert again.pgmq_version == bundled_version()  # recorded in kombu_pgmq.settings


def test_extension_path(extension_server):
    name = f"kpt_ext_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(extension_server, autocommit=True) as c:
        c.execute(f'CREATE DATABASE "{name}"')
    dsn = psycopg.conninfo.make_conninfo(extension_server, dbname=name)
    try:
        info = schema.bootstrap(dsn)
        assert info.method == "create_extension"
        assert info.pgmq_version == installed_pgmq_version()
        assert sql(dsn, "SELECT extversion FROM pg_extension WHERE extname = 'pgmq'") == [
            (installed_pgmq_version(),)
        ]
        again = schema.bootstrap(dsn)
        assert (again.method, again.applied) == ("extension", ())
    finally:
        with psycopg.connect(extension_server, autocommit=True) as c:
            c.execute(f'DROP DATABASE "{name}" WITH (FORCE)')


def test_many_processes_bootstrapping_at_once(empty_db_dsn):
    results: list[object] = []
    barrier = threading.Barrier(8)

    def run() -> None:
        barrier.wait()
        try:
            results.append(schema.bootstrap(empty_db_dsn))
        except Exception as exc:  # collected and asserted below
            results.append(exc)

    threads = [threading.Thread(target=run) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert all(isinstance(r, schema.SchemaInfo) for r in results), results
    assert sorted(r.method for r in results) == ["install_sql"] + ["sql"] * 7
    assert sql(empty_db_dsn, "SELECT count(*) FROM kombu_pgmq.migrations") == [(len(migrations()),)]


def test_old_pgmq_is_refused_with_a_clear_error(empty_db_dsn):
    # An old SQL-only PGMQ: schema and meta table, but none of the functions we need.
    sql(empty_db_dsn, "CREATE SCHEMA pgmq; CREATE TABLE pgmq.meta (queue_name varchar)")
    with pytest.raises(
        UnsupportedPgmqVersion, match=r"needs >= 1\.8\.0; .*pgmq.set_vt\(text,bigint\[\],integer\)"
    ):
        schema.bootstrap(empty_db_dsn)
    # Nothing half-applied: kombu_pgmq's schema was rolled back with the transaction.
    assert sql(empty_db_dsn, "SELECT to_regclass('kombu_pgmq.migrations')") == [(None,)]


def test_version_comparison():
    assert schema._parse_version("1.13.0") > schema._parse_version("1.5.1")
    assert schema._parse_version("1.4.4") < schema.MIN_PGMQ_VERSION
    # batch set_vt, which kombu_pgmq calls, is PGMQ 1.8.0's
    assert schema._parse_version("1.7.3") < schema.MIN_PGMQ_VERSION <= (1, 8, 0)


def test_schema_cli(empty_db_dsn):
    from click.testing import CliRunner

    from kombu_pgmq import cli

    result = CliRunner().invoke(cli.main, ["schema", "install", "--url", empty_db_dsn])
    assert result.exit_code == 0, result.output
    out = result.stdout
    applied = [m.version for m in migrations()]
    assert "install_sql" in out and f"applied now: {applied}" in out


def test_the_servers_run_the_requested_postgresql_major(db_dsn, extension_server):
    """``tox -e pgNN`` (``KOMBU_PGMQ_TEST_PG_VERSION``): the test server, and the
    throwaway servers when that major's binaries are here, run PostgreSQL NN."""
    version = containers.requested_version()
    if version is None:
        pytest.skip("KOMBU_PGMQ_TEST_PG_VERSION is not set (tox -e pg14 ... pg18 set it)")
    majors = {"test server": sql(db_dsn, "SHOW server_version_num")[0][0]}
    if pginstalls.find_install(version) is not None:
        majors["extension server"] = sql(extension_server, "SHOW server_version_num")[0][0]
    assert {name: int(num) // 10000 for name, num in majors.items()} == dict.fromkeys(
        majors, int(version)
    )
