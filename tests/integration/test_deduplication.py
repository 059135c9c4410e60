"""Deduplication ids (SQS FIFO's ``MessageDeduplicationId``): a message
with an ``x-deduplication-id`` header (or, on a queue declared with
``x-deduplicate-task-id``, a Celery task id) is enqueued once per queue within
``deduplication_window`` seconds; concurrent publishers never enqueue a duplicate and
never deadlock; a claim rolled back with its transaction frees the id."""

from __future__ import annotations

import logging
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import psycopg
import pytest
from kombu import Exchange, Producer, Queue
from kombu.exceptions import ChannelError

import kombu_pgmq

from .helpers import connect, drain, sql


def _count(url: str, queue: str) -> int:
    return int(sql(url, f"SELECT count(*) FROM pgmq.q_{queue}")[0][0])


def test_an_id_is_enqueued_once_within_its_window(db_dsn, caplog):
    with connect(db_dsn, deduplication_window=1.5) as conn:
        producer = Producer(conn)
        queue = Queue("orders")
        with caplog.at_level(logging.DEBUG, logger="kombu_pgmq"):
            for _ in range(3):
                producer.publish(
                    {"order": 7},
                    routing_key="orders",
                    declare=[queue],
                    headers={"x-deduplication-id": "order-7"},
                )
        assert "deduplication id" in caplog.text
        producer.publish({"order": 8}, routing_key="orders", headers={"x-deduplication-id": "o-8"})
        producer.publish({"order": 0}, routing_key="orders")  # no id: never deduplicated
        producer.publish({"order": 0}, routing_key="orders")
        assert _count(db_dsn, "orders") == 4
        time.sleep(1.6)  # the window passed: the id is accepted again
        producer.publish(
            {"order": 7}, routing_key="orders", headers={"x-deduplication-id": "order-7"}
        )
        assert _count(db_dsn, "orders") == 5


def test_ids_are_per_queue_and_an_exchange_publish_claims_each_queue(db_dsn):
    fanout = Exchange("fan", type="fanout")
    with connect(db_dsn) as conn:
        producer = Producer(conn)
        queues = [Queue(name, fanout) for name in ("fan_a", "fan_b")]
        for q in queues:
            q(conn.default_channel).declare()
        producer.publish({}, routing_key="fan_a", headers={"x-deduplication-id": "x"})
        for _ in range(2):
            producer.publish({}, exchange=fanout, headers={"x-deduplication-id": "x"})
    assert (_count(db_dsn, "fan_a"), _count(db_dsn, "fan_b")) == (1, 1)


def test_a_celery_task_id_is_an_id_on_queues_that_ask_for_it(db_dsn):
    from celery import Celery

    app = Celery("dedup", broker=db_dsn, set_as_current=False)
    app.conf.task_queues = [
        Queue("once", queue_arguments={"x-deduplicate-task-id": True}),
        Queue("plain"),
    ]

    @app.task(name="dedup.work", shared=False)
    def work() -> None: ...

    try:
        for queue in ("once", "once", "plain", "plain"):
            work.apply_async(task_id="fixed-id", queue=queue)  # e.g. a retried enqueue
    finally:
        app.close()
    assert (_count(db_dsn, "once"), _count(db_dsn, "plain")) == (1, 2)


def test_a_rolled_back_claim_frees_the_id(db_dsn):
    with psycopg.connect(db_dsn) as pg:
        producer = Producer(kombu_pgmq.using(pg))
        with pytest.raises(ZeroDivisionError), pg.transaction():
            producer.publish(
                {}, routing_key="rb", declare=[Queue("rb")], headers={"x-deduplication-id": "k"}
            )
            raise ZeroDivisionError
        with pg.transaction():
            producer.publish({}, routing_key="rb", headers={"x-deduplication-id": "k"})
    assert _count(db_dsn, "rb") == 1


def test_concurrent_publishers_never_enqueue_a_duplicate_nor_deadlock(db_dsn):
    """8 threads publish 30 ids to 2 queues through one exchange (the claims of a routed
    publish are taken in queue order), each in its own application transaction that
    stays open a random few ms, a quarter of them rolled back: every id that any
    committed transaction published is in each queue exactly once."""
    topic = Exchange("dd", type="topic")
    with connect(db_dsn) as conn:
        for name in ("dd_a", "dd_b"):
            Queue(name, topic, routing_key="#")(conn.default_channel).declare()
    committed: set[str] = set()
    lock = threading.Lock()

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        with psycopg.connect(db_dsn) as pg:
            producer = Producer(kombu_pgmq.using(pg))
            for _ in range(40):
                key = f"id-{rng.randrange(30)}"
                rollback = rng.random() < 0.25
                try:
                    with pg.transaction():
                        producer.publish(
                            {"key": key},
                            exchange=topic,
                            routing_key="k",
                            headers={"x-deduplication-id": key},
                        )
                        time.sleep(rng.random() * 0.005)
                        if rollback:
                            raise psycopg.Rollback
                except psycopg.errors.DeadlockDetected:  # pragma: no cover - the bug
                    raise
                if not rollback:
                    with lock:
                        committed.add(key)

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(worker, range(8), timeout=120))
    for name in ("dd_a", "dd_b"):
        rows = sql(db_dsn, f"SELECT message->>'key', count(*) FROM pgmq.q_{name} GROUP BY 1")
        assert all(n == 1 for _, n in rows), rows
        assert {key for key, _ in rows} == committed


def test_expired_claims_are_forgotten_by_the_reaper_round(db_dsn):
    with connect(db_dsn, deduplication_window=0.2) as conn:
        producer = Producer(conn)
        for i in range(5):
            producer.publish(
                {},
                routing_key="exp",
                declare=[Queue("exp")],
                headers={"x-deduplication-id": f"e{i}"},
            )
        time.sleep(0.3)
        conn.transport.reap()
    assert sql(db_dsn, "SELECT count(*) FROM kombu_pgmq.deduplication") == [(0,)]
    with connect(db_dsn) as conn:
        assert len(drain(conn, "exp", expect=5)) == 5


#: Header values of other headers that jsonb cannot store (Celery's argsrepr of a task
#: called with a NUL character, a float NaN), which move the headers to the exact form.
AWKWARD_HEADERS = [{"argsrepr": "('\x00',)"}, {"ratio": float("nan")}, {"note": "\ud800"}]


@pytest.mark.parametrize("other", AWKWARD_HEADERS, ids=["nul", "nan", "surrogate"])
@pytest.mark.parametrize("dedup_id", ["BANaNa-1", "acct-NaN-1", "Infinity", "a\\u0000b"])
def test_an_id_that_looks_like_nan_or_nul_still_deduplicates(db_dsn, dedup_id, other):
    """An id containing 'NaN', 'Infinity' or an escaped backslash before 'u0000' stays
    readable to the server when another header forces the exact (base64) block. Fails on
    a substring test of the headers' JSON text: it moves such an id into that block, the
    server never sees it and deduplication silently switches off."""
    with connect(db_dsn) as conn:
        producer = Producer(conn)
        for _ in range(3):
            producer.publish(
                {"n": 1},
                routing_key="dedup_nan",
                declare=[Queue("dedup_nan")],
                headers={"x-deduplication-id": dedup_id, **other},
            )
        assert _count(db_dsn, "dedup_nan") == 1
        [message] = drain(conn, "dedup_nan", expect=1, timeout=5)
    assert message.headers["x-deduplication-id"] == dedup_id
    assert message.headers.keys() == {"x-deduplication-id", *other}  # exact, all of them
    assert sql(db_dsn, "SELECT headers->>'x-deduplication-id' FROM pgmq.a_dedup_nan") == [
        (dedup_id,)
    ]


@pytest.mark.parametrize("bad", ["a\x00b", "\udc80", float("nan")], ids=["nul", "surrogate", "nan"])
def test_an_id_jsonb_cannot_hold_is_refused_not_ignored(db_dsn, bad):
    with connect(db_dsn) as conn:
        producer = Producer(conn)
        with pytest.raises(kombu_pgmq.errors.ConfigurationError, match="x-deduplication-id"):
            producer.publish(
                {"n": 1},
                routing_key="dedup_bad",
                declare=[Queue("dedup_bad")],
                headers={"x-deduplication-id": bad},
            )
    assert _count(db_dsn, "dedup_bad") == 0


def test_a_channel_that_did_not_declare_a_deduplicating_queue_still_deduplicates(db_dsn):
    """Another process declared the queue with x-deduplicate-task-id; this connection
    publishes to it without declaring it (kombu's maybe_declare skips a queue it
    declared on another channel): the stored declaration decides, and a task id is
    still enqueued once."""
    with connect(db_dsn) as other:
        Queue("once_elsewhere", queue_arguments={"x-deduplicate-task-id": True})(
            other.default_channel
        ).declare()
    with connect(db_dsn) as conn, conn.channel() as channel:
        producer = Producer(channel)
        for _ in range(3):
            producer.publish({}, routing_key="once_elsewhere", headers={"id": "task-1"})
    assert _count(db_dsn, "once_elsewhere") == 1


def test_a_second_channel_publishes_to_a_plain_queue_with_the_direct_statement(db_dsn, monkeypatch):
    """A queue declared on one channel of a connection is known to all its channels: a
    publish on another channel (Celery's producer pool, kombu's maybe_declare cache)
    takes the plan-cached ``send_queue`` statement, not the deduplicating function
    (0.4 against 0.6 ms a publish, measured). Fails if each channel knew only its own
    declarations."""
    from kombu_pgmq._db.broker import Broker

    direct = []
    send_queue = Broker._send_queue

    def counting(self, *args, **kwargs):
        direct.append(args[0])
        return send_queue(self, *args, **kwargs)

    monkeypatch.setattr(Broker, "_send_queue", counting)
    with connect(db_dsn) as conn:
        with conn.channel() as first:
            Queue("plain_two")(first).declare()
        with conn.channel() as second:
            producer = Producer(second)
            for n in range(3):
                producer.publish({"n": n}, routing_key="plain_two", headers={"id": f"t{n % 2}"})
    assert direct == ["plain_two"] * 3
    assert _count(db_dsn, "plain_two") == 3  # the same task id twice: both there (plain)


def test_a_priority_publish_to_a_queue_declared_elsewhere_reads_its_declaration_once(
    db_dsn, monkeypatch
):
    """A connection that publishes with a priority to a queue it never declared needs the
    stored bands and the stored deduplication setting: both come from one ``queue_info``
    row, read once per queue and transport (fails if each cache read its own)."""
    from kombu_pgmq._db.declarations import Declarations

    with connect(db_dsn) as other:
        Queue("banded_elsewhere", queue_arguments={"x-max-priority": 3})(
            other.default_channel
        ).declare()
    reads = []
    queue_info = Declarations.queue_info

    def counting(self, queue):
        reads.append(queue)
        return queue_info(self, queue)

    monkeypatch.setattr(Declarations, "queue_info", counting)
    with connect(db_dsn) as conn, conn.channel() as channel:
        producer = Producer(channel)
        for n in range(3):
            producer.publish({"n": n}, routing_key="banded_elsewhere", priority=3)
        assert reads == ["banded_elsewhere"]
        assert _count(db_dsn, "banded_elsewhere") == 0  # in band 3, none in band 0
        got = drain(conn, "banded_elsewhere", expect=3)
    assert sorted(m.payload["n"] for m in got) == [0, 1, 2]


@pytest.mark.parametrize(
    ("queue", "argument", "stored"),
    [
        ("refuse_dedup_on", "x-deduplicate-task-id", False),
        ("refuse_dedup_off", "x-deduplicate-task-id", True),
        ("refuse_fifo_on", "x-fifo-groups", False),
    ],
)
def test_a_declaration_giving_another_flag_is_refused_and_sends_nothing(
    db_dsn, queue, argument, stored
):
    """A queue keeps its first declaration's arguments. A declaration that gives
    x-deduplicate-task-id or x-fifo-groups otherwise is refused as RabbitMQ refuses an
    inequivalent argument (406), naming the argument and the fix, and its publish sends
    nothing; one that leaves the argument out takes the stored one (fails if the
    stored setting silently won: the declarer would believe it deduplicates or orders)."""
    with connect(db_dsn) as conn:
        Queue(queue, queue_arguments={argument: True} if stored else {})(
            conn.default_channel
        ).declare()
    with connect(db_dsn) as conn:
        producer = Producer(conn.default_channel)
        with pytest.raises(ChannelError, match=rf"inequivalent arg '{argument}'.*queue_delete"):
            producer.publish(
                {},
                routing_key=queue,
                declare=[Queue(queue, queue_arguments={argument: not stored})],
            )
        producer.publish({}, routing_key=queue, declare=[Queue(queue)])
    assert _count(db_dsn, queue) == 1
