"""Concurrency slots held by tasks running after their ack (``kombu_pgmq.held_slots``,
:mod:`kombu_pgmq.transport._slots`) against a real PostgreSQL: a held slot counts toward
the queue's concurrency, its key's and a FIFO group's until it is released or lapses;
renewals keep it; a worker role may hold them. The transport holds one when a message is
acked while Celery's worker state says its task runs (simulated here with
``celery.worker.state``; real workers: tests/e2e/test_limits_early_ack.py)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
from kombu import Consumer, Producer, Queue

from kombu_pgmq._db.broker import Broker, Receipt
from kombu_pgmq._db.connector import Connector
from kombu_pgmq._db.limits import LimitStore
from tests.conftest import LeastPrivilegeDb

from .helpers import connect, publish, sql, table, wait_for
from .limit_helpers import Holder, declare, limits_info, set_limits, sql_read


def held(dsn: str) -> list[tuple[str, int, str | None]]:
    """``(pgmq_queue, msg_id, key)`` of the slots held now (not lapsed)."""
    return [
        (q, int(m), k)
        for q, m, k in sql(
            dsn,
            "SELECT pgmq_queue, msg_id, key FROM kombu_pgmq.held_slots"
            " WHERE held_until > clock_timestamp() ORDER BY msg_id",
        )
    ]


@contextlib.contextmanager
def store(dsn: str) -> Iterator[LimitStore]:
    with contextlib.closing(Connector(dsn)) as db:
        yield LimitStore(db)


def receipts(dsn: str, queue: str, msg_ids: list[int], hold_seconds: int) -> list[Receipt]:
    """Receipts of rows of PGMQ queue ``queue`` (as a worker holds them), each holding its
    slot ``hold_seconds`` (0: not)."""
    rows = sql(
        dsn,
        f"SELECT msg_id, read_ct, enqueued_at FROM pgmq.q_{queue}"
        " WHERE msg_id = ANY(%s) ORDER BY msg_id",
        (msg_ids,),
    )
    return [Receipt(queue, int(m), int(c), at, hold_seconds) for m, c, at in rows]


def ack_holding(dsn: str, queue: str, msg_ids: list[int], hold_seconds: int = 30) -> int:
    """Ack ``msg_ids`` of PGMQ queue ``queue`` as a worker acks tasks that run on
    (``Broker.ack``: ``kombu_pgmq.ack``); how many were settled."""
    with contextlib.closing(Connector(dsn)) as db:
        return len(Broker(db).ack(receipts(dsn, queue, msg_ids, hold_seconds)))


def test_a_held_slot_counts_until_it_is_released_or_lapses(db_dsn):
    """Concurrency 1: a message delivered, then acked holding its slot: the queue stays at
    its limit (the next read is throttled, state 1) until the slot is released; a slot
    held for 1 s then holds the queue only until it lapses."""
    with connect(db_dsn) as conn:
        publish(conn, "one", list(range(3)))
    assert set_limits(db_dsn, "one", {"concurrency": 1})
    first = sql_read(db_dsn, ["one"], 10)
    assert len(first.messages) == 1
    msg_id = first.messages[0][1]
    assert ack_holding(db_dsn, "one", [msg_id]) == 1
    assert held(db_dsn) == [("one", msg_id, None)]
    assert sql(db_dsn, "SELECT count(*) FROM pgmq.a_one") == [(1,)]  # archived
    info = limits_info(db_dsn, "one")
    assert info is not None and info.in_flight == 1
    refused = sql_read(db_dsn, ["one"], 10)
    assert refused.messages == [] and refused.markers["one"][0] == 1
    with store(db_dsn) as limits:
        assert limits.release_slots([("one", msg_id)]) == 1
    second = sql_read(db_dsn, ["one"], 10)
    assert len(second.messages) == 1
    # a slot that is not renewed lapses: the queue is free again once it has
    second_id = second.messages[0][1]
    assert ack_holding(db_dsn, "one", [second_id], hold_seconds=1) == 1
    assert sql_read(db_dsn, ["one"], 10).messages == []
    wait_for(lambda: not held(db_dsn), 10, "the slot lapses")
    assert len(sql_read(db_dsn, ["one"], 10).messages) == 1


def test_only_concurrency_limits_and_acks_that_ask_hold_slots(db_dsn):
    """An ack of a queue with only a rate limit, of an unlimited one, an ack that does not
    ask (a late ack) and a stale one (its read_ct moved on) hold nothing."""
    with connect(db_dsn) as conn:
        publish(conn, "rated", [1])
        publish(conn, "free", [1])
        publish(conn, "capped2", [1, 2, 3])
    assert set_limits(db_dsn, "rated", {"rate": "100/s"})
    assert set_limits(db_dsn, "capped2", {"concurrency": 5})
    for queue in ("rated", "free"):
        (_, msg_id, _, _), *_ = sql_read(db_dsn, [queue], 1).messages
        assert ack_holding(db_dsn, queue, [msg_id]) == 1
    late, stale, early = (m for _, m, _, _ in sql_read(db_dsn, ["capped2"], 3).messages)
    assert ack_holding(db_dsn, "capped2", [late], hold_seconds=0) == 1
    (receipt,) = receipts(db_dsn, "capped2", [stale], 30)
    with contextlib.closing(Connector(db_dsn)) as db:
        assert Broker(db).ack([receipt._replace(read_ct=receipt.read_ct + 1)]) == set()
    assert ack_holding(db_dsn, "capped2", [early]) == 1
    assert held(db_dsn) == [("capped2", early, None)]


@pytest.mark.parametrize("path", ["ack", "read_queue", "kombu_pgmq.read", "ack_queue"])
def test_every_ack_path_holds_the_slot_in_the_ack_itself(db_dsn, path):
    """The slot of an ack whose task runs on is held by the ack statement itself, whichever
    carries it: statement ack_queue (a flush), read_queue (acks riding with a read),
    kombu_pgmq.read (several queues, key limits) or ack_queue sent without waiting (in
    Celery's event loop); all of them through the queue's ack function. The message is
    archived, and its slot counts."""
    limits = {"key_concurrency": 5} if path == "kombu_pgmq.read" else {"concurrency": 5}
    with connect(db_dsn) as conn:
        publish(conn, "paths", [1, 2], headers={"x-limit-key": "k"})
    assert set_limits(db_dsn, "paths", limits)
    with contextlib.closing(Connector(db_dsn)) as db:
        broker = Broker(db)
        first = broker.read_many(["paths"], 30, 1)
        assert len(first) == 1 and "paths" in broker.limited
        acks = receipts(db_dsn, "paths", [first[0].msg_id], 30)
        if path == "ack":  # statement ack_queue
            assert broker.ack(acks) == {("paths", first[0].msg_id)}
        elif path == "ack_queue":  # sent without waiting
            settled: list[Any] = []
            assert broker.ack_nowait(
                acks, durable=False, on_settled=settled.append, on_error=pytest.fail
            )
            db.collect()
            assert settled == [{("paths", first[0].msg_id)}]
        else:
            assert path == "kombu_pgmq.read" or "paths" not in broker.keyed
            broker.read_many(["paths"], 30, 1, acks, durable_acks=False)
    assert sql(db_dsn, "SELECT count(*) FROM pgmq.a_paths") == [(1,)]
    assert held(db_dsn) == [("paths", first[0].msg_id, "k")]  # key: the limit_key header
    info = limits_info(db_dsn, "paths")
    assert info is not None and info.in_flight >= 1


def test_renewals_keep_a_slot_and_report_released_ones(db_dsn):
    with connect(db_dsn) as conn:
        publish(conn, "renewed", [1, 2])
    assert set_limits(db_dsn, "renewed", {"concurrency": 5})
    ids = [m for _, m, _, _ in sql_read(db_dsn, ["renewed"], 2).messages]
    assert ack_holding(db_dsn, "renewed", ids, hold_seconds=2) == 2
    with store(db_dsn) as limits:
        assert limits.release_slots([("renewed", ids[1])]) == 1
        kept = limits.renew_slots([("renewed", ids[0]), ("renewed", ids[1])], 60)
        assert kept == {("renewed", ids[0])}
    until = sql(
        db_dsn,
        "SELECT held_until > clock_timestamp() + interval '30 seconds'"
        " FROM kombu_pgmq.held_slots WHERE msg_id = %s",
        (ids[0],),
    )
    assert until == [(True,)]


def test_a_release_that_overtakes_its_hold_leaves_the_slot_free(db_dsn):
    """A short task ends before its batched ack reaches the server (release and ack travel
    on different connections): the release comes first, and the late ack holds nothing, so
    the queue is not held for a visibility timeout by a task that is done. A released
    slot's row is gone; only the overtaking release leaves one (released, not counted)."""
    with connect(db_dsn) as conn:
        publish(conn, "overtaken", [1, 2, 3])
    assert set_limits(db_dsn, "overtaken", {"concurrency": 1})
    ((_, first_id, _, _),) = sql_read(db_dsn, ["overtaken"], 1).messages
    with store(db_dsn) as limits:
        assert limits.release_slots([("overtaken", first_id)]) == 0  # not held yet
    assert ack_holding(db_dsn, "overtaken", [first_id]) == 1  # archived, holds nothing
    assert held(db_dsn) == []
    (_, second, _, _), *_ = sql_read(db_dsn, ["overtaken"], 1).messages
    assert ack_holding(db_dsn, "overtaken", [second]) == 1
    assert held(db_dsn) == [("overtaken", second, None)]
    with store(db_dsn) as limits:
        assert limits.release_slots([("overtaken", second)]) == 1
    rows = sql(db_dsn, "SELECT msg_id, released FROM kombu_pgmq.held_slots ORDER BY msg_id")
    assert rows == [(first_id, True)]
    assert len(sql_read(db_dsn, ["overtaken"], 1).messages) == 1


def test_a_held_slot_counts_for_its_key_and_holds_back_its_fifo_group(db_dsn):
    """Key concurrency 1: the held slot of key a keeps a's next message back, not b's; a
    FIFO group's next message waits for its head's slot, not only for its ack."""
    with connect(db_dsn) as conn:
        for key in ("a", "a", "b"):
            publish(conn, "keyed", [key], headers={"x-limit-key": key})
        fifo = Queue("groups", queue_arguments={"x-fifo-groups": True})
        producer = Producer(conn)
        for n in range(2):
            producer.publish([n], routing_key="groups", declare=[fifo], headers={"x-group-id": "g"})
    assert set_limits(db_dsn, "keyed", {"key_concurrency": 1})
    first = sql_read(db_dsn, ["keyed"], 10)
    assert sorted(first.keyed()) == ["a", "b"]
    ids = [m for _, m, _, _ in first.messages]
    assert ack_holding(db_dsn, "keyed", ids) == 2
    assert sorted(k for _, _, k in held(db_dsn)) == ["a", "b"]
    assert sql_read(db_dsn, ["keyed"], 10).messages == []  # a's slot is held
    a_id = next(m for _, m, _, h in first.messages if h["x-limit-key"] == "a")
    with store(db_dsn) as limits:
        limits.release_slots([("keyed", a_id)])
    assert sql_read(db_dsn, ["keyed"], 10).keyed() == ["a"]

    head = sql_read(db_dsn, ["groups"], 10).messages
    assert [h["x-group-id"] for _, _, _, h in head] == ["g"]
    head_id = head[0][1]
    assert ack_holding(db_dsn, "groups", [head_id]) == 1
    assert sql_read(db_dsn, ["groups"], 10).messages == []  # the head still runs
    with store(db_dsn) as limits:
        limits.release_slots([("groups", head_id)])
    assert len(sql_read(db_dsn, ["groups"], 10).messages) == 1


class _Request:
    """What the transport reads of Celery's worker request: its task id and message."""

    def __init__(self, message: Any) -> None:
        self.id = message.headers["id"]
        self.message = message


@pytest.fixture
def celery_state() -> Iterator[Any]:
    """``celery.worker.state``, emptied of the requests a test adds."""
    state = pytest.importorskip("celery.worker.state")
    before = dict(state.requests)
    try:
        yield state
    finally:
        state.requests.clear()
        state.requests.update(before)
        state.active_requests.clear()


def test_an_ack_while_its_task_runs_holds_the_slot_until_the_task_ends(db_dsn, celery_state):
    """Concurrency 1, a Kombu consumer acking as Celery's early ack does (the request
    active in Celery's worker state): the slot stays held after the ack, so nothing else is
    delivered until the task ends (``task_postrun`` in this process: threads, gevent and
    solo pools). An ack once the task ended (a late ack) holds nothing. A renewal round
    releases the slot of a task that ended without ``task_postrun`` here (prefork: the
    pool process runs it)."""
    from celery import signals

    from kombu_pgmq import _worker_checks

    _worker_checks.connect()  # as `import kombu_pgmq` does once Celery is imported
    state = celery_state
    with connect(db_dsn, polling_interval=5) as conn:
        for n in range(4):
            publish(conn, "early", [n], headers={"id": f"task-{n}"})
        assert set_limits(db_dsn, "early", {"concurrency": 1})
        requests: list[_Request] = []

        def on_message(message: Any) -> None:
            request = _Request(message)
            state.requests[request.id] = request
            state.active_requests.add(request)  # Celery's task_accepted
            requests.append(request)
            message.ack()  # Celery's early ack: the task runs on

        got: list[Any] = []
        with Consumer(
            conn.channel(),
            [Queue("early", routing_key="early")],
            on_message=lambda m: (got.append(m), on_message(m)),
            prefetch_count=10,
        ):
            wait_for(lambda: _drain(conn) or len(got) == 1, 10, "the first delivery")
            assert [k for _, _, k in held(db_dsn)] == [None]
            assert sql(db_dsn, f"SELECT count(*) FROM {table('early')}") == [(3,)]
            for _ in range(3):
                _drain(conn)
            assert len(got) == 1  # the running task holds the queue's only slot
            # the task ends: Celery's task_ready, then task_postrun
            state.active_requests.discard(requests[0])
            signals.task_postrun.send(sender=None, task_id=requests[0].id)
            wait_for(lambda: held(db_dsn) == [], 10, "the release (sent without waiting)")
            wait_for(lambda: _drain(conn) or len(got) == 2, 10, "the next delivery")
            # this task ended without task_postrun here: the lease round releases it
            assert len(held(db_dsn)) == 1
            state.active_requests.discard(requests[1])
            conn.transport.leases.renew()
            assert held(db_dsn) == []
            wait_for(lambda: _drain(conn) or len(got) == 3, 10, "the third delivery")
            assert len(held(db_dsn)) == 1
            state.active_requests.discard(requests[2])
            conn.transport.leases.slots.release_finished()  # a turn of Celery's event loop
            wait_for(lambda: held(db_dsn) == [], 10, "the release (sent without waiting)")

    # a late ack: the task ended before it, nothing is held
    with connect(db_dsn, polling_interval=5) as conn, Holder(conn, [Queue("early")]) as holder:
        holder.drain_until(1, timeout=10)
        message = holder.held[0]
        state.requests[message.headers["id"]] = _Request(message)  # received, not active
        message.ack()
        assert held(db_dsn) == []


def _drain(conn: Any) -> bool:
    with contextlib.suppress(TimeoutError):
        conn.drain_events(timeout=0.3)
    return False


def test_a_worker_role_holds_renews_and_releases_slots(least_privilege_db):
    db: LeastPrivilegeDb = least_privilege_db
    with connect(db.worker_url, queue_limits={"lp": {"concurrency": 1}}) as conn:
        declare(conn, "lp")
        publish(conn, "lp", [1])
    with contextlib.closing(Connector(db.worker_url)) as worker:
        broker = Broker(worker)
        (row,) = broker.read_many(["lp"], 30, 1)
        receipt = Receipt("lp", row.msg_id, row.read_ct, row.enqueued_at, 30)
        assert broker.ack([receipt]) == {("lp", row.msg_id)}
        limits = LimitStore(worker)
        assert limits.renew_slots([("lp", row.msg_id)], 30) == {("lp", row.msg_id)}
        assert limits.release_slots([("lp", row.msg_id)]) == 1
