"""Beat settings read from the Celery configuration (``app.conf``), and their
documentation: :data:`SETTINGS` describes each setting the readers below read, and the
Settings of :mod:`kombu_pgmq.beat.scheduler`'s docstring and docs/beat.md's table are
generated from it (:func:`options_rst`, ``docs/_ext/hooks.py``), so no copy can drift.
"""

from __future__ import annotations

from typing import Any

from .. import _conninfo as conninfo
from .. import errors
from .._option_docs import OptionDoc, rst_list

__all__ = [
    "OPTIONS_MARKER",
    "SETTINGS",
    "catch_up",
    "database_url",
    "history_seconds",
    "install_schema",
    "lookahead_seconds",
    "option_docs",
    "options_rst",
    "takeover_seconds",
]

#: Every ``beat_*`` setting the readers of this module read: name, type, unit, default
#: and what it does (reST inline markup: ``code`` only).
SETTINGS: tuple[OptionDoc, ...] = (
    OptionDoc(
        "beat_database_url",
        "str or None",
        "",
        "None",
        "the schedule's database (``postgresql://...``). None: the broker's database "
        "when the broker is kombu_pgmq (its ``direct_url`` behind PgBouncer in transaction "
        "mode: the leader holds a session advisory lock, so beat refuses a transaction "
        "pooler without one), else ``result_backend`` when it is PostgreSQL, else "
        "``$KOMBU_PGMQ_URL``, ``$DATABASE_URL`` or the embedded PostgreSQL.",
        (("PgBouncer", "pgbouncer.md"),),
    ),
    OptionDoc(
        "beat_takeover_seconds",
        "number",
        "seconds",
        "10",
        "longest time without a working leader when the leader hangs (above 1); a leader "
        "that dies is replaced within about one election round (``min(1, takeover / 5)`` "
        "seconds).",
    ),
    OptionDoc(
        "beat_catch_up",
        "str",
        "",
        "'once'",
        "default catch-up policy of the entries for ticks missed while no leader ran: "
        "``'once'`` (one tick) or ``'skip'`` (an entry's own: ``catch_up`` in the entry or "
        "its ``options``).",
        (("Catch-up: once or skip", "beat.md#catch-up-once-or-skip"),),
    ),
    OptionDoc(
        "beat_history_seconds",
        "number",
        "seconds",
        "604800",
        "how long sent ticks are kept in ``kombu_pgmq.beat_ticks`` (7 days).",
    ),
    OptionDoc(
        "beat_install_schema",
        "bool",
        "",
        "True",
        "install the migrations if missing. False for least-privilege roles (``kombu-pgmq "
        "schema grant``): the schema must be installed already.",
        (("Least privilege", "beat.md#least-privilege"),),
    ),
    OptionDoc(
        "beat_lookahead_seconds",
        "number",
        "seconds",
        "0",
        "publish ticks up to this early, invisible until their due time (0: at the due "
        "time; at most 60; only with the broker in the schedule's database).",
        (("Publishing ahead", "beat.md#publishing-ahead"),),
    ),
)

#: Where the scheduler's docstring lists :data:`SETTINGS` (:func:`options_rst`), and
#: docs/beat.md their table (``docs/_ext/hooks.py``).
OPTIONS_MARKER = "<!-- beat-settings -->"


def option_docs() -> list[OptionDoc]:
    """The beat's settings (:data:`SETTINGS`), as the docs' table shows them."""
    return list(SETTINGS)


def options_rst(width: int = 88) -> str:
    """The beat's settings as a reST bullet list (:func:`kombu_pgmq._option_docs.rst_list`)."""
    return rst_list(SETTINGS, width)


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


def catch_up(conf: Any) -> str:
    """``beat_catch_up`` (default ``"once"``)."""
    return str(conf.get("beat_catch_up", "once"))


def history_seconds(conf: Any) -> float:
    """``beat_history_seconds`` (default 7 days)."""
    return float(conf.get("beat_history_seconds", 7 * 86400))


def install_schema(conf: Any) -> bool:
    """``beat_install_schema`` (default True)."""
    return bool(conf.get("beat_install_schema", True))
