"""Fixtures of the end-to-end tests: real ``celery worker`` subprocesses on a test database.

``start_worker(**env)`` starts ``python -m celery -A tests.e2e.celery_app worker`` (prefork,
2 processes) in its own session, waits until it ran a ``ping`` task sent to a queue only it
consumes (or, with ``own_queue=False``, answered a remote-control ping), and kills its
process group at teardown (Spark tests: SIGTERM first, a warm shutdown). Worker logs
are files in ``tmp_path``; when a test fails they are appended to its report.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import psycopg
import pytest
from celery import Celery

from kombu_pgmq.results import ResultBackend
from tests.e2e import celery_app
from tests.e2e.helpers import DEFAULT_WITHOUT, REPO_ROOT, Worker

#: Processes whose logs a failed test's report shows (anything with ``name`` and ``log()``).
_WORKERS_KEY = pytest.StashKey[list[Any]]()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    """Append the worker logs of a failed test (setup or call) to its report."""
    report = yield
    if report.failed and report.when in ("setup", "call"):
        for worker in item.stash.get(_WORKERS_KEY, []):
            report.sections.append((f"celery {worker.name} log", worker.log()))
    return report


@pytest.fixture
def reported_logs(request: pytest.FixtureRequest) -> list[Any]:
    """Append a process (``name``, ``log() -> str``) to this list: a failed test's report
    shows its log (as it shows the logs of :func:`start_worker`'s workers)."""
    return request.node.stash.setdefault(_WORKERS_KEY, [])


@pytest.fixture
def e2e_env(db_dsn: str) -> dict[str, str]:
    """Environment of the worker subprocesses (and of the test process's app)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KPT_")}
    env.update(
        KPT_BROKER_URL=db_dsn,
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")])),
        PYTHONUNBUFFERED="1",
    )
    return env


@pytest.fixture
def db(db_dsn: str) -> Iterator[psycopg.Connection]:
    """Autocommit connection to the test database, with table ``e2e_runs`` created."""
    with psycopg.connect(db_dsn, autocommit=True, application_name="kpt_e2e_test") as conn:
        conn.execute(celery_app.RUNS_DDL)
        yield conn


@pytest.fixture
def app(e2e_env: dict[str, str], db: psycopg.Connection) -> Iterator[Celery]:
    """The test process's Celery app (publisher and result reader), same settings as the
    workers. With Celery's SQLAlchemy backend it creates the result tables up front, so
    worker processes never race to; kombu_pgmq's (``KPT_RESULT_BACKEND=postgresql``) is
    closed with its connections at the end."""
    instance = celery_app.create_app(e2e_env)
    backend = instance.backend
    if hasattr(backend, "ResultSession"):
        backend.ResultSession().close()
    try:
        yield instance
    finally:
        if isinstance(backend, ResultBackend):
            backend.result_consumer.stop()
            if backend._db is not None:
                backend._db.close()
        instance.close()


@pytest.fixture
def start_worker(
    request: pytest.FixtureRequest, tmp_path: Path, e2e_env: dict[str, str], app: Celery
) -> Iterator[Callable[..., Worker]]:
    """``start_worker(wait=True, *, extra_args=(), without=DEFAULT_WITHOUT, own_queue=True,
    queues=("celery",), concurrency=2, pool="prefork", app_module="tests.e2e.celery_app",
    **env_overrides) -> Worker`` (keywords as :class:`Worker`'s); every worker is stopped
    at teardown."""
    workers: list[Worker] = []
    reported = request.node.stash.setdefault(_WORKERS_KEY, [])

    def start(
        wait: bool = True,
        *,
        extra_args: Sequence[str] = (),
        without: Sequence[str] = DEFAULT_WITHOUT,
        own_queue: bool = True,
        queues: Sequence[str] = ("celery",),
        concurrency: int = 2,
        pool: str = "prefork",
        app_module: str = "tests.e2e.celery_app",
        **env_overrides: str,
    ) -> Worker:
        name = f"w{len(workers) + 1}_{uuid.uuid4().hex[:6]}"
        worker = Worker(
            name,
            {**e2e_env, **env_overrides},
            tmp_path / f"worker_{name}.log",
            extra_args=extra_args,
            without=without,
            own_queue=own_queue,
            queues=queues,
            concurrency=concurrency,
            pool=pool,
            app_module=app_module,
        )
        workers.append(worker)
        reported.append(worker)
        worker.start()
        if wait:
            worker.wait_ready(app)
        return worker

    try:
        yield start
    finally:
        if request.node.get_closest_marker("spark") is None:
            # What a test proves is done by then, and its database is dropped next: the
            # process groups are SIGKILLed (an idle worker's warm shutdown takes ~3 s).
            # Tests of shutdowns stop their workers themselves.
            for worker in workers:
                worker.kill()
        else:  # Spark workers shut their Spark sessions down on a warm shutdown
            for worker in workers:  # warm shutdowns in parallel (each takes seconds)
                worker.terminate()
            for worker in reversed(workers):
                worker.stop()
