"""Exchanges and bindings stored in PostgreSQL: every process routes alike."""

from __future__ import annotations

import pytest
from kombu import Connection, Exchange, Producer, Queue
from kombu.exceptions import ChannelError
from kombu.transport.virtual import NotEquivalentError

from kombu_pgmq.errors import QueueNotFound

from .helpers import connect, drain, sql, table


def bind(conn: Connection, queue: str, exchange: Exchange, routing_key: str = "") -> None:
    Queue(queue, exchange, routing_key=routing_key)(conn.channel()).declare()


def publish_to(conn: Connection, exchange: Exchange, routing_key: str, body: object) -> None:
    Producer(conn.channel(), exchange=exchange).publish(body, routing_key=routing_key)


def count(url: str, queue: str) -> int:
    return sql(url, f"SELECT count(*) FROM {table(queue)}")[0][0]


def test_binding_made_by_one_process_routes_publishes_of_another(db_dsn):
    logs = Exchange("logs", type="topic")
    with connect(db_dsn) as publisher, connect(db_dsn) as consumer:
        # The publisher caches the routing table while nothing is bound: dropped.
        publish_to(publisher, logs, "logs.error", {"n": 0})
        bind(consumer, "errors", logs, "#.error")
        bind(consumer, "all.logs", logs, "logs.#")
        publish_to(publisher, logs, "logs.error", {"n": 1})
        publish_to(publisher, logs, "logs", {"n": 2})
        assert [m.decode() for m in drain(consumer, "errors", expect=1)] == [{"n": 1}]
        got = drain(consumer, "all.logs", expect=2)
        assert sorted(m.decode()["n"] for m in got) == [1, 2]
        # Unbind in one process: the other stops routing there at its next publish.
        consumer.channel().queue_unbind("errors", "logs", "#.error")
        publish_to(publisher, logs, "x.error", {"n": 3})
        assert count(db_dsn, "errors") == 0


def test_fanout_reaches_every_bound_queue_in_one_statement(db_dsn):
    broadcast = Exchange("broadcast", type="fanout")
    with connect(db_dsn) as conn:
        for name in ("f1", "f2", "F3.upper"):
            bind(conn, name, broadcast)
        channel = conn.channel()
        calls = []
        original = channel.pgmq.send_routed

        def spy(queues, message, headers, **kwargs):
            calls.append(sorted(queues))
            return original(queues, message, headers, **kwargs)

        channel.pgmq.send_routed = spy
        Producer(channel, exchange=broadcast).publish({"hello": 1}, routing_key="ignored")
    assert len(calls) == 1 and len(calls[0]) == 3
    for name in ("f1", "f2", "F3.upper"):
        assert count(db_dsn, name) == 1


def test_fanout_is_all_or_nothing(db_dsn):
    broadcast = Exchange("atomic", type="fanout")
    with connect(db_dsn) as conn:
        for name in ("a1", "a2", "a3"):
            bind(conn, name, broadcast)
        # Drop one PGMQ table behind kombu_pgmq's back: the route still names it.
        sql(db_dsn, "SELECT pgmq.drop_queue(%s)", [table("a2").split(".q_", 1)[1]])
        with pytest.raises(QueueNotFound, match="nothing was published"):
            publish_to(conn, broadcast, "", {"x": 1})
    assert count(db_dsn, "a1") == 0 and count(db_dsn, "a3") == 0


def test_direct_exchange_declared_elsewhere(db_dsn):
    # Celery's case: the worker binds queue "celery" to exchange "celery"; a producer
    # process that never declared anything publishes to the exchange.
    with connect(db_dsn) as worker:
        bind(worker, "celery", Exchange("celery", type="direct"), "celery")
    with connect(db_dsn) as producer:
        Producer(producer.channel()).publish({"task": 1}, exchange="celery", routing_key="celery")
        Producer(producer.channel()).publish({"task": 2}, exchange="celery", routing_key="other")
    assert count(db_dsn, "celery") == 1


def test_exchange_declare_rules(db_dsn):
    with connect(db_dsn) as conn:
        channel = conn.channel()
        with pytest.raises(ChannelError, match="NOT_FOUND"):
            channel.exchange_declare("missing", passive=True)
        channel.exchange_declare("ex", type="topic")
        channel.exchange_declare("ex", passive=True)
        with pytest.raises(NotEquivalentError, match="different type"):
            channel.exchange_declare("ex", type="fanout")
        bind(conn, "exq", Exchange("ex", type="topic"), "k.#")
        assert ("exq", "ex", "k.#") in list(channel.list_bindings())
        channel.exchange_delete("ex")
        assert sql(db_dsn, "SELECT count(*) FROM kombu_pgmq.bindings WHERE exchange = 'ex'") == [
            (0,)
        ]


def test_workers_declaring_a_new_exchange_at_once_both_succeed(db_dsn):
    """Found by the fault suite (issue 25): workers started together declare Celery's
    pidbox exchange at the same moment; the one whose insert waited for the other's
    commit found nothing in its statement's snapshot and died with NotEquivalentError
    ("different type 'fanout': it is 'None'")."""
    import threading

    import psycopg

    with connect(db_dsn) as conn, psycopg.connect(db_dsn) as first:
        conn.channel()  # the schema is there
        first.execute(
            "INSERT INTO kombu_pgmq.exchanges (exchange, type, durable, auto_delete)"
            " VALUES ('started.together', 'fanout', false, false)"
        )  # not committed yet: the second declaration waits on the unique key
        outcome: list[object] = []

        def declare() -> None:
            try:
                Exchange("started.together", type="fanout")(conn.channel()).declare()
                outcome.append("declared")
            except Exception as exc:
                outcome.append(exc)

        second = threading.Thread(target=declare)
        second.start()
        second.join(0.5)
        assert second.is_alive()  # waiting for the first one's commit
        first.commit()
        second.join(10)
    assert outcome == ["declared"]


def test_queue_delete_removes_its_bindings(db_dsn):
    ex = Exchange("direct.ex", type="direct")
    with connect(db_dsn) as conn:
        bind(conn, "doomed", ex, "k")
        conn.channel().queue_delete("doomed")
        assert sql(db_dsn, "SELECT count(*) FROM kombu_pgmq.bindings") == [(0,)]
        publish_to(conn, ex, "k", {"x": 1})  # unroutable now: dropped, nothing recreated
    assert sql(db_dsn, "SELECT to_regclass(%s)", [table("doomed")]) == [(None,)]


def test_unroutable_message_goes_to_kombu_deadletter_queue_if_set(db_dsn):
    ex = Exchange("nobody", type="direct")
    with connect(db_dsn, deadletter_queue="unroutable") as conn:
        conn.channel().exchange_declare("nobody", type="direct")
        publish_to(conn, ex, "k", {"lost": False})
        assert [m.decode() for m in drain(conn, "unroutable", expect=1)] == [{"lost": False}]


def test_unroutable_publishes_check_the_version_instead_of_reloading(db_dsn):
    events = Exchange("celeryev.like", type="topic")
    with connect(db_dsn) as conn:
        conn.channel().exchange_declare("celeryev.like", type="topic")
        publish_to(conn, events, "worker.heartbeat", {"n": 0})  # loads the table once
        transport = conn.transport
        reloads = []
        original = transport.topology.reload_routes

        def counting_reload():
            reloads.append(1)
            return original()

        transport.topology.reload_routes = counting_reload
        for n in range(5):
            publish_to(conn, events, "worker.heartbeat", {"n": n})
        assert reloads == []  # routes unchanged: no reload, messages dropped as in AMQP
        bind(conn, "monitor", events, "#")  # the version moves: next publish reloads
        publish_to(conn, events, "worker.heartbeat", {"n": 9})
        assert reloads == [1]
    assert count(db_dsn, "monitor") == 1
