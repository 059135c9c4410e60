"""An old snapshot held in the broker's database, against a real PostgreSQL: the holder of
the xmin horizon is named (Management, ``kombu-pgmq queues``, the Prometheus metrics, the
worker's log), and the maintenance VACUUM backs off while it holds, resuming once it is
gone."""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator

import psycopg
from click.testing import CliRunner
from prometheus_client import CollectorRegistry, generate_latest

from kombu_pgmq import cli
from kombu_pgmq._db import horizon as horizon_module
from kombu_pgmq._naming import pgmq_queue_name
from kombu_pgmq.cli import operations
from kombu_pgmq.management import Management
from kombu_pgmq.metrics import QueueCollector
from kombu_pgmq.transport._maintenance import Maintainer

from .helpers import connect, drain, publish, wait_for


@contextlib.contextmanager
def held_snapshot(dsn: str, application_name: str = "report_job") -> Iterator[int]:
    """A session that opens a REPEATABLE READ transaction, runs one SELECT and stays
    idle in it (what an analytics query or a forgotten session does); yields its pid."""
    with psycopg.connect(dsn, application_name=application_name) as holder:
        holder.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        holder.execute("SELECT count(*) FROM pg_class")
        yield holder.info.backend_pid
        holder.rollback()


def churn(dsn: str, queue: str, n: int = 60) -> None:
    """Publish ``n`` messages and consume and ack them: each leaves dead row versions."""
    with connect(dsn) as conn:
        publish(conn, queue, list(range(n)))
        drain(conn, queue, expect=n)


def dead_rows(dsn: str, queue: str) -> int:
    with Management(dsn) as management:
        (stats,) = [q for q in management.queues() if q.name == queue]
    return stats.dead_tuples or 0


def test_the_holder_of_the_horizon_is_named_with_its_session(db_dsn):
    churn(db_dsn, "held")
    wait_for(lambda: dead_rows(db_dsn, "held") > 0, 10, "dead rows in the statistics")
    with Management(db_dsn) as management:
        assert management.horizon() is None  # nothing else holds one
        with held_snapshot(db_dsn) as pid:
            found = management.horizon()
            assert found is not None
            assert (found.kind, found.pid, found.application_name) == ("session", pid, "report_job")
            assert found.state == "idle in transaction"
            assert found.age_seconds is not None and found.age_seconds >= 0
            assert found.query == "SELECT count(*) FROM pg_class"
            described = found.describe()
            assert f"session pid {pid}" in described and "'report_job'" in described
            assert "idle in transaction" in described
        assert management.horizon() is None


def test_queues_json_and_table_say_who_keeps_the_dead_rows(db_dsn, monkeypatch):
    monkeypatch.setattr(horizon_module, "OLD_SECONDS", 0.0)  # any age counts as old
    monkeypatch.setattr(operations, "HELD_DEAD_ROWS", 1)
    churn(db_dsn, "kept")
    wait_for(lambda: dead_rows(db_dsn, "kept") > 0, 10, "dead rows in the statistics")
    runner = CliRunner()
    result = runner.invoke(cli.main, ["--url", db_dsn, "queues", "--json"])
    assert result.exit_code == 0, result.output
    (row,) = [json.loads(line) for line in result.stdout.splitlines()]
    assert row["dead_tuples"] > 0 and row["dead_tuples_held_by"] is None
    with held_snapshot(db_dsn) as pid:
        result = runner.invoke(cli.main, ["--url", db_dsn, "queues", "--json"])
        (row,) = [json.loads(line) for line in result.stdout.splitlines()]
        assert row["dead_tuples_held_by"]["pid"] == pid
        assert row["dead_tuples_held_by"]["application_name"] == "report_job"
        table = runner.invoke(cli.main, ["--url", db_dsn, "queues"])
        assert table.exit_code == 0, table.output
        text = " ".join(table.output.split())  # as rich wrapped it
        assert "dead rows" in text
        assert f"session pid {pid}" in text and "holds the database's xmin" in text
    table = runner.invoke(cli.main, ["--url", db_dsn, "queues"])
    assert "holds the database's xmin" not in " ".join(table.output.split())


def test_metrics_give_the_horizon_age_and_the_dead_rows(db_dsn):
    churn(db_dsn, "measured")
    wait_for(lambda: dead_rows(db_dsn, "measured") > 0, 10, "dead rows in the statistics")
    registry = CollectorRegistry()
    collector = QueueCollector(db_dsn, cache_seconds=0)
    registry.register(collector)
    try:
        with held_snapshot(db_dsn, "nightly_export") as pid:
            text = generate_latest(registry).decode()
        assert 'kombu_pgmq_queue_dead_tuples{queue="measured"}' in text
        assert (
            f'kombu_pgmq_xmin_horizon_holder{{application_name="nightly_export",kind="session",'
            f'name="",pid="{pid}",state="idle in transaction"}} 1.0'
        ) in text
        (age,) = [
            float(line.split()[-1])
            for line in text.splitlines()
            if line.startswith("kombu_pgmq_xmin_horizon_age_seconds ")
        ]
        assert age > 0
        after = generate_latest(registry).decode()
        assert "kombu_pgmq_xmin_horizon_age_seconds 0.0" in after
        assert "nightly_export" not in after
    finally:
        collector.close()


def test_vacuum_backs_off_while_the_horizon_is_held_and_resumes_after(db_dsn, monkeypatch, caplog):
    """A table VACUUMed under the current horizon is not VACUUMed again until it moves
    (it would remove nothing): one VACUUM, then skipped rounds and one warning naming the
    holder; once the holder ends, the next round VACUUMs and the dead rows go."""
    monkeypatch.setattr(horizon_module, "OLD_SECONDS", 0.0)
    name = pgmq_queue_name("backoff")
    churn(db_dsn, "backoff", 10)
    maintainer = Maintainer(
        db_dsn,
        owner=lambda: "test",
        interval_seconds=0,
        consumed_tables=lambda: [name],
        vacuum_threshold=1,
    )

    def round_() -> None:
        # the statistics lag, and a table VACUUMed less than a second ago is not due
        wait_for(
            lambda: maintainer.consumers.dead_tuples([name], 1.0).get(name, 0) > 1,
            10,
            "the table due for VACUUM",
        )
        maintainer.vacuum(maintainer.consumers, [name])

    caplog.set_level(logging.INFO, logger="kombu_pgmq.transport._maintenance")
    try:
        with held_snapshot(db_dsn, "long_report") as pid:
            churn(db_dsn, "backoff", 60)  # dead rows the held snapshot keeps
            round_()
            assert (maintainer.vacuums, maintainer.vacuums_skipped) == (1, 0)
            round_()
            round_()
            assert (maintainer.vacuums, maintainer.vacuums_skipped) == (1, 2)
            warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
            assert len(warnings) == 1, [r.getMessage() for r in warnings]
            message = warnings[0].getMessage()
            assert f"pgmq.q_{name}" in message and f"session pid {pid}" in message
            assert "'long_report'" in message
        round_()
        assert maintainer.vacuums == 2
        assert any("moved on" in r.getMessage() for r in caplog.records)
        wait_for(lambda: dead_rows(db_dsn, "backoff") <= 1, 10, "the dead rows removed")
    finally:
        maintainer.close()


def test_a_worker_role_sees_the_holder_without_its_age(least_privilege_db):
    """pg_stat_activity hides another role's transaction start, state and query: the
    holder is still named by pid and application_name, its age is None and said to be
    hidden."""
    with (
        held_snapshot(least_privilege_db.owner_url, "owner_report") as pid,
        Management(least_privilege_db.worker_url) as management,
    ):
        found = management.horizon()
        assert found is not None and (found.pid, found.application_name) == (pid, "owner_report")
        assert found.age_seconds is None and found.old is None
        assert "age hidden from this role" in found.describe()
