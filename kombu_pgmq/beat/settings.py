"""Beat settings read from the Celery configuration (see :mod:`kombu_pgmq.beat.scheduler`
for what each means)."""

from __future__ import annotations

from typing import Any

from .. import _conninfo as conninfo
from .. import errors

__all__ = ["database_url", "lookahead_seconds", "takeover_seconds"]


def database_url(app: Any) -> str:
    """The libpq string of the schedule's database (see the module docstring); the
    broker's ``direct_url`` when the broker is behind a transaction pooler.

    Raises:
        ConfigurationError: ``beat_database_url`` is not a PostgreSQL URL, or the broker is
            behind a transaction pooler without ``direct_url``.
    """
    conf = app.conf
    url = conf.get("beat_database_url")
    if not url:
        broker = conf.broker_write_url or conf.broker_url
        if isinstance(broker, (list, tuple)):
            broker = ";".join(broker)
        backend = conf.result_backend
        if broker and conninfo.is_ours(broker, conf.broker_transport):
            url = _direct_url(broker, conf.broker_transport_options or {})
        elif isinstance(backend, str) and backend.split("://")[0] in ("postgresql", "postgres"):
            url = backend
        else:
            from ..embedded import default_broker_url

            url = default_broker_url()
    urls = [u for u in str(url).split(";") if u.strip()]
    if not urls or not conninfo.is_ours(urls[0]):
        raise errors.ConfigurationError(
            f"beat_database_url {conninfo.redact(str(url))!r} is not a PostgreSQL URL: give "
            "postgresql://user@host/db"
        )
    if len(urls) > 1:
        return conninfo.make_dsn(conninfo.failover_params(urls))
    return conninfo.to_dsn(urls[0])


def _direct_url(broker: str, options: Any) -> str:
    """The broker's URL, or its ``direct_url`` behind a transaction pooler: the leader
    holds a session advisory lock, which a transaction pooler would share with other
    clients (two leaders, or none).

    Raises:
        ConfigurationError: ``pooler="transaction"`` without ``direct_url``.
    """
    if options.get("pooler") != "transaction":
        return broker
    direct = options.get("direct_url")
    if not direct:
        raise errors.ConfigurationError(
            "beat: the broker is behind a transaction pooler (broker_transport_options "
            "pooler='transaction') and the leader election needs a session advisory lock, "
            "which a transaction pooler cannot keep: set broker_transport_options "
            "direct_url (or beat_database_url) to a direct PostgreSQL URL"
        )
    return str(direct)


def takeover_seconds(conf: Any) -> float:
    """``beat_takeover_seconds`` (seconds > 1, default 10).

    Raises:
        ConfigurationError: not a number above 1.
    """
    value = conf.get("beat_takeover_seconds", 10)
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        seconds = 0.0
    if seconds <= 1:
        raise errors.ConfigurationError(
            f"beat_takeover_seconds={value!r}: give seconds > 1 (default 10)"
        )
    return seconds


def lookahead_seconds(conf: Any) -> float:
    """``beat_lookahead_seconds`` (0 to 60 seconds, default 0).

    Raises:
        ConfigurationError: not a number from 0 to 60.
    """
    value = conf.get("beat_lookahead_seconds", 0)
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        seconds = -1.0
    if not 0 <= seconds <= 60:
        raise errors.ConfigurationError(
            f"beat_lookahead_seconds={value!r}: give seconds from 0 (publish at the due time, "
            "the default) to 60"
        )
    return seconds
