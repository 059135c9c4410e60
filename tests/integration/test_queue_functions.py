"""The queues' own functions on PGMQ's tables: the transport publishes, reads and acks
through static SQL (``kombu_pgmq.send_q_<queue>``, ``read_q_<queue>``, ``ack_q_<queue>``;
statements ``send_queue``, ``read_queue``, ``ack_queue``) instead of
``pgmq.send/read/archive``. The tables must stay exactly PGMQ's: what the transport
writes, PGMQ's functions read, and the other way round; the rows it archives are the
rows ``pgmq.archive`` would write. Run on PGMQ's SQL-only install, on the extension, and
on the table shape of PGMQ < 1.11 (no ``last_read_at``; emulated by dropping the column,
the oldest version we accept, 1.8, is not installable here).
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from typing import Any

import pytest
from kombu import Connection, Queue

import kombu_pgmq  # noqa: F401
from kombu_pgmq import schema
from kombu_pgmq._db.broker import Broker
from kombu_pgmq._db.connector import Connector
from kombu_pgmq._db.rows import Receipt, Row
from kombu_pgmq.errors import PermissionDenied
from tests.integration.helpers import connect, drain, publish, sql

QUEUE = "direct"
PGMQ = "direct"  # the PGMQ name of QUEUE


@pytest.fixture(params=["sql_only", "extension", "before_1_11"])
def url(request: pytest.FixtureRequest) -> Iterator[str]:
    """A database with kombu_pgmq installed: SQL-only PGMQ, the extension, or SQL-only
    with queue tables shaped as PGMQ < 1.11 made them."""
    if request.param == "extension":
        dsn = request.getfixturevalue("extension_bootstrapped_db_dsn")
        assert schema.bootstrap(dsn).method != "install_sql"  # done in the template
    else:
        dsn = request.getfixturevalue("db_dsn")
    request.node.shape = request.param
    yield dsn


def declare(url: str, request: pytest.FixtureRequest) -> None:
    """Declare QUEUE through the transport (and reshape it for PGMQ < 1.11)."""
    with connect(url) as conn, conn.channel() as channel:
        Queue(QUEUE, routing_key=QUEUE)(channel).declare()
    if request.node.shape == "before_1_11":
        sql(url, f"ALTER TABLE pgmq.q_{PGMQ} DROP COLUMN last_read_at")
        sql(url, f"ALTER TABLE pgmq.a_{PGMQ} DROP COLUMN last_read_at")
        # the queue's functions follow the shape of its tables when they are created
        sql(url, "SELECT kombu_pgmq.queue_functions(%s, true)", (PGMQ,))


def broker_of(conn: Connection) -> Broker:
    return conn.transport.broker()


def composed(conn: Connection) -> dict[tuple[str, str], bytes]:
    """(statement, PGMQ queue) composed for a queue's own function on ``conn``."""
    return broker_of(conn).queue_functions._statements


def columns(url: str, table: str) -> set[str]:
    rows = sql(
        url,
        "SELECT attname FROM pg_attribute WHERE attrelid = %s::regclass AND attnum > 0 "
        "AND NOT attisdropped",
        (table,),
    )
    return {r[0] for r in rows}


def test_published_directly_read_by_pgmq(url: str, request: pytest.FixtureRequest) -> None:
    declare(url, request)
    with connect(url) as conn:
        publish(conn, QUEUE, [{"n": i} for i in range(3)])
        assert ("send_queue", PGMQ) in composed(conn)  # the direct path ran
    assert sql(url, "SELECT queue_length FROM pgmq.metrics(%s)", (PGMQ,)) == [(3,)]
    if request.node.shape == "before_1_11":
        # PGMQ 1.13's functions need last_read_at: check the rows as stored instead
        rows = sql(url, f"SELECT msg_id, read_ct, message, headers, vt <= now() FROM pgmq.q_{PGMQ}")
        assert [(r[1], r[4]) for r in rows] == [(0, True)] * 3
        assert all(r[2] is not None and r[3] is not None for r in rows)
        return
    rows = sql(url, "SELECT msg_id, read_ct, message, headers FROM pgmq.read(%s, 30, 10)", (PGMQ,))
    assert [r[1] for r in rows] == [1, 1, 1]
    assert all(r[2] is not None for r in rows)  # message column written
    assert all(r[3] is not None for r in rows)  # headers column written
    assert sql(url, "SELECT pgmq.archive(%s, %s::bigint[])", (PGMQ, [r[0] for r in rows]))
    assert sql(url, f"SELECT count(*) FROM pgmq.a_{PGMQ}") == [(3,)]


def test_sent_by_pgmq_read_and_archived_directly(url: str, request: pytest.FixtureRequest) -> None:
    declare(url, request)
    for i in range(4):
        sql(url, "SELECT pgmq.send(%s, %s::jsonb)", (PGMQ, json.dumps({"n": i})))
    with connect(url) as conn:
        got = drain(conn, QUEUE, expect=4, prefetch=10)
        assert ("read_queue", PGMQ) in composed(conn)  # the queue's function
    assert len(got) == 4
    assert {m.delivery_info["pgmq_read_ct"] for m in got} == {1}
    assert sql(url, f"SELECT count(*) FROM pgmq.q_{PGMQ}") == [(0,)]
    archive = sql(
        url,
        f"SELECT msg_id, read_ct, enqueued_at, vt, archived_at, message FROM pgmq.a_{PGMQ} "
        "ORDER BY msg_id",
    )
    assert [r[1] for r in archive] == [1, 1, 1, 1]
    assert [r[5] for r in archive] == [{"n": i} for i in range(4)]
    assert all(r[2] is not None and r[3] is not None and r[4] is not None for r in archive)
    if "last_read_at" in columns(url, f"pgmq.a_{PGMQ}"):
        assert sql(url, f"SELECT count(*) FROM pgmq.a_{PGMQ} WHERE last_read_at IS NULL") == [(0,)]
    if request.node.shape == "before_1_11":
        return  # PGMQ 1.13's functions need last_read_at
    # PGMQ's own functions still work on the same tables
    sql(url, "SELECT pgmq.send(%s, '{\"n\": 9}'::jsonb)", (PGMQ,))
    (msg_id,) = sql(url, "SELECT msg_id FROM pgmq.read(%s, 30, 1)", (PGMQ,))[0]
    assert sql(url, "SELECT count(*) FROM pgmq.set_vt(%s, %s, 0)", (PGMQ, msg_id)) == [(1,)]
    assert sql(url, "SELECT pgmq.delete(%s, %s::bigint)", (PGMQ, msg_id)) == [(True,)]


def test_direct_read_marks_delivery_like_pgmq_read(
    url: str, request: pytest.FixtureRequest
) -> None:
    """vt, read_ct (and last_read_at where the table has it) as pgmq.read sets them."""
    declare(url, request)
    sql(url, "SELECT pgmq.send(%s, '{}'::jsonb)", (PGMQ,))
    with connect(url, visibility_timeout=60) as conn:
        got = drain(conn, QUEUE, expect=1, ack=False)
        assert len(got) == 1
        row = sql(url, f"SELECT read_ct, vt - clock_timestamp() FROM pgmq.q_{PGMQ}")[0]
        assert row[0] == 1
        assert 50 < row[1].total_seconds() <= 60
        if "last_read_at" in columns(url, f"pgmq.q_{PGMQ}"):
            (seen,) = sql(url, f"SELECT last_read_at IS NOT NULL FROM pgmq.q_{PGMQ}")[0]
            assert seen
        if request.node.shape != "before_1_11":  # pgmq.read does not see it held
            assert sql(url, "SELECT count(*) FROM pgmq.read(%s, 30, 10)", (PGMQ,)) == [(0,)]
        got[0].ack()


def test_stale_ack_is_not_applied(url: str, request: pytest.FixtureRequest) -> None:
    """A receipt whose lease lapsed and was read again by PGMQ is never archived."""
    declare(url, request)
    sql(url, "SELECT pgmq.send(%s, '{}'::jsonb)", (PGMQ,))
    with connect(url, visibility_timeout=1) as conn:
        got = drain(conn, QUEUE, expect=1, ack=False)
        conn.transport.leases.stop()  # let the lease lapse
        time.sleep(1.5)
        # delivered again by someone else (pgmq.read's update, as PGMQ < 1.11 makes it)
        assert sql(
            url,
            f"UPDATE pgmq.q_{PGMQ} SET read_ct = read_ct + 1, "
            "vt = clock_timestamp() + interval '30 seconds' RETURNING read_ct",
        ) == [(2,)]
        got[0].ack()
        conn.transport.poller.flush_acks()
    assert sql(url, f"SELECT count(*) FROM pgmq.a_{PGMQ}") == [(0,)]
    assert sql(url, f"SELECT read_ct FROM pgmq.q_{PGMQ}") == [(2,)]


def test_reads_commit_asynchronously_without_touching_the_session(
    url: str, request: pytest.FixtureRequest
) -> None:
    """A read (and non-durable acks) commits with synchronous_commit off in its own
    transaction (set_config(..., true) in the statement), durable acks with the session's
    setting; the session itself is never SET (through a transaction pooler it is not
    ours). A deferred constraint trigger records the setting in force at each commit."""
    declare(url, request)
    sql(
        url,
        "CREATE TABLE IF NOT EXISTS public.commit_modes (at serial, mode text);"
        "CREATE OR REPLACE FUNCTION public.record_commit_mode() RETURNS trigger "
        "LANGUAGE plpgsql AS $$ BEGIN INSERT INTO public.commit_modes (mode) "
        "VALUES (current_setting('synchronous_commit')); RETURN NULL; END $$;"
        f"CREATE CONSTRAINT TRIGGER commit_mode AFTER UPDATE OR DELETE ON pgmq.q_{PGMQ} "
        "DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION public.record_commit_mode()",
    )

    def modes() -> list[str]:
        rows = sql(url, "DELETE FROM public.commit_modes RETURNING at, mode")
        return sorted({mode for _, mode in rows})

    def setting(conn: Connection) -> Any:
        return broker_of(conn).db.connection.execute("SHOW synchronous_commit").fetchone()[0]

    def receipt(row: Row) -> Receipt:
        return Receipt(row.queue, row.msg_id, row.read_ct, row.enqueued_at)

    # the session default "on" (the test servers run with it off)
    with connect(url, connection_options={"options": "-c synchronous_commit=on"}) as conn:
        publish(conn, QUEUE, [1, 2, 3])
        broker = broker_of(conn)
        (first,) = broker.read_many([PGMQ], 30, 1)
        assert modes() == ["off"]  # the delivery: a crash may forget it (redelivered)
        assert setting(conn) == "on"  # the session untouched
        (second,) = broker.read_many([PGMQ], 30, 1, acks=[receipt(first)], durable_acks=True)
        assert modes() == ["on"]  # a durable ack: the session's setting, "on"
        broker.read_many([PGMQ], 30, 1, acks=[receipt(second)], durable_acks=False)
        assert modes() == ["off"]
        assert setting(conn) == "on"


def test_least_privilege_roles_run_the_queue_s_own_functions(least_privilege_db: Any) -> None:
    """Producer and worker roles have no rights on PGMQ's tables: the producer publishes
    and the worker reads and acks through the queue's own SECURITY DEFINER functions, the
    statements the owner runs (nothing lost). Each role may run what its kind does: a
    producer the send function only; PUBLIC none of them."""
    db = least_privilege_db
    with connect(db.owner_url) as conn, conn.channel() as channel:
        Queue("lp_direct", routing_key="lp_direct")(channel).declare()
    with connect(db.producer_url) as conn:
        publish(conn, "lp_direct", [{"n": i} for i in range(5)])
        assert ("send_queue", "lp_direct") in composed(conn)
    with connect(db.worker_url) as conn:
        got = drain(conn, "lp_direct", expect=5)
        assert ("read_queue", "lp_direct") in composed(conn)
    assert sorted(json.loads(m.body)["n"] for m in got) == list(range(5))
    assert sql(db.owner_url, "SELECT count(*) FROM pgmq.a_lp_direct") == [(5,)]
    rights = sql(
        db.owner_url,
        "SELECT p.proname, has_function_privilege(%s, p.oid, 'EXECUTE'),"
        " has_function_privilege(%s, p.oid, 'EXECUTE'),"
        " has_function_privilege('public', p.oid, 'EXECUTE')"
        " FROM pg_proc p WHERE p.proname LIKE '%%q_lp_direct' ORDER BY 1",
        (db.producer, db.worker),
    )
    assert rights == [
        ("ack_q_lp_direct", False, True, False),
        ("read_q_lp_direct", False, True, False),
        ("send_q_lp_direct", True, True, False),
    ]


def test_a_handed_off_row_is_pgmq_s_delivered_row(url: str, request: pytest.FixtureRequest) -> None:
    """A publish handed to a waiting consumer writes the row as
    pgmq.read leaves a delivered one (read_ct 1, vt ahead, last_read_at where the table
    has it); the consumer's ack archives it as pgmq.archive would."""

    from kombu import Consumer, Producer

    from kombu_pgmq._stats import STATS

    declare(url, request)
    got: list[Any] = []
    with (
        connect(url, polling_interval=60) as conn,
        connect(url) as producer,
        Consumer(conn.channel(), [Queue(QUEUE, routing_key=QUEUE)], on_message=got.append),
    ):
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not sql(
            url,
            "SELECT 1 FROM kombu_pgmq.handoff_offers WHERE pgmq_queue = %s",
            (PGMQ,),
        ):
            with contextlib.suppress(TimeoutError):
                conn.drain_events(timeout=0.2)
        channel = producer.channel()
        Queue(QUEUE, routing_key=QUEUE)(channel).declare()
        before = STATS.handoffs
        Producer(channel).publish({"n": 1}, routing_key=QUEUE)
        row = sql(url, f"SELECT read_ct, vt > now() FROM pgmq.q_{PGMQ}")
        assert row == [(1, True)]
        if "last_read_at" in columns(url, f"pgmq.q_{PGMQ}"):
            assert sql(url, f"SELECT last_read_at IS NOT NULL FROM pgmq.q_{PGMQ}") == [(True,)]
        while not got and time.monotonic() < deadline:
            with contextlib.suppress(TimeoutError):
                conn.drain_events(timeout=0.2)
        assert STATS.handoffs == before + 1
        got[0].ack()
        with contextlib.suppress(TimeoutError):
            conn.drain_events(timeout=0.3)
    assert sql(url, f"SELECT read_ct, message FROM pgmq.a_{PGMQ}") == [(1, {"n": 1})]


def test_a_queue_made_by_plain_pgmq_gets_its_functions_at_first_use(
    least_privilege_db: Any,
) -> None:
    """A queue made by ``pgmq.create`` has no functions of ours: the first publish, read
    or ack of a least-privilege role creates them (owned by the schema owner) and goes
    on; deleting the queue through the transport drops them with it."""
    db = least_privilege_db

    def functions() -> list[tuple[str, str]]:
        return sql(
            db.owner_url,
            "SELECT proname, pg_get_userbyid(proowner) FROM pg_proc"
            " WHERE proname LIKE '%%q_plain_made' ORDER BY 1",
        )

    sql(db.owner_url, "SELECT pgmq.create('plain_made')")
    assert functions() == []
    with contextlib.closing(Connector(db.producer_url)) as producer:
        sent = Broker(producer).send("plain_made", '{"n": 1}', "{}", deduplicated=False)
        assert sent is not None and sent > 0
    assert functions() == [(f"{op}_q_plain_made", db.owner) for op in ("ack", "read", "send")]
    with contextlib.closing(Connector(db.worker_url)) as worker:
        broker = Broker(worker)
        (row,) = broker.read_many(["plain_made"], 30, 10)
        receipt = Receipt("plain_made", row.msg_id, row.read_ct, row.enqueued_at)
        assert broker.ack([receipt]) == {("plain_made", row.msg_id)}
    assert sql(db.owner_url, "SELECT count(*) FROM pgmq.a_plain_made") == [(1,)]
    with connect(db.owner_url) as conn:
        conn.channel().queue_delete("plain_made")
    assert functions() == []


def test_a_role_granted_after_the_queue_exists_runs_its_functions(least_privilege_db: Any) -> None:
    """Grants reach the functions of queues declared before them: a worker granted again
    (after a revoke took everything back) reads and acks, a role made producer may
    publish but not read."""
    db = least_privilege_db
    with connect(db.owner_url) as conn, conn.channel() as channel:
        Queue("regranted", routing_key="regranted")(channel).declare()
        publish(conn, "regranted", [{"n": 1}])
    assert schema.revoke(db.owner_url, db.worker)
    with (
        contextlib.closing(Connector(db.worker_url)) as worker,
        pytest.raises(PermissionDenied),
    ):
        Broker(worker).read_many(["regranted"], 30, 10)
    schema.grant(db.owner_url, db.worker, "worker")
    with contextlib.closing(Connector(db.worker_url)) as worker:
        broker = Broker(worker)
        (row,) = broker.read_many(["regranted"], 30, 10)
        receipt = Receipt("regranted", row.msg_id, row.read_ct, row.enqueued_at)
        assert broker.ack([receipt]) == {("regranted", row.msg_id)}
    schema.grant(db.owner_url, db.worker, "producer")
    with contextlib.closing(Connector(db.worker_url)) as producer:
        broker = Broker(producer)
        assert broker.send("regranted", '{"n": 2}', "{}", deduplicated=False)
        with pytest.raises(PermissionDenied):
            broker.read_many(["regranted"], 30, 10)
    schema.grant(db.owner_url, db.worker, "worker")
