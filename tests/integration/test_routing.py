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
        original = channel.broker.send_routed

        def spy(queues, message, headers, **kwargs):
            calls.append(sorted(queues))
            return original(queues, message, headers, **kwargs)

        channel.broker.send_routed = spy
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
    """Workers started together declare Celery's pidbox exchange at the same moment (a
    case of the fault suite): both succeed. Fails if the one whose insert waited for the
    other's commit looks in its statement's snapshot: it finds nothing there and dies
    with NotEquivalentError ("different type 'fanout': it is 'None'")."""
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


def _statements_sent(conn: Connection) -> list[str]:
    """Names of the named statements the connection's broker sends from now on
    ("direct" for a statement composed on a queue's tables; the catalog lookup composing
    one, ``table_columns``, left out)."""
    db = conn.transport.broker().db
    sent: list[str] = []
    fetch = db.fetch

    def spy(query, *args, **kwargs):  # type: ignore[no-untyped-def]
        if query != "table_columns":
            sent.append(query if isinstance(query, str) else "direct")
        return fetch(query, *args, **kwargs)

    db.fetch = spy
    return sent


def test_a_routed_publish_to_one_queue_is_one_guarded_direct_statement(db_dsn):
    """Celery's case: exchange "celery" routes to one queue; the publish is the queue's
    send function with the routing version guard, not kombu_pgmq.publish_routed.
    The row is PGMQ's (pgmq.read takes it); a delay and a priority band keep working."""
    celery = Exchange("celery", type="direct")
    with connect(db_dsn) as conn:
        bind(conn, "celery", celery, "celery")
        Queue("prio", celery, routing_key="prio", max_priority=9)(conn.channel()).declare()
        publish_to(conn, celery, "celery", {"n": 0})  # loads the routes
        sent = _statements_sent(conn)
        publish_to(conn, celery, "celery", {"n": 1})
        Producer(conn.channel(), exchange=celery).publish(
            {"n": 2}, routing_key="celery", headers={"x-delay": 60_000}
        )
        Producer(conn.channel(), exchange=celery).publish({"n": 3}, routing_key="prio", priority=9)
        assert sent == ["direct"] * 3
        statements = conn.transport.broker().queue_functions._statements
        assert ("send_queue", "celery") in statements
        high = conn.transport.topology.bands("prio").queue_for(9)
        assert high != "prio" and ("send_queue", high) in statements
    rows = sql(db_dsn, "SELECT message, read_ct FROM pgmq.read('celery', 30, 10)")
    assert sorted((r[0]["n"], r[1]) for r in rows) == [(0, 1), (1, 1)]  # n=2 is delayed
    delayed = sql(db_dsn, "SELECT vt > now() + interval '50 seconds' FROM pgmq.q_celery")
    assert sorted(d[0] for d in delayed) == [False, False, True]
    assert count(db_dsn, "prio") == 0
    assert sql(db_dsn, f"SELECT message FROM pgmq.q_{high}") == [({"n": 3},)]


BIND_ELSEWHERE = """
import sys
from kombu import Connection, Exchange, Queue
import kombu_pgmq
url, old, new = sys.argv[1:4]
with Connection(url) as conn:
    channel = conn.channel()
    channel.queue_unbind(old, "moving", "k")
    Queue(new, Exchange("moving", type="direct"), routing_key="k")(channel).declare()
"""


def test_a_binding_moved_by_another_process_moves_the_next_routed_publish(db_dsn):
    """The publisher's cached routes name one queue; another process unbinds it and binds
    another (committed): the publisher's next publish reaches the new queue only (its
    guarded statement wrote nothing, the routes were reloaded)."""
    import subprocess
    import sys

    moving = Exchange("moving", type="direct")
    with connect(db_dsn) as conn:
        bind(conn, "before", moving, "k")
        publish_to(conn, moving, "k", {"n": 0})
        assert count(db_dsn, "before") == 1
        subprocess.run(
            [sys.executable, "-c", BIND_ELSEWHERE, db_dsn, "before", "after"], check=True
        )
        sent = _statements_sent(conn)
        publish_to(conn, moving, "k", {"n": 1})
        assert sent == ["direct", "routing_table", "direct"]  # refused, reloaded, sent
        assert (count(db_dsn, "before"), count(db_dsn, "after")) == (1, 1)
        # and back, through another connection in this process
        with connect(db_dsn) as other:
            other.channel().queue_unbind("after", "moving", "k")
            bind(other, "before", moving, "k")
        publish_to(conn, moving, "k", {"n": 2})
    assert (count(db_dsn, "before"), count(db_dsn, "after")) == (2, 1)


def test_routed_publishes_with_deduplication_take_publish_routed(db_dsn):
    """A target queue declared with x-deduplicate-task-id (known from the routing table)
    or an x-deduplication-id header: kombu_pgmq.publish_routed claims the id."""
    ex = Exchange("dedup.ex", type="direct")
    with connect(db_dsn) as conn:
        Queue("by_task", ex, routing_key="t", queue_arguments={"x-deduplicate-task-id": True})(
            conn.channel()
        ).declare()
        bind(conn, "by_header", ex, "h")
        with connect(db_dsn) as producer:  # never declared them: the routes tell
            sent = _statements_sent(producer)
            for _ in range(2):
                Producer(producer.channel(), exchange=ex).publish(
                    {}, routing_key="t", headers={"id": "task-1"}
                )
                Producer(producer.channel(), exchange=ex).publish(
                    {}, routing_key="h", headers={"x-deduplication-id": "d-1"}
                )
            assert sent.count("send_routed") == 4 and "direct" not in sent, sent
    assert (count(db_dsn, "by_task"), count(db_dsn, "by_header")) == (1, 1)


def test_a_queue_deleted_by_another_process_under_a_cached_routed_statement(db_dsn):
    """The guarded statement of a queue (plan-cached) meets the queue dropped by another
    connection: the publish reloads the routes, finds no binding and drops the message
    (as AMQP does), without an error and without creating the queue again."""
    ex = Exchange("dropped.ex", type="direct")
    with connect(db_dsn) as conn:
        bind(conn, "dropped", ex, "k")
        publish_to(conn, ex, "k", {"n": 0})
        assert ("send_queue", "dropped") in conn.transport.broker().queue_functions._statements
        with connect(db_dsn) as other:
            other.channel().queue_delete("dropped")
        publish_to(conn, ex, "k", {"n": 1})
        assert ("send_queue", "dropped") not in conn.transport.broker().queue_functions._statements
    assert sql(db_dsn, "SELECT to_regclass(%s)", [table("dropped")]) == [(None,)]
