"""``kombu-pgmq queue limit`` and the limits column of ``kombu-pgmq queues`` on a real
PostgreSQL: set, change (the others kept), show with their use (messages
in flight held by a live consumer), clear (a FIFO queue keeps its group limit), --json,
errors naming the option or the queue and the fix, and ``queues`` still working when the
limits cannot be read (no ``kombu_pgmq.limits_info``, a producer role).
"""

from __future__ import annotations

from typing import Any

from click.testing import Result

from tests.support.doc_samples import check_sample

from .helpers import connect, drain, publish, sql
from .test_cli import assert_one_error_line
from .test_cli_operations import invoke, lines


def limit(db_dsn: str, queue: str, *options: str) -> Result:
    return invoke("queue", "limit", queue, "--url", db_dsn, *options)


def shown(db_dsn: str, queue: str) -> dict[str, Any]:
    [row] = lines(limit(db_dsn, queue, "--json"))
    return row


def queue_rows(url: str) -> dict[str, dict[str, Any]]:
    return {r["queue"]: r for r in lines(invoke("queues", "--url", url, "--json"))}


def test_the_output_the_docs_show(db_dsn: str) -> None:
    """docs/limits.md shows this output (tests/support/doc_samples.py)."""
    with connect(db_dsn) as conn:
        publish(conn, "emails", [1])
    command = ["queue", "limit", "emails", "--concurrency", "20", "--rate", "100/s"]
    result = invoke(*command, "--url", db_dsn)
    assert result.exit_code == 0, result.output
    check_sample("queue_limit", f"$ kombu-pgmq {' '.join(command)}\n{result.stdout}")


def test_set_change_show_and_clear(db_dsn: str) -> None:
    with connect(db_dsn) as conn:
        publish(conn, "lim_mail", [1, 2, 3])
        publish(conn, "lim_free", [1])
    none = limit(db_dsn, "lim_mail")
    assert none.exit_code == 0, none.output
    assert "queue lim_mail has no limits" in none.stdout
    assert shown(db_dsn, "lim_mail")["limited"] is False
    table = invoke("queues", "--url", db_dsn)
    assert "limits" not in table.stdout  # no limited queue: no column

    result = limit(db_dsn, "lim_mail", "--concurrency", "2", "--rate", "100/s")
    assert result.exit_code == 0, result.output
    assert "in force at the workers' next read (no restart needed)" in result.stdout
    assert "concurrency      2 across every worker (0 in flight now)" in result.stdout
    assert "100/s (100 per second; burst 10 tokens" in result.stdout
    row = shown(db_dsn, "lim_mail")
    assert (row["limited"], row["concurrency"], row["rate"], row["burst"]) == (
        True,
        2,
        "100/s",
        10.0,
    )
    assert row["updated_by"] and row["updated_at"]

    # options given change those limits; the others are kept; 0 removes one
    ok = limit(db_dsn, "lim_mail", "--rate", "0", "--key-concurrency", "1", "--limit-key", "task")
    assert ok.exit_code == 0, ok.output
    row = shown(db_dsn, "lim_mail")
    assert (row["concurrency"], row["rate"], row["key_concurrency"], row["limit_key"]) == (
        2,
        None,
        1,
        "task",
    )
    assert "per Celery task name" in limit(db_dsn, "lim_mail").stdout

    with connect(db_dsn) as conn:
        held = drain(conn, "lim_mail", expect=3, ack=False, timeout=3)
        assert len(held) == 2  # the concurrency limit: the third is not delivered
        use = shown(db_dsn, "lim_mail")
        assert use["in_flight"] == 2 and use["throttled_concurrency"] >= 1
        stats = queue_rows(db_dsn)
        assert stats["lim_mail"]["limits"]["in_flight"] == 2
        assert stats["lim_mail"]["limits"]["concurrency"] == 2
        assert stats["lim_free"]["limits"] is None
        table = invoke("queues", "--url", db_dsn)
        assert table.exit_code == 0 and "limits" in table.stdout
        assert "conc 2/2" in table.stdout, table.stdout
        view = limit(db_dsn, "lim_mail").stdout
        assert "(2 in flight now)" in view and "concurrency" in view

    cleared = limit(db_dsn, "lim_mail", "--clear")
    assert cleared.exit_code == 0, cleared.output
    assert "cleared the limits of queue lim_mail" in cleared.stdout
    assert "has no limits" in cleared.stdout
    assert shown(db_dsn, "lim_mail")["limited"] is False
    assert queue_rows(db_dsn)["lim_mail"]["limits"] is None

    # --clear with options: exactly those
    limit(db_dsn, "lim_mail", "--concurrency", "5", "--rate", "10/s")
    replaced = lines(limit(db_dsn, "lim_mail", "--clear", "--rate", "6000/m", "--json"))[0]
    assert (replaced["concurrency"], replaced["rate"], replaced["rate_per_second"]) == (
        None,
        "6000/m",
        100.0,
    )


def test_bad_values_name_the_option(db_dsn: str) -> None:
    with connect(db_dsn) as conn:
        publish(conn, "lim_bad", [1])
    for options, option, fragment in (
        (["--rate", "5/x"], "--rate", "is not a rate"),
        (["--key-rate", "fast"], "--key-rate", "is not a rate"),
        (["--concurrency", "-1"], "'--concurrency'", "-1 is not in the range x>=0"),
        (["--key-concurrency", "-3"], "'--key-concurrency'", "-3 is not in the range x>=0"),
        (["--burst", "0.5"], "'--burst'", "give 1 token or more (0: the default burst)"),
        (["--key-burst", "0.2"], "'--key-burst'", "give 1 token or more"),
        (["--limit-key", " "], "'--limit-key'", "header name"),
    ):
        result = limit(db_dsn, "lim_bad", *options)
        assert result.exit_code == 2, (options, result.output)
        assert f"Invalid value for {option}" in result.stderr and fragment in result.stderr
        assert "=" not in result.stderr.replace(">=", "").replace("<=", ""), result.stderr
    result = limit(db_dsn, "lim_bad", "--clear", "--burst", "5")
    assert result.exit_code == 2 and "--burst needs --rate" in result.stderr
    assert "give --rate with --burst" in result.stderr
    # a burst without a stored rate: the server refuses, one line in flags
    assert_one_error_line(
        limit(db_dsn, "lim_bad", "--burst", "5"),
        "queue lim_bad has no rate limit for --burst to size: give --rate with --burst",
    )
    assert_one_error_line(
        limit(db_dsn, "lim_bad", "--key-burst", "5"),
        "has no per-key rate limit for --key-burst to size: give --key-rate with --key-burst",
    )
    assert shown(db_dsn, "lim_bad")["limited"] is False


def test_a_queue_that_does_not_exist_names_the_fix(db_dsn: str) -> None:
    for options in ([], ["--concurrency", "3"], ["--clear"], ["--json"]):
        assert_one_error_line(
            limit(db_dsn, "lim_nowhere", *options),
            "'lim_nowhere' does not exist",
            "declare it first",
        )


def test_a_fifo_queue_keeps_its_group_limit(db_dsn: str) -> None:
    from kombu import Queue

    with connect(db_dsn) as conn:
        Queue("lim_fifo", queue_arguments={"x-fifo-groups": True})(conn.default_channel).declare()
    row = shown(db_dsn, "lim_fifo")
    assert (row["limited"], row["ordered_keys"], row["limit_key"], row["key_concurrency"]) == (
        True,
        True,
        "x-group-id",
        1,
    )
    assert "FIFO queue: header x-group-id" in limit(db_dsn, "lim_fifo").stdout
    assert "fifo" in invoke("queues", "--url", db_dsn).stdout

    assert limit(db_dsn, "lim_fifo", "--rate", "5/s").exit_code == 0
    cleared = limit(db_dsn, "lim_fifo", "--clear")
    assert cleared.exit_code == 0, cleared.output
    assert "it keeps its group limit, one message per x-group-id at a time" in cleared.stdout
    row = shown(db_dsn, "lim_fifo")
    assert (row["rate"], row["ordered_keys"], row["key_concurrency"]) == (None, True, 1)
    assert_one_error_line(limit(db_dsn, "lim_fifo", "--key-concurrency", "3"), "FIFO queue")


def test_queues_without_migration_0021_or_the_privilege(
    db_dsn: str, least_privilege_db: Any
) -> None:
    lp = least_privilege_db
    with connect(lp.worker_url) as conn:
        publish(conn, "lim_lp", [1])
    # a worker role may set and read limits (set_queue_limits and limits_info are granted)
    assert limit(lp.worker_url, "lim_lp", "--concurrency", "4").exit_code == 0
    assert queue_rows(lp.worker_url)["lim_lp"]["limits"]["concurrency"] == 4
    # a producer role may not read them: queues works, without them
    rows = queue_rows(lp.producer_url)
    assert rows["lim_lp"]["ready"] == 1 and rows["lim_lp"]["limits"] is None
    table = invoke("queues", "--url", lp.producer_url)
    assert table.exit_code == 0 and "lim_lp" in table.stdout and "limits" not in table.stdout
    assert_one_error_line(limit(lp.producer_url, "lim_lp"), "lacks the privilege")

    with connect(db_dsn) as conn:
        publish(conn, "lim_old", [1])
    limit(db_dsn, "lim_old", "--concurrency", "4")
    sql(db_dsn, "DROP FUNCTION kombu_pgmq.limits_info(text)")  # a schema without limits
    rows = queue_rows(db_dsn)
    assert rows["lim_old"]["ready"] == 1 and rows["lim_old"]["limits"] is None
    assert invoke("queues", "--url", db_dsn).exit_code == 0
    assert_one_error_line(
        limit(db_dsn, "lim_old"), "schema version 21", "kombu-pgmq schema install"
    )
