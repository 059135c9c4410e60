"""``kombu-pgmq beat add`` checks TASK when it is added, as a Celery user expects (a
misspelled name must not wait for a worker's log to show up): with ``-A APP`` against the
app's registered tasks (a close name suggested; the app's schedule database is the default
URL); without it, against the workers running on the database (none here: added with a
warning saying it was not checked; running workers: tests/e2e/test_beat_add_check.py);
``--force`` adds it unchecked. Celery's built-in tasks are always known."""

from __future__ import annotations

import pytest
from click.testing import CliRunner, Result

from kombu_pgmq import cli
from kombu_pgmq.beat import PeriodicTasks

from .test_cli import assert_one_error_line

APP = "tests.integration.beat_cli_app"


def add(*args: str, env: dict[str, str | None] | None = None) -> Result:
    return CliRunner().invoke(
        cli.main, ["beat", "add", *args, "--every", "60"], env=env, prog_name="kombu-pgmq"
    )


def names(url: str) -> set[str]:
    with PeriodicTasks(url) as tasks:
        return {entry.name for entry in tasks.all()}


def test_with_the_app_a_task_it_does_not_register_is_refused(db_dsn: str) -> None:
    refused = add("r1", "beatcli.reprot", "-A", APP, "--url", db_dsn)
    assert_one_error_line(
        refused,
        "task 'beatcli.reprot' is not registered in app 'beat_cli_app'",
        "did you mean 'beatcli.report'?",
        "give --force to add it anyway",
    )
    assert "r1" not in names(db_dsn)
    ok = add("r2", "beatcli.report", "-A", APP, "--url", db_dsn)
    assert ok.exit_code == 0 and ok.stderr.count("\n") == 1, ok.output  # the database line
    forced = add("r3", "beatcli.reprot", "-A", APP, "--url", db_dsn, "--force")
    assert forced.exit_code == 0, forced.output
    builtin = add("r4", "celery.backend_cleanup", "-A", APP, "--url", db_dsn)
    assert builtin.exit_code == 0, builtin.output
    assert {"r2", "r3", "r4"} <= names(db_dsn)


def test_the_apps_database_is_the_default_url(db_dsn: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.integration import beat_cli_app

    monkeypatch.setattr(beat_cli_app.app.conf, "broker_url", db_dsn)
    result = add("d1", "beatcli.noop", "-A", APP, env={"KOMBU_PGMQ_URL": None})
    assert result.exit_code == 0, result.output
    assert "d1" in names(db_dsn)


@pytest.mark.parametrize(
    ("app", "fragment"),
    [
        ("tests.integration.no_such_module", "cannot find the Celery app"),
        ("tests.integration.beat_cli_app:nope", "cannot find the Celery app"),
    ],
)
def test_an_app_that_cannot_be_loaded_is_a_usage_error(
    db_dsn: str, app: str, fragment: str
) -> None:
    result = add("x", "beatcli.noop", "-A", app, "--url", db_dsn)
    assert result.exit_code == 2, result.output
    assert "Invalid value for '-A' / '--app'" in result.stderr and fragment in result.stderr


def test_without_the_app_and_no_worker_running_it_is_added_with_a_warning(db_dsn: str) -> None:
    result = add("w1", "anything.at_all", "--url", db_dsn)
    assert result.exit_code == 0, result.output
    assert (
        "warning: no worker runs on this database: task 'anything.at_all' is not checked"
        in result.stderr
    )
    assert "w1" in names(db_dsn)
    forced = add("w2", "anything.at_all", "--url", db_dsn, "--force")
    assert forced.exit_code == 0 and "warning" not in forced.stderr, forced.output


def test_the_api_refuses_an_unregistered_task_unless_told_not_to_check(db_dsn: str) -> None:
    from kombu_pgmq.beat.entries import UnregisteredTask
    from tests.integration.beat_cli_app import app

    with (
        PeriodicTasks(db_dsn, app=app) as tasks,
        pytest.raises(UnregisteredTask, match=r"did you mean 'beatcli\.noop'"),
    ):
        tasks.add("a1", "beatcli.nop", 60)
    with PeriodicTasks(db_dsn, app=app, check_tasks=False) as tasks:
        tasks.add("a2", "beatcli.nop", 60)
    assert names(db_dsn) == {"a2"}
