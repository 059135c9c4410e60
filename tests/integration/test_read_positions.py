"""Reads that start at a position in PGMQ's vt index, against a real PostgreSQL: while an
old snapshot keeps every dead row version, a read walks the index entries of the last
moments only, not all of them; and no row a bounded read cannot see yet is lost (a
transaction that commits a message late, a delayed message, a lease that lapses, a
``pgmq.send`` with a past visibility time)."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from kombu_pgmq._db import positions
from kombu_pgmq._db.broker import Broker
from kombu_pgmq._db.connector import Connector
from kombu_pgmq._db.rows import Receipt
from kombu_pgmq._naming import pgmq_queue_name

from .helpers import connect, publish, sql, wait_for


@pytest.fixture(autouse=True)
def no_full_scans(monkeypatch):
    """Every read of these tests is bounded by its position (the periodic read from the
    start of the index would hide a missed row), unless a test says otherwise."""
    monkeypatch.setattr(positions, "FULL_SCAN_SECONDS", 3600.0)


#: How a read of one queue reaches the table: statement read_queue, or kombu_pgmq.read
#: (several queues or priority bands in one read, least-privilege roles).
READS = pytest.mark.parametrize("direct", [True, False], ids=["read_queue", "kombu_pgmq.read"])


@contextlib.contextmanager
def broker(dsn: str, queue: str, *, direct: bool = True) -> Iterator[Broker]:
    with connect(dsn) as conn:
        conn.channel().queue_declare(queue)
    db = Connector(dsn)
    try:
        pgmq = Broker(db)
        pgmq.direct_reads = direct
        yield pgmq
    finally:
        db.close()


@contextlib.contextmanager
def held(dsn: str, *, write: bool = False) -> Iterator[psycopg.Connection]:
    """A session idle in an old REPEATABLE READ transaction (``write``: one that has
    written, so its transaction id is in progress too)."""
    with psycopg.connect(dsn, application_name="report_job") as holder:
        holder.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        holder.execute("SELECT count(*) FROM pg_class")
        if write:
            holder.execute("CREATE TEMP TABLE scratch (n int)")
            holder.execute("INSERT INTO scratch VALUES (1)")
        yield holder
        holder.rollback()


def cycle(pgmq: Broker, queue: str, n: int) -> None:
    """Publish ``n`` messages, read them and archive them: each leaves dead versions (the
    delivered ones with a visibility timeout far beyond the test, so that only the sent
    versions lie in the index below now)."""
    for i in range(n):
        pgmq.send(queue, json.dumps({"n": i}), "{}", deduplicated=False)
    rows = pgmq.read_many([queue], 3600, n)
    assert len(rows) == n
    ids = [r.msg_id for r in rows]
    pgmq.db.connection.execute("SELECT pgmq.archive(%s, %s::bigint[])", (queue, ids))


def index_entries_read(pgmq: Broker, dsn: str, index: str) -> int:
    """pg_stat_user_indexes.idx_tup_read of PGMQ index ``index`` (every entry a scan
    returned, dead or alive), with this broker's connection's counts flushed."""
    pgmq.db.connection.execute("SELECT pg_stat_force_next_flush()")
    pgmq.db.connection.execute("SELECT 1")  # the flush happens at its end
    ((n,),) = sql(
        dsn,
        "SELECT idx_tup_read FROM pg_stat_user_indexes "
        "WHERE schemaname = 'pgmq' AND indexrelname = %s",
        (index,),
    )
    return int(n)


def entries_walked(pgmq: Broker, dsn: str, queue: str, *, settle: bool = True) -> int:
    """Index entries of the queue's vt index one empty read walks, once the position
    has moved past the last cycle: a read after a pause longer than the position's lag
    behind the reads (their own transaction ids bound it: STAMP_SECONDS, MARGIN_SECONDS),
    then the measured read after another."""
    if settle:
        pause = 2 * (positions.STAMP_SECONDS + positions.MARGIN_SECONDS)
        time.sleep(pause)
        assert pgmq.read_many([queue], 30, 10) == []
        time.sleep(pause)
    before = index_entries_read(pgmq, dsn, f"q_{queue}_vt_idx")
    assert pgmq.read_many([queue], 30, 10) == []
    return index_entries_read(pgmq, dsn, f"q_{queue}_vt_idx") - before


@READS
def test_reads_walk_the_same_few_entries_however_long_a_snapshot_is_held(db_dsn, direct):
    queue = pgmq_queue_name("walk")
    with broker(db_dsn, "walk", direct=direct) as pgmq, held(db_dsn):
        for _ in range(5):
            cycle(pgmq, queue, 200)
        early = entries_walked(pgmq, db_dsn, queue)
        for _ in range(45):
            cycle(pgmq, queue, 200)
        late = entries_walked(pgmq, db_dsn, queue)
        pgmq.positions.forget(queue)
        from_start = entries_walked(pgmq, db_dsn, queue, settle=False)
    # 10,000 messages delivered and archived behind the snapshot, all still in the index:
    # a read from the start walks them all, a read from its position what the last
    # moments left (none: the position trails the reads by MARGIN_SECONDS), however many
    # were consumed before
    assert from_start >= 10_000
    assert late < 200, (early, late, from_start)


@READS
def test_a_long_transaction_that_has_written_does_not_hold_the_position_back(db_dsn, direct):
    queue = pgmq_queue_name("writer")
    with broker(db_dsn, "writer", direct=direct) as pgmq, held(db_dsn, write=True):
        for _ in range(5):
            cycle(pgmq, queue, 200)
        early = entries_walked(pgmq, db_dsn, queue)
        for _ in range(25):
            cycle(pgmq, queue, 200)
        late = entries_walked(pgmq, db_dsn, queue)
        pgmq.positions.forget(queue)
        from_start = entries_walked(pgmq, db_dsn, queue, settle=False)
    # held back to the writer's start, the read would walk all of them
    assert from_start >= 6_000
    assert late < 200, (early, late, from_start)


def test_a_read_of_several_queues_walks_few_entries_of_each(db_dsn):
    """Several queues in one read (a consumer of two queues, priority bands): each
    queue's walk starts at its own position."""
    names = [pgmq_queue_name("bands"), pgmq_queue_name("bands.1")]
    with broker(db_dsn, "bands") as pgmq, held(db_dsn):
        with connect(db_dsn) as conn:
            conn.channel().queue_declare("bands.1")

        def walked() -> int:
            return sum(index_entries_read(pgmq, db_dsn, f"q_{q}_vt_idx") for q in names)

        for _ in range(20):
            for q in names:
                for i in range(100):
                    pgmq.send(q, json.dumps({"n": i}), "{}", deduplicated=False)
            rows = pgmq.read_many(names, 3600, 400)
            assert len(rows) == 200
            for q in names:
                ids = [r.msg_id for r in rows if r.queue == q]
                pgmq.db.connection.execute("SELECT pgmq.archive(%s, %s::bigint[])", (q, ids))
        time.sleep(2 * (positions.STAMP_SECONDS + positions.MARGIN_SECONDS))
        assert pgmq.read_many(names, 30, 10) == []
        time.sleep(2 * (positions.STAMP_SECONDS + positions.MARGIN_SECONDS))
        before = walked()
        assert pgmq.read_many(names, 30, 10) == []
        late = walked() - before
        pgmq.positions.forget()
        before = walked()
        assert pgmq.read_many(names, 30, 10) == []
        from_start = walked() - before
    assert from_start >= 4_000
    assert late < 200, (late, from_start)


@READS
@pytest.mark.parametrize("when", ["id-before-reads", "id-at-send", "commit-before-listed"])
def test_a_message_committed_late_is_delivered(db_dsn, when, direct):
    """A transaction publishes (vt = the time of its INSERT) and commits only after reads
    moved past that time: the read after its commit delivers it. id-before-reads: the
    transaction has had its id since before those reads (it is in their snapshots'
    in-progress list); id-at-send: it gets its id with the INSERT; commit-before-listed:
    it commits right after one read whose snapshot did not list it yet (its id is above
    that snapshot's xmax: no transaction with a later id had ended)."""
    queue = pgmq_queue_name("late")
    with broker(db_dsn, "late", direct=direct) as pgmq:
        cycle(pgmq, queue, 5)
        with psycopg.connect(db_dsn) as app:
            if when == "id-before-reads":
                app.execute("SELECT pg_current_xact_id()")
                cycle(pgmq, queue, 5)
            app.execute("SELECT pgmq.send(%s, '{\"late\": true}'::jsonb)", (queue,))
            if when == "commit-before-listed":
                time.sleep(0.05)
                assert pgmq.read_many([queue], 30, 10) == []  # moves on past its vt
            else:
                for _ in range(20):  # the position moves on past the late message's vt
                    cycle(pgmq, queue, 5)
                    time.sleep(0.05)
                assert pgmq.read_many([queue], 30, 10) == []
            app.commit()
        rows = pgmq.read_many([queue], 30, 10)
        assert [json.loads(r.message) for r in rows] == [{"late": True}]


@READS
def test_messages_that_become_visible_again_below_the_position_are_delivered(db_dsn, direct):
    """A delayed message, a lease that lapses and a requeue with a delay come due while
    reads move on: each is delivered when due, without a read from the start."""
    queue = pgmq_queue_name("due")
    with broker(db_dsn, "due", direct=direct) as pgmq:
        pgmq.send(queue, '{"delayed": true}', "{}", 2, deduplicated=False)
        pgmq.send(queue, '{"leased": true}', "{}", deduplicated=False)
        pgmq.send(queue, '{"requeued": true}', "{}", deduplicated=False)
        _leased, requeued = pgmq.read_many([queue], 1, 10)  # invisible for 1 s
        receipt = Receipt(queue, requeued.msg_id, requeued.read_ct, requeued.enqueued_at)
        assert pgmq.requeue([receipt], 2) == {(queue, requeued.msg_id)}
        got: list[dict[str, bool]] = []
        deadline = time.monotonic() + 10
        while len(got) < 3 and time.monotonic() < deadline:
            for i in range(3):
                pgmq.send(queue, json.dumps({"n": i}), "{}", deduplicated=False)
            rows = pgmq.read_many([queue], 30, 10)
            ids = [r.msg_id for r in rows]
            pgmq.db.connection.execute("SELECT pgmq.archive(%s, %s::bigint[])", (queue, ids))
            got += [m for m in (json.loads(r.message) for r in rows) if "n" not in m]
            time.sleep(0.1)
        assert sorted(got, key=str) == [{"delayed": True}, {"leased": True}, {"requeued": True}]


def test_a_past_visibility_time_is_found_by_the_periodic_read_from_the_start(db_dsn, monkeypatch):
    """``pgmq.send`` with a timestamp in the past writes a row below every position: the
    read from the start of the index (every FULL_SCAN_SECONDS) delivers it."""
    monkeypatch.setattr(positions, "FULL_SCAN_SECONDS", 1.0)
    queue = pgmq_queue_name("past")
    with broker(db_dsn, "past") as pgmq:
        cycle(pgmq, queue, 5)
        sql(
            db_dsn,
            "SELECT pgmq.send(%s, '{\"past\": true}'::jsonb, now() - interval '1 hour')",
            (queue,),
        )
        got: list[object] = []
        wait_for(
            lambda: (
                got.extend(json.loads(r.message) for r in pgmq.read_many([queue], 30, 10)) or got
            ),
            5,
            "the message sent with a past visibility time",
        )
        assert got == [{"past": True}]


def test_a_message_requeued_to_its_place_by_another_connection_is_read_at_once(db_dsn):
    """Another connection's consumer rejects a message with requeue: it goes back to its
    place (vt = its enqueued_at, below this consumer's position), and the requeue's NOTIFY
    ('rewind') makes this consumer read the queue from the start."""
    from kombu import Consumer, Queue

    queue = Queue("rewound", routing_key="rewound")
    held: list[Any] = []
    got: list[Any] = []
    with (
        connect(db_dsn, polling_interval=60) as first,
        connect(db_dsn, polling_interval=60) as other,
    ):
        publish(first, "rewound", [{"n": 0}])
        with Consumer(first.channel(), [queue], on_message=held.append, prefetch_count=1):
            wait_for(lambda: _drain(first) or held, 5, "the first delivery")
        time.sleep(2 * (positions.STAMP_SECONDS + positions.MARGIN_SECONDS))
        with Consumer(other.channel(), [queue], on_message=lambda m: (got.append(m), m.ack())):
            for n in range(1, 6):  # this consumer's position moves on, past message 0's
                time.sleep(positions.STAMP_SECONDS)
                publish(first, "rewound", [{"n": n}])
                wait_for(lambda n=n: _drain(other) or len(got) >= n, 5, f"message {n}")
            held[0].reject(requeue=True)
            wait_for(lambda: _drain(other) or len(got) >= 6, 5, "the requeued message")
    assert [m.decode() for m in got] == [{"n": n} for n in (1, 2, 3, 4, 5, 0)]


def _drain(conn: Any) -> None:
    with contextlib.suppress(TimeoutError):
        conn.drain_events(timeout=0.1)


def test_in_the_event_loop_a_probe_looks_below_the_positions(db_dsn, monkeypatch):
    """In Celery's event loop no read starts from the beginning by the clock (it would hold
    up the loop while it walks every dead row version): the fallback poll's probe looks
    below the positions every FULL_SCAN_SECONDS instead, on the LISTEN connection, and a
    visible row found there (a ``pgmq.send`` with a past visibility time) rewinds the
    queue: it is delivered."""
    from kombu import Consumer, Queue

    from .helpers import FakeHub

    monkeypatch.setattr(positions, "FULL_SCAN_SECONDS", 1.0)
    queue = pgmq_queue_name("below")
    got: list[Any] = []
    with connect(db_dsn, polling_interval=0.2) as conn, conn.channel() as channel:
        hub = FakeHub()
        conn.transport.register_with_event_loop(conn.connection, hub)
        poller = conn.transport.poller
        with Consumer(channel, [Queue("below")], on_message=lambda m: (got.append(m), m.ack())):
            publish(conn, "below", [{"n": 1}])
            deadline = time.monotonic() + 10
            while not got and time.monotonic() < deadline:
                hub.run_once()
            assert got, "the first message"
            sql(
                db_dsn,
                "SELECT pgmq.send(%s, '{\"past\": true}'::jsonb, now() - interval '1 hour')",
                (queue,),
            )
            deadline = time.monotonic() + 10
            while len(got) < 2 and time.monotonic() < deadline:
                poller._on_hub_fallback()  # the hub's repeating timer (FakeHub has none)
                hub.run_once()
            assert conn.transport.broker().positions.full_scan_by_probe
        poller.unregister_from_event_loop()
    assert [m.decode() for m in got] == [{"n": 1}, {"past": True}]


def test_acks_probe_the_primary_key_after_a_vacuum_behind_a_held_snapshot(db_dsn):
    """A VACUUM behind the snapshot removes nothing and leaves pg_class.reltuples at the
    few live rows: an ack (and the read it rides) still finds its rows by msg_id on the
    primary key, not by a scan of the whole index (every dead entry of 4,000 messages)."""
    queue = pgmq_queue_name("probe_pk")
    with broker(db_dsn, "probe_pk") as pgmq, held(db_dsn):
        for _ in range(20):
            cycle(pgmq, queue, 200)
        sql(db_dsn, f"VACUUM pgmq.q_{queue}")
        for i in range(10):
            pgmq.send(queue, json.dumps({"n": i}), "{}", deduplicated=False)
        rows = pgmq.read_many([queue], 30, 10)
        receipts = [Receipt(queue, r.msg_id, r.read_ct, r.enqueued_at) for r in rows]
        before = index_entries_read(pgmq, db_dsn, f"q_{queue}_pkey")
        assert pgmq.ack(receipts) == {(queue, r.msg_id) for r in rows}
        walked = index_entries_read(pgmq, db_dsn, f"q_{queue}_pkey") - before
    assert walked <= 100, walked
