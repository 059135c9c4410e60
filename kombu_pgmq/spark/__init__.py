"""Spark for Celery tasks and DataFrames in and out of queues (extra ``kombu_pgmq[spark]``).

* :class:`SparkTask` / :func:`spark_task`: Celery tasks with ``self.spark``, a Spark Connect
  session per execution (progress as ``PROGRESS`` state, cancelled on revoke/time limit,
  orphans interrupted), against a local Connect server started on demand
  (:mod:`kombu_pgmq.spark.server`) or a cluster (``spark_remote`` / ``$SPARK_REMOTE``).
* The ``pgmq`` data source (:mod:`kombu_pgmq.spark.datasource`): ``df.write.format("pgmq")``
  (rows or Celery task messages, atomic per job), ``spark.read.format("pgmq")`` (queue or
  archive snapshot), ``spark.readStream.format("pgmq")`` (archive on commit).
* On a cluster: :mod:`kombu_pgmq.spark.preflight` checks that executors see a job's paths,
  import ``kombu_pgmq`` and reach the broker; :mod:`kombu_pgmq.spark.cluster` runs a local
  standalone cluster (``kombu-pgmq spark cluster start|stop|status|check``).

Importing this package does not import pyspark (the worker's main process must not open a
Spark session before the prefork pool forks), nor Celery: the names of
:mod:`~kombu_pgmq.spark.session` and :mod:`~kombu_pgmq.spark.task` are imported on first
use, so that executors, which import :mod:`kombu_pgmq.spark.datasource` (and so this
package), need neither Celery nor kombu.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .session import connect_url, interrupt_task, open_session, session_id
    from .task import PROGRESS, SparkRequest, SparkTask, spark_task

#: Lazily imported names: ``{name: submodule}``.
_LAZY = {
    "connect_url": "session",
    "interrupt_task": "session",
    "open_session": "session",
    "session_id": "session",
    "PROGRESS": "task",
    "SparkRequest": "task",
    "SparkTask": "task",
    "spark_task": "task",
}

__all__ = [
    "PROGRESS",
    "SparkRequest",
    "SparkTask",
    "connect_url",
    "interrupt_task",
    "open_session",
    "register",
    "session_id",
    "spark_task",
]


def register(spark: Any) -> None:
    """Register the ``pgmq`` data source in ``spark`` (a classic or Connect session)."""
    from .datasource import register as _register

    _register(spark)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # once
    return value
