"""``kombu-pgmq queues|messages|queue pause|resume|task find|cancel|metrics serve`` on a
real PostgreSQL: JSON for scripts, tables for people, exit statuses, one error line
naming the fix (a database without the schema), and the metrics endpoint over HTTP(S):
127.0.0.1 by default, a warning when wider without TLS or basic auth, the TLS and basic
auth options and their errors (the server itself: test_metrics_server.py).
(Unreachable databases, usage errors and ``--help`` examples: test_cli.py.)
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import re
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from kombu_pgmq import cli
from tests.support.doc_samples import check_sample

from .helpers import connect, publish
from .test_cli import REPO_ROOT, assert_one_error_line
from .test_metrics_server import get, make_certificates


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


def test_the_queues_table_the_docs_show(db_dsn: str) -> None:
    """docs/guides/operations.md shows this output (tests/support/doc_samples.py): a paused
    queue with limits, acked and dead-lettered messages, one in flight, two delayed."""
    with connect(db_dsn) as conn:
        publish(conn, "emails", list(range(20)))
        publish(conn, "orders", list(range(9)))
        publish(conn, "orders", [10, 11], headers={"x-delay": 3600})
        channel = conn.channel()
        for _ in range(6):
            channel.basic_get("emails").ack()
        for _ in range(2):
            channel.basic_get("emails").reject(requeue=False)
        for _ in range(5):
            channel.basic_get("orders").ack()
        held = channel.basic_get("orders")  # in flight while the table is read
        assert held is not None
        for command in (
            ["queue", "limit", "emails", "--concurrency", "20", "--rate", "100/s"],
            ["queue", "pause", "emails"],
        ):
            assert invoke(*command, "--url", db_dsn).exit_code == 0
        table = invoke("queues", "--url", db_dsn)
    assert table.exit_code == 0, table.output
    comment = "# --all adds Celery's pidbox/reply queues"
    check_sample(
        "queues",
        f"$ kombu-pgmq queues {comment:>52}\n{table.stdout}",
        masks=[(r"[━─]+", "━")],  # rules as wide as their column
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
    again = invoke("task", "cancel", task_id, "--url", db_dsn)  # queued no more: revoked
    assert again.exit_code == 0, again.output
    assert "in no queue of this database" in again.stdout and "task find" in again.stdout
    assert f"{task_id} revoked: sent to every worker" in again.stdout
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
            "kombu_pgmq",
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
                "kombu_pgmq",
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


class Served:
    """A ``kombu-pgmq metrics serve`` subprocess: ``line`` its first line of stdout,
    ``url`` its /metrics; after the ``with`` block, ``returncode`` and ``stderr``."""

    line = url = stderr = ""
    returncode: int | None = None


@contextlib.contextmanager
def metrics_serve(*args: str, env: dict[str, str] | None = None) -> Iterator[Served]:
    """Run ``kombu-pgmq metrics serve --port 0 ARGS`` until it serves (``url``: on
    127.0.0.1 whatever the host); SIGTERM after."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "kombu_pgmq", "metrics", "serve", "--port", "0", *args],
        cwd=REPO_ROOT,
        env={**os.environ, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    served = Served()
    try:
        assert proc.stdout is not None
        served.line = proc.stdout.readline()
        match = re.match(r"serving kombu_pgmq metrics on (\S+) ", served.line)
        assert match, (served.line, proc.communicate(timeout=20))
        served.url = match.group(1).replace("://0.0.0.0:", "://127.0.0.1:")
        yield served
    finally:
        proc.send_signal(signal.SIGTERM)
        _, served.stderr = proc.communicate(timeout=20)
        served.returncode = proc.returncode


def test_metrics_serve_defaults_to_loopback_and_warns_when_wider(db_dsn: str) -> None:
    with metrics_serve("--url", db_dsn) as local:
        assert local.line.startswith("serving kombu_pgmq metrics on http://127.0.0.1:"), local.line
        assert "snapshot cached 5s" in local.line
        assert get(local.url)[0] == 200
    assert local.returncode == 0 and "WARNING" not in local.stderr, local.stderr

    env = {"KOMBU_PGMQ_METRICS_PASSWORD": "hunter2-secret"}
    with metrics_serve(
        "--url", db_dsn, "--host", "0.0.0.0", "--basic-auth-user", "prom", env=env
    ) as wide:
        assert wide.line.startswith("serving kombu_pgmq metrics on http://0.0.0.0:"), wide.line
        assert "basic auth as prom" in wide.line
        assert get(wide.url)[0] == 401
        assert get(wide.url, auth=("prom", "hunter2-secret"))[0] == 200
    assert wide.returncode == 0, wide.stderr
    warning = [line for line in wide.stderr.splitlines() if "WARNING" in line]
    assert len(warning) == 1 and "serving 0.0.0.0 port" in warning[0], wide.stderr
    assert "without TLS" in warning[0] and "without basic auth" not in warning[0]
    assert "--tls-cert" in warning[0]
    assert "hunter2" not in wide.line + wide.stderr


def test_metrics_serve_https_with_basic_auth_from_a_password_file(
    db_dsn: str, tmp_path: Path
) -> None:
    certs = make_certificates(tmp_path)
    password_file = tmp_path / "password"
    password_file.write_text("s3cret-from-file\n")  # the final newline is not part of it
    with connect(db_dsn) as conn:
        publish(conn, "cli_tls", [1, 2, 3])
    with metrics_serve(
        "--url", db_dsn, "--host", "0.0.0.0", "--cache-seconds", "0",
        "--tls-cert", str(certs.server_cert), "--tls-key", str(certs.server_key),
        "--basic-auth-user", "prom", "--basic-auth-password-file", str(password_file),
    ) as served:  # fmt: skip
        assert served.line.startswith("serving kombu_pgmq metrics on https://0.0.0.0:")
        assert "(TLS, basic auth as prom, snapshot cached 0s;" in served.line
        context = ssl.create_default_context(cafile=str(certs.server_cert))
        assert get(served.url, context=context)[0] == 401
        status, _, body = get(served.url, context=context, auth=("prom", "s3cret-from-file"))
        assert status == 200
        assert 'kombu_pgmq_queue_messages{queue="cli_tls",state="ready"} 3.0' in body
        with pytest.raises((OSError, http.client.HTTPException)):
            get(served.url.replace("https://", "http://"))
    assert served.returncode == 0, served.stderr
    assert "WARNING" not in served.stderr and "s3cret" not in served.stderr, served.stderr


def test_metrics_serve_bad_tls_or_auth_options_are_one_error_line(
    db_dsn: str, tmp_path: Path
) -> None:
    certs = make_certificates(tmp_path)
    cert, key, ca = str(certs.server_cert), str(certs.server_key), str(certs.ca_cert)
    empty = tmp_path / "empty"
    empty.write_text("\n")
    password = tmp_path / "password"
    password.write_text("hunter2-secret")
    no_env = {"KOMBU_PGMQ_METRICS_PASSWORD": None}

    def serve_with(*args: str, env: dict[str, str | None] = no_env) -> Result:
        return CliRunner().invoke(cli.main, ["metrics", "serve", "--url", db_dsn, *args], env=env)

    for args, fragments in [
        (["--tls-cert", cert], ["--tls-cert needs --tls-key"]),
        (["--tls-key", key], ["--tls-key needs --tls-cert"]),
        (["--tls-client-ca", ca], ["--tls-client-ca needs --tls-cert and --tls-key"]),
        (["--tls-cert", "/no/such.crt", "--tls-key", key], ["--tls-cert", "No such file"]),
        (
            ["--tls-cert", cert, "--tls-key", key, "--tls-client-ca", "/no/ca.crt"],
            ["--tls-client-ca /no/ca.crt", "No such file"],
        ),
        (
            ["--tls-cert", cert, "--tls-key", str(certs.client_key)],
            ["--tls-cert", "--tls-key", "KEY_VALUES_MISMATCH", "key matching the certificate"],
        ),
        (
            ["--basic-auth-user", "prom"],
            ["--basic-auth-password-file FILE or $KOMBU_PGMQ_METRICS_PASSWORD"],
        ),
        (["--basic-auth-user", "prom", "--basic-auth-password-file", str(empty)], ["is empty"]),
        (
            ["--basic-auth-user", "prom", "--basic-auth-password-file", "/no/pw"],
            ["--basic-auth-password-file /no/pw", "No such file"],
        ),
        (["--basic-auth-password-file", str(password)], ["needs --basic-auth-user"]),
        (
            ["--basic-auth-user", "a:b", "--basic-auth-password-file", str(password)],
            ["--basic-auth-user", "without ':'"],
        ),
    ]:
        result = serve_with(*args)
        assert_one_error_line(result, *fragments)
        assert "hunter2" not in result.output
    assert_one_error_line(
        serve_with(env={"KOMBU_PGMQ_METRICS_PASSWORD": "hunter2-secret"}),
        "$KOMBU_PGMQ_METRICS_PASSWORD is set but --basic-auth-user is not",
    )
    usage = serve_with("--cache-seconds", "-1")
    assert usage.exit_code == 2 and "--cache-seconds" in usage.output
    both = serve_with("--host", "0.0.0.0", "--addr", "127.0.0.1")
    assert both.exit_code == 2 and "--addr is the old name of --host" in both.output
