"""Least privilege with real Celery processes: the schema is installed by an
owner role that is no superuser; a ``celery worker`` logs in as a worker role
(``install_schema=False``), declares its queues and its remote-control (pidbox) queue,
and runs tasks that an application publishes as a producer role; ``celery inspect ping``
as the worker role gets the worker's answer (its reply queue is created by the client).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from tests.conftest import LeastPrivilegeDb
from tests.e2e import chaos_app
from tests.e2e.chaos import executions
from tests.e2e.helpers import REPO_ROOT, Worker, celery_cli, wait_for


def _env(url: str, log: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KPT_")}
    env.update(
        KPT_CHAOS_BROKER=url,
        KPT_CHAOS_OPTIONS=json.dumps({"install_schema": False}),
        KPT_CHAOS_LOG=str(log),
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")])),
    )
    return env


def test_worker_and_producer_roles_run_celery(
    least_privilege_db: LeastPrivilegeDb, tmp_path: Path
) -> None:
    db = least_privilege_db
    log = tmp_path / "executions.log"
    worker_env = _env(db.worker_url, log)
    worker = Worker(
        "least",
        worker_env,
        tmp_path / "worker.log",
        app_module="tests.e2e.chaos_app",
        queues=("chaos",),
        own_queue=False,
    )
    control = chaos_app.create_app(worker_env)  # a worker-role client (replies)
    producer = chaos_app.create_app(_env(db.producer_url, log))
    try:
        worker.start()
        worker.wait_ready(control)  # a remote-control ping, answered through the pidbox
        for n in range(20):
            producer.tasks["chaos.work"].apply_async((n,))
        wait_for(lambda: set(executions(log)) == set(range(20)), 60, "the 20 tasks to run")

        ping = celery_cli(worker_env, "inspect", "ping", app="tests.e2e.chaos_app")
        assert ping.returncode == 0, ping.stdout + ping.stderr
        assert "pong" in ping.stdout
        assert "permission denied" not in worker.log()
    finally:
        worker.stop()
        control.close()
        producer.close()
