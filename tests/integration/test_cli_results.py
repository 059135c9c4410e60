"""``kombu-pgmq results [expire]`` on a real PostgreSQL: counts by state, oldest, size and
expired-not-yet-deleted as JSON and as a table, the expiry run at once, and one error
line naming the fix for a database without the result backend's tables."""

from __future__ import annotations

import json
import time

import psycopg
from click.testing import CliRunner, Result

from kombu_pgmq import cli

from .test_cli import assert_one_error_line


def invoke(*args: str) -> Result:
    return CliRunner().invoke(cli.main, list(args))


def store(url: str, key: str, state: str, size: int, expires_seconds: float | None) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(
            "SELECT kombu_pgmq.results_store(%s, %s, %s, %s, false)",
            (key, state, b"x" * size, expires_seconds),
        )


def test_results_by_state_then_expire(db_dsn: str) -> None:
    empty = invoke("results", "--url", db_dsn)
    assert empty.exit_code == 0 and "no results stored" in empty.stdout
    for i in range(3):
        store(db_dsn, f"celery-task-meta-ok{i}", "SUCCESS", 100, None)
    store(db_dsn, "celery-task-meta-bad", "FAILURE", 2000, 0.2)
    store(db_dsn, "celery-task-meta-old", "SUCCESS", 50, 0.2)
    time.sleep(0.4)

    result = invoke("results", "--url", db_dsn, "--json")
    assert result.exit_code == 0, (result.output, result.exception)
    rows = {r["state"]: r for r in map(json.loads, result.stdout.splitlines())}
    assert rows["SUCCESS"]["results"] == 4 and rows["SUCCESS"]["bytes"] == 350
    assert rows["SUCCESS"]["expired"] == 1 and rows["SUCCESS"]["oldest"]
    assert rows["FAILURE"] == {**rows["FAILURE"], "results": 1, "bytes": 2000, "expired": 1}

    table = invoke("results", "--url", db_dsn)
    assert table.exit_code == 0, table.output
    assert "SUCCESS" in table.stdout and "FAILURE" in table.stdout
    assert "total" in table.stdout and "2.3 kB" in table.stdout

    expired = invoke("results", "expire", "--url", db_dsn, "--batch-size", "1")
    assert expired.exit_code == 0, (expired.output, expired.exception)
    assert expired.stdout.strip() == "2 expired results deleted"
    after = invoke("results", "--url", db_dsn, "--json")
    rows = {r["state"]: r for r in map(json.loads, after.stdout.splitlines())}
    assert set(rows) == {"SUCCESS"} and rows["SUCCESS"]["results"] == 3
    assert rows["SUCCESS"]["expired"] == 0


def test_expire_takes_the_url_of_the_group_too(db_dsn: str) -> None:
    store(db_dsn, "celery-task-meta-x", "SUCCESS", 10, 0.01)
    time.sleep(0.1)
    result = invoke("results", "--url", db_dsn, "expire")
    assert result.exit_code == 0, (result.output, result.exception)
    assert result.stdout.strip() == "1 expired results deleted"


def test_a_database_without_the_result_tables_names_the_fix(empty_db_dsn: str) -> None:
    for command in (("results",), ("results", "expire")):
        assert_one_error_line(invoke(*command, "--url", empty_db_dsn), "kombu-pgmq schema install")
    bad = invoke("results", "expire", "--url", empty_db_dsn, "--batch-size", "0")
    assert bad.exit_code == 2 and "'--batch-size'" in bad.stderr  # before any database
