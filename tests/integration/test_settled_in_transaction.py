"""Messages settled inside an application's transaction (``kombu_pgmq.ack_in_transaction``,
what :class:`kombu_pgmq.AtomicTask` calls) in the operations view, on a real PostgreSQL:
``Management.queues()`` (``QueueStats.settled_in_transaction``, priority bands summed,
a rolled-back settle not counted), ``kombu-pgmq queues`` (the ``in tx`` column, shown
once a queue has some, and ``--json``) and the Prometheus counter
``kombu_pgmq_queue_settled_in_transaction_total{queue}``. A schema without
``kombu_pgmq.settled_in_transaction()`` leaves them out (None, null, no sample) and
fails nothing.
"""

from __future__ import annotations

import json
from typing import Any

import psycopg
from click.testing import CliRunner, Result
from kombu import Exchange, Producer, Queue
from prometheus_client import CollectorRegistry

from kombu_pgmq import cli
from kombu_pgmq.management import Management
from kombu_pgmq.metrics import QueueCollector

from .helpers import connect, publish, sql
from .test_operations import samples

METRIC = "kombu_pgmq_queue_settled_in_transaction_total"


def settle(url: str, message: Any, *, commit: bool = True) -> None:
    """Archive ``message`` by its receipt in a transaction of another connection (as an
    AtomicTask's transaction does), then commit it or roll it back."""
    info = message.delivery_info
    with psycopg.connect(url) as conn:
        conn.execute(
            "SELECT kombu_pgmq.ack_in_transaction(%s, %s, %s, %s)",
            (
                info["pgmq_queue"],
                info["pgmq_msg_id"],
                info["pgmq_read_ct"],
                info.get("pgmq_enqueued_at"),
            ),
        )
        if commit:
            conn.commit()
        else:
            conn.rollback()


def invoke(*args: str) -> Result:
    result = CliRunner().invoke(cli.main, list(args))
    assert result.exit_code == 0, (result.output, result.exception)
    return result


def as_json(url: str) -> dict[str, dict[str, Any]]:
    rows = [
        json.loads(line)
        for line in invoke("queues", "--url", url, "--json").stdout.split("\n")
        if line
    ]
    return {row["queue"]: row for row in rows}


def table(url: str) -> dict[str, dict[str, str]]:
    """``kombu-pgmq queues``'s table: queue -> {column header: cell}."""
    lines = invoke("queues", "--url", url).stdout.splitlines()
    header = next(line for line in lines if line.startswith("┃"))
    names = [cell.strip() for cell in header.strip("┃").split("┃")]
    rows = {}
    for line in lines:
        if line.startswith("│"):
            cells = [cell.strip() for cell in line.strip("│").split("│")]
            rows[cells[0]] = dict(zip(names, cells, strict=True))
    return rows


def test_queues_table_json_and_metric_count_committed_settles_per_queue(db_dsn):
    prio = Queue("atx_prio", Exchange("atx_prio"), "atx_prio", max_priority=9)
    with connect(db_dsn) as conn:
        publish(conn, "atx_plain", [1, 2, 3])
        publish(conn, "atx_acked", [1])
        producer = Producer(conn.channel())
        for priority in (0, 9):  # two bands
            producer.publish(
                {"p": priority},
                exchange=prio.exchange,
                routing_key="atx_prio",
                declare=[prio],
                priority=priority,
            )
        assert "in tx" not in next(iter(table(db_dsn).values()))  # none settled yet
        assert as_json(db_dsn)["atx_plain"]["settled_in_transaction"] == 0

        channel = conn.channel()
        plain = [channel.basic_get("atx_plain", no_ack=False) for _ in range(3)]
        settle(db_dsn, plain[0])
        settle(db_dsn, plain[1])
        settle(db_dsn, plain[2], commit=False)  # rolled back: still in flight, not counted
        for _ in range(2):
            settle(db_dsn, channel.basic_get("atx_prio", no_ack=False))
        channel.basic_get("atx_acked", no_ack=False).ack()  # the worker's own ack

        with Management(db_dsn) as management:
            stats = {q.name: q for q in management.queues()}
        assert stats["atx_plain"].settled_in_transaction == 2
        assert (stats["atx_plain"].in_flight, stats["atx_plain"].archived) == (1, 2)
        assert len(stats["atx_prio"].bands) > 1
        assert stats["atx_prio"].settled_in_transaction == 2  # bands summed
        assert stats["atx_acked"].settled_in_transaction == 0
        assert stats["atx_acked"].archived == 1

        rows = as_json(db_dsn)
        assert [
            rows[q]["settled_in_transaction"] for q in ("atx_plain", "atx_prio", "atx_acked")
        ] == [2, 2, 0]
        shown = table(db_dsn)
        assert [shown[q]["in tx"] for q in ("atx_plain", "atx_prio", "atx_acked")] == [
            "2",
            "2",
            "0",
        ]

        registry = CollectorRegistry()
        collector = QueueCollector(db_dsn, cache_seconds=0)
        registry.register(collector)
        found = samples(registry)
        collector.close()
    assert found[(METRIC, (("queue", "atx_plain"),))] == 2
    assert found[(METRIC, (("queue", "atx_prio"),))] == 2
    assert found[(METRIC, (("queue", "atx_acked"),))] == 0


def test_a_schema_without_the_count_leaves_it_out(db_dsn):
    with connect(db_dsn) as conn:
        publish(conn, "atx_old", [1])
    sql(db_dsn, "DROP FUNCTION kombu_pgmq.settled_in_transaction()")
    with Management(db_dsn) as management:
        assert {q.name: q for q in management.queues()}["atx_old"].settled_in_transaction is None
    row = as_json(db_dsn)["atx_old"]
    assert row["ready"] == 1 and row["settled_in_transaction"] is None
    assert "in tx" not in table(db_dsn)["atx_old"]
    registry = CollectorRegistry()
    collector = QueueCollector(db_dsn, cache_seconds=0)
    registry.register(collector)
    found = samples(registry)
    collector.close()
    assert found[("kombu_pgmq_up", ())] == 1
    assert found[("kombu_pgmq_queue_messages", (("queue", "atx_old"), ("state", "ready")))] == 1
    assert not [key for key in found if key[0] == METRIC]
