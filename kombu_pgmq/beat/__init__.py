"""Celery beat on PostgreSQL: a leader elected among any number of beat processes, the
schedule in PostgreSQL, each tick sent once.

- :class:`Scheduler`: ``celery -A proj beat -S kombu_pgmq.beat:Scheduler`` (see
  :mod:`kombu_pgmq.beat.scheduler` for settings and guarantees);
- :class:`PeriodicTasks`: add, change, enable, disable, remove and run periodic tasks at
  run time from application code (:mod:`kombu_pgmq.beat.api`);
- :mod:`kombu_pgmq.beat.leader`: the election (advisory lock, heartbeat, fencing).

Needs Celery (``pip install kombu-pgmq[celery]``).
"""

from __future__ import annotations

from .api import PeriodicTask, PeriodicTasks, Tick, UnknownPeriodicTask
from .scheduler import Scheduler

__all__ = ["PeriodicTask", "PeriodicTasks", "Scheduler", "Tick", "UnknownPeriodicTask"]
