"""``kombu-pgmq queues|messages|queue pause|resume|task find|cancel|metrics serve`` on a
real PostgreSQL: JSON for scripts, tables for people, exit statuses, one error line
naming the fix (a database without the schema), and the metrics endpoint over HTTP.
(Unreachable databases, usage errors and ``--help`` examples: test_cli.py.)
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid

from click.testing import CliRunner, Result

from kombu_pgmq import cli

from .helpers import connect, publish
from .test_cli import REPO_ROOT, assert_one_error_line


def invoke(*args: str) -> Result:
    return CliRunner().invoke(cli.main, list(args))


def lines(result: Result) -> list[dict]:
    assert result.exit_code == 0, (result.output, result.exception)
    return [json.loads(line) for line in result.stdout.splitlines()]


def test_queues_and_messages_as_json_and_tables(db_dsn: str) -> None:
    task_id = str(uuid.uuid4())
    with connect(db_dsn) as conn:
        publish(
            conn,
            "cli_orders",
            [{"order": 7}],
            headers={"task": "shop.confirm", "id": task_id, "argsrepr": "(7,)"},
        )
        publish(conn, "cli_orders", [{"order": 8}])
        conn.channel().queue_declare("w1@host.celery.pidbox", auto_delete=True)
    rows = {r["queue"]: r for r in lines(invoke("queues", "--url", db_dsn, "--json"))}
    assert rows["cli_orders"]["ready"] == 2 and rows["cli_orders"]["in_flight"] == 0
    assert "w1@host.celery.pidbox" not in rows
    assert "w1@host.celery.pidbox" in {
        r["queue"] for r in lines(invoke("queues", "--url", db_dsn, "--all", "--json"))
    }
    table = invoke("queues", "--url", db_dsn)
    assert table.exit_code == 0 and "cli_orders" in table.stdout and "in flight" in table.stdout

    peeked = lines(invoke("messages", "cli_orders", "--url", db_dsn, "--json"))
    assert [(m["task"], m["task_id"], m["args"], m["read_ct"]) for m in peeked] == [
        ("shop.confirm", task_id, "(7,)", 0),
        (None, None, '{"order": 8}', 0),
    ]
    shown = invoke("messages", "cli_orders", "--url", db_dsn, "--limit", "1")
    assert (
        shown.exit_code == 0
        and "shop.confirm" in shown.stdout
        and '{"order": 8}' not in shown.stdout
    )
    assert_one_error_line(
        invoke("messages", "cli_nothing", "--url", db_dsn), "cli_nothing", "kombu-pgmq queues"
    )


def test_pause_resume_and_task_find_cancel(db_dsn: str) -> None:
    task_id = str(uuid.uuid4())
    with connect(db_dsn) as conn:
        publish(conn, "cli_jobs", [1], headers={"task": "jobs.run", "id": task_id})
    paused = invoke("queue", "pause", "cli_jobs", "--url", db_dsn)
    assert paused.exit_code == 0 and "paused cli_jobs" in paused.stdout
    assert lines(invoke("queues", "--url", db_dsn, "--json"))[0]["paused"] is True
    assert "paused" in invoke("queues", "--url", db_dsn).stdout
    assert (
        invoke("queue", "resume", "cli_jobs", "--url", db_dsn).stdout.strip() == "resumed cli_jobs"
    )
    assert (
        invoke("queue", "resume", "cli_jobs", "--url", db_dsn).stdout.strip()
        == "cli_jobs was not paused"
    )
    assert_one_error_line(
        invoke("queue", "pause", "cli_unknown", "--url", db_dsn), "cli_unknown", "not declared"
    )

    found = lines(invoke("task", "find", task_id, "--url", db_dsn, "--json"))
    assert [(f["queue"], f["state"], f["task"]) for f in found] == [
        ("cli_jobs", "ready", "jobs.run")
    ]
    cancelled = invoke("task", "cancel", task_id, "--url", db_dsn, "--no-revoke")
    assert cancelled.exit_code == 0 and "archived (reason cancelled)" in cancelled.stdout
    found = lines(invoke("task", "find", task_id, "--url", db_dsn, "--json"))
    assert [(f["state"], f["reason"]) for f in found] == [("archived", "cancelled")]
    assert_one_error_line(
        invoke("task", "cancel", task_id, "--url", db_dsn), "not queued", "task find"
    )
    assert_one_error_line(
        invoke("task", "find", "no-such-task", "--url", db_dsn), "no-such-task", "no queue"
    )


def test_a_database_without_the_schema_names_the_fix(empty_db_dsn: str) -> None:
    for command in (["queues"], ["messages", "celery"], ["task", "find", "x"]):
        assert_one_error_line(invoke(*command, "--url", empty_db_dsn), "kombu-pgmq schema install")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_metrics_serve_answers_scrapes_and_stops_on_sigterm(db_dsn: str) -> None:
    with connect(db_dsn) as conn:
        publish(conn, "cli_scraped", [1, 2, 3])
    port = _free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kombu_pgmq.cli",
            "metrics",
            "serve",
            "--url",
            db_dsn,
            "--port",
            str(port),
            "--addr",
            "127.0.0.1",
        ],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        body = ""
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                    body = r.read().decode()
                break
            except OSError:
                assert proc.poll() is None, proc.communicate()
                time.sleep(0.2)
        assert 'kombu_pgmq_queue_messages{queue="cli_scraped",state="ready"} 3.0' in body, body
        assert "kombu_pgmq_up 1.0" in body
        taken = subprocess.run(
            [
                sys.executable,
                "-m",
                "kombu_pgmq.cli",
                "metrics",
                "serve",
                "--url",
                db_dsn,
                "--port",
                str(port),
                "--addr",
                "127.0.0.1",
            ],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert taken.returncode == 1 and "choose another --port" in taken.stderr, taken.stderr
    finally:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=20)
    assert proc.returncode == 0, err
    assert f"serving kombu_pgmq metrics on http://127.0.0.1:{port}/metrics" in out
