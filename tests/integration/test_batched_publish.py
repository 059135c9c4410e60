"""``Binding.batched()``: publishes inside ``using(conn)`` gathered and sent in one
statement at the end of the block (``send_many``; what a beat tick of many entries does):
in order, still in the application's transaction, routed and direct alike, deduplicated
as one by one, and nothing sent when the block fails or the routing table moved."""

from __future__ import annotations

import psycopg
import pytest
from kombu import Exchange, Producer, Queue

import kombu_pgmq
from kombu_pgmq import errors

from .helpers import connect, drain, sql


class Rollback(Exception):
    pass


def _count(url: str, queue: str) -> int:
    return int(sql(url, f"SELECT count(*) FROM pgmq.q_{queue}")[0][0])


def _statements(bound) -> list[str]:  # type: ignore[no-untyped-def]
    """Names of the statements the bound connection's publisher sends from now on."""
    sent: list[str] = []
    db = bound.binding.broker.db
    fetch = db.fetch

    def spy(query, *args, **kwargs):  # type: ignore[no-untyped-def]
        sent.append(query if isinstance(query, str) else "composed")
        return fetch(query, *args, **kwargs)

    db.fetch = spy
    return sent


def test_one_statement_in_order_visible_at_commit(db_dsn):
    exchange = Exchange("batched_x", type="direct")
    with connect(db_dsn) as broker, psycopg.connect(db_dsn) as pg:
        producer = Producer(broker)
        producer.publish(
            {"n": -1}, exchange=exchange, routing_key="k",
            declare=[Queue("batched_routed", exchange, routing_key="k"), Queue("batched_d")],
        )  # fmt: skip
        drain(broker, "batched_routed", expect=1)
        bound = kombu_pgmq.using(pg, broker_url=db_dsn)
        sent = _statements(bound)
        with pg.transaction(), bound, bound.binding.batched() as batch:
            for n in range(5):
                producer.publish({"n": n}, exchange=exchange, routing_key="k")
                producer.publish({"n": n}, routing_key="batched_d")
            assert len(batch) == 10 and _count(db_dsn, "batched_routed") == 0
        assert sent.count("send_many") == 1, sent
        assert not {"send", "send_routed", "send_queue"} & set(sent), sent
        assert _count(db_dsn, "batched_routed") == 5 and _count(db_dsn, "batched_d") == 5
        got = [m.payload["n"] for m in drain(broker, "batched_routed", expect=5)]
        assert got == [0, 1, 2, 3, 4]
        assert [m.payload["n"] for m in drain(broker, "batched_d", expect=5)] == got


def test_nothing_is_sent_when_the_block_fails(db_dsn):
    with connect(db_dsn) as broker, psycopg.connect(db_dsn) as pg:
        producer = Producer(broker)
        producer.publish({}, routing_key="batched_fail", declare=[Queue("batched_fail")])
        drain(broker, "batched_fail", expect=1)
        bound = kombu_pgmq.using(pg, broker_url=db_dsn)
        with pytest.raises(Rollback), pg.transaction(), bound, bound.binding.batched():
            producer.publish({"n": 1}, routing_key="batched_fail")
            raise Rollback
        # the next block publishes one by one again, and commits
        with pg.transaction(), bound:
            producer.publish({"n": 2}, routing_key="batched_fail")
        assert [m.payload["n"] for m in drain(broker, "batched_fail", expect=1)] == [2]


def test_a_routing_change_during_the_batch_sends_nothing(db_dsn):
    exchange = Exchange("batched_moved", type="direct")
    with connect(db_dsn) as broker, psycopg.connect(db_dsn) as pg, connect(db_dsn) as other:
        producer = Producer(broker)
        producer.publish(
            {}, exchange=exchange, routing_key="k",
            declare=[Queue("batched_moved_a", exchange, routing_key="k")],
        )  # fmt: skip
        drain(broker, "batched_moved_a", expect=1)
        bound = kombu_pgmq.using(pg, broker_url=db_dsn)
        moved = pytest.raises(errors.StatementError, match="routing table changed")
        with moved, pg.transaction(), bound, bound.binding.batched():
            producer.publish({"n": 1}, exchange=exchange, routing_key="k")
            # another process binds a second queue: the recorded route is stale
            Queue("batched_moved_b", exchange, routing_key="k")(other.default_channel).declare()
        assert _count(db_dsn, "batched_moved_a") == 0
        assert _count(db_dsn, "batched_moved_b") == 0


def test_deduplication_holds_in_a_batch(db_dsn):
    with connect(db_dsn) as broker, psycopg.connect(db_dsn) as pg:
        producer = Producer(broker)
        producer.publish({}, routing_key="batched_dedup", declare=[Queue("batched_dedup")])
        drain(broker, "batched_dedup", expect=1)
        bound = kombu_pgmq.using(pg, broker_url=db_dsn)
        headers = {"x-deduplication-id": "same"}
        with pg.transaction(), bound, bound.binding.batched():
            producer.publish({"n": 1}, routing_key="batched_dedup", headers=headers)
            producer.publish({"n": 2}, routing_key="batched_dedup", headers=headers)
        assert [m.payload["n"] for m in drain(broker, "batched_dedup", expect=1)] == [1]


def test_visible_at_keeps_a_message_invisible_until_then(db_dsn):
    from datetime import datetime, timedelta, timezone

    with connect(db_dsn) as broker, psycopg.connect(db_dsn) as pg:
        producer = Producer(broker)
        producer.publish({}, routing_key="batched_at", declare=[Queue("batched_at")])
        drain(broker, "batched_at", expect=1)
        bound = kombu_pgmq.using(pg, broker_url=db_dsn)
        at = datetime.now(timezone.utc) + timedelta(seconds=1.25)
        with pg.transaction(), bound, bound.binding.batched() as batch:
            batch.visible_at = at
            producer.publish({"n": 1}, routing_key="batched_at")
            batch.visible_at = None
            producer.publish({"n": 2}, routing_key="batched_at")
        vts = sql(db_dsn, "SELECT message->>'body', vt FROM pgmq.q_batched_at ORDER BY msg_id")
        assert vts[0][1] == at  # to the microsecond: not rounded to whole seconds
        assert vts[1][1] < at
        assert [m.payload["n"] for m in drain(broker, "batched_at", expect=1)] == [2]
        assert [m.payload["n"] for m in drain(broker, "batched_at", expect=1)] == [1]
