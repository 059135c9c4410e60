"""Checks a ``celery worker`` runs before it starts, when its broker is kombu_pgmq's
(and, at ``worker_init`` or ``worker_ready``, the durable revocations it loads:
:mod:`kombu_pgmq.revocations`).

Celery creates the transport inside ``app.Worker(...)`` (to ask whether it can run an
event loop), before its logging is set up and outside any error handler: a
:class:`~kombu_pgmq.errors.ConfigurationError` raised by the transport there reaches the
terminal as Python's traceback, some 60 lines of click, Celery and kombu frames with the
message last. Celery sends ``celeryd_init`` just before that, in ``celery worker`` only;
:func:`check_transport_options` validates ``broker_transport_options`` there and, if they
are invalid, ends the worker with one line on stderr naming the option, the value and the
fix (a ``SystemExit``, as Celery's own ``WorkerShutdown``). Exit status 1.

Connected by ``import kombu_pgmq`` in a process that has imported Celery: ``celery -A proj
worker`` imports the app module, which imports kombu_pgmq (it must, for the
``postgresql://`` scheme), after Celery. A worker that finds the transport only through
``broker_transport = "kombu_pgmq:Transport"``, without that import, reports the error as
the traceback above.

The same import connects the result backend's expiry sweep
(:mod:`kombu_pgmq.results.expiry`): started on ``worker_ready`` in the worker's main
process when ``result_backend`` is kombu_pgmq's, stopped on ``worker_shutdown``.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

from ._conninfo import SCHEMES, is_ours
from .errors import ConfigurationError

__all__ = [
    "check_transport_options",
    "connect",
    "release_task_slots",
    "start_result_expiry",
    "stop_result_expiry",
]


def connect() -> None:
    """Run :func:`check_transport_options` at every ``celery worker`` start (idempotent).
    Only for a process that has imported Celery already (Celery is an extra)."""
    if "celery" not in sys.modules:
        return
    signals = importlib.import_module("celery.signals")
    signals.celeryd_init.connect(
        check_transport_options, weak=False, dispatch_uid="kombu_pgmq.check_transport_options"
    )
    from .revocations import load_into_worker, load_when_ready

    signals.worker_init.connect(
        load_into_worker, weak=False, dispatch_uid="kombu_pgmq.load_revocations"
    )
    signals.worker_ready.connect(
        load_when_ready, weak=False, dispatch_uid="kombu_pgmq.load_revocations_when_ready"
    )
    signals.worker_ready.connect(
        start_result_expiry, weak=False, dispatch_uid="kombu_pgmq.start_result_expiry"
    )
    signals.worker_shutdown.connect(
        stop_result_expiry, weak=False, dispatch_uid="kombu_pgmq.stop_result_expiry"
    )
    signals.task_postrun.connect(
        release_task_slots, weak=False, dispatch_uid="kombu_pgmq.release_task_slots"
    )


def release_task_slots(task_id: str | None = None, **_: Any) -> None:
    """``task_postrun`` receiver, in the process that ran the task: free the concurrency
    slot its early ack left held (:mod:`kombu_pgmq.transport._slots`), when this process
    is the worker's own (threads, gevent, solo pools; a prefork child holds none)."""
    slots = sys.modules.get("kombu_pgmq.transport._slots")
    if slots is not None and task_id:
        slots.release_task(task_id)


def _uses_our_backend(app: Any) -> bool:
    """``app``'s ``result_backend`` names kombu_pgmq's (a ``postgresql://`` or
    ``postgres://`` URL, or the class path), judged from the setting alone."""
    setting = app.conf.result_backend
    if not isinstance(setting, str):
        return False
    scheme = setting.partition("://")[0].strip().lower()
    return scheme in SCHEMES or setting.startswith("kombu_pgmq")


def start_result_expiry(sender: Any = None, **_: Any) -> None:
    """``worker_ready`` receiver (``sender``: the worker's consumer): start the expiry
    sweep of a kombu_pgmq result backend in this (the worker's main) process."""
    app = getattr(sender, "app", None)
    if app is None or not _uses_our_backend(app):
        return
    from .results import ResultBackend, expiry  # Celery is there: this is a worker

    backend = app.backend
    if isinstance(backend, ResultBackend):
        expiry.start(backend)


def stop_result_expiry(**_: Any) -> None:
    """``worker_shutdown`` receiver: stop this process's expiry sweep, if it runs."""
    expiry = sys.modules.get("kombu_pgmq.results.expiry")
    if expiry is not None:
        expiry.stop()


def check_transport_options(conf: Any = None, **_: Any) -> None:
    """``celeryd_init`` receiver: refuse invalid ``broker_transport_options`` of a
    kombu_pgmq broker with one line.

    Raises:
        SystemExit: an unknown option or a bad value (the message says which and the fix).
    """
    if conf is None:
        return
    urls = (conf.broker_url, conf.broker_read_url, conf.broker_write_url)
    if not any(is_ours(url, conf.broker_transport) for url in urls):
        return
    from .transport.options import TransportOptions  # the transport package, only now

    try:
        TransportOptions.parse(conf.broker_transport_options or {})
    except ConfigurationError as exc:
        raise SystemExit(f"kombu_pgmq: broker_transport_options: {exc}") from None
