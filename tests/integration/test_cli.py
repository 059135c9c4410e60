"""``kombu-pgmq schema|embedded`` and what every command group shares: exit statuses
(0 ok, 1 error on one ``error:`` line naming the fix, 2 usage), the ``--url`` default,
an example in every ``--help``, and ``python -m kombu_pgmq`` (the one other way to run it).

The dlq and archive commands themselves are tested in test_dlq.py; the embedded server is
never started or stopped here (see test_embedded.py).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import click
import pytest
from click.testing import CliRunner, Result

from kombu_pgmq import cli, embedded, schema
from kombu_pgmq._db.queries import migrations

from .helpers import sql

REPO_ROOT = Path(__file__).resolve().parents[2]
#: Nothing listens on port 1: the connection is refused at once.
UNREACHABLE = "postgresql://postgres@127.0.0.1:1/x"
LATEST = len(migrations())


def invoke(*args: str, env: dict[str, str | None] | None = None) -> Result:
    return CliRunner().invoke(cli.main, list(args), env=env)


def assert_one_error_line(result: Result, *fragments: str) -> None:
    """Exit status 1, stderr one ``error: ...`` line holding ``fragments``, no traceback."""
    assert result.exit_code == 1, (result.output, result.exception)
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(
        result.exception
    )
    lines = result.stderr.splitlines()
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
    assert after.stdout.splitlines()[-1] == "ready" and after.stderr == ""

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
    assert from_kombu_url.exit_code == 0 and db_dsn in from_kombu_url.stdout
    from_database_url = invoke(
        "schema", "status", env={"KOMBU_PGMQ_URL": None, "DATABASE_URL": db_dsn}
    )
    assert from_database_url.exit_code == 0 and db_dsn in from_database_url.stdout
    given = invoke("schema", "status", "--url", db_dsn, env={"KOMBU_PGMQ_URL": UNREACHABLE})
    assert given.exit_code == 0, given.output


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
