"""Example tasks: arithmetic, pandas on real data, a retrying task. The Spark tasks are in
:mod:`examples.pipeline`."""

from __future__ import annotations

import functools
from typing import Any

from kombu_pgmq.atomic import AtomicTask

from . import spark_flights
from .celeryapp import app, broker_url


@app.task
def add(x: float, y: float) -> float:
    return x + y


@app.task
def mul(x: float, y: float) -> float:
    return x * y


@app.task
def xsum(numbers: list[float]) -> float:
    return sum(numbers)


@app.task
def confirm_order(order_id: int) -> dict[str, Any]:
    """Confirm an order of ``example_orders``: enqueued in the transaction that saved it
    (``kombu_pgmq.using`` or ``kombu_pgmq.send_task`` in SQL), so the row is there."""
    import psycopg

    with psycopg.connect(broker_url) as conn:
        row = conn.execute(
            "SELECT item, total FROM example_orders WHERE id = %s", (order_id,)
        ).fetchone()
    if row is None:
        return {"order": order_id, "found": False}
    return {"order": order_id, "found": True, "item": row[0], "total": float(row[1])}


@app.task(base=AtomicTask, bind=True)
def pay_order(self: AtomicTask, order_id: int) -> dict[str, Any]:
    """Mark an order of ``example_orders`` paid and send its confirmation, exactly once:
    the UPDATE, the ``confirm_order`` task, this task's result and the ack of its message
    commit in one transaction (``self.db``, :class:`kombu_pgmq.AtomicTask`). A worker
    killed before the commit leaves none of it (the message is delivered again), one
    killed after it leaves all of it (the message is archived)."""
    self.db.execute("UPDATE example_orders SET paid = paid + 1 WHERE id = %s", (order_id,))
    confirm_order.delay(order_id)
    return {"order": order_id}


class TransientError(Exception):
    """Stands for a failure that goes away on its own (a timeout, a 503, a lock)."""


@app.task(bind=True, max_retries=5)
def flaky(self, fail_times: int = 2) -> dict[str, int]:
    """Fail the first *fail_times* attempts, then succeed: retried by Celery, 1 s apart.

    Deterministic: the attempt number is ``self.request.retries``, carried in the message.
    """
    attempt = self.request.retries + 1
    if self.request.retries < fail_times:
        raise self.retry(
            exc=TransientError(f"attempt {attempt} of {fail_times + 1} fails on purpose"),
            countdown=1,
        )
    return {"attempts": attempt, "retries": self.request.retries}


@functools.lru_cache(maxsize=1)
def _flights() -> Any:
    """The flights table (pandas), read once per worker process (~0.5 s)."""
    import pandas as pd

    return pd.read_csv(
        spark_flights.data_dir() / "flights.csv.zip",
        usecols=["month", "origin", "dest", "carrier", "dep_delay", "distance"],
    )


@app.task
def flights_in_month(month: int) -> int:
    """Number of flights that left NYC in *month* (1-12) of 2013."""
    if not 1 <= month <= 12:
        raise ValueError(f"month must be 1..12, not {month!r}")
    flights = _flights()
    return int((flights["month"] == month).sum())


@app.task
def busiest_routes(n: int = 3) -> list[dict[str, Any]]:
    """The *n* routes with the most flights, with distance and share delayed > 15 min."""
    flights = _flights()
    routes = (
        flights.assign(late=flights["dep_delay"] > 15)
        .groupby(["origin", "dest"])
        .agg(flights=("late", "size"), late=("late", "mean"), miles=("distance", "first"))
        .sort_values(["flights", "origin", "dest"], ascending=[False, True, True])
        .head(n)
    )
    return [
        {
            "origin": origin,
            "dest": dest,
            "flights": int(row.flights),
            "miles": int(row.miles),
            "late_pct": round(100 * float(row.late), 1),
        }
        for (origin, dest), row in routes.iterrows()
    ]
