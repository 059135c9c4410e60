"""Through PgBouncer in transaction mode: a real pgbouncer 1.18
(:mod:`tests.support.pgbouncer`; 1.21+ for prepared statements through the pooler,
``pooler_prepared_statements``) with 2 server connections per database and
``server_round_robin`` on, shared by 3 or more Kombu connections, so consecutive
transactions of one client run on different server connections: a prepared statement or
a session setting relied on fails (``test_without_pooled_mode_the_same_work_fails``
shows that it does). Broker URL: the pooler's; transport options ``pooler`` and
``direct_url`` (LISTEN straight to the server) or no ``direct_url`` (polling).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import Any

import psycopg
import psycopg.sql
import pytest
from kombu import Connection, Consumer, Producer, Queue
from psycopg.conninfo import conninfo_to_dict

import kombu_pgmq
from kombu_pgmq._conninfo import to_dsn
from kombu_pgmq._db import pooling
from kombu_pgmq._db.connector import Connector
from kombu_pgmq.dlq import DeadLetterQueue
from kombu_pgmq.errors import ConfigurationError, KombuPgmqError
from tests.support import pgbouncer as support

from .helpers import connect, drain, publish, sql


def _options(db: Any, *, direct: bool = True, **more: Any) -> dict[str, Any]:
    options: dict[str, Any] = {"pooler": "transaction", **more}
    if direct:
        options["direct_url"] = db.direct_url
    return options


def _server_settings(url: str, names: tuple[str, ...], rounds: int = 6) -> set[tuple[str, ...]]:
    """The values of ``names`` as fresh transactions of one pooled client see them, over
    ``rounds`` transactions (round robin: every server connection of the pool)."""
    seen = set()
    with psycopg.connect(url, autocommit=True, prepare_threshold=None) as conn:
        for _ in range(rounds):
            seen.add(tuple(conn.execute(f"SHOW {name}").fetchone()[0] for name in names))
    return seen


def _defaults(direct_url: str, names: tuple[str, ...]) -> set[tuple[str, ...]]:
    """The server's values of ``names`` for a new session (the server's configuration)."""
    return _server_settings(direct_url, names, rounds=1)


def _work(url: str, options: dict[str, Any], queue: str, rounds: int = 30) -> list[Any]:
    """Publish, consume and ack ``rounds`` messages one at a time, on three Kombu
    connections (publisher, consumer, and one renewing leases with ``lock_timeout``)."""
    got = []
    with (
        connect(url, **options) as producer_conn,
        connect(url, **options) as consumer_conn,
        connect(url, **options, lease_renewal_interval=0.05, visibility_timeout=5) as lessee,
    ):
        held = lessee.channel().basic_get(publish_one(producer_conn, queue + "_held", "held"))
        assert held is not None
        lessee.transport.keep_leases()
        for i in range(rounds):
            publish(producer_conn, queue, [{"n": i}])
            got += [m.payload["n"] for m in drain(consumer_conn, queue, expect=1)]
        held.ack()
    return got


def publish_one(conn: Connection, queue: str, body: Any) -> str:
    publish(conn, queue, [body])
    return queue


# -- the fixture itself ---------------------------------------------------------------


def test_clients_share_two_server_connections(pooled_db):
    conns = [
        psycopg.connect(pooled_db.pooled_url, autocommit=True, prepare_threshold=None)
        for _ in range(4)
    ]
    try:
        pids = {c.execute("SELECT pg_backend_pid()").fetchone()[0] for c in conns for _ in "ab"}
        assert 1 <= len(pids) <= 2  # 4 clients, at most 2 server connections
        dbname = conninfo_to_dict(pooled_db.direct_url)["dbname"]
        pools = [p for p in pooled_db.bouncer.show("POOLS") if p["database"] == dbname]
        assert pools and pools[0]["pool_mode"] == "transaction"
        assert pools[0]["cl_active"] >= 4
    finally:
        for c in conns:
            c.close()


# -- Kombu through the pooler -------------------------------------------------------------


def test_publish_consume_ack_and_requeue_over_three_connections(pooled_db):
    options = _options(pooled_db)
    with (
        connect(pooled_db.pooled_url, **options) as a,
        connect(pooled_db.pooled_url, **options) as b,
        connect(pooled_db.pooled_url, **options) as c,
    ):
        publish(a, "work", [{"n": i} for i in range(10)])
        publish(c, "work", [{"n": i} for i in range(10, 20)])
        rejected: list[int] = []
        got: list[int] = []

        def first(message: Any) -> None:
            n = message.payload["n"]
            if n % 4 == 0 and n not in rejected:
                rejected.append(n)
                message.reject(requeue=True)
            else:
                got.append(n)
                message.ack()

        with Consumer(b.channel(), [Queue("work")], on_message=first, prefetch_count=5):
            _drain_until(b, lambda: len(got) == 20)
        assert sorted(got) == list(range(20)) and len(rejected) == 5
        assert drain(c, "work", expect=1, timeout=1.0) == []
        archived = sql(pooled_db.direct_url, "SELECT count(*) FROM pgmq.a_work")[0][0]
        assert archived == 20


def test_leases_are_renewed_and_lapse_through_the_pooler(pooled_db):
    url = pooled_db.pooled_url
    with (
        connect(url, **_options(pooled_db)) as producer,
        connect(
            url, **_options(pooled_db), visibility_timeout=2, lease_renewal_interval=0.3
        ) as holder,
        connect(
            url, **_options(pooled_db), visibility_timeout=2, lease_renewal_interval=0
        ) as careless,
        connect(url, **_options(pooled_db)) as other,
    ):
        publish(producer, "kept", ["k"])
        publish(producer, "lapsed", ["l"])
        kept = holder.channel().basic_get("kept")
        assert kept is not None
        assert careless.channel().basic_get("lapsed") is not None
        holder.transport.keep_leases()
        time.sleep(3.5)  # past the 2 s visibility timeout: renewed (kept), not (lapsed)
        assert other.channel().basic_get("kept") is None
        assert holder.transport.leases.rounds >= 3 and holder.transport.leases.failures == 0
        again = other.channel().basic_get("lapsed")
        assert again is not None and again.payload == "l"
        again.ack()
        kept.ack()
    # lock_timeout of the lease connection was set per transaction: it never stayed on a
    # server connection other clients use
    names = ("lock_timeout", "synchronous_commit")
    assert _server_settings(url, names) == _defaults(pooled_db.direct_url, names)


def test_delays_priorities_and_dead_letters(pooled_db):
    url = pooled_db.pooled_url
    options = _options(pooled_db, max_deliveries=2)
    with connect(url, **options) as producer, connect(url, **options) as consumer:
        start = time.monotonic()
        publish(producer, "later", ["soon"], headers={"x-delay": 1500})
        assert drain(consumer, "later", expect=1, timeout=0.5) == []
        got = drain(consumer, "later", expect=1, timeout=10)
        assert [m.payload for m in got] == ["soon"] and time.monotonic() - start >= 1.5

        prio = Queue("prio", routing_key="prio", max_priority=9)
        with producer.channel() as channel:
            for p in (1, 9, 5):
                Producer(channel).publish(p, routing_key="prio", declare=[prio], priority=p)
        with consumer.channel() as channel:
            firsts = [channel.basic_get("prio") for _ in range(3)]
        assert [m.payload for m in firsts] == [9, 5, 1]
        for m in firsts:
            m.ack()

        publish(producer, "poison", ["p"])
        for _ in range(2):
            message = consumer.channel().basic_get("poison")
            assert message is not None
            message.reject(requeue=True)
        assert consumer.channel().basic_get("poison") is None  # the third read dead-letters
    with DeadLetterQueue(pooled_db.direct_url) as dlq:
        assert [(d.queue, d.reason) for d in dlq.list()] == [("poison", "max_deliveries")]


def test_transactional_enqueue_on_a_pooled_application_connection(pooled_db):
    """kombu_pgmq.using(conn) with the application's connection through PgBouncer
    (``prepare_threshold=None``, as a pooled application connects): the message is
    written in its transaction, seen at commit, gone at rollback."""
    url = pooled_db.pooled_url
    with psycopg.connect(url, prepare_threshold=None) as pg:
        with pg.transaction():
            Producer(kombu_pgmq.using(pg)).publish(
                {"n": 1}, routing_key="tx", declare=[Queue("tx")]
            )
        with pytest.raises(ZeroDivisionError), pg.transaction():
            Producer(kombu_pgmq.using(pg)).publish({"n": 2}, routing_key="tx")
            1 / 0  # noqa: B018
        for n in range(3, 12):  # enough statements for psycopg to prepare if it would
            with pg.transaction():
                Producer(kombu_pgmq.using(pg)).publish({"n": n}, routing_key="tx")
    with connect(url, **_options(pooled_db)) as conn:
        got = sorted(m.payload["n"] for m in drain(conn, "tx", expect=10))
    assert got == [1, *range(3, 12)]


# -- wake-ups ---------------------------------------------------------------------------


def _wake_latency(url: str, options: dict[str, Any], queue: str) -> float:
    """Seconds from a publish (by another connection) to its delivery to a consumer that
    was asleep on the empty queue."""
    got: list[float] = []
    with connect(url, **options) as consumer, connect(url, **options) as producer:
        publish(producer, queue, ["warm"])
        with Consumer(
            consumer.channel(),
            [Queue(queue)],
            on_message=lambda m: (got.append(time.monotonic()), m.ack()),
        ):
            _drain_until(consumer, lambda: len(got) == 1)
            with pytest.raises(TimeoutError):  # empty: the consumer sleeps now
                consumer.drain_events(timeout=0.5)
            sent: list[float] = []

            def later() -> None:
                time.sleep(0.3)
                publish(producer, queue, ["hello"])
                sent.append(time.monotonic())

            thread = threading.Thread(target=later)
            thread.start()
            _drain_until(consumer, lambda: len(got) == 2, timeout=15)
            thread.join()
        return got[1] - sent[0]


def _drain_until(conn: Connection, done: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, "nothing delivered in time"
        with contextlib.suppress(TimeoutError):
            conn.drain_events(timeout=0.2)


def test_with_direct_url_a_notify_wakes_the_consumer(pooled_db, caplog):
    with caplog.at_level(logging.WARNING, "kombu_pgmq"):
        latency = _wake_latency(
            pooled_db.pooled_url, _options(pooled_db, polling_interval=5), "woken"
        )
    assert latency < 2.0  # a poll would take up to 5 s
    assert not [r for r in caplog.records if "direct_url" in r.getMessage()]


def test_without_direct_url_consumers_poll_and_say_so_once(pooled_db, caplog, monkeypatch):
    monkeypatch.setattr(pooling, "_warned", set())
    options = _options(pooled_db, direct=False, polling_interval=0.5)
    with caplog.at_level(logging.WARNING, "kombu_pgmq"):
        latency = _wake_latency(pooled_db.pooled_url, options, "polled")
        got = _work(pooled_db.pooled_url, options, "polled_more", rounds=3)
    assert got == [0, 1, 2]
    assert latency < 3.0
    warnings = [r.getMessage() for r in caplog.records if "direct_url" in r.getMessage()]
    assert len(warnings) == 1 and "polling_interval (0.5 s)" in warnings[0]
    # nobody listens: publishers were never asked to NOTIFY (no waiting rows)
    assert sql(pooled_db.direct_url, "SELECT count(*) FROM kombu_pgmq.waiting")[0][0] == 0


# -- no session state -----------------------------------------------------------------------


def test_many_statements_over_shared_server_connections(pooled_db):
    """Three Kombu connections (one renewing leases every 50 ms with ``lock_timeout``)
    take turns on 2 server connections for 30 publish/consume/ack rounds: nothing fails,
    and no setting stays behind on a server connection."""
    got = _work(pooled_db.pooled_url, _options(pooled_db), "shared")
    assert got == list(range(30))
    names = ("lock_timeout", "synchronous_commit")
    seen = _server_settings(pooled_db.pooled_url, names)
    assert seen == _defaults(pooled_db.direct_url, names)


def test_without_pooled_mode_the_same_work_fails(db_dsn, pg_server, monkeypatch):
    """The test above can fail: with pooled mode off (psycopg's prepared statements,
    settings per session) the same work through a transaction pooler breaks. A PgBouncer
    of its own: the failure leaves prepared statements and settings on its server
    connections."""
    reason = support.available()
    if reason is not None:
        pytest.skip(reason)
    monkeypatch.setattr("kombu_pgmq._db.connector.is_pooled", lambda dsn: False)
    with support.PgBouncer(pg_server, settings={"server_round_robin": "1"}) as bouncer:
        url = bouncer.pooled_url(db_dsn)
        with pytest.raises(KombuPgmqError, match="prepared statement"):
            _work(url, {"pooler": "transaction", "direct_url": db_dsn}, "broken")
        lease = Connector(url, settings={"lock_timeout": "1s"}, pooled=False)
        try:
            for _ in range(4):
                lease.execute(psycopg.sql.SQL("SELECT 1"))
        finally:
            lease.close()
        assert ("1s",) in _server_settings(url, ("lock_timeout",))


# -- prepared statements through a pooler that keeps them (PgBouncer >= 1.21) -------------


@pytest.fixture
def prepared_db(db_dsn: str, pgbouncer_prepared: Any) -> Any:
    """``db_dsn`` through the session's PgBouncer >= 1.21 (``max_prepared_statements``
    100; 2 server connections, round robin), and directly."""
    from tests.conftest import PooledDb

    return PooledDb(pgbouncer_prepared.pooled_url(db_dsn), db_dsn, pgbouncer_prepared)


def _parses_and_binds(db: Any) -> tuple[int, int]:
    """(Parse messages from clients, Bind messages) PgBouncer counted for the database."""
    dbname = conninfo_to_dict(db.direct_url)["dbname"]
    [row] = [r for r in db.bouncer.show("STATS") if r["database"] == dbname]
    return int(row["total_client_parse_count"]), int(row["total_bind_count"])


def test_statements_are_prepared_through_a_pooler_that_keeps_them(prepared_db):
    """pooler_prepared_statements=True: the same work as through 1.18 (three connections,
    leases renewed with lock_timeout, every message once), with the statements prepared:
    the pooler saw far fewer Parse messages than Binds (each prepared statement parsed
    once per client, bound on every call)."""
    options = _options(prepared_db, pooler_prepared_statements=True)
    got = _work(prepared_db.pooled_url, options, "prepared")
    assert got == list(range(30))
    parses, binds = _parses_and_binds(prepared_db)
    assert binds >= 60 and parses * 3 < binds, (parses, binds)
    # no session setting left behind either
    defaults = _defaults(prepared_db.direct_url, ("lock_timeout", "synchronous_commit"))
    seen = _server_settings(prepared_db.pooled_url, ("lock_timeout", "synchronous_commit"))
    assert seen == defaults


def test_without_the_option_nothing_is_prepared_through_the_pooler(prepared_db):
    """The test above can fail: without pooler_prepared_statements the same work sends
    no prepared statement through the pooler (it counts none: unnamed statements only)."""
    got = _work(prepared_db.pooled_url, _options(prepared_db), "unprepared")
    assert got == list(range(30))
    assert _parses_and_binds(prepared_db) == (0, 0)


@contextlib.contextmanager
def _not_keeping(pg_server: str, db_dsn: str, **pgbouncer: Any) -> Any:
    """A PgBouncer of its own that keeps no prepared statements (1.18, or 1.21+ with
    ``max_prepared_statements = 0``): yields (its URL of ``db_dsn``, transport options
    with ``pooler_prepared_statements=True``). Its own: the tests leave prepared
    statements on its server connections."""
    reason = support.available()
    if reason is not None:
        pytest.skip(reason)
    settings = dict(pgbouncer.pop("settings", {}))
    if (support.version(support.BINARY) or (0,)) >= (1, 21):
        settings["max_prepared_statements"] = "0"
    with support.PgBouncer(pg_server, settings=settings, **pgbouncer) as bouncer:
        options = {"pooler": "transaction", "direct_url": db_dsn}
        options["pooler_prepared_statements"] = True
        yield bouncer.pooled_url(db_dsn), options


def test_a_pooler_that_does_not_keep_prepared_statements_is_refused_at_connect(db_dsn, pg_server):
    """pooler_prepared_statements=True through a PgBouncer that keeps none (1.18, or
    max_prepared_statements = 0): the connection's first statement, a probe sent
    prepared, sees psycopg's own statement name on the server (a pooler that keeps them
    renames them) and fails with a ConfigurationError naming the option and the fix,
    before any message is sent, instead of failing mid-stream later or running another
    client's statement of the same name."""
    with _not_keeping(pg_server, db_dsn, settings={"server_round_robin": "1"}) as (url, options):
        for _ in range(2):  # on both server connections: the second meets the first's probe
            with (
                pytest.raises(ConfigurationError, match="pooler_prepared_statements=False"),
                connect(url, **options) as conn,
            ):
                publish(conn, "refused", [{"n": 1}])
    assert sql(db_dsn, "SELECT to_regclass('pgmq.q_refused') IS NULL") == [(True,)]


def test_the_option_on_a_direct_connection_is_refused_too(db_dsn):
    """No pooler at all (the option says there is one that keeps prepared statements):
    the probe sees psycopg's name, and the error says so."""
    options = {"pooler": "transaction", "pooler_prepared_statements": True}
    with (
        pytest.raises(ConfigurationError, match="no pooler at all"),
        connect(db_dsn, **options) as conn,
    ):
        publish(conn, "direct_refused", [{"n": 1}])


@pytest.fixture
def no_probe(monkeypatch):
    """Skip the connect-time probe, to reach the failures it prevents (a pooler
    reconfigured under running clients meets them the same way)."""
    monkeypatch.setattr(pooling, "check_prepared_kept", lambda conn, probe: None)


def test_prepared_statement_names_that_collide_through_the_pooler_name_the_option(
    db_dsn, pg_server, no_probe
):
    """Past the probe (``no_probe``): a statement that lands on a server connection
    where another client prepared one of the same name (psycopg names them ``_pg3_0``,
    ``_pg3_1``... per client, at a statement's fifth run): 'already exists' also becomes
    the ConfigurationError naming the option. One server connection, so the second client's
    first prepared statement collides with the first client's."""
    with (
        _not_keeping(pg_server, db_dsn, default_pool_size=1) as (url, options),
        connect(url, **options) as first,
    ):
        publish(first, "collide", [{"n": n} for n in range(6)])  # prepares _pg3_0
        with (
            connect(url, **options) as second,
            pytest.raises(ConfigurationError, match="pooler_prepared_statements") as failed,
        ):
            publish(second, "collide", [{"n": n} for n in range(6, 12)])
        assert "already exists" in str(failed.value)
    published = sql(db_dsn, "SELECT (message->>'n')::int FROM pgmq.q_collide ORDER BY 1")
    assert [r[0] for r in published][:6] == list(range(6))  # the first client's, all there


def test_a_prepared_statement_replaced_through_the_pooler_names_the_option(
    db_dsn, pg_server, no_probe
):
    """The third face of the same mistake: the client binds its ``_pg3_0`` on a server
    connection where another client's ``_pg3_0`` takes another number of parameters
    ("bind message supplies 6 parameters, but prepared statement ... requires 1": a
    protocol violation, SQLSTATE 08P01). It also becomes the ConfigurationError naming
    the option, not a lost connection. One server connection: the other client replaces
    the statement there between two of the first client's publishes."""
    with (
        _not_keeping(pg_server, db_dsn, default_pool_size=1) as (url, options),
        connect(url, **options) as client,
        client.channel() as channel,
    ):
        producer = Producer(channel)
        queue = Queue("replaced", routing_key="replaced")
        for n in range(6):  # the publish statement's sixth run is prepared: _pg3_0
            producer.publish({"n": n}, routing_key="replaced", declare=[queue])
        with psycopg.connect(url, autocommit=True, prepare_threshold=None) as other:
            other.execute("DEALLOCATE _pg3_0")
            other.execute("PREPARE _pg3_0 (int) AS SELECT $1")
        with pytest.raises(ConfigurationError, match="pooler_prepared_statements") as failed:
            producer.publish({"n": 6}, routing_key="replaced", declare=[queue])
        assert "requires 1" in str(failed.value)
    published = sql(db_dsn, "SELECT (message->>'n')::int FROM pgmq.q_replaced ORDER BY 1")
    assert [r[0] for r in published] == list(range(6))


def test_beat_refuses_a_transaction_pooler_without_direct_url(pooled_db):
    from celery import Celery

    from kombu_pgmq.beat.settings import database_url

    app = Celery("pooled", broker=pooled_db.pooled_url, set_as_current=False)
    app.conf.broker_transport_options = {"pooler": "transaction"}
    with pytest.raises(ConfigurationError, match="direct_url"):
        database_url(app)
    app.conf.broker_transport_options = _options(pooled_db)
    assert database_url(app) == to_dsn(pooled_db.direct_url)  # the leader's lock: direct


# -- the result backend ---------------------------------------------------------------------


@pytest.mark.parametrize("direct", [True, False], ids=["direct_url", "polling"])
def test_result_backend_through_the_pooler(pooled_db, caplog, monkeypatch, direct):
    """``result_backend = "postgresql://"`` takes the broker's pooler and direct_url: a
    ``get()`` waiting on the pooled backend is woken by NOTIFY on ``direct_url``, or finds
    the result by polling (one warning) without it."""
    from celery import Celery, states

    monkeypatch.setattr(pooling, "_warned", set())

    def make() -> Celery:
        app = Celery("kpt_pooled_results", set_as_current=False)
        app.conf.update(
            broker_url=pooled_db.pooled_url,
            result_backend="postgresql://",
            broker_transport_options=_options(pooled_db, direct=direct),
            result_backend_transport_options={"polling_interval": 0.2},
        )
        return app

    waiter, worker = make(), make()
    task_id = "pooled-result-1"
    done: list[float] = []  # when the store began: the result cannot exist before it
    try:
        with caplog.at_level(logging.WARNING, "kombu_pgmq"):
            result = waiter.AsyncResult(task_id)
            storing = worker.backend  # Celery's backends are per thread: this one, closed below

            def store_later() -> None:
                time.sleep(0.3)
                done.append(time.monotonic())  # before the store: get() can return before
                storing.store_result(task_id, 42, states.SUCCESS)  # store_result does

            thread = threading.Thread(target=store_later)
            thread.start()
            assert result.get(timeout=10) == 42
            latency = time.monotonic() - done[0]
            thread.join()
            for n in range(10):  # statements enough for psycopg to prepare, if it would
                worker.backend.store_result(f"pooled-result-more-{n}", n, states.SUCCESS)
                assert waiter.AsyncResult(f"pooled-result-more-{n}").get(timeout=10) == n
    finally:
        for app in (waiter, worker):
            app.backend.result_consumer.stop()
            if app.backend._db is not None:
                app.backend._db.close()
    assert latency < 1.0
    warnings = [r.getMessage() for r in caplog.records if "direct_url" in r.getMessage()]
    assert len(warnings) == (0 if direct else 1)
