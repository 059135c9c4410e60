"""Steering a running Celery worker from the command line: ``kombu-pgmq queue
pause|resume`` (the worker stops receiving, publishes land, ``celery inspect
active_queues`` is unchanged, resume delivers at once) and ``kombu-pgmq task cancel`` (a
queued countdown task never runs, even for a worker started afterwards; a task already
delivered, held by the worker until its ETA, is revoked through Celery's remote control).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from tests.e2e import celery_app
from tests.e2e.helpers import REPO_ROOT, celery_cli, runs, wait_for


def kombu_pgmq(db_dsn: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kombu_pgmq", *args, "--url", db_dsn],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


def find(db_dsn: str, task_id: str) -> list[dict]:
    done = kombu_pgmq(db_dsn, "task", "find", task_id, "--json")
    return [json.loads(line) for line in done.stdout.splitlines()]


def test_pause_stops_delivery_and_resume_delivers(start_worker, app, db, db_dsn, e2e_env):
    worker = start_worker(KPT_POLLING_INTERVAL="0.5")
    record = app.tasks["e2e.record"]
    assert record.delay("before").get(timeout=60) == "before"

    paused = kombu_pgmq(db_dsn, "queue", "pause", "celery")
    assert paused.returncode == 0, paused.stderr
    held = record.delay("while paused")
    time.sleep(3.0)  # six polling intervals: the worker would have run it long ago
    assert runs(db, held.id) == []
    assert [f["state"] for f in find(db_dsn, held.id)] == ["ready"]
    listed = kombu_pgmq(db_dsn, "queues", "--json").stdout.splitlines()
    queues = next(q for q in map(json.loads, listed) if q["queue"] == "celery")
    assert queues["paused"] and queues["ready"] == 1 and queues["consumers"] >= 1
    active = celery_cli(e2e_env, "inspect", "active_queues", "-d", worker.node, "-j")
    assert active.returncode == 0, active.stderr
    assert "celery" in {q["name"] for q in json.loads(active.stdout)[worker.node]}
    assert worker.alive()

    resumed = kombu_pgmq(db_dsn, "queue", "resume", "celery")
    assert resumed.returncode == 0, resumed.stderr
    assert held.get(timeout=30) == "while paused"
    assert len(runs(db, held.id)) == 1


@pytest.mark.slow
def test_cancel_is_durable_and_revokes_a_delivered_task(start_worker, app, db, db_dsn, e2e_env):
    record = app.tasks["e2e.record"]
    # Queued with a countdown, no worker yet: cancelled in the table, so a worker started
    # afterwards never receives it (Celery's revoke lives in workers' memory only).
    queued = record.apply_async(("cancelled while queued",), countdown=8)  # delayed still,
    queued_eta = time.monotonic() + 8  # on a loaded machine too, when it is looked up
    assert [f["state"] for f in find(db_dsn, queued.id)] == ["delayed"]
    cancelled = kombu_pgmq(db_dsn, "task", "cancel", queued.id)
    assert cancelled.returncode == 0 and "reason cancelled" in cancelled.stdout, cancelled.stderr

    start_worker(KPT_POLLING_INTERVAL="0.5")
    # Delivered 8 s before its ETA (the publisher's eta_lead_seconds), then held by the
    # worker: revoked through Celery (the command and the broadcast have those 8 s, on a
    # loaded machine too).
    publisher = celery_app.create_app({**e2e_env, "KPT_ETA_LEAD_SECONDS": "8"})
    try:
        sent = publisher.tasks["e2e.record"].apply_async(("revoked while held",), countdown=11)
    finally:
        publisher.close()
    delivered = app.AsyncResult(sent.id)
    past_both_etas = max(queued_eta, time.monotonic() + 11) + 2  # the later ETA, 2 s to run
    wait_for(
        lambda: [f["state"] for f in find(db_dsn, delivered.id)] == ["in_flight"],
        20,
        "the worker to receive the ETA task",
        interval=0.2,
    )
    revoked = kombu_pgmq(db_dsn, "task", "cancel", delivered.id)
    assert revoked.returncode == 0, revoked.stderr
    assert f"{delivered.id} revoked: sent to every worker" in revoked.stdout

    time.sleep(max(0.0, past_both_etas - time.monotonic()))  # neither may run by then
    assert record.delay("sentinel").get(timeout=60) == "sentinel"
    assert runs(db, queued.id) == [] and runs(db, delivered.id) == []
    assert delivered.state == "REVOKED"
    assert [(f["state"], f["reason"]) for f in find(db_dsn, queued.id)] == [
        ("archived", "cancelled")
    ]
