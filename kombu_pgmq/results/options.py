"""The result backend's options: one frozen, validated :class:`ResultBackendOptions`,
parsed once per backend from Celery's ``result_backend_transport_options``.

Each field carries its unit and its documentation (``metadata``, as the transport
options' do): the Transport Options of :mod:`kombu_pgmq.results.backend`'s docstring and
the table of docs/results.md are generated from them (:func:`option_docs`). Any other name
in ``result_backend_transport_options`` is refused with the closest known one; Celery's
own settings (``result_expires``...) are not in that dict and are not checked here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from .._option_docs import OptionDoc, field_docs, refuse_unknown, rst_list
from .._option_docs import default_of as _default
from .._option_docs import field_doc as _doc
from .._option_docs import finite_number as _number
from ..errors import ConfigurationError

__all__ = [
    "DEFAULT_MAX_BYTES",
    "OPTIONS_MARKER",
    "ResultBackendOptions",
    "option_docs",
    "options_rst",
]

#: Default ``result_max_bytes``: the largest encoded result stored (64 MiB).
DEFAULT_MAX_BYTES = 64 * 1024 * 1024
#: PostgreSQL's hard limit for one bytea value is 1 GB; keep clear of it.
MAX_BYTES_LIMIT = 1_000_000_000
#: Where the result backend's docstring lists these options (:func:`options_rst`), and
#: docs/results.md their table (``docs/_ext/hooks.py``).
OPTIONS_MARKER = "<!-- result-backend-options -->"
#: What each ``durable_states`` value names.
DURABLE_STATES = ("ready", "all", "none")
_SOURCE = "result_backend_transport_options"
#: The options that come from the broker's ``broker_transport_options`` for
#: ``result_backend = "postgresql://"`` unless ``pooler`` is given here.
_POOLER_OPTIONS = ("pooler", "direct_url", "pooler_prepared_statements")


@dataclass(frozen=True)
class ResultBackendOptions:
    """The options in force for one result backend. Each field's ``metadata`` documents it
    (:func:`option_docs`)."""

    connection_options: Mapping[str, Any] = field(
        default_factory=dict,
        metadata=_doc(
            "",
            "extra libpq parameters, merged over the URL's (e.g. ``{'connect_timeout': 5}``), "
            "for the backend's connections and its LISTEN connection.",
        ),
    )
    install_schema: bool = field(
        default=True,
        metadata=_doc(
            "",
            "install PGMQ and kombu_pgmq's migrations if missing. False for least-privilege "
            "roles (``kombu-pgmq schema grant``): the schema must be installed already.",
            see=(("Least privilege", "guides/least-privilege.md"),),
        ),
    )
    result_max_bytes: int = field(
        default=DEFAULT_MAX_BYTES,
        metadata=_doc(
            "bytes",
            "the largest encoded result stored (64 MiB); a larger one raises Celery's "
            "``BackendStoreError`` and the task is stored as failed with that error. At "
            "most 1000000000 (PostgreSQL stores at most 1 GB in one value).",
        ),
    )
    durable_states: str = field(
        default="ready",
        metadata=_doc(
            "",
            "which writes wait for the WAL flush at commit (PostgreSQL's "
            "``synchronous_commit``): ``'ready'`` the final states (SUCCESS, FAILURE, "
            "REVOKED; STARTED, RETRY and custom progress states do not wait: a server crash "
            "may forget them, never a result); ``'all'``; ``'none'`` (as Redis without "
            "``appendfsync always``: a server crash may forget the latest results, and a task "
            "acked after its result, ``acks_late``, is then run again).",
        ),
    )
    expire_interval_seconds: float = field(
        default=60.0,
        metadata=_doc(
            "seconds",
            "how often each worker's main process deletes expired results "
            "(``result_expires``); 0 turns the sweep off (``celery.backend_cleanup`` or "
            "``kombu-pgmq results expire`` then do it).",
        ),
    )
    expire_batch: int = field(
        default=5000,
        metadata=_doc(
            "rows",
            "rows deleted per statement of the expiry sweep: smaller batches hold their "
            "locks for less time, larger ones take fewer statements.",
        ),
    )
    global_keyprefix: str | None = field(
        default=None,
        metadata=_doc(
            "",
            "Celery's own option: a prefix added to every key the backend stores, so that "
            "several applications can share the results table.",
        ),
    )
    pooler: str | None = field(
        default=None,
        metadata=_doc(
            "",
            "the backend's URL is a connection pooler's: ``'transaction'`` for PgBouncer's "
            "``pool_mode = transaction`` (statements rely on no session state, waiting for "
            "results LISTENs on ``direct_url``); ``'session'``: nothing changes; None: no "
            "pooler. For ``result_backend = 'postgresql://'`` (the broker's database) "
            "``pooler``, ``direct_url`` and ``pooler_prepared_statements`` are the broker's "
            "(``broker_transport_options``) unless ``pooler`` is given here.",
            see=(("PgBouncer", "pgbouncer.md"),),
        ),
    )
    direct_url: str | None = field(
        default=None,
        repr=False,  # may hold a password
        metadata=_doc(
            "",
            "with ``pooler='transaction'``: a libpq URL straight to the server, where "
            "waiting for results LISTENs. Without it ``get()`` re-reads what it waits for "
            "every ``polling_interval`` (one WARNING per process says so). Never shown in "
            "logs or ``repr``.",
            see=(("PgBouncer", "pgbouncer.md"),),
        ),
    )
    pooler_prepared_statements: bool = field(
        default=False,
        metadata=_doc(
            "",
            "with ``pooler='transaction'``: the pooler keeps prepared statements (PgBouncer "
            ">= 1.21 with ``max_prepared_statements`` > 0), so statements are prepared "
            "through it as on a direct connection.",
            see=(("PgBouncer", "pgbouncer.md"),),
        ),
    )
    polling_interval: float = field(
        default=0.5,
        metadata=_doc(
            "seconds",
            "behind a transaction pooler without ``direct_url``: how often a waiting "
            "``get()`` re-reads the results it waits for. Shorter: results seen sooner, more "
            "statements while waiting.",
        ),
    )

    @classmethod
    def parse(
        cls,
        options: Mapping[str, Any] | None,
        broker_options: Mapping[str, Any] | None = None,
    ) -> ResultBackendOptions:
        """Validate ``options`` (``result_backend_transport_options``) once;
        ``broker_options``: the broker's transport options when the backend's database is
        the broker's (``result_backend = "postgresql://"``), whose ``pooler``,
        ``direct_url`` and ``pooler_prepared_statements`` apply unless ``pooler`` is in
        ``options``.

        Raises:
            ConfigurationError: an unknown name (the message suggests the closest known
                one), or a bad value (the message names the option and the value).
        """
        from ..transport.options import validate_pooler, validate_pooler_prepared

        options = options or {}
        refuse_unknown(
            options,
            [f.name for f in fields(cls)],
            what=f"{_SOURCE} key",
            owners="kombu_pgmq's result backend or Celery",
        )
        values = {f.name: options.get(f.name, _default(f)) for f in fields(cls)}
        if broker_options is not None and "pooler" not in options:
            for name in _POOLER_OPTIONS:
                values[name] = broker_options.get(name, _default(_FIELDS[name]))
        max_bytes = _int(values["result_max_bytes"])
        if max_bytes is None or not 0 < max_bytes <= MAX_BYTES_LIMIT:
            shown = values["result_max_bytes"] if max_bytes is None else max_bytes
            raise ConfigurationError(
                f"{_SOURCE} result_max_bytes={shown!r} must be between 1 and "
                f"{MAX_BYTES_LIMIT} (PostgreSQL stores at most 1 GB in one value)"
            )
        durable = values["durable_states"]
        if durable not in DURABLE_STATES:
            raise ConfigurationError(
                f"{_SOURCE} durable_states={durable!r}: use 'ready' (the default), 'all' or 'none'"
            )
        if not isinstance(values["install_schema"], bool):
            raise _bad("install_schema", values, "True or False")
        interval = _number(values["expire_interval_seconds"])
        if interval is None or interval < 0:
            raise _bad("expire_interval_seconds", values, "seconds >= 0 (0: no sweep)")
        batch = _int(values["expire_batch"])
        if batch is None or batch < 1:
            raise _bad("expire_batch", values, "an int >= 1")
        polling = _number(values["polling_interval"])
        if polling is None or polling <= 0:
            raise _bad("polling_interval", values, "seconds > 0")
        connection_options = values["connection_options"] or {}
        if not isinstance(connection_options, Mapping):
            raise _bad("connection_options", values, "a dict of libpq parameters")
        prefix = values["global_keyprefix"]
        if prefix is not None and not isinstance(prefix, str):
            raise _bad("global_keyprefix", values, "a str")
        pooler, direct_url = validate_pooler(values["pooler"], values["direct_url"], _SOURCE)
        prepared = validate_pooler_prepared(values["pooler_prepared_statements"], pooler, _SOURCE)
        return cls(
            connection_options=dict(connection_options),
            install_schema=values["install_schema"],
            result_max_bytes=max_bytes,
            durable_states=durable,
            expire_interval_seconds=interval,
            expire_batch=batch,
            global_keyprefix=prefix,
            pooler=pooler,
            direct_url=direct_url,
            pooler_prepared_statements=prepared,
            polling_interval=polling,
        )


_FIELDS = {f.name: f for f in fields(ResultBackendOptions)}


def _bad(name: str, values: Mapping[str, Any], want: str) -> ConfigurationError:
    return ConfigurationError(
        f"{_SOURCE} {name}={values[name]!r} is invalid: expected {want} "
        f"(default: {_default(_FIELDS[name])!r})"
    )


def _int(value: Any) -> int | None:
    """``value`` as an int (``"2000"`` and ``2000.0`` too; None: not a whole number)."""
    if isinstance(value, bool):
        return None
    try:
        number = int(value)
    except (TypeError, ValueError):
        return None
    return number if number == _number(value) else None


def option_docs() -> list[OptionDoc]:
    """Every result backend option's documentation, in field order: the one source of the
    backend's docstring (:func:`options_rst`) and of docs/results.md's table."""
    return field_docs(ResultBackendOptions)


def options_rst(width: int = 88) -> str:
    """The result backend's options as a reST bullet list
    (:func:`kombu_pgmq._option_docs.rst_list`)."""
    return rst_list(option_docs(), width)
