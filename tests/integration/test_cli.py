"""``kombu-pgmq schema|embedded`` and what every command group shares: exit statuses
(0 ok, 1 error on one ``error:`` line naming the fix, 2 usage), the ``--url`` default,
an example in every ``--help``, and ``python -m kombu_pgmq`` (the one other way to run it).

The dlq and archive commands themselves are tested in test_dlq.py; the embedded server is
never started or stopped here (see test_embedded.py).
"""

from __future__ import annotations

import getpass
import json
import subprocess
import sys
import uuid
from pathlib import Path

import click
import pytest
from click.testing import CliRunner, Result
from psycopg.conninfo import conninfo_to_dict

from kombu_pgmq import cli, embedded, schema
from kombu_pgmq._conninfo import redact
from kombu_pgmq._db.queries import migrations
from tests.support import pgserver

from .helpers import sql

REPO_ROOT = Path(__file__).resolve().parents[2]
#: Nothing listens on port 1: the connection is refused at once.
UNREACHABLE = "postgresql://postgres@127.0.0.1:1/x"
LATEST = len(migrations())


def invoke(*args: str, env: dict[str, str | None] | None = None) -> Result:
    return CliRunner().invoke(cli.main, list(args), env=env)


def assert_one_error_line(result: Result, *fragments: str) -> None:
    """Exit status 1, stderr one ``error: ...`` line holding ``fragments`` (after the
    ``database: ...`` line of a command that got as far as choosing one), no traceback."""
    assert result.exit_code == 1, (result.output, result.exception)
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(
        result.exception
    )
    lines = result.stderr.splitlines()
    if lines and lines[0].startswith("database: "):
        lines = lines[1:]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.output
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def test_schema_status_install_status(empty_db_dsn: str) -> None:
    before = invoke("schema", "status", "--url", empty_db_dsn)
    assert "PGMQ:              not installed" in before.stdout, before.stdout
    assert f"version 0 (this release needs {LATEST})" in before.stdout
    assert_one_error_line(
        before,
        "PGMQ is not installed",
        f"this release needs {LATEST}",
        f"run kombu-pgmq schema install --url {empty_db_dsn}",
    )

    installed = invoke("schema", "install", "--url", empty_db_dsn)
    assert installed.exit_code == 0, installed.output
    assert installed.stdout.strip() == (
        f"{empty_db_dsn}: PGMQ {schema.status(empty_db_dsn).pgmq_version} (install_sql), "
        f"kombu_pgmq schema version {LATEST}, applied now: {list(range(1, LATEST + 1))}"
    )

    after = invoke("schema", "status", "--url", empty_db_dsn)
    assert after.exit_code == 0, after.output
    assert "(SQL-only, no extension)" in after.stdout
    assert f"version {LATEST} (this release needs {LATEST})" in after.stdout
    assert after.stdout.splitlines()[-1] == "ready"
    assert after.stderr == f"database: {redact(empty_db_dsn)}\n"

    again = invoke("schema", "install", "--url", empty_db_dsn)
    assert again.exit_code == 0 and "applied now: nothing" in again.stdout


def test_schema_status_of_an_older_schema_and_pgmq(db_dsn: str) -> None:
    sql(db_dsn, "DELETE FROM kombu_pgmq.migrations WHERE version = %s", (LATEST,))
    behind = invoke("schema", "status", "--url", db_dsn)
    assert_one_error_line(
        behind,
        f"kombu_pgmq schema is at version {LATEST - 1}, this release needs {LATEST}",
        "kombu-pgmq schema install --url",
    )
    # A PGMQ without a function kombu_pgmq calls: install would not fix it, the message
    # says what does.
    sql(db_dsn, "ALTER FUNCTION pgmq.pop(text, integer) RENAME TO pop_renamed")
    old = invoke("schema", "status", "--url", db_dsn)
    assert_one_error_line(old, "pgmq.pop(text,integer)", "ALTER EXTENSION pgmq UPDATE")
    state = schema.status(db_dsn)
    assert not state.ready and state.pgmq_problem and state.schema_version == LATEST - 1


def test_url_defaults_to_kombu_pgmq_url_then_database_url(db_dsn: str) -> None:
    from_kombu_url = invoke("schema", "status", env={"KOMBU_PGMQ_URL": db_dsn})
    assert from_kombu_url.exit_code == 0, from_kombu_url.output
    assert from_kombu_url.stderr == f"database: {redact(db_dsn)}\n"
    from_database_url = invoke(
        "schema", "status", env={"KOMBU_PGMQ_URL": None, "DATABASE_URL": db_dsn}
    )
    assert from_database_url.exit_code == 0, from_database_url.output
    assert from_database_url.stderr == f"database: {redact(db_dsn)}\n"
    given = invoke("schema", "status", "--url", db_dsn, env={"KOMBU_PGMQ_URL": UNREACHABLE})
    assert given.exit_code == 0, given.output


DATABASE_COMMANDS = [
    ["schema", "install"],
    ["schema", "status"],
    ["schema", "grant", "--list"],
    ["dlq", "list"],
    ["dlq", "replay", "--all"],
    ["dlq", "purge", "--all", "--yes"],
    ["archive", "prune", "--older-than", "7d"],
    ["queues"],
    ["messages", "celery"],
    ["queue", "pause", "celery"],
    ["queue", "resume", "celery"],
    ["task", "find", "0b5c4a9e"],
    ["task", "cancel", "0b5c4a9e"],
    ["metrics", "serve", "--port", "0"],
]


@pytest.fixture
def no_database(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[None]:
    """No URL in the environment and no embedded server running (an empty data
    directory); ``embedded.start`` replaced by a stub that records its calls."""
    for name in ("KOMBU_PGMQ_URL", "DATABASE_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(embedded.ENV_DIR, str(tmp_path / "embedded"))
    started: list[None] = []
    monkeypatch.setattr(embedded, "start", lambda: started.append(None) or UNREACHABLE)
    return started


@pytest.mark.parametrize("command", DATABASE_COMMANDS, ids=" ".join)
def test_no_database_is_one_line_and_starts_nothing(
    no_database: list[None], command: list[str]
) -> None:
    result = invoke(*command)
    assert_one_error_line(result, cli._base.NO_DATABASE)
    assert result.stderr == f"error: {cli._base.NO_DATABASE}\n"
    assert no_database == []  # the embedded server was not started


def test_embedded_flag_starts_the_embedded_server(no_database: list[None]) -> None:
    result = invoke("queues", "--embedded")  # the stub's URL: nothing listens there
    assert no_database == [None]
    assert result.stderr.splitlines()[0] == (
        f"database: {UNREACHABLE} (the embedded PostgreSQL, --embedded)"
    )
    assert_one_error_line(result, "check the URL")
    both = invoke("queues", "--embedded", "--url", UNREACHABLE)
    assert both.exit_code == 2 and "give one of them" in both.stderr, both.output
    assert no_database == [None]
    # --embedded wins over a URL of the environment (it is the explicit choice)
    from_env = invoke("queues", "--embedded", env={"KOMBU_PGMQ_URL": "postgresql://x@y/z"})
    assert no_database == [None, None] and "postgresql://x@y/z" not in from_env.output


def test_a_running_embedded_server_is_used_and_named(
    no_database: list[None], db_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(embedded, "running_url", lambda: db_dsn)
    result = invoke("schema", "status")
    assert result.exit_code == 0, result.output
    assert result.stderr == (
        f"database: {redact(db_dsn)} (the embedded PostgreSQL, running; no --url given)\n"
    )
    assert no_database == []


def _with_password(dsn: str, password: str) -> str:
    """``dsn`` as a URL with ``password`` added (the test servers trust: it is ignored)."""
    params = conninfo_to_dict(dsn)
    user = str(params.get("user") or getpass.getuser())
    return pgserver.database_url(dsn, str(params["dbname"]), user=user, password=password)


@pytest.mark.parametrize(
    "command",
    [
        ["queues", "--json"],
        ["dlq", "list", "--json"],
        ["task", "find", "0b5c4a9e", "--json"],
        ["schema", "status"],
        ["archive", "prune", "--older-than", "7d"],
    ],
    ids=" ".join,
)
def test_commands_name_their_database_on_stderr_without_password(
    db_dsn: str, command: list[str]
) -> None:
    secret_url = _with_password(db_dsn, "s3cretpw")
    for result in (
        invoke(*command, "--url", secret_url),
        invoke(*command, env={"KOMBU_PGMQ_URL": secret_url}),
    ):
        assert "s3cretpw" not in result.output + result.stderr, result.output
        assert result.stderr.splitlines()[0] == f"database: {redact(secret_url)}"
        assert ":**@" in result.stderr.splitlines()[0]
        if "--json" in command:  # stdout stays JSON lines (or nothing)
            for line in result.stdout.splitlines():
                json.loads(line)


@pytest.mark.parametrize(
    "command",
    [
        ["schema", "install"],
        ["schema", "status"],
        ["dlq", "list"],
        ["dlq", "replay", "--all"],
        ["dlq", "purge", "--all", "--yes"],
        ["archive", "prune", "--older-than", "7d"],
        ["queues"],
        ["messages", "celery"],
        ["queue", "pause", "celery"],
        ["queue", "resume", "celery"],
        ["task", "find", "0b5c4a9e"],
        ["task", "cancel", "0b5c4a9e"],
        ["metrics", "serve", "--port", "0"],
    ],
    ids=" ".join,
)
def test_unreachable_database_is_one_line_naming_the_fix(command: list[str]) -> None:
    result = invoke(*command, "--url", UNREACHABLE)
    assert_one_error_line(
        result, "Connection refused", UNREACHABLE, "check the URL", "$KOMBU_PGMQ_URL"
    )
    from_env = invoke(*command, env={"KOMBU_PGMQ_URL": UNREACHABLE})
    assert_one_error_line(from_env, UNREACHABLE, "check the URL")


@pytest.mark.parametrize(
    "command", [["queues"], ["schema", "status"], ["dlq", "list"]], ids=" ".join
)
def test_a_missing_database_is_one_line_naming_createdb(pg_server: str, command: list[str]) -> None:
    """The server answered and refused: the message names the database and createdb,
    not "check that the server is running" (it is)."""
    name = f"kpt_missing_{uuid.uuid4().hex[:12]}"  # never created
    result = invoke(*command, "--url", pgserver.database_url(pg_server, name))
    assert_one_error_line(result, f'database "{name}" does not exist', "(createdb ")
    assert "server is running" not in result.stderr


@pytest.mark.parametrize(
    ("command", "message"),
    [
        (["queue", "pause", "cli_nosuch"], 'queue "cli_nosuch" is not declared'),
        (["queue", "resume", "cli_nosuch"], 'queue "cli_nosuch" is not declared'),
        (["messages", "cli_nosuch"], 'queue "cli_nosuch" does not exist'),
    ],
    ids=lambda v: " ".join(v) if isinstance(v, list) else "",
)
def test_a_server_error_is_one_line_without_its_plpgsql_context(
    db_dsn: str, command: list[str], message: str
) -> None:
    """The server's message says what is wrong and the fix; its CONTEXT (the PL/pgSQL
    call stack) and the translation's prefixes are noise on a terminal."""
    result = invoke(*command, "--url", db_dsn)
    assert_one_error_line(result)
    error = result.stderr.splitlines()[-1]
    assert error == f"error: {message} (see kombu-pgmq queues)", result.stderr
    for noise in ("CONTEXT", "PL/pgSQL", "kombu_pgmq:", "queue table does not exist"):
        assert noise not in result.stderr, result.stderr


def test_an_invalid_url_is_one_line() -> None:
    assert_one_error_line(invoke("schema", "status", "--url", "http://db/x"), "postgresql://")


@pytest.mark.parametrize(
    "command",
    [
        ["schema", "status", "--bogus"],
        ["schema", "migrate"],
        ["archive", "prune"],  # --older-than is required
        ["embedded", "restart"],
        ["dlq", "list", "--reason", "bored"],
        ["messages"],  # QUEUE is required
        ["queue", "stop", "celery"],
        ["task", "cancel"],
    ],
    ids=" ".join,
)
def test_usage_errors_exit_2(command: list[str]) -> None:
    result = invoke(*command)
    assert result.exit_code == 2, result.output
    assert "Usage:" in result.stderr


def test_embedded_status_of_an_empty_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(embedded.ENV_DIR, str(tmp_path))
    result = invoke("embedded", "status")
    assert result.exit_code == 1, result.output
    assert result.stdout.splitlines() == [f"data_dir: {tmp_path}", "running:  no"]


def _commands(
    command: click.Command, path: tuple[str, ...] = ()
) -> list[tuple[tuple[str, ...], click.Command]]:
    found = [(path, command)]
    if isinstance(command, click.Group):
        for name, sub in sorted(command.commands.items()):
            found += _commands(sub, (*path, name))
    return found


def test_every_help_has_an_example() -> None:
    commands = _commands(cli.main)
    assert {("schema", "install"), ("schema", "status"), ("embedded", "url")} <= {
        path for path, _ in commands
    }
    for path, _ in commands:
        result = invoke(*path, "--help")
        assert result.exit_code == 0, (path, result.output)
        examples = result.stdout.split("Examples:\n", 1)
        assert len(examples) == 2, (path, result.stdout)
        assert " ".join(("kombu-pgmq", *path)) in examples[1], (path, result.stdout)


def test_python_m_kombu_pgmq_is_the_command(empty_db_dsn: str) -> None:
    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "kombu_pgmq", *args],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=REPO_ROOT,
        )

    installed = run("schema", "install", "--url", empty_db_dsn)
    assert installed.returncode == 0, installed.stderr
    assert f"applied now: {list(range(1, LATEST + 1))}" in installed.stdout
    status = run("schema", "status", "--url", empty_db_dsn)
    assert status.returncode == 0 and status.stdout.splitlines()[-1] == "ready", status.stdout
    unreachable = run("schema", "install", "--url", UNREACHABLE)
    assert unreachable.returncode == 1 and unreachable.stdout == ""
    assert "check the URL" in unreachable.stderr.splitlines()[-1], unreachable.stderr
    usage = run("schema", "install", empty_db_dsn)
    assert usage.returncode == 2 and "Usage: kombu-pgmq schema install" in usage.stderr
    helped = run("--help")
    assert helped.returncode == 0 and "Usage: kombu-pgmq [OPTIONS] COMMAND" in helped.stdout


def test_schema_grant_list_and_revoke(least_privilege_db) -> None:
    db = least_privilege_db
    listed = invoke("schema", "grant", "--list", "--url", db.owner_url)
    assert listed.exit_code == 0, listed.output
    assert sorted(listed.stdout.split("\n")[:2]) == sorted(
        [f"{db.producer}\tproducer", f"{db.worker}\tworker"]
    )
    assert invoke("schema", "grant", "--revoke", db.producer, "--url", db.owner_url).exit_code == 0
    again = invoke("schema", "grant", "producer", db.producer, "--url", db.owner_url)
    assert again.exit_code == 0 and f"granted producer privileges to {db.producer}" in again.stdout
    missing = invoke("schema", "grant", "worker", "no_such_role_kpt", "--url", db.owner_url)
    assert_one_error_line(missing, "no_such_role_kpt does not exist", "CREATE ROLE")
    not_owner = invoke("schema", "grant", "worker", db.producer, "--url", db.worker_url)
    assert not_owner.exit_code == 1 and "error:" in not_owner.stderr
    usage = invoke("schema", "grant", "worker", "--url", db.owner_url)
    assert usage.exit_code == 2
