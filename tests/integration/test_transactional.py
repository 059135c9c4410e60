"""``kombu_pgmq.using(conn)`` at the Kombu level: a publish is part of
the application's transaction (invisible until it commits, gone if it or its savepoint
rolls back, never committed by us), declarations stay outside it, failures are not
retried, and bad input gets a clear error."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from kombu import Connection, Consumer, Producer, Queue

import kombu_pgmq
from kombu_pgmq import errors
from kombu_pgmq.transactional import BoundConnection, driver_connection

from .helpers import connect, drain, sql


class Rollback(Exception):
    pass


def _count(url: str, queue: str) -> int:
    return int(sql(url, f"SELECT count(*) FROM pgmq.q_{queue}")[0][0])


def test_visible_at_commit_gone_at_rollback_and_with_a_rolled_back_savepoint(db_dsn):
    with psycopg.connect(db_dsn) as pg:
        with pg.transaction():
            Producer(kombu_pgmq.using(pg)).publish(
                {"n": 1}, routing_key="tx", declare=[Queue("tx")]
            )
            assert _count(db_dsn, "tx") == 0  # another session: not yet
            with pytest.raises(Rollback), pg.transaction():
                Producer(kombu_pgmq.using(pg)).publish({"n": 2}, routing_key="tx")
                raise Rollback
            Producer(kombu_pgmq.using(pg)).publish({"n": 3}, routing_key="tx")
        assert _count(db_dsn, "tx") == 2
        with pytest.raises(Rollback), pg.transaction():
            Producer(kombu_pgmq.using(pg)).publish({"n": 4}, routing_key="tx")
            raise Rollback
        assert not pg.info.transaction_status  # idle: we never left a transaction open
    with connect(db_dsn) as conn:
        assert sorted(m.payload["n"] for m in drain(conn, "tx", expect=2)) == [1, 3]


def test_the_queue_is_declared_outside_the_application_transaction(db_dsn):
    # A queue first declared by a publish in a transaction that rolls back stays declared,
    # and no row of kombu_pgmq's tables is locked by the application meanwhile.
    with psycopg.connect(db_dsn) as pg, pytest.raises(Rollback), pg.transaction():
        Producer(kombu_pgmq.using(pg)).publish({}, routing_key="fresh", declare=[Queue("fresh")])
        locks = sql(
            db_dsn,
            "SELECT c.relname FROM pg_locks l JOIN pg_class c ON c.oid = l.relation "
            "JOIN pg_namespace n ON n.oid = c.relnamespace "
            "WHERE n.nspname = 'kombu_pgmq' AND l.pid = %s AND l.mode <> 'AccessShareLock'"
            # its own row there, keyed by its transaction id (the wake-up at its commit)
            " AND c.relname NOT LIKE 'commit_wakeups%%'",
            (pg.info.backend_pid,),
        )
        assert locks == []
        raise Rollback
    assert sql(db_dsn, "SELECT queue FROM kombu_pgmq.queues WHERE queue = 'fresh'") == [("fresh",)]
    assert _count(db_dsn, "fresh") == 0


def test_every_publish_of_a_with_block_joins_the_transaction(db_dsn):
    with connect(db_dsn) as broker, psycopg.connect(db_dsn) as pg:
        queue = Queue("ambient")
        Producer(broker).publish({"n": 0}, routing_key="ambient", declare=[queue])
        with pytest.raises(Rollback), pg.transaction(), kombu_pgmq.using(pg):
            Producer(broker).publish({"n": 1}, routing_key="ambient")  # the app's own producer
            raise Rollback
        with pg.transaction(), kombu_pgmq.using(pg):
            Producer(broker).publish({"n": 2}, routing_key="ambient")
            assert _count(db_dsn, "ambient") == 1
        Producer(broker).publish({"n": 3}, routing_key="ambient")  # outside: its own commit
        assert sorted(m.payload["n"] for m in drain(broker, "ambient", expect=3)) == [0, 2, 3]


def test_a_failure_in_the_application_transaction_is_not_retried(db_dsn):
    with psycopg.connect(db_dsn) as pg:
        bound = kombu_pgmq.using(pg)
        producer = Producer(bound)
        producer.publish({}, routing_key="fail", declare=[Queue("fail")])
        pg.commit()
        with pg.transaction():
            with pytest.raises(psycopg.errors.DivisionByZero):
                pg.execute("SELECT 1 / 0")  # the application's transaction is aborted
            with pytest.raises(errors.TransactionError, match="roll back and try it again"):
                producer.publish({}, routing_key="fail", retry=True)
            raise psycopg.Rollback
    assert _count(db_dsn, "fail") == 1
    pg_closed = psycopg.connect(db_dsn)
    bound = kombu_pgmq.using(pg_closed)
    producer = Producer(bound)
    pg_closed.close()
    with pytest.raises(errors.TransactionError, match="is closed"):
        producer.publish({}, routing_key="fail")


def test_one_bound_connection_per_application_connection(db_dsn):
    with psycopg.connect(db_dsn) as pg, psycopg.connect(db_dsn) as other:
        assert kombu_pgmq.using(pg) is kombu_pgmq.using(pg)
        assert kombu_pgmq.using(pg) is not kombu_pgmq.using(other)
        assert isinstance(kombu_pgmq.using(pg), Connection)
        assert driver_connection(kombu_pgmq.using(pg)) is pg


def test_a_bound_connection_only_publishes(db_dsn):
    with psycopg.connect(db_dsn) as pg:
        bound: BoundConnection = kombu_pgmq.using(pg)
        with pytest.raises(errors.ConfigurationError, match="only publishes"):
            Consumer(bound, [Queue("x")], callbacks=[lambda body, message: None]).consume()


def test_unsupported_connections_are_clear_errors(db_dsn):
    with pytest.raises(errors.ConfigurationError, match="not a psycopg 3 connection"):
        kombu_pgmq.using(object())
    with pytest.raises(errors.ConfigurationError, match="is closed"):
        closed = psycopg.connect(db_dsn)
        closed.close()
        kombu_pgmq.using(closed)


def _dbname(dsn: str) -> str:
    return str(psycopg.conninfo.conninfo_to_dict(dsn)["dbname"])


def _schemas(dsn: str) -> list[str]:
    rows = sql(dsn, "SELECT nspname FROM pg_namespace WHERE nspname IN ('pgmq', 'kombu_pgmq')")
    return sorted(r[0] for r in rows)


@contextlib.contextmanager
def _current_celery_app(broker_url: str) -> Iterator[Any]:
    """A Celery app set as current (as ``Celery(...)`` does by default), then the one
    before it again."""
    from celery import Celery, _state

    previous = _state._tls.current_app
    app = Celery("using_check", broker=broker_url)  # set_as_current=True
    try:
        yield app
    finally:
        _state._tls.current_app = previous


def test_an_application_connection_to_another_database_is_refused(db_dsn, empty_db_dsn):
    with (
        connect(db_dsn) as broker,
        psycopg.connect(empty_db_dsn) as elsewhere,
        kombu_pgmq.using(elsewhere),
        pytest.raises(errors.ConfigurationError, match="publish outside the block") as info,
    ):
        Producer(broker).publish({}, routing_key="x", declare=[Queue("x")])
    assert f"database {_dbname(empty_db_dsn)!r}" in str(info.value)
    assert f"database {_dbname(db_dsn)!r}" in str(info.value)
    assert _schemas(empty_db_dsn) == []


def test_the_connection_form_is_checked_against_the_current_celery_apps_broker(
    db_dsn, empty_db_dsn
):
    """``apply_async(connection=using(conn))`` with ``conn`` to another database than the
    app's broker is refused before anything is written (else PGMQ and kombu_pgmq would be
    installed there and the task left in it, where no worker of the app looks)."""
    with _current_celery_app(db_dsn) as app, psycopg.connect(empty_db_dsn) as elsewhere:

        @app.task(name="using_check.noop")
        def noop() -> None:
            pass

        with pytest.raises(errors.ConfigurationError) as info:
            noop.apply_async(connection=kombu_pgmq.using(elsewhere))
        with pytest.raises(errors.ConfigurationError):  # again: refused from the cache
            noop.apply_async(connection=kombu_pgmq.using(elsewhere))
    message = str(info.value)
    assert f"is to database {_dbname(empty_db_dsn)!r}" in message
    assert f"database {_dbname(db_dsn)!r}" in message
    assert "the current Celery app's broker_url" in message
    assert "nothing was written" in message and "broker_url=..." in message
    assert _schemas(empty_db_dsn) == []  # no PGMQ, no kombu_pgmq, no task in B
    assert sql(db_dsn, "SELECT to_regclass('pgmq.q_celery')") == [(None,)]  # nor in A
    assert sql(db_dsn, "SELECT count(*) FROM kombu_pgmq.queues") == [(0,)]


def test_the_connection_form_is_checked_against_an_explicit_broker_url(db_dsn, empty_db_dsn):
    with psycopg.connect(empty_db_dsn) as elsewhere:
        bound = kombu_pgmq.using(elsewhere, broker_url=db_dsn)
        with pytest.raises(errors.ConfigurationError, match="given as broker_url="):
            Producer(bound).publish({}, routing_key="x", declare=[Queue("x")])
    assert _schemas(empty_db_dsn) == []


def test_the_check_costs_no_round_trip_per_publish(db_dsn, monkeypatch):
    """Once per application connection (one query on it), the broker's database once
    per process; a URL spelled differently for the same database is the same broker."""
    from kombu_pgmq._db.connector import Connector

    looked_up: list[str] = []
    fetch = Connector.fetch

    def spy(self: Any, query: Any, *args: Any, **kwargs: Any) -> Any:
        if query == "database_identity":
            looked_up.append(type(self).__name__)
        return fetch(self, query, *args, **kwargs)

    monkeypatch.setattr(Connector, "fetch", spy)
    joiner = "&" if "?" in db_dsn else "?"  # an embedded server's URL has ?host=
    same_database = f"{db_dsn}{joiner}application_name=another_spelling"
    with _current_celery_app(same_database) as app:

        @app.task(name="using_check.record")
        def record(n: int) -> None:
            pass

        with psycopg.connect(db_dsn) as pg, pg.transaction():
            bound = kombu_pgmq.using(pg)
            for n in range(5):
                record.apply_async((n,), connection=kombu_pgmq.using(pg))
            # kombu put Celery's retry policy in its transport_options: still the same
            assert kombu_pgmq.using(pg) is bound and "max_retries" in bound.transport_options
        assert sorted(looked_up) == ["Connector", "ExternalConnector"]
        with psycopg.connect(db_dsn) as pg, pg.transaction():
            for n in range(5):
                record.apply_async((n,), connection=kombu_pgmq.using(pg))
        assert sorted(looked_up) == ["Connector", "ExternalConnector", "ExternalConnector"]
    assert _count(db_dsn, "celery") == 10


def test_a_current_celery_app_on_another_kind_of_broker_is_refused(db_dsn):
    with _current_celery_app("redis://:secret@localhost:6379/0"), psycopg.connect(db_dsn) as pg:
        with pytest.raises(errors.ConfigurationError, match="is not kombu_pgmq's") as info:
            kombu_pgmq.using(pg)
        assert "secret" not in str(info.value)
        Producer(kombu_pgmq.using(pg, broker_url=db_dsn)).publish(
            {}, routing_key="named", declare=[Queue("named")]
        )


def test_threads_bind_independently(db_dsn):
    """The ``with using(conn):`` binding is per thread: another thread's publishes commit
    on their own."""
    with connect(db_dsn) as broker, psycopg.connect(db_dsn) as pg:
        Producer(broker).publish({}, routing_key="threads", declare=[Queue("threads")])
        with pg.transaction(), kombu_pgmq.using(pg):

            def publish_elsewhere() -> None:
                with connect(db_dsn) as conn:
                    Producer(conn).publish({}, routing_key="threads")

            thread = threading.Thread(target=publish_elsewhere)
            thread.start()
            thread.join(30)
            assert _count(db_dsn, "threads") == 2  # the other thread's is committed


def test_a_consumer_that_waits_after_the_publish_is_woken_at_the_commit(db_dsn):
    """The consumer goes to sleep between the application's publish and its commit: the
    waiting consumers are looked for at the commit (a deferred trigger), so it is woken
    then, not by its fallback poll (60 s here; the bound leaves a loaded machine 10 s)."""
    queue = Queue("late_waiter")
    got: list[float] = []
    with connect(db_dsn, polling_interval=60) as consumer_conn, psycopg.connect(db_dsn) as pg:
        Producer(consumer_conn).publish({}, routing_key="warm", declare=[Queue("warm")])
        Producer(kombu_pgmq.using(pg)).publish({"n": 1}, routing_key="late_waiter", declare=[queue])
        assert pg.info.transaction_status  # the application's transaction is open

        def on_message(message: Any) -> None:
            got.append(time.monotonic())
            message.ack()

        with Consumer(consumer_conn, [queue], on_message=on_message):
            with contextlib.suppress(TimeoutError):
                consumer_conn.drain_events(timeout=1.0)  # found nothing: asleep now
            assert got == []
            committed: list[float] = []

            def commit() -> None:
                pg.commit()
                committed.append(time.monotonic())

            committer = threading.Timer(0.5, commit)
            committer.start()
            with contextlib.suppress(TimeoutError):
                consumer_conn.drain_events(timeout=15.0)
            committer.join()
    assert len(got) == 1 and got[0] - committed[0] < 10.0, (got, committed)


def test_a_binding_does_not_keep_the_application_connection_alive(db_dsn):
    import gc
    import weakref

    pg = psycopg.connect(db_dsn)
    ref = weakref.ref(pg)
    Producer(kombu_pgmq.using(pg)).publish({}, routing_key="gone", declare=[Queue("gone")])
    pg.commit()
    pg.close()
    del pg
    gc.collect()
    assert ref() is None  # kombu_pgmq's caches hold it weakly
