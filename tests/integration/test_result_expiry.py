"""Expired results are deleted without Celery beat (kombu_pgmq.results.expiry): the sweep
service on a real PostgreSQL, its start on ``worker_ready`` (one per process, off with
``expire_interval_seconds=0``), and ``celery.backend_cleanup``'s ``backend.cleanup()``."""

from __future__ import annotations

import time
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import psycopg
import pytest
from celery import Celery

from kombu_pgmq import _worker_checks
from kombu_pgmq.results import ResultBackend, expiry

_apps: list[Celery] = []


def make_app(url: str, **options: Any) -> Celery:
    app = Celery("expiry", set_as_current=False)
    _apps.append(app)
    app.conf.update(
        broker_url=url,
        result_backend=url,
        result_expires=1,
        result_backend_transport_options=options,
    )
    return app


def count(url: str) -> int:
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute("SELECT count(*) FROM kombu_pgmq.results").fetchone()
    assert row is not None
    return int(row[0])


def store(backend: ResultBackend, n: int, prefix: str = "t") -> None:
    for i in range(n):
        backend.mark_as_done(f"{prefix}-{i}", i)


@pytest.fixture(autouse=True)
def _no_sweep_left() -> Iterator[None]:
    yield
    expiry.stop()
    while _apps:  # the backend has no close(): its connection, then Celery's pools
        backend = _apps.pop()._local.__dict__.get("backend")
        if backend is not None and backend._db is not None:
            backend._db.close()


def wait_for(predicate: Any, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return bool(predicate())


def test_sweep_deletes_expired_results_in_batches(db_dsn: str) -> None:
    backend = make_app(db_dsn).backend
    assert isinstance(backend, ResultBackend)
    store(backend, 25)
    backend.expires = None  # these never expire
    store(backend, 3, prefix="kept")
    assert count(db_dsn) == 28
    time.sleep(1.2)
    service = expiry.ResultExpiry(backend.dsn, interval_seconds=0.2, batch=4)
    service.start()
    try:
        # The round's count is added after its last DELETE commits: wait for the count.
        assert wait_for(lambda: service.deleted >= 25), service.deleted
        assert service.deleted == 25
        assert count(db_dsn) == 3
    finally:
        service.close()
    assert backend.get_task_meta("kept-0")["status"] == "SUCCESS"


def test_sweep_holds_no_connection_between_rounds(db_dsn: str) -> None:
    """A round a minute: the sweep connects for a round and closes after it."""
    backend = make_app(db_dsn).backend
    store(backend, 2)
    time.sleep(1.2)
    tag = f"kpt_sweep_{time.monotonic_ns()}"
    dsn = backend.dsn + f" application_name={tag}"
    service = expiry.ResultExpiry(dsn, interval_seconds=0.05, batch=10)
    service.start()
    try:
        assert wait_for(lambda: service.rounds >= 2)
    finally:
        service.stop()
        service.join(5)
    assert service._connector is None  # released after its last round, not by close()
    with psycopg.connect(db_dsn, autocommit=True) as conn:
        query = "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s"
        assert wait_for(lambda: conn.execute(query, (f"{tag}:result-expiry",)).fetchone()[0] == 0)
    service.close()


def test_worker_ready_starts_one_sweep_and_shutdown_stops_it(db_dsn: str) -> None:
    app = make_app(db_dsn, expire_interval_seconds=0.2, expire_batch=10)
    store(app.backend, 12)
    consumer = SimpleNamespace(app=app)
    _worker_checks.start_result_expiry(sender=consumer)
    first = expiry.running()
    assert first is not None and first.batch == 10
    _worker_checks.start_result_expiry(sender=consumer)  # a second app or signal: same sweep
    assert expiry.running() is first
    assert wait_for(lambda: count(db_dsn) == 0, timeout=15), count(db_dsn)
    _worker_checks.stop_result_expiry(sender=None)
    assert expiry.running() is None


def test_no_sweep_when_off_or_another_backend(db_dsn: str) -> None:
    _worker_checks.start_result_expiry(
        sender=SimpleNamespace(app=make_app(db_dsn, expire_interval_seconds=0))
    )
    assert expiry.running() is None
    other = Celery("other", set_as_current=False)
    other.conf.result_backend = "cache+memory://"
    _worker_checks.start_result_expiry(sender=SimpleNamespace(app=other))
    assert expiry.running() is None
    assert "_backend" not in vars(other) and other._local.__dict__.get("backend") is None


def test_backend_cleanup_deletes_every_expired_result(db_dsn: str) -> None:
    app = make_app(db_dsn, expire_batch=7)
    store(app.backend, 20)
    time.sleep(1.2)
    app.tasks["celery.backend_cleanup"]()
    assert count(db_dsn) == 0
