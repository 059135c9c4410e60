"""Publishes seen before their WAL flush, returned after it (transport option
``visible_before_flush``, statement ``flush_commits``).

A publish that a waiting consumer gets now commits without waiting for the WAL flush, so
its NOTIFY (a hand-off) leaves at once, then waits for the flush with a second
transaction (statement ``flush_commits``). What the caller is promised is unchanged: when
``publish`` returns, the message is on disk.

These tests run on a throwaway server of their own whose commits wait for the flush
(``synchronous_commit`` on, unlike the suite's shared server) and whose WAL writer does
not flush by itself for 10 s (``wal_writer_delay``, ``wal_writer_flush_after``): a commit
that did not wait for the flush is then still unflushed when the test looks. The WAL
records of each publish are read back with ``pg_walinspect``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from kombu import Producer, Queue

from .helpers import WaitingConsumer, connect, sql, table

pytestmark = pytest.mark.integration

SETTINGS = {
    "fsync": "off",  # the flush position still advances (XLogFlush), only the fsync is skipped
    "synchronous_commit": "on",
    "wal_writer_delay": "10s",
    "wal_writer_flush_after": "1GB",
    "autovacuum": "off",
    "checkpoint_timeout": "1h",
    "log_min_messages": "warning",
}


@pytest.fixture(scope="module")
def server() -> Iterator[Any]:
    """The throwaway server (:class:`tests.support.pgserver.LocalServer`), its database
    ``broker`` bootstrapped."""
    from kombu_pgmq import schema
    from tests.support import pgserver

    with pgserver.throwaway_server(SETTINGS, "broker") as server:
        schema.bootstrap(pgserver.socket_url(server))
        with psycopg.connect(pgserver.socket_url(server), autocommit=True) as admin:
            if not admin.execute(
                "SELECT 1 FROM pg_available_extensions WHERE name = 'pg_walinspect'"
            ).fetchone():
                pytest.skip(
                    "pg_walinspect is not in this PostgreSQL installation "
                    f"({pgserver.server_install().source} ships no contrib extensions)"
                )
            admin.execute("CREATE EXTENSION pg_walinspect")
        yield server


@pytest.fixture
def server_url(server: Any) -> str:
    from tests.support import pgserver

    return pgserver.socket_url(server)


def _lsn(admin: psycopg.Connection, what: str) -> str:
    row = admin.execute(f"SELECT pg_current_wal_{what}_lsn()::text").fetchone()
    assert row is not None
    return str(row[0])


def _publish_records(admin: psycopg.Connection, start: str, queue: str, i: int) -> dict[str, Any]:
    """The WAL since ``start`` of the publish of ``{"i": i}``: the end of its commit
    record, and whether a ``kombu_pgmq.flush`` message (statement ``flush_commits``)
    follows it."""
    xid = admin.execute(
        f"SELECT xmin::text FROM {table(queue)} WHERE (message->>'i')::int = %s", (i,)
    ).fetchone()
    assert xid is not None, f"message {i} is not in its queue"
    # pg_walinspect reads only flushed WAL before PostgreSQL 16 (a later end LSN is refused)
    end = "insert" if admin.info.server_version >= 160000 else "flush"
    records = admin.execute(
        "SELECT end_lsn, xid::text, resource_manager, record_type, description"
        f" FROM pg_get_wal_records_info(%s::pg_lsn, pg_current_wal_{end}_lsn())"
        " ORDER BY start_lsn",
        (start,),
    ).fetchall()
    commits = [
        r[0] for r in records if r[1] == xid[0] and r[2] == "Transaction" and r[3] == "COMMIT"
    ]
    assert len(commits) == 1, records
    flush = any(r[2] == "LogicalMessage" and "kombu_pgmq.flush" in (r[4] or "") for r in records)
    return {"commit_end": str(commits[0]), "flush_commits": flush}


def _flushed_past(admin: psycopg.Connection, flushed: str, lsn: str) -> bool:
    row = admin.execute("SELECT %s::pg_lsn >= %s::pg_lsn", (flushed, lsn)).fetchone()
    return bool(row and row[0])


def test_a_publish_a_consumer_waits_for_returns_once_its_commit_is_flushed(server, server_url):
    """With a consumer waiting, each publish is handed off before its WAL flush
    (``flush_commits`` follows it in the WAL) and has its commit record flushed when it
    returns; a bare asynchronous commit shows the check can fail; after a crash every
    published message is in its queue."""
    queue = Queue("flushed", routing_key="flushed")
    with psycopg.connect(server_url, autocommit=True) as admin:
        admin.execute("CREATE TABLE probe (id int)")
        # the check can fail: two asynchronous commits (the WAL writer may flush the first,
        # as its last flush was long ago; not the second, 10 s within it)
        admin.execute("SET synchronous_commit = off")
        admin.execute("INSERT INTO probe VALUES (1)")
        start = _lsn(admin, "insert")
        admin.execute("INSERT INTO probe VALUES (2)")
        assert not _flushed_past(admin, _lsn(admin, "flush"), _lsn(admin, "insert")), (
            "an asynchronous commit was flushed at once: the check is blind"
        )
        admin.execute("RESET synchronous_commit")
        with connect(server_url) as conn:
            assert conn.transport.options.visible_before_flush  # the default
            producer = Producer(conn.channel())
            producer.publish({"i": -1}, routing_key="flushed", declare=[queue])
            consumer = WaitingConsumer(server_url, queue)
            try:
                consumer.wait_for(1)
                for i in range(5):
                    time.sleep(0.3)  # the consumer waits again
                    start = _lsn(admin, "insert")
                    producer.publish({"i": i}, routing_key="flushed", declare=[queue])
                    flushed = _lsn(admin, "flush")
                    wal = _publish_records(admin, start, "flushed", i)
                    assert wal["flush_commits"], f"publish {i} was not seen before its flush"
                    assert _flushed_past(admin, flushed, wal["commit_end"]), (
                        f"publish {i} returned before its WAL flush: {flushed} < {wal}"
                    )
                consumer.wait_for(6)
            finally:
                consumer.stop()
    # a crash right after: every publish that returned is there
    server.crash()
    server.start_again()
    assert sql(server_url, f"SELECT count(*) FROM {table('flushed')}") == [(6,)]


def test_a_publish_nobody_waits_for_commits_once(server_url):
    """No consumer waiting, or ``visible_before_flush=False``: one transaction per
    publish, its commit flushed when it returns (no ``flush_commits``)."""
    queue = Queue("strict", routing_key="strict")
    with psycopg.connect(server_url, autocommit=True) as admin:
        for options in ({}, {"visible_before_flush": False}):
            with connect(server_url, **options) as conn:
                producer = Producer(conn.channel())
                producer.publish({"i": -1}, routing_key="strict", declare=[queue])
                for i in range(3):
                    admin.execute(f"DELETE FROM {table('strict')}")
                    start = _lsn(admin, "insert")
                    producer.publish({"i": i}, routing_key="strict", declare=[queue])
                    flushed = _lsn(admin, "flush")
                    wal = _publish_records(admin, start, "strict", i)
                    assert not wal["flush_commits"], (options, i)
                    assert _flushed_past(admin, flushed, wal["commit_end"]), (options, i)


def test_unconfirmed_publishes_commit_without_their_wal_flush_and_a_crash_forgets_them(
    server, server_url
):
    """``confirm_publish=False``: a direct publish (sent without waiting), a deduplicated
    one and one routed through an exchange (both answered) each commit without waiting for
    the WAL flush (``synchronous_commit = off`` for that transaction): WAL is left
    unflushed when the publish returns, and a server crash within the WAL writer's delay
    forgets them (here 10 s; PostgreSQL's default ``wal_writer_delay`` is 200 ms, and an
    asynchronous commit is flushed within three times that); published confirmed, the same
    messages leave nothing unflushed and survive the crash."""
    from kombu import Exchange

    exchange = Exchange("unflushed_ex", type="direct")
    queue = Queue("unflushed", exchange=exchange, routing_key="unflushed")
    sends: list[dict[str, Any]] = [
        {"routing_key": "unflushed"},
        {"routing_key": "unflushed", "headers": {"x-deduplication-id": "d"}},
        {"routing_key": "unflushed", "exchange": exchange},
    ]

    def publish_all(confirm: bool) -> list[bool]:
        """Publish each of ``sends`` after a synchronous commit (a probe row) flushed the
        WAL, and whether WAL was left unflushed after each; then all of them again, with
        no commit of anyone else after them (left in the queue for a crash)."""
        unflushed = []
        with (
            psycopg.connect(server_url, autocommit=True) as admin,
            connect(server_url, confirm_publish=confirm) as conn,
        ):
            admin.execute("CREATE TABLE IF NOT EXISTS flush_probe (id int)")
            producer = Producer(conn.channel())
            producer.publish({"i": -1}, routing_key="unflushed", declare=[queue])
            # no dead row versions left for a statement to prune: pruning writes WAL outside
            # any commit (unflushed, whatever the publish's own commit did)
            admin.execute("VACUUM")
            for i, how in enumerate(sends):
                admin.execute("INSERT INTO flush_probe VALUES (%s)", (i,))  # flushes the WAL
                headers = {**how.get("headers", {}), "x-deduplication-id": f"{confirm}{i}"}
                producer.publish({"i": i}, **{**how, "headers": headers})
                conn.transport.broker().db.collect()  # the answer of one sent without waiting
                flushed, inserted = _lsn(admin, "flush"), _lsn(admin, "insert")
                unflushed.append(not _flushed_past(admin, flushed, inserted))
            admin.execute(f"DELETE FROM {table('unflushed')}")  # a synchronous commit
            for i, how in enumerate(sends):
                headers = {**how.get("headers", {}), "x-deduplication-id": f"{confirm}again{i}"}
                producer.publish({"i": i}, **{**how, "headers": headers})
            conn.transport.broker().db.collect()
        return unflushed

    assert publish_all(confirm=False) == [True, True, True]
    server.crash()
    server.start_again()
    assert sql(server_url, f"SELECT count(*) FROM {table('unflushed')}") == [(0,)]
    assert publish_all(confirm=True) == [False, False, False]
    server.crash()
    server.start_again()
    assert sql(server_url, f"SELECT count(*) FROM {table('unflushed')}") == [(3,)]
