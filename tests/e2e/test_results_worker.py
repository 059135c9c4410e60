"""kombu_pgmq's result backend (``result_backend = "postgresql://"``) under real ``celery
worker`` processes: states a worker stores, groups, chords counted in SQL (never a
``chord_unlock`` task), chord errors and their errbacks, and a chord whose workers are
SIGKILLed mid-header (acks_late): its callback runs exactly once with every header result.

The e2e app (:mod:`tests.e2e.celery_app`) runs with ``KPT_RESULT_BACKEND=postgresql``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import celery
import psycopg
import pytest
from celery import Celery, chain, chord, group, states
from celery.exceptions import BackendStoreError, ChordError
from celery.result import GroupResult

from tests.e2e.helpers import Worker, wait_for

RESULT_TIMEOUT_S = 60.0
#: Celery 5.7 wakes every result object waiting on a task id in one process; 5.5 and 5.6
#: wake only the first one made (celery/celery#4925, with every async backend, Redis's
#: too): a GroupResult restored while the original still waits would never wake there.
CELERY_WAKES_EVERY_WAITER = tuple(int(p) for p in celery.__version__.split(".")[:2]) >= (5, 7)
#: Header size of the kill test (the issue asks 1,000: ``KPT_KILL_CHORD_SIZE=1000``; 300
#: keeps the default suite short on 2 cores).
KILL_CHORD_SIZE = int(os.environ.get("KPT_KILL_CHORD_SIZE", "300"))


@pytest.fixture
def e2e_env(e2e_env: dict[str, str]) -> dict[str, str]:
    return {**e2e_env, "KPT_RESULT_BACKEND": "postgresql"}


def _runs_named(db: psycopg.Connection, name: str) -> list[tuple[str, int]]:
    return db.execute(
        "SELECT task_id, count(*)::int FROM e2e_runs WHERE name = %s GROUP BY task_id"
        " ORDER BY task_id",
        (name,),
    ).fetchall()


def _messages_naming(db: psycopg.Connection, text: str) -> int:
    """Messages (queued or archived) of every queue whose row mentions ``text``."""
    total = 0
    tables = db.execute(
        "SELECT table_name FROM information_schema.tables WHERE table_schema = 'pgmq'"
        " AND (table_name LIKE 'q\\_%' OR table_name LIKE 'a\\_%')"
    ).fetchall()
    for (table,) in tables:
        row = db.execute(
            f'SELECT count(*) FROM pgmq."{table}" m WHERE m::text LIKE %s', (f"%{text}%",)
        ).fetchone()
        total += int(row[0]) if row else 0
    return total


def _assert_no_chord_unlock(db: psycopg.Connection, workers: list[Worker]) -> None:
    # The check can see a task: the callbacks' messages are there.
    assert _messages_naming(db, "e2e.record_sum") >= 1
    assert _messages_naming(db, "celery.chord_unlock") == 0
    for worker in workers:
        assert "celery.chord_unlock" not in worker.log()


def test_states_a_worker_stores(app: Celery, start_worker: Callable[..., Worker]) -> None:
    worker = start_worker(KPT_TRACK_STARTED="1", KPT_RESULT_OPTIONS='{"result_max_bytes": 10000}')
    slow = app.tasks["e2e.record_and_sleep"].delay(2.0)
    wait_for(lambda: slow.state == states.STARTED, RESULT_TIMEOUT_S, "STARTED")
    assert slow.get(timeout=RESULT_TIMEOUT_S)["runs"] == 1
    assert slow.name == "e2e.record_and_sleep"
    assert slow.args == [2.0]
    assert slow.kwargs == {}
    assert slow.worker == worker.node
    assert slow.queue == "celery"

    failed = app.tasks["e2e.fail"].delay("nope")
    with pytest.raises(ValueError, match="nope"):
        failed.get(timeout=RESULT_TIMEOUT_S)
    assert failed.state == states.FAILURE
    assert "ValueError: nope" in failed.traceback

    # Over result_max_bytes: the task ends FAILURE with BackendStoreError.
    big = app.tasks["e2e.big"].delay(20_000)
    with pytest.raises(BackendStoreError, match="result_max_bytes=10000"):
        big.get(timeout=RESULT_TIMEOUT_S)
    assert big.state == states.FAILURE
    small = app.tasks["e2e.big"].delay(100)
    assert small.get(timeout=RESULT_TIMEOUT_S) == "x" * 100


def test_groups_and_chords_without_chord_unlock(
    app: Celery, db: psycopg.Connection, start_worker: Callable[..., Worker]
) -> None:
    worker = start_worker()
    add, xsum = app.signature("e2e.add"), app.signature("e2e.xsum")
    part, record_sum = app.signature("e2e.chord_part"), app.signature("e2e.record_sum")

    # A group saved and restored (by id, from the database).
    saved = group(add.clone((i, i)) for i in range(5)).delay()
    saved.save()
    if not CELERY_WAKES_EVERY_WAITER:
        assert saved.get(timeout=RESULT_TIMEOUT_S) == [0, 2, 4, 6, 8]
    restored = GroupResult.restore(saved.id, app=app)
    assert restored is not None
    assert restored.get(timeout=RESULT_TIMEOUT_S) == [0, 2, 4, 6, 8]

    # Header order, whatever the order the header tasks finish in (the first ones last).
    n = 12
    header = [part.clone((i, 0.3 if i < 2 else 0.0)) for i in range(n)]
    ordered = chord(header, record_sum.clone()).delay()
    got = ordered.get(timeout=RESULT_TIMEOUT_S)
    assert got == {"values": list(range(n)), "runs": 1}

    # A chord in a chain, a chord of chords, a group of chords, an empty header.
    in_chain = chain(
        add.clone((1, 1)),
        chord([add.clone((10,)), add.clone((20,))], xsum.clone()),
        add.clone((100,)),
    ).delay()
    assert in_chain.get(timeout=RESULT_TIMEOUT_S) == 134
    inner = [chord([add.clone((1, 1)), add.clone((2, 2))], xsum.clone()) for _ in range(2)]
    of_chords = chord(inner, xsum.clone()).delay()
    assert of_chords.get(timeout=RESULT_TIMEOUT_S) == 12
    of_group = group(
        chord([add.clone((i, 1)) for i in range(3)], xsum.clone()) for i in range(3)
    ).delay()
    assert of_group.get(timeout=RESULT_TIMEOUT_S) == [6, 6, 6]
    empty = chord([], record_sum.clone()).delay()
    assert empty.get(timeout=RESULT_TIMEOUT_S)["values"] == []

    _assert_no_chord_unlock(db, [worker])


def test_a_failing_header_fails_the_callback_and_runs_its_errback(
    app: Celery, db: psycopg.Connection, start_worker: Callable[..., Worker]
) -> None:
    worker = start_worker()
    callback = app.signature("e2e.record_sum").on_error(app.signature("e2e.on_chord_error"))
    header = [app.signature("e2e.add", (1, 1)), app.signature("e2e.fail", ("header broke",))]
    result = chord(header, callback).delay()
    # (propagate=True would raise the header task's own ValueError first: its parent)
    result.get(timeout=RESULT_TIMEOUT_S, propagate=False)
    assert result.state == states.FAILURE
    assert isinstance(result.result, ChordError)
    assert "header broke" in str(result.result)
    errbacks = wait_for(
        lambda: _runs_named(db, "e2e.on_chord_error:ChordError"),
        RESULT_TIMEOUT_S,
        "the errback",
    )
    assert errbacks == [(result.id, 1)]
    assert _runs_named(db, "e2e.record_sum") == []  # the callback itself never ran
    assert _messages_naming(db, "celery.chord_unlock") == 0
    assert "celery.chord_unlock" not in worker.log()


@pytest.mark.slow
def test_chord_callback_runs_once_with_every_result_when_workers_are_killed_mid_header(
    app: Celery, db: psycopg.Connection, start_worker: Callable[..., Worker]
) -> None:
    """Two workers (acks_late header tasks); three times during the header one worker's
    whole process group is SIGKILLed (its leased messages come back after the visibility
    timeout, some after their result was stored and counted) and a new one started."""
    size = KILL_CHORD_SIZE
    env = {"KPT_VISIBILITY_TIMEOUT": "3"}
    workers = [start_worker(**env), start_worker(**env)]
    everyone = list(workers)
    part = app.signature("e2e.chord_part")
    result = chord([part.clone((i, 0.02)) for i in range(size)], app.signature("e2e.record_sum"))
    async_result = result.delay()

    def started() -> int:
        row = db.execute(
            "SELECT count(DISTINCT task_id) FROM e2e_runs WHERE name = 'e2e.chord_part'"
        ).fetchone()
        return int(row[0]) if row else 0

    for fraction in (6, 3, 2):
        threshold = size // fraction
        wait_for(lambda t=threshold: started() >= t, 180, f"{threshold} header tasks to start")
        victim = workers.pop(0)
        victim.kill()
        replacement = start_worker(wait=False, **env)
        workers.append(replacement)
        everyone.append(replacement)

    got: dict[str, Any] = async_result.get(timeout=300)
    assert got["values"] == list(range(size))
    # Every redelivered copy has run: nothing left in the queue (leased or not).
    wait_for(
        lambda: db.execute("SELECT count(*) FROM pgmq.q_celery").fetchone() == (0,),
        180,
        "the queue to drain",
    )
    assert _runs_named(db, "e2e.record_sum") == [(async_result.id, 1)]
    assert got["runs"] == 1
    header_runs = db.execute(
        "SELECT count(*), count(DISTINCT task_id) FROM e2e_runs WHERE name = 'e2e.chord_part'"
    ).fetchone()
    assert header_runs is not None
    total, distinct = header_runs
    assert distinct == size
    # The kills did hit running header tasks (they ran again): the test proved something.
    assert total > distinct, "no header task ran twice: the kills missed"
    print(f"chord of {size}: {total - distinct} header task runs repeated after 3 kills")
    _assert_no_chord_unlock(db, everyone)


def test_a_chord_in_the_applications_transaction_commits_or_rolls_back_with_it(
    start_worker: Callable[..., Worker], app: Celery, db: psycopg.Connection, db_dsn: str
) -> None:
    """A chord published inside ``with kombu_pgmq.using(conn):`` in a transaction that
    rolls back leaves no chord row and no message; in one that commits, it runs to its
    callback."""
    import kombu_pgmq

    start_worker()
    add, xsum = app.tasks["e2e.add"], app.tasks["e2e.xsum"]
    with psycopg.connect(db_dsn) as pg:
        with pg.transaction(force_rollback=True), kombu_pgmq.using(pg):
            chord([add.s(i, i) for i in range(3)])(xsum.s())
        assert db.execute(
            "SELECT (SELECT count(*) FROM kombu_pgmq.chords) + (SELECT count(*) FROM pgmq.q_celery)"
        ).fetchone() == (0,)
        with pg.transaction(), kombu_pgmq.using(pg):
            chorded = chord([add.s(i, i) for i in range(3)])(xsum.s())
    assert chorded.get(timeout=RESULT_TIMEOUT_S) == 6
