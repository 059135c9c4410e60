"""Large messages and results against a real PostgreSQL: how their values are stored
(TOAST compression) and that they come back equal.

kombu_pgmq's statement and result connections compress the values PostgreSQL TOASTs
with lz4 when the server has it and its configuration names no method (statement
``toast_compression_lz4``); a method the server, database, role or connection string
names is kept. ``tests/e2e/test_large_payloads.py`` runs 20 MB through a real worker.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery, states

from kombu_pgmq.results import ResultBackend

from .helpers import connect, drain, publish, sql, table

#: Compressible JSON of about 1 MB: TOASTed (over ~2 kB) and compressed.
ROWS = [{"id": i, "name": f"row {i}", "tags": ["a", "b", "c"]} for i in range(25_000)]


def _lz4_available(dsn: str) -> bool:
    rows = sql(
        dsn,
        "SELECT 'lz4' = ANY (enumvals) AND source = 'default' FROM pg_catalog.pg_settings"
        " WHERE name = 'default_toast_compression'",
    )
    return bool(rows and rows[0][0])


@pytest.fixture
def lz4_dsn(db_dsn: str) -> str:
    if not _lz4_available(db_dsn):
        pytest.skip("this server has no lz4, or its configuration names a TOAST compression")
    return db_dsn


def _app(broker_url: str, **backend_options: Any) -> Celery:
    app = Celery(f"kpt_large_{uuid.uuid4().hex[:6]}", set_as_current=False)
    app.conf.update(
        broker_url=broker_url,
        result_backend=broker_url,
        result_backend_transport_options=backend_options,
        broker_connection_retry_on_startup=True,
    )
    return app


@pytest.fixture
def apps() -> Iterator[list[Celery]]:
    made: list[Celery] = []
    yield made
    for app in made:
        backend = app.backend
        if isinstance(backend, ResultBackend):
            backend.result_consumer.stop()
            if backend._db is not None:
                backend._db.close()
        app.close()


def _message_compression(dsn: str, queue: str, prefix: str = "q") -> list[tuple[Any, ...]]:
    return sql(dsn, f"SELECT pg_column_compression(message) FROM {table(queue, prefix)}")


def _result_compression(dsn: str, task_id: str) -> list[tuple[Any, ...]]:
    return sql(
        dsn,
        "SELECT pg_column_compression(meta) FROM kombu_pgmq.results WHERE key = %s",
        (f"celery-task-meta-{task_id}",),
    )


def test_large_messages_and_results_are_compressed_with_lz4(
    lz4_dsn: str, apps: list[Celery]
) -> None:
    with connect(lz4_dsn) as conn:
        publish(conn, "large", [ROWS])
        assert _message_compression(lz4_dsn, "large") == [("lz4",)]
        got = drain(conn, "large", expect=1)
    assert [m.decode() for m in got] == [ROWS]
    # the ack moved the row to the archive with its value as stored
    assert _message_compression(lz4_dsn, "large", "a") == [("lz4",)]

    app = _app(lz4_dsn)
    apps.append(app)
    task_id = str(uuid.uuid4())
    app.backend.store_result(task_id, ROWS, states.SUCCESS)
    assert _result_compression(lz4_dsn, task_id) == [("lz4",)]
    reader = _app(lz4_dsn)  # another connection reads it back
    apps.append(reader)
    assert reader.AsyncResult(task_id).get(timeout=30) == ROWS


def test_a_compression_method_the_connection_names_is_kept(
    lz4_dsn: str, apps: list[Celery]
) -> None:
    pglz = {"options": "-c default_toast_compression=pglz"}
    with connect(lz4_dsn, connection_options=pglz) as conn:
        publish(conn, "named", [ROWS])
    assert _message_compression(lz4_dsn, "named") == [("pglz",)]

    app = _app(lz4_dsn, connection_options=pglz)
    apps.append(app)
    task_id = str(uuid.uuid4())
    app.backend.store_result(task_id, ROWS, states.SUCCESS)
    assert _result_compression(lz4_dsn, task_id) == [("pglz",)]


def test_binary_results_of_every_size_come_back_equal(db_dsn: str, apps: list[Celery]) -> None:
    """Results are read in PostgreSQL's binary format: the stored bytes, whatever they
    hold (pickle, compression), small or large."""
    app = _app(db_dsn)
    app.conf.update(result_serializer="pickle", accept_content=["json", "pickle"])
    apps.append(app)
    values: list[Any] = [
        b"",
        bytes(range(256)),
        bytes(range(256)) * 40_000,  # 10 MB, every byte value
        {"nested": [b"\x00\xff", "ü", 1.5]},
        json.dumps(ROWS),
    ]
    ids = [str(uuid.uuid4()) for _ in values]
    for task_id, value in zip(ids, values, strict=True):
        app.backend.store_result(task_id, value, states.SUCCESS)
    reader = _app(db_dsn)
    reader.conf.update(result_serializer="pickle", accept_content=["json", "pickle"])
    apps.append(reader)
    for task_id, value in zip(ids, values, strict=True):
        assert reader.AsyncResult(task_id).get(timeout=30) == value
    got = reader.backend.get_many(ids, timeout=30)
    assert {task_id: meta["result"] for task_id, meta in got} == dict(zip(ids, values, strict=True))
