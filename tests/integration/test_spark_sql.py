"""The SQL behind the Spark data source, without Spark: staged writes,
commit/abort per attempt, stream horizons, range archiving, snapshots."""

from __future__ import annotations

import threading
import time
import uuid

import psycopg
import pytest
from psycopg import sql

from kombu_pgmq._db.broker import Broker
from kombu_pgmq._db.connector import Connector
from kombu_pgmq._db.declarations import Declarations
from kombu_pgmq._db.spark_store import SparkStore
from kombu_pgmq._encoding import dumps
from kombu_pgmq.errors import StatementError
from kombu_pgmq.spark.messages import WRITE_HEADER, row_message
from tests.integration.helpers import connect, drain, publish


@pytest.fixture
def client(db_dsn: str):
    connector = Connector(db_dsn)
    Declarations(connector).create_queue("rows", "rows")
    yield SparkStore(connector)
    connector.close()


def _stage(client: SparkStore, marker: str, values: range) -> int:
    pairs = [row_message({"v": v}, "rows", marker) for v in values]
    write_id = marker.split("/")[0]
    return client.stage_messages(write_id, [m for m, _ in pairs], [h for _, h in pairs])


def _rows(db_dsn: str) -> list[tuple]:
    with psycopg.connect(db_dsn) as conn:
        return conn.execute(
            "SELECT (message->>'v')::int, vt <= clock_timestamp(), headers ? %s"
            " FROM pgmq.q_rows ORDER BY msg_id",
            (WRITE_HEADER,),
        ).fetchall()


def test_staged_messages_are_invisible_until_their_attempt_commits(client, db_dsn) -> None:
    client.open_write("w1", "rows")
    client.open_write("w2", "rows")
    assert _stage(client, "w1/0/0", range(0, 3)) == 3
    _stage(client, "w1/1/0", range(3, 5))  # attempt 0 of partition 1 failed...
    _stage(client, "w1/1/1", range(5, 7))  # ...attempt 1 succeeded
    _stage(client, "w2/0/0", range(100, 101))  # another write in flight
    with connect(db_dsn) as conn:
        assert drain(conn, "rows", expect=1, timeout=0.5) == []  # nothing visible yet
    assert client.commit_write("w1", ["w1/0/0", "w1/1/1"]) == 5
    assert _rows(db_dsn) == [
        (0, True, False),
        (1, True, False),
        (2, True, False),
        (5, True, False),
        (6, True, False),
        (100, False, True),  # the other write is untouched
    ]
    with connect(db_dsn) as conn:
        bodies = sorted(m.decode()["v"] for m in drain(conn, "rows", expect=5))
    assert bodies == [0, 1, 2, 5, 6]
    assert client.abort_write("w2") == 1
    assert _rows(db_dsn) == []
    with psycopg.connect(db_dsn) as conn:
        states = conn.execute(
            "SELECT write_id, state, published FROM kombu_pgmq.spark_writes ORDER BY 1"
        ).fetchall()
    assert states == [("w1", "committed", 5), ("w2", "aborted", None)]


def test_an_ended_write_refuses_stragglers_and_waits_for_staging_in_flight(client, db_dsn) -> None:
    """Spark aborts a failed job while killed tasks may still be inserting: abort waits
    for the staging transaction in flight, and later staging is refused."""
    client.open_write("w", "rows")
    with psycopg.connect(db_dsn) as straggler:  # a task attempt mid-insert (not committed)
        message, headers = row_message({"v": 1}, "rows", "w/0/0")
        straggler.execute(
            "SELECT kombu_pgmq.stage_write('w', ARRAY[%s::jsonb], ARRAY[%s::jsonb])",
            (message, headers),
        )
        ended = threading.Event()
        aborted: list[int] = []

        def abort() -> None:
            aborted.append(client.abort_write("w"))
            ended.set()

        threading.Thread(target=abort, daemon=True).start()
        assert not ended.wait(0.5)  # abort waits for the staging transaction
        straggler.commit()
    assert ended.wait(10) and aborted == [1]  # ...then deletes what it staged
    with pytest.raises(StatementError, match="Spark write w is aborted"):
        _stage(client, "w/1/0", range(3))
    assert _rows(db_dsn) == []
    assert client.abort_write("w") == 0  # idempotent
    with pytest.raises(StatementError, match="not open"):
        client.commit_write("w", ["w/0/0"])


def test_stream_horizon_stops_before_hidden_messages(client, db_dsn) -> None:
    with connect(db_dsn) as conn:
        publish(conn, "rows", [1, 2, 3])
    first = client.msg_id_range("rows")[1] - 2
    assert client.stream_horizon("rows", 0, 100, 1.0) == first + 2
    assert client.stream_horizon("rows", 0, 2, 1.0) == first + 1  # max_rows
    client.open_write("w", "rows")
    _stage(client, "w/0/0", range(1))  # hidden: the horizon must not pass it
    with connect(db_dsn) as conn:
        publish(conn, "rows", [4])
    assert client.stream_horizon("rows", first + 2, 100, 1.0) == first + 2
    client.commit_write("w", ["w/0/0"])
    assert client.stream_horizon("rows", first + 2, 100, 1.0) == first + 4


def test_stream_horizon_waits_for_writers_in_flight(client, db_dsn) -> None:
    """A transaction that took a smaller msg_id but has not committed yet must not be
    skipped: the horizon waits for it (or gives no progress after wait_seconds)."""
    with connect(db_dsn) as conn:
        publish(conn, "rows", [1])
    base = client.msg_id_range("rows")[1]
    with psycopg.connect(db_dsn) as slow:  # takes msg_id base+1, commits later
        slow.execute(
            "SELECT pgmq.send('rows', %s::jsonb, %s::jsonb)",
            (dumps(2), dumps({"x-kombu": {}})),
        )
        # msg_id base+2, committed (client.send: a Kombu publish would redeclare the queue,
        # and pgmq.create waits for the open transaction's table lock)
        Broker(client.db).send("rows", dumps(3), dumps({"x-kombu": {}}))
        t0 = time.monotonic()
        assert client.stream_horizon("rows", base, 100, 0.3) == base  # gave up: no progress
        assert time.monotonic() - t0 >= 0.3
        threading.Timer(0.3, slow.commit).start()
        assert client.stream_horizon("rows", base, 100, 5.0) == base + 2


def test_archive_range_and_snapshot(client, db_dsn) -> None:
    with connect(db_dsn) as conn:
        publish(conn, "rows", list(range(6)))
    lo, hi = client.msg_id_range("rows")
    assert hi - lo == 5
    rows = list(client.snapshot("rows", lo - 1, hi))
    assert [r[0] for r in rows] == list(range(lo, hi + 1))
    assert client.archive_range("rows", 0, lo + 2) == 3
    assert client.msg_id_range("rows") == (lo + 3, hi)
    archived = list(client.snapshot("rows", 0, hi, archive=True))
    assert [r[0] for r in archived] == [lo, lo + 1, lo + 2]
    assert all(r[5] is not None for r in archived)  # archived_at


def test_stream_horizon_waits_for_writers_without_the_stats_privilege(client, db_dsn) -> None:
    """A reader role without pg_read_all_stats sees other sessions'
    xact_start as NULL; the horizon must still wait for a writer in flight."""
    role = f"kpt_reader_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(db_dsn, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE ROLE {} NOLOGIN").format(sql.Identifier(role)))
        for schema in ("pgmq", "kombu_pgmq"):
            ident = sql.Identifier(schema)
            admin.execute(
                sql.SQL("GRANT USAGE ON SCHEMA {} TO {}").format(ident, sql.Identifier(role))
            )
            admin.execute(
                sql.SQL("GRANT SELECT ON ALL TABLES IN SCHEMA {} TO {}").format(
                    ident, sql.Identifier(role)
                )
            )
    try:
        with connect(db_dsn) as conn:
            publish(conn, "rows", [1])
        base = client.msg_id_range("rows")[1]
        with psycopg.connect(db_dsn) as slow, psycopg.connect(db_dsn, autocommit=True) as reader:
            reader.execute(sql.SQL("SET ROLE {}").format(sql.Identifier(role)))
            slow.execute(
                "SELECT pgmq.send('rows', %s::jsonb, %s::jsonb)",
                (dumps(2), dumps({"x-kombu": {}})),
            )
            Broker(client.db).send("rows", dumps(3), dumps({"x-kombu": {}}))
            horizon = "SELECT kombu_pgmq.stream_horizon('rows', %s, 100, 0.3)"
            assert reader.execute(horizon, (base,)).fetchone() == (base,)  # waited, gave up
            slow.commit()
            assert reader.execute(horizon, (base,)).fetchone() == (base + 2,)
    finally:
        with psycopg.connect(db_dsn, autocommit=True) as admin:
            admin.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
            admin.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))
