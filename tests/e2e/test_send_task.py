"""A Celery task enqueued from SQL: a trigger on ``INSERT INTO orders``
calls ``kombu_pgmq.send_task`` in the inserting transaction; a stock worker runs the task
of a committed insert, and a rolled-back insert enqueues nothing."""

from __future__ import annotations

import psycopg
from celery import Celery

from tests.e2e.helpers import wait_for

TRIGGER = """
CREATE TABLE orders (id bigserial PRIMARY KEY, label text NOT NULL);
CREATE FUNCTION orders_confirm() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM kombu_pgmq.send_task('e2e.record', jsonb_build_array(NEW.label));
    RETURN NEW;
END
$$;
CREATE TRIGGER orders_confirm AFTER INSERT ON orders
    FOR EACH ROW EXECUTE FUNCTION orders_confirm();
"""


def _runs_of(app: Celery, db: psycopg.Connection, label: str) -> int:
    # e2e.record returns its label: the result backend says which tasks ran (read through
    # Celery: how its SQLAlchemy backend stores a result differs between Celery versions)
    ids = [row[0] for row in db.execute("SELECT task_id FROM e2e_runs").fetchall()]
    return sum(1 for task_id in ids if app.AsyncResult(task_id).result == label)


def test_a_trigger_enqueues_a_task_that_a_worker_runs_once_committed(start_worker, app, db, db_dsn):
    db.execute(TRIGGER)
    start_worker()
    with psycopg.connect(db_dsn) as conn:
        with conn.transaction():
            conn.execute("INSERT INTO orders (label) VALUES ('order-1')")
        with conn.transaction():
            conn.execute("INSERT INTO orders (label) VALUES ('order-rolled-back')")
            raise psycopg.Rollback
        with conn.transaction():
            conn.execute("INSERT INTO orders (label) VALUES ('order-2')")
            task_id = conn.execute(
                "SELECT kombu_pgmq.send_task('e2e.record', '[\"direct\"]')"
            ).fetchone()[0]
    assert app.AsyncResult(str(task_id)).get(timeout=60) == "direct"

    def both_ran() -> bool:
        return bool(_runs_of(app, db, "order-1") and _runs_of(app, db, "order-2"))

    wait_for(both_ran, 60, "both orders")
    app.tasks["e2e.record"].delay("sentinel").get(timeout=60)  # published after everything
    assert (_runs_of(app, db, "order-1"), _runs_of(app, db, "order-2")) == (1, 1)
    assert _runs_of(app, db, "order-rolled-back") == 0
    assert db.execute(
        "SELECT count(*) FROM pgmq.a_celery WHERE message->0->>0 = 'order-rolled-back'"
    ).fetchone() == (0,)
