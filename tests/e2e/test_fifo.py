"""FIFO groups with real workers: 2 workers x 4 processes consume a
queue declared with ``x-fifo-groups``; 4 groups x 12 steps, published interleaved with
Celery's ``headers={"x-group-id": ...}``: each group's steps run one at a time in publish
order, and different groups run at the same time, with ``acks_late`` tasks (the next step
of a group is delivered once the previous one is acked) and with Celery's default early
acks (once the previous one's task finished: its slot is held past the ack)."""

from __future__ import annotations

from itertools import pairwise

import pytest

from tests.e2e import celery_app
from tests.e2e.helpers import wait_for

GROUPS = ("g1", "g2", "g3", "g4")
STEPS = 12
DDL = """
CREATE TABLE e2e_fifo (
    grp text NOT NULL, seq int NOT NULL, pid int NOT NULL,
    started_at timestamptz NOT NULL, finished_at timestamptz NOT NULL
)
"""


@pytest.mark.parametrize("task", ["e2e.fifo_step", "e2e.fifo_step_early"])
def test_groups_run_in_order_one_step_at_a_time_and_in_parallel(task, start_worker, db, e2e_env):
    db.execute(DDL)
    env = {"KPT_FIFO_QUEUE": "1", "KPT_POLLING_INTERVAL": "0.5"}
    for _ in range(2):
        start_worker(queues=("celery", "fifo"), concurrency=4, **env)
    app = celery_app.create_app({**e2e_env, **env})
    try:
        step = app.tasks[task]
        for seq in range(STEPS):
            for group in GROUPS:
                step.apply_async((group, seq), queue="fifo", headers={"x-group-id": group})
    finally:
        app.close()
    total = len(GROUPS) * STEPS
    wait_for(
        lambda: db.execute("SELECT count(*) FROM e2e_fifo").fetchone() == (total,),
        120,
        f"{total} steps",
    )
    rows = db.execute(
        "SELECT grp, seq, pid, started_at, finished_at FROM e2e_fifo ORDER BY started_at"
    ).fetchall()
    for group in GROUPS:
        steps = [r for r in rows if r[0] == group]
        assert [r[1] for r in steps] == list(range(STEPS)), (group, [r[1] for r in steps])
        for before, after in pairwise(steps):
            assert after[3] >= before[4], (
                f"{group}: step {after[1]} started before {before[1]} ended"
            )
    # different groups ran at the same time, in more than one process
    overlaps = sum(1 for a, b in pairwise(rows) if a[0] != b[0] and b[3] < a[4])
    assert overlaps > 0
    assert len({r[2] for r in rows}) > 1
