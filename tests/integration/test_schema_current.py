"""sql/schema.sql and sql/migrations give the same schema.

A new install runs ``sql/schema.sql``; an install of an earlier release upgrades through
the migrations after its recorded version. Each test compares a normalized dump of the
two databases' catalogs (:mod:`tests.support.catalog`: relations, columns, constraints,
indexes, functions, triggers, views, sequences, types, ACLs, owners, comments, the
grantable rows): fresh installs both ways (PGMQ SQL-only and the ``pgmq`` extension; as a
superuser and as an owner role that is none, with producer and worker roles granted),
and upgrades from older schema versions with data in them, which must survive.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg import sql as pgsql

from kombu_pgmq import schema
from kombu_pgmq._db.connector import Connector
from kombu_pgmq._db.queries import migrations
from kombu_pgmq._db.schema_store import SchemaStore
from tests.support import catalog, pginstalls, pgserver

from .helpers import sql

#: The version table as the bootstrap of releases before sql/schema.sql created it, before
#: their migrations (sql/schema.sql creates it now).
MIGRATIONS_TABLE = """
CREATE SCHEMA IF NOT EXISTS kombu_pgmq;
CREATE TABLE IF NOT EXISTS kombu_pgmq.migrations (
    version integer PRIMARY KEY,
    name text NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now()
)
"""

#: Rows that are schema on a fresh install (routing_version's counter moves with data).
FRESH_SEEDS = {
    **catalog.SEED_TABLES,
    ("kombu_pgmq", "settings"): ("key", "value"),
    ("kombu_pgmq", "routing_version"): ("singleton", "version"),
}

ALL_VERSIONS = tuple(m.version for m in migrations())


def install_from_migrations(dsn: str, upto: int | None = None) -> None:
    """Install as a release whose last migration was ``upto`` (default: the last) did:
    PGMQ's SQL-only form unless PGMQ is there, the version table, migrations 1..upto
    applied and recorded, the SQL-only PGMQ's version recorded; one transaction."""
    client = Connector(dsn)
    try:
        store = SchemaStore(client)
        with store.transaction():
            pgmq_version = None
            if not store.pgmq_schema_present():
                pgmq_version, script = pginstalls.pgmq_sql()
                store.run_script(script)
            store.run_script(MIGRATIONS_TABLE)
            for migration in migrations()[:upto]:
                store.apply_migration(migration.version, migration.name, migration.sql)
            if pgmq_version is not None:
                store.record_pgmq_install(pgmq_version)
    finally:
        client.close()


def assert_same_catalog(
    migrated: str, current: str, seeds: dict[tuple[str, str], tuple[str, ...]] | None = None
) -> None:
    """The catalogs of the two databases are equal; else the first differences, readably."""
    difference = catalog.diff(
        catalog.snapshot(migrated, seeds),
        catalog.snapshot(current, seeds),
        ("migrations", "schema.sql"),
    )
    assert not difference, f"the install from migrations and from schema.sql differ:\n{difference}"


@pytest.fixture
def second_empty_db_dsn(pg_server: str, request: pytest.FixtureRequest) -> Iterator[str]:
    """Another database as ``empty_db_dsn`` (no PGMQ, cloned from ``template0``)."""
    name = pgserver.create_database(pg_server, request.node.name, template="template0")
    yield pgserver.database_url(pg_server, name)
    pgserver.drop_database(pg_server, name)


def test_a_fresh_install_runs_schema_sql_and_equals_the_migrations(
    empty_db_dsn: str, second_empty_db_dsn: str
) -> None:
    install_from_migrations(empty_db_dsn)
    assert schema.bootstrap(empty_db_dsn).applied == ()
    info = schema.bootstrap(second_empty_db_dsn)
    assert (info.method, info.applied) == ("install_sql", ALL_VERSIONS)
    assert_same_catalog(empty_db_dsn, second_empty_db_dsn, FRESH_SEEDS)
    again = schema.bootstrap(second_empty_db_dsn)
    assert (again.method, again.applied) == ("sql", ())


def test_a_fresh_install_on_the_pgmq_extension_equals_the_migrations(
    extension_server: str,
) -> None:
    names = [pgserver.create_database(extension_server, "ext_schema", template="template0")]
    names.append(pgserver.create_database(extension_server, "ext_schema", template="template0"))
    migrated, current = (pgserver.database_url(extension_server, name) for name in names)
    try:
        sql(migrated, "CREATE EXTENSION pgmq")
        install_from_migrations(migrated)
        info = schema.bootstrap(current)
        assert (info.method, info.applied) == ("create_extension", ALL_VERSIONS)
        assert_same_catalog(migrated, current, FRESH_SEEDS)
    finally:
        for name in names:
            pgserver.drop_database(extension_server, name)


def test_an_owner_that_is_no_superuser_gets_the_same_schema_and_grants(pg_server: str) -> None:
    """As ``least_privilege_db`` sets up: the owner installs (PGMQ SQL-only too) and grants a
    producer and a worker role; same owners, ACLs and grants both ways."""
    roles: list[str] = []
    names: list[str] = []
    try:
        owner, password = pgserver.create_role(pg_server, "owner")
        roles.append(owner)
        kinds = {}
        for kind in ("producer", "worker"):
            role, _ = pgserver.create_role(pg_server, kind)
            roles.append(role)
            kinds[role] = kind
        urls = []
        for _ in range(2):
            names.append(
                pgserver.create_database(pg_server, "lp_schema", template="template0", owner=owner)
            )
            urls.append(pgserver.database_url(pg_server, names[-1], user=owner, password=password))
        install_from_migrations(urls[0])
        assert schema.bootstrap(urls[1]).applied == ALL_VERSIONS
        for url in urls:
            for role, kind in kinds.items():
                schema.grant(url, role, kind)
        admin = [pgserver.database_url(pg_server, name) for name in names]
        assert sql(
            admin[1],
            "SELECT DISTINCT pg_get_userbyid(proowner) FROM pg_proc"
            " WHERE pronamespace = 'kombu_pgmq'::regnamespace",
        ) == [(owner,)]
        assert_same_catalog(admin[0], admin[1], FRESH_SEEDS)
    finally:
        for name in names:
            pgserver.drop_database(pg_server, name)
        for role in roles:
            pgserver.drop_role(pg_server, role)


# -- upgrades ---------------------------------------------------------------------------------

#: What each schema version can hold, put in through that version's own functions:
#: ``{first version that has it: statements}``.
DATA = {
    10: """
        SELECT kombu_pgmq.declare_queue('orders', 'orders', true, false, NULL, NULL, NULL,
                                        NULL, NULL);
        SELECT kombu_pgmq.declare_queue('urgent', 'urgent', true, false, NULL, NULL,
                                        9::smallint, '{0,5}', '{urgent,urgent_p5}');
        SELECT kombu_pgmq.declare_queue('replies', 'replies', false, true, 60000, 30000, NULL,
                                        NULL, NULL);
        SELECT pgmq.send('orders', jsonb_build_object('n', n), '{"id": "t"}'::jsonb)
        FROM generate_series(1, 3) n;
        SELECT pgmq.send('urgent_p5', '{"n": 9}'::jsonb);
        SELECT pgmq.send('replies', '{"n": 1}'::jsonb);
        SELECT pgmq.archive('orders', 1::bigint);
        SELECT msg_id FROM pgmq.read('orders', 300, 1);  -- msg 2 in flight
        INSERT INTO kombu_pgmq.exchanges (exchange, type) VALUES ('events', 'topic');
        INSERT INTO kombu_pgmq.bindings (exchange, routing_key, queue)
        VALUES ('events', 'order.*', 'orders');
        INSERT INTO kombu_pgmq.consumers (queue, owner, consumer_tag, stale_after_seconds)
        VALUES ('orders', 'host:1:x', 'tag', 60);
    """,
    11: """
        SELECT kombu_pgmq.publish('orders', '{"n": 4}', '{"x-deduplication-id": "d"}');
    """,
    12: "SELECT kombu_pgmq.pause('replies');",
    18: """
        SELECT kombu_pgmq.results_store('celery-task-meta-t', 'SUCCESS', '\\x01', NULL, true);
        SELECT kombu_pgmq.revoke_tasks(ARRAY['r'], NULL);
        SELECT kombu_pgmq.chord_start('g', 3600);
    """,
    20: """
        SELECT kombu_pgmq.beat_upsert('tick', 'tasks.tick', 'interval', '{"every": 60}', '[]',
                                      '{}', '{}', true, 'once', false);
    """,
    21: """
        SELECT kombu_pgmq.declare_queue('fifo', 'fifo', true, false, NULL, NULL, NULL, NULL,
                                        NULL, true, false);
        SELECT kombu_pgmq.set_queue_limits('orders',
                                           '{"concurrency": 5, "rate": "10/s", "burst": 10}');
    """,
}


def put_data(dsn: str, version: int) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        for since, statements in DATA.items():
            if since <= version:
                conn.execute(statements.encode())


Rows = dict[str, tuple[list[str], list[tuple[Any, ...]]]]


def table_rows(dsn: str) -> Rows:
    """``{table: (columns, rows)}`` of kombu_pgmq's tables (but the schema's own:
    grantable, migrations) and of PGMQ's."""
    rows: Rows = {}
    with psycopg.connect(dsn, autocommit=True) as conn:
        tables = conn.execute(
            "SELECT n.nspname, c.relname FROM pg_class c"
            " JOIN pg_namespace n ON n.oid = c.relnamespace"
            " WHERE n.nspname IN ('kombu_pgmq', 'pgmq') AND c.relkind = 'r'"
            " AND c.relname NOT IN ('grantable', 'migrations')"
        ).fetchall()
        for nsp, rel in tables:
            cur = conn.execute(pgsql.SQL("SELECT * FROM {}").format(pgsql.Identifier(nsp, rel)))
            rows[f"{nsp}.{rel}"] = ([c.name for c in cur.description or ()], cur.fetchall())
    return rows


def survived(before: Rows, after: Rows) -> dict[str, list[str]]:
    """The rows of ``before``'s tables as ``after`` holds them, in the columns ``before``
    had (an upgrade adds columns), sorted: equal to ``survived(before, before)`` when the
    upgrade kept every row as it was."""
    kept = {}
    for table, (columns, _) in before.items():
        names, rows = after[table]
        kept[table] = sorted(
            repr([dict(zip(names, row, strict=True))[c] for c in columns]) for row in rows
        )
    return kept


def declare_the_same(old: str, current: str) -> None:
    """Give ``current`` the queues ``old`` has (declared with the same arguments; PGMQ
    queues of no Kombu queue made by pgmq.create) and their own functions."""
    declared = sql(
        old,
        "SELECT queue, pgmq_queue, durable, auto_delete, expires_ms, message_ttl_ms,"
        " max_priority, priority_bands, band_queues, fifo_groups, deduplicate_task_id"
        " FROM kombu_pgmq.queues",
    )
    with psycopg.connect(current, autocommit=True) as conn:
        for row in declared:
            conn.execute(
                "SELECT kombu_pgmq.declare_queue(%s, %s, %s, %s, %s, %s, %s::smallint,"
                " %s::smallint[], %s::text[], %s, %s)",
                row,
            )
        for (name,) in sql(old, "SELECT queue_name FROM pgmq.meta"):
            conn.execute(
                "SELECT pgmq.create(%s) WHERE NOT EXISTS"
                " (SELECT 1 FROM pgmq.meta WHERE queue_name = %s)",
                (name, name),
            )
        conn.execute("SELECT kombu_pgmq.queue_functions(queue_name) FROM pgmq.meta")


@pytest.mark.parametrize("version", [10, 21, 29])
def test_an_upgrade_keeps_the_data_and_equals_schema_sql(
    empty_db_dsn: str, second_empty_db_dsn: str, version: int
) -> None:
    old, current = empty_db_dsn, second_empty_db_dsn
    install_from_migrations(old, upto=version)
    put_data(old, version)
    before = table_rows(old)
    ready = sql(old, "SELECT msg_id FROM pgmq.q_orders WHERE vt <= clock_timestamp()")

    info = schema.bootstrap(old)
    assert (info.method, info.applied) == ("sql", ALL_VERSIONS[version:])

    assert survived(before, table_rows(old)) == survived(before, before)
    schema.bootstrap(current)
    declare_the_same(old, current)
    assert_same_catalog(old, current)
    # the current functions work on what an earlier release left
    read = sql(
        old,
        "SELECT msg_id FROM kombu_pgmq.read(ARRAY['orders'], 30, 10) WHERE msg_id IS NOT NULL",
    )
    assert sorted(read) == sorted(ready)


def test_an_upgrade_on_the_pgmq_extension_equals_schema_sql(extension_server: str) -> None:
    names = [pgserver.create_database(extension_server, "ext_upgrade", template="template0")]
    names.append(pgserver.create_database(extension_server, "ext_upgrade", template="template0"))
    old, current = (pgserver.database_url(extension_server, name) for name in names)
    try:
        sql(old, "CREATE EXTENSION pgmq")
        install_from_migrations(old, upto=21)
        put_data(old, 21)
        before = table_rows(old)
        assert schema.bootstrap(old).applied == ALL_VERSIONS[21:]
        assert survived(before, table_rows(old)) == survived(before, before)
        schema.bootstrap(current)
        declare_the_same(old, current)
        assert_same_catalog(old, current)
    finally:
        for name in names:
            pgserver.drop_database(extension_server, name)


# -- the comparison itself ------------------------------------------------------------------


def test_a_difference_is_shown_readably(
    pg_server: str, template_db: str, db_dsn: str, request: pytest.FixtureRequest
) -> None:
    """What a schema.sql out of step with the migrations looks like in the failure."""
    name = pgserver.create_database(pg_server, request.node.name, template=template_db)
    other = pgserver.database_url(pg_server, name)
    try:
        sql(
            other,
            "ALTER TABLE kombu_pgmq.exchanges ALTER COLUMN durable SET DEFAULT false;"
            "CREATE INDEX extra_idx ON kombu_pgmq.results (state);"
            "ALTER FUNCTION kombu_pgmq.size(text) STABLE",
        )
        with pytest.raises(AssertionError, match=r"from migrations and from schema\.sql differ"):
            assert_same_catalog(db_dsn, other)
        shown = catalog.diff(
            catalog.snapshot(db_dsn), catalog.snapshot(other), ("migrations", "schema.sql")
        ).splitlines()
        assert [line for line in shown if not line.startswith(" ")] == [
            "differs: column kombu_pgmq.exchanges #3 durable",
            "differs: function kombu_pgmq.size(text)",
            "only in schema.sql: index kombu_pgmq.extra_idx",
        ]
        column = "type=boolean notnull=t default={} identity= generated= collation= acl= comment="
        assert f"    -{column.format('true')}" in shown
        assert f"    +{column.format('false')}" in shown
        assert "    + STABLE SECURITY DEFINER" in shown
    finally:
        pgserver.drop_database(pg_server, name)
