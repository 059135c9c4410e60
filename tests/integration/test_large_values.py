"""Large messages and results against a real PostgreSQL: they come back equal.
``tests/e2e/test_large_payloads.py`` runs 20 MB through a real worker.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery, states

from kombu_pgmq.results import ResultBackend

#: Compressible JSON of about 1 MB: TOASTed (over ~2 kB) and compressed.
ROWS = [{"id": i, "name": f"row {i}", "tags": ["a", "b", "c"]} for i in range(25_000)]


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
