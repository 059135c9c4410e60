"""See and steer the broker, against a real PostgreSQL: queue statistics
(states, bands summed, oldest age, archive, consumers, dead letters), passive declare's
message_count, Prometheus collectors, peek, pause/resume and the durable cancel.
Statistics, pause and cancel run on PGMQ's SQL-only install and on the extension.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from kombu import Consumer, Exchange, Producer, Queue
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from psycopg import sql as pgsql

import kombu_pgmq  # noqa: F401
from kombu_pgmq import errors, schema
from kombu_pgmq._stats import STATS
from kombu_pgmq.management import Management
from kombu_pgmq.metrics import ProcessCollector, QueueCollector
from tests.integration.helpers import connect, drain, publish, sql, table


@pytest.fixture(params=["sql_only", "extension"])
def url(request: pytest.FixtureRequest) -> Iterator[str]:
    """A database with kombu_pgmq installed: PGMQ's SQL-only form, or the extension."""
    if request.param == "sql_only":
        yield request.getfixturevalue("db_dsn")
        return
    dsn = request.getfixturevalue("extension_bootstrapped_db_dsn")
    info = schema.bootstrap(dsn)  # already done in the template: nothing to do
    assert info.method != "install_sql", info
    yield dsn


def samples(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a registry's exposition: (name, sorted labels) -> value."""
    text = generate_latest(registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def task_headers(task_id: str, name: str = "tasks.work", args: str = "(1,)") -> dict[str, Any]:
    return {"task": name, "id": task_id, "argsrepr": args, "kwargsrepr": "{}"}


def by_name(management: Management) -> dict[str, Any]:
    return {q.name: q for q in management.queues()}


def test_queue_states_bands_age_archive_and_dead_letters(url):
    priorities = Queue("ops_prio", Exchange("ops_prio"), "ops_prio", max_priority=9)
    with connect(url, max_deliveries=1) as conn, Management(url) as management:
        producer = Producer(conn.channel())
        for i in range(6):
            producer.publish(
                {"i": i},
                exchange=priorities.exchange,
                routing_key="ops_prio",
                declare=[priorities],
                priority=i,
            )
        producer.publish(
            {"later": 1},
            exchange=priorities.exchange,
            routing_key="ops_prio",
            headers={"x-delay": 600_000},
        )
        publish(conn, "ops_plain", [1, 2, 3])
        assert by_name(management)["ops_prio"].ready == 6
        time.sleep(0.2)
        # one delivered and held, two acked (archived), one rejected (dead-lettered)
        channel = conn.channel()
        held = channel.basic_get("ops_prio", no_ack=False)
        assert held is not None
        got = drain(conn, "ops_plain", expect=2, prefetch=2)
        assert len(got) == 2
        rejected = conn.channel().basic_get("ops_plain", no_ack=False)
        rejected.reject(requeue=False)

        stats = by_name(management)
        prio = stats["ops_prio"]
        assert (prio.ready, prio.in_flight, prio.delayed) == (5, 1, 1)
        assert prio.messages == 7
        assert len(prio.bands) > 1 and sum(b.ready for b in prio.bands) == 5
        assert prio.oldest_age_seconds is not None and prio.oldest_age_seconds >= 0.2
        plain = stats["ops_plain"]
        assert (plain.ready, plain.in_flight, plain.delayed) == (0, 0, 0)
        assert plain.archived == 2 and not plain.archived_estimated
        assert plain.dead_letters == 1 and prio.dead_letters == 0
        assert plain.oldest_age_seconds is None
        assert stats["kombu_pgmq_dlq"].ready == 1
        held.ack()


def test_consumers_are_counted_while_they_consume(url):
    with connect(url) as conn, Management(url) as management:
        publish(conn, "ops_consumed", [1])
        assert by_name(management)["ops_consumed"].consumers == 0
        channel = conn.channel()
        with Consumer(channel, [Queue("ops_consumed")], on_message=lambda m: m.ack()):
            conn.drain_events(timeout=5)
            assert by_name(management)["ops_consumed"].consumers == 1
        channel.close()


def test_a_big_archive_reports_the_estimate(db_dsn):
    with connect(db_dsn) as conn:
        publish(conn, "ops_big", list(range(30)))
        drain(conn, "ops_big", expect=30, prefetch=30)
    sql(db_dsn, f"ANALYZE {table('ops_big', 'a')}")
    with Management(db_dsn) as management:
        exact = {q.name: q for q in management.queues()}["ops_big"]
        estimated = {q.name: q for q in management.queues(exact_archive_below=10)}["ops_big"]
    assert exact.archived == 30 and not exact.archived_estimated
    assert estimated.archived_estimated and 20 <= estimated.archived <= 40


def test_passive_declare_returns_the_ready_count(url):
    with connect(url) as conn:
        publish(conn, "ops_passive", [1, 2, 3, 4])
        channel = conn.channel()
        assert channel.queue_declare("ops_passive", passive=True).message_count == 4
        channel.basic_get("ops_passive")  # one delivered: no longer ready
        assert channel.queue_declare("ops_passive", passive=True).message_count == 3
        with pytest.raises(Exception, match="NOT_FOUND"):
            conn.channel().queue_declare("ops_never_declared", passive=True)


def test_queue_collector_exports_every_state_and_process_counters(url):
    registry = CollectorRegistry()
    collector = QueueCollector(url)
    registry.register(collector)
    registry.register(ProcessCollector())
    before = dict(STATS.as_dict())
    with connect(url) as conn:
        publish(conn, "ops_metrics", list(range(5)))
        got = drain(conn, "ops_metrics", expect=3, prefetch=3)
        assert len(got) == 3
        found = samples(registry)
    collector.close()
    assert found[("kombu_pgmq_queue_messages", (("queue", "ops_metrics"), ("state", "ready")))] == 2
    assert found[("kombu_pgmq_archive_messages", (("queue", "ops_metrics"),))] == 3
    assert found[("kombu_pgmq_up", ())] == 1
    assert found[("kombu_pgmq_acks_total", ())] - before["acks"] == 3
    assert found[("kombu_pgmq_deliveries_total", ())] - before["deliveries"] >= 3
    assert found[("kombu_pgmq_publishes_total", ())] - before["publishes"] == 5


def test_an_unreachable_database_is_up_zero_not_an_error():
    registry = CollectorRegistry()
    registry.register(QueueCollector("postgresql://nobody@127.0.0.1:1/none?connect_timeout=1"))
    assert samples(registry)[("kombu_pgmq_up", ())] == 0


def test_peek_consumes_nothing(url):
    with connect(url) as conn, Management(url) as management:
        publish(conn, "ops_peek", [{"n": 1}], headers=task_headers("t-1", args="(41, 1)"))
        publish(conn, "ops_peek", [{"n": 2}])
        first = management.messages("ops_peek")
        again = management.messages("ops_peek", limit=1)
        assert [m.task for m in first] == ["tasks.work", None]
        assert first[0].task_id == "t-1" and first[0].args == "(41, 1) {}"
        assert first[1].args == '{"n": 2}'
        assert [m.read_ct for m in first] == [0, 0] and [m.state for m in first] == ["ready"] * 2
        assert [m.msg_id for m in again] == [first[0].msg_id]
        assert len(drain(conn, "ops_peek", expect=2)) == 2  # still there, never read
        with pytest.raises(errors.QueueNotFound, match="ops_nothing"):
            management.messages("ops_nothing")


def test_a_paused_queue_delivers_nothing_until_resumed_and_publishes_land(url):
    with connect(url, polling_interval=0.2) as conn, Management(url) as management:
        publish(conn, "ops_paused", [1, 2])
        publish(conn, "ops_running", [1])
        management.pause("ops_paused")
        management.pause("ops_paused")  # idempotent
        publish(conn, "ops_paused", [3])  # publishes land while paused
        assert by_name(management)["ops_paused"].paused
        assert by_name(management)["ops_paused"].ready == 3
        assert conn.channel().basic_get("ops_paused") is None
        assert conn.channel().basic_get("ops_paused", no_ack=True) is None
        assert len(drain(conn, "ops_running", expect=1, timeout=3)) == 1
        assert drain(conn, "ops_paused", expect=1, timeout=1.5) == []
    # the pause is a row: a new connection (a restarted worker) sees it too
    with connect(url, polling_interval=0.2) as conn, Management(url) as management:
        assert drain(conn, "ops_paused", expect=1, timeout=1.0) == []
        assert management.resume("ops_paused") == ["ops_paused"]
        assert management.resume("ops_paused") == []
        assert len(drain(conn, "ops_paused", expect=3, timeout=10)) == 3
        with pytest.raises(errors.QueueNotFound, match="not declared"):
            management.pause("ops_nobody_declared")


def test_a_waiting_consumer_receives_at_resume_not_at_its_next_poll(url):
    with connect(url, polling_interval=30) as conn, Management(url) as management:
        conn.channel().queue_declare("ops_wake")
        management.pause("ops_wake")
        publish(conn, "ops_wake", [1])
        got: list[Any] = []
        channel = conn.channel()
        with Consumer(channel, [Queue("ops_wake")], on_message=lambda m: (got.append(m), m.ack())):
            with pytest.raises(TimeoutError):
                conn.drain_events(timeout=1.0)  # paused: nothing; now it waits on NOTIFY
            management.resume("ops_wake")
            started = time.monotonic()
            conn.drain_events(timeout=10)
            waited = time.monotonic() - started
        assert len(got) == 1 and waited < 5  # far below the 30 s fallback poll


def test_cancel_archives_queued_and_delayed_messages_but_not_held_ones(url):
    queued, delayed, held_id = (str(uuid.uuid4()) for _ in range(3))
    with connect(url) as conn, Management(url) as management:
        publish(conn, "ops_cancel", [1], headers=task_headers(queued))
        publish(conn, "ops_cancel", [2], headers={**task_headers(delayed), "x-delay": 600_000})
        publish(conn, "ops_cancel", [3], headers=task_headers(held_id))
        channel = conn.channel()
        messages = [channel.basic_get("ops_cancel") for _ in range(2)]
        held = next(m for m in messages if m.headers["id"] == held_id)
        queued_message = next(m for m in messages if m.headers["id"] == queued)
        queued_message.reject(requeue=True)  # back to ready: cancellable again

        assert [loc.state for loc in management.find_task(delayed)] == ["delayed"]
        result = management.cancel_task(queued)
        assert [q for q, _ in result.cancelled] == ["ops_cancel"] and not result.in_flight
        assert management.cancel_task(delayed).cancelled
        refused = management.cancel_task(held_id, revoke=False)
        assert refused.cancelled == () and [loc.state for loc in refused.in_flight] == ["in_flight"]
        assert not refused.revoked
        assert management.cancel_task(held_id).revoked  # a revoke broadcast (no worker here)

        archived = sql(
            url,
            f"SELECT headers->>'id', headers->>'x-archive-reason', headers ? 'x-cancelled-at' "
            f"FROM {table('ops_cancel', 'a')} ORDER BY msg_id",
        )
        assert sorted(archived) == sorted(
            [(queued, "cancelled", True), (delayed, "cancelled", True)]
        )
        found = management.find_task(queued)
        assert [(f.state, f.reason, f.task) for f in found] == [
            ("archived", "cancelled", "tasks.work")
        ]
        assert management.find_task(queued, archives=False) == []
        held.ack()
        assert by_name(management)["ops_cancel"].messages == 0


def test_pgmq_functions_still_work_on_the_queues(url):
    """Pause and statistics add rows of kombu_pgmq's own tables only: PGMQ's functions
    read, archive and measure a paused queue's tables as any other."""
    with connect(url) as conn, Management(url) as management:
        publish(conn, "ops_pgmq", [1, 2])
        management.pause("ops_pgmq")
        rows = sql(url, "SELECT msg_id FROM pgmq.read('ops_pgmq', 30, 5)")
        assert len(rows) == 2  # PGMQ's own read ignores kombu_pgmq's pause
        assert sql(url, "SELECT pgmq.archive('ops_pgmq', %s::bigint)", (rows[0][0],)) == [(True,)]
        metrics = sql(url, "SELECT queue_length FROM pgmq.metrics('ops_pgmq')")
        assert metrics == [(1,)]
        assert by_name(management)["ops_pgmq"].in_flight == 1


def store_result(url: str, key: str, state: str, size: int) -> None:
    query = "SELECT kombu_pgmq.results_store(%s, %s, %s, NULL, false)"
    sql(url, query, (key, state, b"r" * size))


def test_queue_collector_exports_results_by_state(db_dsn):
    for i in range(3):
        store_result(db_dsn, f"celery-task-meta-m{i}", "SUCCESS", 10)
    store_result(db_dsn, "celery-task-meta-f", "FAILURE", 7)
    registry = CollectorRegistry()
    collector = QueueCollector(db_dsn, cache_seconds=0)
    registry.register(collector)
    found = samples(registry)
    collector.close()
    assert found[("kombu_pgmq_results", (("state", "SUCCESS"),))] == 3
    assert found[("kombu_pgmq_results", (("state", "FAILURE"),))] == 1
    assert found[("kombu_pgmq_result_bytes", (("state", "SUCCESS"),))] == 30
    assert found[("kombu_pgmq_results_expired", (("state", "FAILURE"),))] == 0
    assert found[("kombu_pgmq_up", ())] == 1


def test_no_result_metrics_without_the_tables_or_the_privilege(db_dsn, least_privilege_db):
    sql(db_dsn, "DROP FUNCTION kombu_pgmq.results_stats()")  # a schema without the result backend
    lp = least_privilege_db
    revoke = "REVOKE EXECUTE ON FUNCTION kombu_pgmq.results_stats() FROM {}"
    sql(lp.owner_url, pgsql.SQL(revoke).format(pgsql.Identifier(lp.producer)))
    for url in (db_dsn, lp.producer_url):
        registry = CollectorRegistry()
        collector = QueueCollector(url, cache_seconds=0)
        registry.register(collector)
        found, again = samples(registry), samples(registry)
        collector.close()
        assert found[("kombu_pgmq_up", ())] == 1 == again[("kombu_pgmq_up", ())], url
        assert not [k for k in found if k[0].startswith("kombu_pgmq_result")], url
