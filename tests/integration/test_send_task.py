"""``kombu_pgmq.send_task``: a Celery protocol 2 message built in SQL,
as Celery itself sends it through kombu_pgmq, with its options; clear errors. The e2e
test (``tests/e2e/test_send_task.py``) runs such tasks on a real worker, from a trigger."""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import uuid
from typing import Any

import psycopg
import pytest
from kombu import Consumer, Exchange, Queue

from .helpers import connect, sql


def _send(url: str, *args: Any) -> str:
    placeholders = ", ".join(["%s"] * len(args))
    return str(sql(url, f"SELECT kombu_pgmq.send_task({placeholders})", args)[0][0])


def _get(url: str, queue: Queue) -> Any:
    with connect(url) as conn:
        got: list[Any] = []
        with Consumer(conn, [queue], on_message=got.append, prefetch_count=10):
            for _ in range(10):
                if got:
                    break
                with contextlib.suppress(TimeoutError):
                    conn.drain_events(timeout=0.3)
        for message in got:
            message.ack()
        return got


def test_the_message_is_celerys_protocol_2(db_dsn):
    task_id = _send(db_dsn, "tasks.confirm", json.dumps([17, "x"]), json.dumps({"k": 3}))
    (message,) = _get(db_dsn, Queue("celery"))
    headers = message.headers
    assert headers["task"] == "tasks.confirm"
    assert headers["id"] == headers["root_id"] == task_id
    assert headers["parent_id"] is None and headers["retries"] == 0
    assert headers["argsrepr"] == '[17, "x"]' and headers["kwargsrepr"] == '{"k": 3}'
    assert headers["lang"] == "py" and headers["origin"].startswith("postgresql:")
    assert message.content_type == "application/json"
    assert message.properties["correlation_id"] == task_id
    args, kwargs, embed = message.decode()
    assert (args, kwargs) == ([17, "x"], {"k": 3})
    assert embed == {"callbacks": None, "errbacks": None, "chain": None, "chord": None}


def test_options_countdown_expires_task_id_priority_and_exchange(db_dsn):
    with connect(db_dsn) as conn:
        Queue("prio", queue_arguments={"x-max-priority": 9})(conn.default_channel).declare()
        topic = Exchange("events", type="topic")
        for name in ("ev_a", "ev_b"):
            Queue(name, topic, routing_key="order.#")(conn.default_channel).declare()
    given = str(uuid.uuid4())
    options = {"task_id": given, "countdown": 30, "expires": 600}
    assert _send(db_dsn, "t.later", "[]", "{}", "later", json.dumps(options)) == given
    (row,) = sql(db_dsn, "SELECT vt - enqueued_at, headers FROM pgmq.q_later")
    assert dt.timedelta(seconds=27) <= row[0] <= dt.timedelta(seconds=29)  # eta_lead 2 s
    props = row[1]["x-kombu"]["properties"]
    assert props["pgmq_delay_seconds"] in (27, 28)  # whole seconds of 30 - 2, as Python's
    assert 599_000 <= int(props["expiration"]) <= 600_000
    assert row[1]["eta"] and row[1]["expires"]

    _send(db_dsn, "t.urgent", "[]", "{}", "prio", json.dumps({"priority": 9}))
    bands = sql(db_dsn, "SELECT band_queues FROM kombu_pgmq.queues WHERE queue = 'prio'")[0][0]
    assert sql(db_dsn, f"SELECT count(*) FROM pgmq.q_{bands[-1]}") == [(1,)]

    _send(
        db_dsn,
        "t.event",
        "[]",
        "{}",
        "celery",
        json.dumps({"exchange": "events", "routing_key": "order.created"}),
    )
    assert [
        len(_get(db_dsn, Queue(name, topic, routing_key="order.#"))) for name in ("ev_a", "ev_b")
    ] == [1, 1]


def test_deduplication_and_groups(db_dsn):
    for _ in range(2):
        _send(db_dsn, "t.once", "[]", "{}", "celery", json.dumps({"deduplication_id": "o-1"}))
    _send(db_dsn, "t.grouped", "[]", "{}", "celery", json.dumps({"group_id": "customer-9"}))
    rows = sql(
        db_dsn, "SELECT headers->>'task', headers->>'x-group-id' FROM pgmq.q_celery ORDER BY msg_id"
    )
    assert rows == [("t.once", None), ("t.grouped", "customer-9")]


def test_bad_calls_are_clear_errors_and_send_nothing(db_dsn):
    cases = [
        (("", "[]", "{}"), "name the task"),
        (("t", '{"a": 1}', "{}"), "args must be a JSON array"),
        (("t", "[]", "{}", "Not.Plain"), "is not declared"),
        (("t", "[]", "{}", "celery", json.dumps({"countdown": 3e9})), "68 years"),
        (
            ("t", "[]", "{}", "celery", json.dumps({"exchange": "nowhere"})),
            "routes celery to no queue",
        ),
    ]
    for args, message in cases:
        with pytest.raises(psycopg.Error, match=message):
            _send(db_dsn, *args)
    assert sql(db_dsn, "SELECT count(*) FROM pgmq.meta WHERE queue_name = 'celery'") in (
        [(0,)],
        [(1,)],
    )
    if sql(db_dsn, "SELECT to_regclass('pgmq.q_celery')")[0][0]:
        assert sql(db_dsn, "SELECT count(*) FROM pgmq.q_celery") == [(0,)]


def test_a_producer_role_may_call_it(least_privilege_db):
    """On a queue that exists: creating one is a worker's or the owner's (see
    tests/integration/test_privileges.py)."""
    db = least_privilege_db
    with psycopg.connect(db.worker_url, autocommit=True) as conn:
        conn.execute(
            "SELECT kombu_pgmq.declare_queue('celery', 'celery', true, false, NULL, NULL,"
            " NULL, NULL, NULL)"
        )
    with psycopg.connect(db.producer_url, autocommit=True) as conn:
        task_id = conn.execute("SELECT kombu_pgmq.send_task('t.role', '[1]')").fetchone()[0]
    with psycopg.connect(db.owner_url) as conn:
        assert conn.execute("SELECT headers->>'id' FROM pgmq.q_celery").fetchone() == (
            str(task_id),
        )
