"""Celery tasks that run Spark jobs: :class:`SparkTask` (base class) and :func:`spark_task`.

Example::

    from kombu_pgmq.spark import SparkTask

    @app.task(base=SparkTask, bind=True, time_limit=600)
    def monthly_delays(self, month):
        df = self.spark.read.parquet("s3://bucket/flights").where(f"month = {month}")
        return df.groupBy("carrier").avg("dep_delay").toPandas().to_dict("records")

``self.spark`` is a Spark Connect session of this task execution, opened on first use in
the process that runs the task (never before the prefork pool forks) and released when the
task returns. Its id is deterministic (:func:`kombu_pgmq.spark.session.session_id`), so the
task's Spark work can be found from any process. Where it connects: Celery setting
``spark_remote`` or ``$SPARK_REMOTE`` (a cluster's Connect endpoint), else a local Connect
server started on demand (:mod:`kombu_pgmq.spark.server`). Task code does not change.

Behaviour:

* **Progress**: while Spark runs, the task's state is ``PROGRESS`` with meta
  ``{"completed_tasks": int, "total_tasks": int, "stages": int, "operation_id": str}``
  (Spark tasks of the current operation's stages), at most every
  :attr:`SparkTask.progress_interval_seconds`; ``AsyncResult(id).info`` shows it.
* **Cancel**: the task body runs in a helper thread; the pool process' main thread waits
  for it. A revoke with ``terminate=True``, a soft or hard time limit, or a warm/cold
  shutdown signal interrupts every operation of the session (~10 ms), then the task ends
  as Celery decides (revoked, ``SoftTimeLimitExceeded``, ...). When the pool process is
  killed (kill -9, hard time limit after its grace), the worker's main process interrupts
  the session instead, from a short subprocess (~1-2 s: it must not open gRPC channels in a
  process that forks). A later delivery of the same task interrupts leftovers too.
* **Leases**: while the task runs, kombu_pgmq's lease renewal keeps its message invisible,
  so a Spark job longer than the visibility timeout is not delivered twice.
* **Clusters**: :meth:`SparkTask.require_executors` checks that the executors see the
  task's paths, import ``kombu_pgmq`` and reach the broker (no-op on a local master); an
  error from Spark saying the executors lack ``kombu_pgmq`` is raised as a
  :class:`~kombu_pgmq.errors.SparkError` naming the fix (:mod:`kombu_pgmq.spark.preflight`).
* The session has the ``pgmq`` data source registered (``df.write.format("pgmq")``,
  ``spark.read.format("pgmq")``); :attr:`SparkTask.pgmq_url` is the broker's URL for it.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

from billiard.exceptions import TimeLimitExceeded
from celery import Task, states
from celery.worker.request import Request

from ..errors import SparkError
from . import preflight, server
from . import session as sessions

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

__all__ = ["PROGRESS", "SparkRequest", "SparkTask", "spark_task"]

_logger = logging.getLogger(__name__)

#: Celery task state while Spark runs (meta: completed/total Spark tasks).
PROGRESS = "PROGRESS"


class _Run:
    """One execution of a Spark task: its session (lazy), progress, cancellation."""

    def __init__(self, task: SparkTask, task_id: str, retries: int) -> None:
        self.task = task
        self.task_id = task_id
        self.retries = retries
        self._spark: SparkSession | None = None
        self._lock = threading.Lock()
        self._cancelled = False
        self._last_progress = 0.0

    @property
    def spark(self) -> SparkSession:
        with self._lock:  # one session per run, opened by the first caller
            if self._spark is None and not self._cancelled:
                spark = self._open()
                if self._cancelled:  # cancelled while it opened (e.g. a server start)
                    sessions.close_quietly(spark)
                else:
                    self._spark = spark
        if self._cancelled or self._spark is None:
            raise SparkError(f"task {self.task_id} was cancelled: no new Spark work")
        return self._spark

    def _open(self) -> SparkSession:
        url = sessions.connect_url(self.task.app.conf)
        t0 = time.monotonic()
        spark, orphans = sessions.open_session(url, self.task_id, self.retries)
        if orphans:
            _logger.warning(
                "task %s: interrupted %d Spark operation(s) left running by an earlier "
                "delivery of this task",
                self.task_id,
                len(orphans),
            )
        from .datasource import register

        register(spark)
        spark.registerProgressHandler(self._on_progress)  # type: ignore[arg-type]
        _logger.debug("task %s: Spark session ready in %.3f s", self.task_id, time.monotonic() - t0)
        return spark

    def _on_progress(
        self, stages: Any, inflight_tasks: int, operation_id: str, done: bool, **_: Any
    ) -> None:
        if self._cancelled:  # the task's final state is being decided: never overwrite it
            return
        now = time.monotonic()
        if not done and now - self._last_progress < self.task.progress_interval_seconds:
            return
        self._last_progress = now
        stages = list(stages or ())
        meta = {
            "completed_tasks": sum(int(s.num_completed_tasks) for s in stages),
            "total_tasks": sum(int(s.num_tasks) for s in stages),
            "stages": len(stages),
            "inflight_tasks": int(inflight_tasks),
            "operation_id": operation_id,
            "done": bool(done),
        }
        try:
            self.task.update_state(task_id=self.task_id, state=PROGRESS, meta=meta)
        except Exception:  # progress is best effort: never fail the Spark job for it
            _logger.warning("task %s: storing PROGRESS failed", self.task_id, exc_info=True)

    def cancel(self) -> list[str]:
        """Interrupt every operation of the session (from any thread, without waiting for a
        session being opened); no new Spark work after."""
        self._cancelled = True
        spark = self._spark
        if spark is None:
            return []
        t0 = time.monotonic()
        try:
            ops = list(spark.interruptAll())
        except Exception:
            _logger.warning("task %s: interrupting Spark failed", self.task_id, exc_info=True)
            return []
        _logger.warning(
            "task %s: interrupted %d Spark operation(s) in %.3f s",
            self.task_id,
            len(ops),
            time.monotonic() - t0,
        )
        return ops

    def close(self) -> None:
        # Not waiting long for a session being opened: spark() closes it itself when it
        # sees the run was cancelled.
        if not self._lock.acquire(timeout=1.0):
            return
        try:
            spark, self._spark = self._spark, None
        finally:
            self._lock.release()
        if spark is not None:
            sessions.close_quietly(spark)


class SparkTask(Task):
    """Celery task base class giving ``self.spark`` (see the module docstring)."""

    #: Minimum seconds between two ``PROGRESS`` updates of one task (each is a write to
    #: the result backend); the end of each Spark operation is always reported.
    progress_interval_seconds: ClassVar[float] = 1.0
    #: Seconds the pool process waits for the task's thread after interrupting Spark
    #: (revoke, time limit), so the job's own error handling can run.
    cancel_grace_seconds: ClassVar[float] = 2.0
    #: The worker's main process uses this request class: it interrupts the task's Spark
    #: session when the pool process died (kill -9, hard time limit) or was terminated.
    Request = "kombu_pgmq.spark.task:SparkRequest"

    _local = threading.local()

    @property
    def spark(self) -> SparkSession:
        """This execution's Spark session (opened on first use, released at the end).

        Raises:
            RuntimeError: used outside a running task.
            SparkError: used after the task was cancelled (revoke, time limit).
            SparkServerError: the local Connect server could not be started.
        """
        run = getattr(self._local, "run", None)
        if run is None:
            raise RuntimeError(
                f"{self.name}: self.spark is only available while the task runs "
                "(bind=True and access it inside the task function)"
            )
        return run.spark

    @property
    def pgmq_url(self) -> str:
        """The broker URL (for the ``pgmq`` data source's ``url`` option)."""
        return str(self.app.conf.broker_url)

    def require_executors(
        self, *, paths: Any = (), broker: bool = False, datasource: bool = False
    ) -> None:
        """On a cluster, check that the executors see ``paths``, reach the broker
        (``broker=True``: :attr:`pgmq_url`) and import the ``pgmq`` data source
        (``datasource=True``); nothing on a local master. See
        :func:`kombu_pgmq.spark.preflight.require`.

        Raises:
            SparkError: a problem, with the executor hosts and the fix.
        """
        preflight.require(
            self.spark,
            paths=paths,
            broker_url=self.pgmq_url if broker else None,
            datasource=datasource,
        )

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        request = self.request
        task_id = request.id
        if task_id is None:  # called as a plain function, not as a task
            return super().__call__(*args, **kwargs)
        run = _Run(self, task_id, int(request.retries or 0))
        outcome: dict[str, Any] = {}
        done = threading.Event()
        context = self.request_stack.top
        body = super().__call__

        def target() -> None:
            # Celery's request context is thread-local: give the helper thread the same one,
            # so self.request, self.retry() and update_state() work in the task body.
            self.request_stack.push(context)
            self._local.run = run
            try:
                outcome["value"] = body(*args, **kwargs)
            except BaseException as exc:
                outcome["error"] = exc
            finally:
                self._local.run = None
                self.request_stack.pop()
                done.set()

        thread = threading.Thread(target=target, name=f"spark-task-{task_id}", daemon=True)
        thread.start()
        try:
            # Waiting in short slices keeps the main thread responsive to the signals
            # Celery uses for revoke/time limits (they raise here, not in the helper).
            while not done.wait(0.05):
                pass
        except BaseException:
            run.cancel()
            done.wait(self.cancel_grace_seconds)
            run.close()
            raise
        run.close()
        if "error" in outcome:
            error = outcome["error"]
            explained = preflight.explain(error)  # kombu_pgmq missing on the executors
            if explained is not None:
                raise explained from error
            raise error
        return outcome.get("value")


def spark_task(app: Any, *args: Any, **options: Any) -> Callable[..., Any]:
    """``@spark_task(app, time_limit=600)``: ``app.task(base=SparkTask, bind=True, ...)``."""
    options.setdefault("base", SparkTask)
    options.setdefault("bind", True)
    return app.task(*args, **options)


class SparkRequest(Request):
    """Request class of :class:`SparkTask` in the worker's main process.

    When the pool process running the task is terminated, killed or timed out, the task
    cannot cancel its own Spark work any more (or might not get to): this interrupts the
    task's session from a subprocess (:mod:`kombu_pgmq.spark.interrupt`).
    """

    def terminate(self, pool: Any, signal: Any = None) -> None:
        super().terminate(pool, signal)
        self._interrupt_spark("terminated")

    def on_timeout(self, soft: bool, timeout: float) -> None:
        super().on_timeout(soft, timeout)
        if not soft:
            # The pool process may store one last PROGRESS between Celery's FAILURE and
            # its death: store FAILURE again once the process is gone.
            exc = TimeLimitExceeded(timeout)
            self._interrupt_spark(
                "hard time limit",
                then=lambda: self.task.backend.store_result(
                    self.id, exc, states.FAILURE, request=self._context
                ),
            )

    def on_failure(
        self, exc_info: Any, send_failed_event: bool = True, return_ok: bool = False
    ) -> None:
        from billiard.exceptions import WorkerLostError

        exc = getattr(exc_info, "exception", None)
        exc = getattr(exc, "exc", exc)  # ExceptionWithTraceback
        try:
            super().on_failure(exc_info, send_failed_event=send_failed_event, return_ok=return_ok)
        finally:
            if isinstance(exc, (WorkerLostError, SystemExit)):
                self._interrupt_spark("pool process lost")

    def _interrupt_spark(self, reason: str, then: Callable[[], Any] | None = None) -> None:
        conf = self.task.app.conf
        try:
            remote = server.remote_url(conf)
            port = server.local_port(conf)
        except Exception:
            _logger.warning("cannot interrupt Spark of task %s", self.id, exc_info=True)
            return
        if remote == "local":  # a private per-process server died with the process
            return
        # Where to connect goes through the environment: a URL may carry a token, and
        # command lines are visible to every user (ps). The subprocess checks that the
        # local server is ours and reads its token itself.
        env = dict(os.environ)
        if remote is not None:
            env[server.ENV_REMOTE] = remote
        else:
            env.pop(server.ENV_REMOTE, None)
            env[server.ENV_PORT] = str(port)
        retries = int(self.request_dict.get("retries") or 0)
        cmd = [sys.executable, "-m", "kombu_pgmq.spark.interrupt", self.id, str(retries)]
        _logger.info("task %s: %s; interrupting its Spark session", self.id, reason)
        try:
            proc = subprocess.Popen(
                cmd,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                start_new_session=True,
            )
        except OSError:
            _logger.warning("cannot start the Spark interrupt of task %s", self.id, exc_info=True)
            return

        def wait() -> None:
            proc.wait()
            if then is not None:
                try:
                    then()
                except Exception:
                    _logger.warning("task %s: after the interrupt", self.id, exc_info=True)

        threading.Thread(target=wait, name="spark-interrupt", daemon=True).start()
