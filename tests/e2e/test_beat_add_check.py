"""End to end: ``kombu-pgmq beat add`` asks the workers running on the database which
tasks they register (Celery's remote control, as ``celery inspect registered``): a name
none registers is refused, naming the workers and the close name, before anything is
stored; a registered name, or ``--force``, is added."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable

import psycopg
import pytest

from tests.e2e.helpers import REPO_ROOT, Worker

pytestmark = [pytest.mark.e2e, pytest.mark.integration]


def beat_add(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kombu_pgmq", "beat", "add", *args, "--every", "60"],
        env=env,
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


def entries(db: psycopg.Connection) -> set[str]:
    return {row[0] for row in db.execute("SELECT name FROM kombu_pgmq.beat_entries")}


def test_a_task_no_running_worker_registers_is_refused(
    e2e_env: dict[str, str],
    db_dsn: str,
    db: psycopg.Connection,
    start_worker: Callable[..., Worker],
) -> None:
    worker = start_worker()
    env = {**e2e_env, "KOMBU_PGMQ_URL": db_dsn}
    refused = beat_add(env, "nightly", "e2e.recrod")
    assert refused.returncode == 1, refused.stderr
    error = refused.stderr.splitlines()[-1]
    assert error.startswith("error: task 'e2e.recrod' is not registered by any running "), error
    assert f"({worker.node})" in error and "did you mean 'e2e.record'?" in error
    assert "give --force" in error
    assert "nightly" not in entries(db)

    added = beat_add(env, "nightly", "e2e.record")
    assert added.returncode == 0, added.stderr
    assert "warning" not in added.stderr
    forced = beat_add(env, "later", "deploy.later", "--force")
    assert forced.returncode == 0, forced.stderr
    assert {"nightly", "later"} <= entries(db)
