"""kombu_pgmq: PostgreSQL as a Kombu/Celery message broker, on PGMQ queues.

``import kombu_pgmq`` registers the URL schemes ``postgresql://`` and ``postgres://``
with kombu (kombu's own ``pgmq`` alias is left alone), so Celery can use
``broker_url = "postgresql://user:password@host:5432/dbname"``.
See :mod:`kombu_pgmq.transport` for behaviour and transport options, and
:func:`kombu_pgmq.using` (:mod:`kombu_pgmq.transactional`) to enqueue inside the
application's own transaction.
"""

from __future__ import annotations

from . import _worker_checks
from ._conninfo import SCHEMES
from ._naming import pgmq_queue_name
from .errors import (
    BootstrapError,
    BrokerConnectionError,
    ConfigurationError,
    InvalidQueueName,
    KombuPgmqError,
    QueueNotFound,
    StaleDelivery,
    StatementError,
    UnsupportedPgmqVersion,
)

__version__ = "0.1.0"

#: Import path of the transport class (also usable as Celery's ``broker_transport``).
TRANSPORT_PATH = "kombu_pgmq.transport:Transport"


def register() -> None:
    """Register ``postgresql://`` and ``postgres://`` as kombu transport aliases (idempotent).
    Without kombu installed (a Spark executor importing only ``kombu_pgmq.spark.datasource``)
    there is nothing to register with: nothing is done."""
    try:
        from kombu.transport import TRANSPORT_ALIASES
    except ModuleNotFoundError as exc:
        if exc.name == "kombu":
            return
        raise
    for scheme in SCHEMES:
        TRANSPORT_ALIASES[scheme] = TRANSPORT_PATH


register()

# In a process that imported Celery (`celery -A proj worker` importing the app module): a
# worker with bad transport options exits with one line, not a traceback.
_worker_checks.connect()


def __getattr__(name: str) -> object:
    # Lazy: importing the transport pulls in kombu's virtual transport machinery.
    if name == "Transport":
        from .transport import Transport

        return Transport
    if name == "OperationalError":
        from . import errors

        return errors.OperationalError  # deprecated alias of StatementError (warns)
    if name == "using":
        from .transactional import using

        return using
    if name == "AtomicTask":  # imports Celery
        from .atomic import AtomicTask

        return AtomicTask
    if name == "default_broker_url":
        from .embedded import default_broker_url

        return default_broker_url
    raise AttributeError(name)


__all__ = [
    "AtomicTask",
    "BootstrapError",
    "BrokerConnectionError",
    "ConfigurationError",
    "InvalidQueueName",
    "KombuPgmqError",
    "QueueNotFound",
    "StaleDelivery",
    "StatementError",
    "Transport",
    "UnsupportedPgmqVersion",
    "default_broker_url",
    "pgmq_queue_name",
    "register",
    "using",
]
