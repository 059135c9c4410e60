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
from kombu_pgmq._db.rows import Receipt, receipt_handles, slot_holds
from kombu_pgmq._naming import pgmq_queue_name

from .helpers import connect, publish, sql, wait_for
from .limit_helpers import set_limits


@pytest.fixture(autouse=True)
def no_full_scans(monkeypatch):
    """Every read of these tests is bounded by its position (the periodic read from the
    start of the index would hide a missed row), unless a test says otherwise."""
    monkeypatch.setattr(positions, "FULL_SCAN_SECONDS", 3600.0)


#: How a read of one queue reaches the table: the queue's read function (statement
#: read_queue), or kombu_pgmq.read (several queues or priority bands in one read, key
#: limits), which calls it.
READS = pytest.mark.parametrize("direct", [True, False], ids=["read_queue", "kombu_pgmq.read"])


@contextlib.contextmanager
def queue_broker(dsn: str, queue: str, *, direct: bool = True) -> Iterator[Broker]:
    with connect(dsn) as conn:
        conn.channel().queue_declare(queue)
    db = Connector(dsn)
    try:
        broker = Broker(db)
        if not direct:  # read as a queue with key limits is: through kombu_pgmq.read
            broker.keyed.add(pgmq_queue_name(queue))
        yield broker
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


def cycle(broker: Broker, queue: str, n: int) -> None:
    """Publish ``n`` messages, read them and archive them: each leaves dead versions (the
    delivered ones with a visibility timeout far beyond the test, so that only the sent
    versions lie in the index below now)."""
    broker.db.connection.execute(
        "SELECT pgmq.send_batch(%s, ARRAY(SELECT jsonb_build_object('n', i)"
        " FROM generate_series(1, %s) AS i))",
        (queue, n),
    )
    rows = broker.read_many([queue], 3600, n)
    assert len(rows) == n
    ids = [r.msg_id for r in rows]
    broker.db.connection.execute("SELECT pgmq.archive(%s, %s::bigint[])", (queue, ids))


def flush_stats(broker: Broker) -> None:
    """Flush the cumulative statistics of this broker's connection now."""
    broker.db.connection.execute("SELECT pg_stat_force_next_flush()")
    broker.db.connection.execute("SELECT 1")  # the flush happens at its end


def touched(broker: Broker, dsn: str, queue: str) -> tuple[int, int]:
    """(index entries its vt index returned to scans, dead or alive; shared buffers its
    table and indexes were read from), cumulative, with this broker's connection's counts
    flushed (pg_stat_user_indexes.idx_tup_read; pg_statio_user_tables' hits and reads)."""
    flush_stats(broker)
    ((entries, buffers),) = sql(
        dsn,
        "SELECT i.idx_tup_read,"
        " t.heap_blks_hit + t.heap_blks_read + t.idx_blks_hit + t.idx_blks_read"
        " FROM pg_stat_user_indexes i JOIN pg_statio_user_tables t USING (relid)"
        " WHERE i.schemaname = 'pgmq' AND i.indexrelname = %s",
        (f"q_{queue}_vt_idx",),
    )
    return int(entries), int(buffers)


def index_entries_read(broker: Broker, dsn: str, index: str) -> int:
    """pg_stat_user_indexes.idx_tup_read of PGMQ index ``index`` (every entry a scan
    returned, dead or alive), with this broker's connection's counts flushed."""
    flush_stats(broker)
    ((n,),) = sql(
        dsn,
        "SELECT idx_tup_read FROM pg_stat_user_indexes "
        "WHERE schemaname = 'pgmq' AND indexrelname = %s",
        (index,),
    )
    return int(n)


def seq_scans(broker: Broker, dsn: str, queue: str) -> int:
    """pg_stat_user_tables.seq_scan of the queue's table (scans of every page), with this
    broker's connection's counts flushed."""
    flush_stats(broker)
    ((n,),) = sql(
        dsn,
        "SELECT seq_scan FROM pg_stat_user_tables WHERE schemaname = 'pgmq' AND relname = %s",
        (f"q_{queue}",),
    )
    return int(n)


def walk(broker: Broker, dsn: str, queue: str, *, settle: bool = True) -> tuple[int, int]:
    """(index entries of the queue's vt index, shared buffers of its table and indexes)
    one empty read touches, once the position has moved past the last cycle: a read after
    a pause longer than the position's lag behind the reads (MARGIN_SECONDS), then the
    measured read after another.

    A transaction of another database (another test process) that was in progress at one
    read, began before this broker's first read and commits before the next, costs that
    next read a walk from the start (the positions' rule for an id older than every read
    id known). So a settled walk is measured up to three times and the least is returned:
    the read by position, whatever the rest of the server does."""
    if settle:
        pause = 2 * (positions.STAMP_SECONDS + positions.MARGIN_SECONDS)
        time.sleep(pause)
        assert broker.read_many([queue], 30, 10) == []
        time.sleep(pause)
    measured = []
    for _ in range(3 if settle else 1):
        entries, buffers = touched(broker, dsn, queue)
        assert broker.read_many([queue], 30, 10) == []
        entries_after, buffers_after = touched(broker, dsn, queue)
        measured.append((entries_after - entries, buffers_after - buffers))
        if measured[-1][0] < 200:
            break
    return min(measured)


def entries_walked(broker: Broker, dsn: str, queue: str, *, settle: bool = True) -> int:
    return walk(broker, dsn, queue, settle=settle)[0]


@READS
def test_a_read_touches_as_much_after_50_000_messages_as_after_1_000(db_dsn, direct):
    """Behind a held snapshot every delivery and ack leaves dead row versions that stay in
    the vt index; one read by position walks and touches the same few entries and
    buffers whether 1,000 or 50,000 messages went through, where a read from the start
    walks all of them."""
    queue = pgmq_queue_name("walk")
    with queue_broker(db_dsn, "walk", direct=direct) as broker, held(db_dsn):
        for _ in range(2):
            cycle(broker, queue, 500)
        early = walk(broker, db_dsn, queue)
        for _ in range(98):
            cycle(broker, queue, 500)
        late = walk(broker, db_dsn, queue)
        broker.positions.forget(queue)
        from_start = walk(broker, db_dsn, queue, settle=False)
    # (entries, buffers): the position trails the reads by MARGIN_SECONDS, so the read
    # walks none of the dead versions; its buffers are the index's descent (one level
    # deeper at most as the index grows) and the catalog rows it checks
    assert from_start[0] >= 50_000, (early, late, from_start)
    assert late[0] < 200, (early, late, from_start)
    assert late[1] <= early[1] + 3, (early, late, from_start)
    assert from_start[1] > 10 * late[1], (early, late, from_start)


@pytest.mark.parametrize(
    "limits", [{"concurrency": 1_000_000}, {"rate": "1000000/s"}], ids=["concurrency", "rate"]
)
def test_a_queue_with_a_rate_or_concurrency_limit_is_read_by_position_too(db_dsn, limits):
    """The read function of a limited queue starts its walk at the position as well (only
    queues with key limits are read through kombu_pgmq.read_limited, from the start)."""
    queue = pgmq_queue_name("limited_walk")
    with queue_broker(db_dsn, "limited_walk") as broker, held(db_dsn):
        assert set_limits(db_dsn, "limited_walk", limits)
        for _ in range(8):
            cycle(broker, queue, 500)
        assert queue in broker.limited  # the reads saw the limits
        late = entries_walked(broker, db_dsn, queue)
        broker.positions.forget(queue)
        from_start = entries_walked(broker, db_dsn, queue, settle=False)
    assert from_start >= 4_000 and late < 200, (late, from_start)


@READS
def test_a_long_transaction_that_has_written_does_not_hold_the_position_back(db_dsn, direct):
    queue = pgmq_queue_name("writer")
    with queue_broker(db_dsn, "writer", direct=direct) as broker, held(db_dsn, write=True):
        for _ in range(5):
            cycle(broker, queue, 200)
        early = entries_walked(broker, db_dsn, queue)
        for _ in range(25):
            cycle(broker, queue, 200)
        late = entries_walked(broker, db_dsn, queue)
        broker.positions.forget(queue)
        from_start = entries_walked(broker, db_dsn, queue, settle=False)
    # held back to the writer's start, the read would walk all of them
    assert from_start >= 6_000
    assert late < 200, (early, late, from_start)


def test_a_read_of_several_queues_walks_few_entries_of_each(db_dsn):
    """Several queues in one read (a consumer of two queues, priority bands): each
    queue's walk starts at its own position."""
    names = [pgmq_queue_name("bands"), pgmq_queue_name("bands.1")]
    with queue_broker(db_dsn, "bands") as broker, held(db_dsn):
        with connect(db_dsn) as conn:
            conn.channel().queue_declare("bands.1")

        def walked() -> int:
            return sum(index_entries_read(broker, db_dsn, f"q_{q}_vt_idx") for q in names)

        for _ in range(20):
            for q in names:
                for i in range(100):
                    broker.send(q, json.dumps({"n": i}), "{}", deduplicated=False)
            rows = broker.read_many(names, 3600, 400)
            assert len(rows) == 200
            for q in names:
                ids = [r.msg_id for r in rows if r.queue == q]
                broker.db.connection.execute("SELECT pgmq.archive(%s, %s::bigint[])", (q, ids))
        time.sleep(2 * (positions.STAMP_SECONDS + positions.MARGIN_SECONDS))
        assert broker.read_many(names, 30, 10) == []
        time.sleep(2 * (positions.STAMP_SECONDS + positions.MARGIN_SECONDS))
        late = 0
        for _ in range(3):  # the least of three reads, as walk() says why
            before = walked()
            assert broker.read_many(names, 30, 10) == []
            late = walked() - before
            if late < 200:
                break
        broker.positions.forget()
        before = walked()
        assert broker.read_many(names, 30, 10) == []
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
    with queue_broker(db_dsn, "late", direct=direct) as broker:
        cycle(broker, queue, 5)
        with psycopg.connect(db_dsn) as app:
            if when == "id-before-reads":
                app.execute("SELECT pg_current_xact_id()")
                cycle(broker, queue, 5)
            app.execute("SELECT pgmq.send(%s, '{\"late\": true}'::jsonb)", (queue,))
            if when == "commit-before-listed":
                time.sleep(0.05)
                assert broker.read_many([queue], 30, 10) == []  # moves on past its vt
            else:
                for _ in range(20):  # the position moves on past the late message's vt
                    cycle(broker, queue, 5)
                    time.sleep(0.05)
                assert broker.read_many([queue], 30, 10) == []
            app.commit()
        rows = broker.read_many([queue], 30, 10)
        assert [json.loads(r.message) for r in rows] == [{"late": True}]


@READS
def test_messages_that_become_visible_again_below_the_position_are_delivered(db_dsn, direct):
    """A delayed message, a lease that lapses and a requeue with a delay come due while
    reads move on: each is delivered when due, without a read from the start."""
    queue = pgmq_queue_name("due")
    with queue_broker(db_dsn, "due", direct=direct) as broker:
        broker.send(queue, '{"delayed": true}', "{}", 2, deduplicated=False)
        broker.send(queue, '{"leased": true}', "{}", deduplicated=False)
        broker.send(queue, '{"requeued": true}', "{}", deduplicated=False)
        _leased, requeued = broker.read_many([queue], 1, 10)  # invisible for 1 s
        receipt = Receipt(queue, requeued.msg_id, requeued.read_ct, requeued.enqueued_at)
        assert broker.requeue([receipt], 2) == {(queue, requeued.msg_id)}
        got: list[dict[str, bool]] = []
        deadline = time.monotonic() + 10
        while len(got) < 3 and time.monotonic() < deadline:
            for i in range(3):
                broker.send(queue, json.dumps({"n": i}), "{}", deduplicated=False)
            rows = broker.read_many([queue], 30, 10)
            ids = [r.msg_id for r in rows]
            broker.db.connection.execute("SELECT pgmq.archive(%s, %s::bigint[])", (queue, ids))
            got += [m for m in (json.loads(r.message) for r in rows) if "n" not in m]
            time.sleep(0.1)
        assert sorted(got, key=str) == [{"delayed": True}, {"leased": True}, {"requeued": True}]


def test_a_past_visibility_time_is_found_by_the_periodic_read_from_the_start(db_dsn, monkeypatch):
    """``pgmq.send`` with a timestamp in the past writes a row below every position: the
    read from the start of the index (every FULL_SCAN_SECONDS) delivers it."""
    monkeypatch.setattr(positions, "FULL_SCAN_SECONDS", 1.0)
    queue = pgmq_queue_name("past")
    with queue_broker(db_dsn, "past") as broker:
        cycle(broker, queue, 5)
        sql(
            db_dsn,
            "SELECT pgmq.send(%s, '{\"past\": true}'::jsonb, now() - interval '1 hour')",
            (queue,),
        )
        got: list[object] = []
        wait_for(
            lambda: (
                got.extend(json.loads(r.message) for r in broker.read_many([queue], 30, 10)) or got
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


@pytest.mark.parametrize("loop", ["event loop", "drain_events"])
def test_the_heartbeat_thread_looks_below_the_positions(db_dsn, monkeypatch, loop):
    """No read starts from the beginning by the clock while the heartbeat thread looks
    below the positions every LOOK_SECONDS on its own connection (a read from the start
    would hold up the consumer while it walks every dead row version): a visible row
    found there (a ``pgmq.send`` with a past visibility time) rewinds the queue, and it
    is delivered, in Celery's event loop and in ``drain_events``."""
    from kombu import Consumer, Queue

    from .helpers import FakeHub

    monkeypatch.setattr(positions, "LOOK_SECONDS", 0.5)  # the reads never start over
    queue = pgmq_queue_name("below")
    got: list[Any] = []
    options = {"polling_interval": 0.2, "consumer_heartbeat_interval": 0.2}
    with connect(db_dsn, **options) as conn, conn.channel() as channel:
        hub = FakeHub() if loop == "event loop" else None
        if hub is not None:
            conn.transport.register_with_event_loop(conn.connection, hub)
        poller = conn.transport.poller

        def turn() -> None:
            if hub is None:
                with contextlib.suppress(TimeoutError, OSError):
                    conn.drain_events(timeout=0.2)
            else:
                poller._on_hub_fallback()  # the hub's repeating timer (FakeHub has none)
                hub.run_once()

        with Consumer(channel, [Queue("below")], on_message=lambda m: (got.append(m), m.ack())):
            publish(conn, "below", [{"n": 1}])
            deadline = time.monotonic() + 10
            while not got and time.monotonic() < deadline:
                turn()
            assert got, "the first message"
            sql(
                db_dsn,
                "SELECT pgmq.send(%s, '{\"past\": true}'::jsonb, now() - interval '1 hour')",
                (queue,),
            )
            deadline = time.monotonic() + 10
            while len(got) < 2 and time.monotonic() < deadline:
                turn()
        if hub is not None:
            poller.unregister_from_event_loop()
    assert [m.decode() for m in got] == [{"n": 1}, {"past": True}]


@READS
def test_settling_probes_the_primary_key_after_a_vacuum_behind_a_held_snapshot(db_dsn, direct):
    """A VACUUM behind the snapshot removes nothing and leaves pg_class.reltuples at the
    few live rows, and an ANALYZE (autovacuum's, after so many changes) records them as
    the whole table: a lease renewal, an ack (and the read it rides), a requeue, a discard
    and a dead letter still find their rows by msg_id on the primary key, not by a scan of
    the whole index (every dead entry of 4,000 messages) nor of every page of the table,
    which the statistics make look cheaper. ``direct``: statement ack_queue, else
    kombu_pgmq.ack."""

    def ack(broker: Broker, receipts: list[Receipt]) -> list[Any]:
        if direct:
            return list(broker.ack(receipts))
        return broker.db.fetch("ack", {**receipt_handles(receipts), **slot_holds(receipts)})

    queue = pgmq_queue_name("probe_pk")
    dead_letters = pgmq_queue_name("probe_pk_dlq")
    sql(db_dsn, "SELECT pgmq.create(%s)", (dead_letters,))
    with queue_broker(db_dsn, "probe_pk", direct=direct) as broker, held(db_dsn):
        for _ in range(20):
            cycle(broker, queue, 200)
        sql(db_dsn, f"VACUUM pgmq.q_{queue}")
        for i in range(20):
            broker.send(queue, json.dumps({"n": i}), "{}", deduplicated=False)
        rows = broker.read_many([queue], 30, 20)
        receipts = [Receipt(queue, r.msg_id, r.read_ct, r.enqueued_at) for r in rows]
        sql(db_dsn, f"ANALYZE pgmq.q_{queue}")  # the local test server runs no autovacuum
        walked, scans = {}, {}
        for step, settle in (
            ("renew", lambda: broker.renew(receipts, 60)),
            ("ack", lambda: ack(broker, receipts[:10])),
            ("requeue", lambda: broker.requeue(receipts[10:], 5)),
            ("discard", lambda: broker.discard(receipts[10:15])),
            (
                "dead_letter",
                lambda: broker.dead_letter(
                    queue,
                    receipts[15:],
                    dead_letter_queue=dead_letters,
                    reason="rejected",
                    kombu_queue="probe_pk",
                ),
            ),
        ):
            before = index_entries_read(broker, db_dsn, f"q_{queue}_pkey")
            scans_before = seq_scans(broker, db_dsn, queue)
            settled = {"renew": 20, "ack": 10, "requeue": 10, "discard": 5, "dead_letter": 5}
            assert len(settle()) == settled[step]
            walked[step] = index_entries_read(broker, db_dsn, f"q_{queue}_pkey") - before
            scans[step] = seq_scans(broker, db_dsn, queue) - scans_before
    # by primary key: neither every entry of the index nor every page of the table
    assert max(walked.values()) <= 100, walked
    assert scans == {"renew": 0, "ack": 0, "requeue": 0, "discard": 0, "dead_letter": 0}, scans


@READS
def test_reads_and_acks_never_scan_the_table_whose_plan_was_made_small(db_dsn, direct):
    """PL/pgSQL keeps the queue functions' plans for the session: plans made while the
    table was a page or two stay in use as it grows behind a held snapshot (nothing
    invalidates them without a VACUUM or ANALYZE). Reads and acks still find their rows by
    index, never by a scan of every page."""
    queue = pgmq_queue_name("small_plan")
    with queue_broker(db_dsn, "small_plan", direct=direct) as broker, held(db_dsn):
        scans = []
        for _ in range(4):  # one ack per message, as a Celery worker's
            broker.db.connection.execute(
                "SELECT pgmq.send_batch(%s, ARRAY(SELECT jsonb_build_object('n', i)"
                " FROM generate_series(1, 500) AS i))",
                (queue,),
            )
            before = seq_scans(broker, db_dsn, queue)
            rows = broker.read_many([queue], 30, 500)
            for r in rows:
                assert broker.ack([Receipt(queue, r.msg_id, r.read_ct, r.enqueued_at)])
            scans.append(seq_scans(broker, db_dsn, queue) - before)
        assert scans == [0, 0, 0, 0]


def test_plain_pgmq_clients_and_a_least_privilege_worker_share_a_queue(least_privilege_db):
    """On the SQL-only install and on the extension: a worker role granted with least
    privilege reads by position (through kombu_pgmq.read) behind a held snapshot, while
    the owner works the same queue with PGMQ's own functions: what pgmq.send writes is
    delivered, what pgmq.read took is not, pgmq.set_vt makes a delivered message visible
    again, and an ack of a message pgmq.archive took first is not applied."""
    db = least_privilege_db
    queue = pgmq_queue_name("shared")
    with connect(db.owner_url) as conn:
        conn.channel().queue_declare("shared")
    worker = Connector(db.worker_url)
    owner = psycopg.connect(db.owner_url, autocommit=True)
    try:
        broker = Broker(worker)

        def read() -> list[Any]:
            return list(broker.read_many([queue], 30, 10))

        def plain(statement: str, *args: object) -> Any:
            return owner.execute(statement, (queue, *args)).fetchall()

        with held(db.admin_url):
            plain("SELECT pgmq.send_batch(%s, ARRAY['{\"n\": 1}'::jsonb, '{\"n\": 2}'])")
            first = read()
            assert sorted(json.loads(r.message)["n"] for r in first) == [1, 2]
            receipts = [Receipt(queue, r.msg_id, r.read_ct, r.enqueued_at) for r in first]
            assert broker.ack(receipts) == {(queue, r.msg_id) for r in first}
            with pytest.raises(psycopg.errors.InsufficientPrivilege):  # nor PGMQ's tables
                worker.connection.execute(f"SELECT count(*) FROM pgmq.q_{queue}")
            assert broker.positions.age(queue) is not None  # and it reads by position
            time.sleep(2 * (positions.STAMP_SECONDS + positions.MARGIN_SECONDS))
            assert read() == []
            ((taken,),) = plain("SELECT pgmq.send(%s, '{\"n\": 3}')")
            ((other,),) = plain("SELECT pgmq.send(%s, '{\"n\": 4}')")
            assert plain("SELECT msg_id FROM pgmq.read(%s, 30, 1)") == [(taken,)]
            (got,) = read()  # what pgmq.read took is invisible
            assert got.msg_id == other
            plain("SELECT pgmq.set_vt(%s, %s, 0)", other)  # visible now, above the position
            (again,) = read()
            assert (again.msg_id, again.read_ct) == (other, 2)
            assert plain("SELECT pgmq.archive(%s, %s)", other) == [(True,)]
            stale = Receipt(queue, again.msg_id, again.read_ct, again.enqueued_at)
            assert broker.ack([stale]) == set()
            assert plain("SELECT pgmq.archive(%s, %s)", taken) == [(True,)]
            ((ready,),) = plain("SELECT queue_length FROM pgmq.metrics(%s)")
            assert ready == 0
    finally:
        owner.close()
        worker.close()
