"""A Redis user's app with only ``broker_url`` changed to ``postgresql://`` (its module
never imports kombu_pgmq): a real ``celery worker`` and a producer (``add.delay``) each
end with the error docs/troubleshooting.md quotes, word for word, and the fix it gives
without the import (``broker_transport = "kombu_pgmq:Transport"``) runs the task.

kombu finds a transport by the URL's scheme in ``kombu.transport.TRANSPORT_ALIASES``, a
dict no installed package can add to (kombu reads no entry points for transports):
``import kombu_pgmq`` adds ``postgresql`` and ``postgres``. The result backend needs no
import (Celery's ``celery.result_backends`` entry points), so the app below uses it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.helpers import REPO_ROOT

TROUBLESHOOTING = REPO_ROOT / "docs" / "troubleshooting.md"

#: The app module, as a Redis user has it with only the URLs changed (no kombu_pgmq
#: import); ``APP_BROKER_TRANSPORT`` sets ``broker_transport`` (the fix without the import).
APP = """\
import os

from celery import Celery

app = Celery("tasks")
app.conf.broker_url = os.environ["APP_BROKER_URL"]
app.conf.result_backend = os.environ["APP_RESULT_BACKEND"]
if os.environ.get("APP_BROKER_TRANSPORT"):
    app.conf.broker_transport = os.environ["APP_BROKER_TRANSPORT"]


@app.task
def add(x, y):
    return x + y
"""

PRODUCER = "from tasks import add; print(add.delay(2, 3).get(timeout=60))"


@pytest.fixture
def app_dir(tmp_path: Path) -> Path:
    (tmp_path / "tasks.py").write_text(APP, encoding="utf-8")
    return tmp_path


def _env(app_dir: Path, broker_url: str, result_backend: str, **more: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("APP_", "KPT_"))}
    env.update(
        APP_BROKER_URL=broker_url,
        APP_RESULT_BACKEND=result_backend,
        PYTHONPATH=os.pathsep.join([str(app_dir), str(REPO_ROOT)]),
        PYTHONUNBUFFERED="1",
        **more,
    )
    return env


def _worker_args() -> list[str]:
    return [
        sys.executable,
        "-m",
        "celery",
        "-A",
        "tasks",
        "worker",
        "-P",
        "solo",
        "-l",
        "info",
        "--without-heartbeat",
        "--without-gossip",
        "--without-mingle",
    ]


def _run(args: list[str], env: dict[str, str], cwd: Path) -> tuple[int, list[str]]:
    done = subprocess.run(
        args,
        cwd=cwd,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=120,
    )
    return done.returncode, [line for line in (done.stdout + done.stderr).splitlines() if line]


def _quoted_errors() -> set[str]:
    """The ``KeyError`` lines docs/troubleshooting.md quotes."""
    text = TROUBLESHOOTING.read_text(encoding="utf-8")
    return {
        line.strip()
        for line in text.splitlines()
        if line.strip().startswith("KeyError: 'No such transport:")
    }


def test_without_the_import_worker_and_producer_end_with_the_documented_error(
    app_dir: Path, db_dsn: str
) -> None:
    assert TROUBLESHOOTING.exists(), "docs/troubleshooting.md quotes the error and its fix"
    quoted = _quoted_errors()
    assert "KeyError: 'No such transport: postgresql'" in quoted, quoted
    env = _env(app_dir, db_dsn, db_dsn)

    status, worker = _run(_worker_args(), env, app_dir)
    assert status == 1, worker
    assert worker[-1] in quoted, worker[-5:]
    assert worker[-1] == "KeyError: 'No such transport: postgresql'"

    status, producer = _run([sys.executable, "-c", PRODUCER], env, app_dir)
    assert status == 1, producer
    assert producer[-1] == worker[-1], producer[-5:]

    # A DATABASE_URL-style postgres:// URL: the same error, naming that scheme.
    postgres_url = "postgres://" + db_dsn.split("://", 1)[1]
    status, producer = _run(
        [sys.executable, "-c", PRODUCER], _env(app_dir, postgres_url, db_dsn), app_dir
    )
    assert status == 1, producer
    assert producer[-1] == "KeyError: 'No such transport: postgres'"
    assert producer[-1] in quoted, quoted


def test_broker_transport_runs_the_app_without_the_import(app_dir: Path, db_dsn: str) -> None:
    assert 'broker_transport = "kombu_pgmq:Transport"' in TROUBLESHOOTING.read_text(
        encoding="utf-8"
    )
    env = _env(app_dir, db_dsn, db_dsn, APP_BROKER_TRANSPORT="kombu_pgmq:Transport")
    log = app_dir / "worker.log"
    with log.open("wb") as out:
        worker = subprocess.Popen(
            _worker_args(),
            cwd=app_dir,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        # get(timeout=60) waits for the worker to start and run the task
        status, producer = _run([sys.executable, "-c", PRODUCER], env, app_dir)
        assert (status, producer[-1:]) == (0, ["5"]), (producer, log.read_text())
        assert worker.poll() is None, log.read_text()
    finally:
        os.killpg(worker.pid, signal.SIGKILL)  # its own process group (solo: one process)
        worker.wait()
