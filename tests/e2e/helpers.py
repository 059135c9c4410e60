"""Helpers of the end-to-end tests: the worker subprocess, polling, ``e2e_runs`` rows."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psycopg
from celery import Celery
from celery.exceptions import TimeoutError as CeleryTimeoutError
from celery.utils.nodenames import host_format

from tests.support.waiting import wait_for as wait_for  # re-exported

REPO_ROOT = Path(__file__).resolve().parents[2]
#: Longest wait for a worker to start and run its first task (2-core CI, cold imports).
WORKER_READY_TIMEOUT_S = 60.0
#: Longest wait for a warm shutdown after SIGTERM before the process group is SIGKILLed.
WORKER_STOP_TIMEOUT_S = 20.0
#: Worker features switched off by default (``--without-<name>``): fewer moving parts.
DEFAULT_WITHOUT = ("heartbeat", "gossip", "mingle")


class WorkerDied(RuntimeError):
    """The worker subprocess exited while we waited for it."""


class Worker:
    """One ``celery worker`` subprocess (leader of its own process group)."""

    def __init__(
        self,
        name: str,
        env: dict[str, str],
        log_path: Path,
        *,
        extra_args: Sequence[str] = (),
        without: Sequence[str] = DEFAULT_WITHOUT,
        own_queue: bool = True,
        app_module: str = "tests.e2e.celery_app",
        queues: Sequence[str] = ("celery",),
        concurrency: int = 2,
        pool: str = "prefork",
    ) -> None:
        """*without*: ``--without-<x>`` flags; *extra_args*: more ``celery worker``
        arguments (``-E``...); *own_queue*: also consume queue ``e2e_<name>`` (readiness
        is a ``ping`` task sent there; without it, a remote-control ping); *app_module*:
        the ``-A`` argument; *queues*: the ``-Q`` queues (besides its own);
        *concurrency*: pool processes (threads, greenlets); *pool*: the ``-P`` pool type."""
        self.name = name
        self.node = host_format(f"{name}@%h")  # the worker's node name, as -n expands it
        # Consumed by this worker only: readiness pings (None: no such queue).
        self.queue: str | None = f"e2e_{name}" if own_queue else None
        self.env = env
        self.log_path = log_path
        self.extra_args = list(extra_args)
        self.without = list(without)
        self.app_module = app_module
        self.queues = list(queues)
        self.concurrency = concurrency
        self.pool = pool
        self.proc: subprocess.Popen[bytes] | None = None
        self._terminated = False

    @property
    def pidbox_queue(self) -> str:
        """Kombu name of the worker's remote-control queue (auto_delete)."""
        return f"{self.node}.celery.pidbox"

    def start(self) -> None:
        cmd = [
            sys.executable,
            "-m",
            "celery",
            "-A",
            self.app_module,
            "worker",
            "-P",
            self.pool,
            "-c",
            str(self.concurrency),
            *(f"--without-{feature}" for feature in self.without),
            "-l",
            "info",
            "-n",
            f"{self.name}@%h",
            "-Q",
            ",".join(filter(None, [*self.queues, self.queue])),
            *self.extra_args,
        ]
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                cmd,
                cwd=REPO_ROOT,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def wait_ready(self, app: Celery, timeout: float = WORKER_READY_TIMEOUT_S) -> None:
        """Wait until this worker ran a ``ping`` task sent to its own queue (or, without
        one, answered a remote-control ``ping`` addressed to its node name)."""
        result = app.tasks["e2e.ping"].apply_async(queue=self.queue) if self.queue else None
        deadline = time.monotonic() + timeout
        while True:
            if not self.alive():
                raise WorkerDied(
                    f"worker {self.name} exited with {self.proc and self.proc.returncode}"
                )
            if result is None:
                replies = app.control.ping(destination=[self.node], timeout=1.0)
                if {self.node: {"ok": "pong"}} in replies:
                    return
            else:
                try:
                    assert result.get(timeout=1.0, interval=0.1) == "pong"
                    return
                except CeleryTimeoutError:
                    pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"worker {self.name} not ready after {timeout} s")

    def kill(self) -> None:
        """SIGKILL the whole process group (parent and pool processes) and reap the parent."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)
        assert self.proc is not None
        self.proc.wait(timeout=10)

    def terminate(self) -> None:
        """Start a warm shutdown (SIGTERM to the parent), once; :meth:`stop` waits for it."""
        if self.proc is not None and not self._terminated and self.proc.poll() is None:
            self._terminated = True
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)

    def stop(self, timeout: float = WORKER_STOP_TIMEOUT_S) -> int | None:
        """Warm shutdown (SIGTERM to the parent); SIGKILL the group if it takes too long.
        Returns the parent's exit code (``None`` if it had to be killed)."""
        if self.proc is None:
            return None
        code: int | None = self.proc.poll()
        if code is None:
            self.terminate()
            try:
                code = self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                code = None
        # Pool processes or anything else left in the group.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)
        if code is None:
            self.proc.wait(timeout=10)
        return code

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""


def runs(conn: psycopg.Connection, task_id: str) -> list[dict[str, Any]]:
    """The ``e2e_runs`` rows of *task_id*, oldest first."""
    cur = conn.execute(
        "SELECT pid, redelivered, retries, started_at FROM e2e_runs"
        " WHERE task_id = %s ORDER BY started_at, id",
        (task_id,),
    )
    names = [d.name for d in cur.description or []]
    return [dict(zip(names, row, strict=True)) for row in cur.fetchall()]


def celery_cli(
    env: dict[str, str], *args: str, timeout: float = 60.0, app: str = "tests.e2e.celery_app"
) -> subprocess.CompletedProcess[str]:
    """Run ``python -m celery -A <app> ARGS...`` to completion."""
    return subprocess.run(
        [sys.executable, "-m", "celery", "-A", app, *args],
        cwd=REPO_ROOT,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def waiting_on(conn: psycopg.Connection, queue: str) -> int:
    """How many consumers wait for a publish to *queue* (``kombu_pgmq.waiting`` rows: an
    idle worker asleep on LISTEN, woken by NOTIFY)."""
    from kombu_pgmq._naming import pgmq_queue_name

    row = conn.execute(
        "SELECT count(*) FROM kombu_pgmq.waiting WHERE pgmq_queue = %s",
        (pgmq_queue_name(queue),),
    ).fetchone()
    return int(row[0]) if row else 0


def pgmq_queues(conn: psycopg.Connection) -> set[str]:
    """Names of the PGMQ queues (``pgmq.meta``) of the database."""
    return {row[0] for row in conn.execute("SELECT queue_name FROM pgmq.meta").fetchall()}
