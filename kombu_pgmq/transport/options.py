"""Transport options: one frozen, validated :class:`TransportOptions`, parsed once per
Kombu connection from ``Connection(transport_options=...)`` / Celery's
``broker_transport_options``.

Each field carries its unit and its documentation (``metadata``); the README's table of
transport options is checked against :data:`OPTIONS` by a test, so the two cannot drift.
The options kombu itself reads from the same dict (:data:`KOMBU_OPTIONS`) are accepted
and left to it; a removed option (:data:`REMOVED_OPTIONS`) is refused, saying what
replaced it; any other name is refused, with the closest known name (a typo such as
``visibilty_timeout`` would otherwise pass silently and leave the default in force).
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from .. import _conninfo as conninfo
from .._db.pooling import POOLERS
from .._priorities import validate_steps
from ..errors import ConfigurationError
from ..limits import validate_limits

__all__ = ["JSONB_MAX_BYTES", "KOMBU_OPTIONS", "OPTIONS", "REMOVED_OPTIONS", "TransportOptions"]

#: Largest value a jsonb column holds (PostgreSQL's limit, 255 MiB).
JSONB_MAX_BYTES = 268_435_455
#: Caps the server enforces on windows a caller sets (migration 0017): a visibility
#: timeout of 12 hours (SQS's maximum), a deduplication window of 7 days, a consumer
#: counted as gone at most a day after its last heartbeat.
MAX_VISIBILITY_TIMEOUT_SECONDS = 43_200
MAX_DEDUPLICATION_WINDOW_SECONDS = 604_800
MAX_CONSUMER_STALE_AFTER_SECONDS = 86_400

#: Transport options kombu reads itself (kombu 5.7; Celery adds none of its own): its
#: virtual channel's ``from_transport_options``; its ``Connection``'s connect retries
#: (``_extract_failover_opts``); and a publish's retry policy, which
#: ``Producer.publish(retry=True)`` writes into the connection's transport options
#: (``Connection.ensure``'s arguments, Celery's ``task_publish_retry_policy``).
#: ``polling_interval`` is kombu's and ours.
KOMBU_OPTIONS = frozenset(
    {
        "body_encoding",
        "deadletter_queue",
        "max_retries",
        "interval_start",
        "interval_step",
        "interval_max",
        "connect_retries_timeout",
        "errback",
        "callback",
        "on_revive",
        "retry_errors",
    }
)

#: Removed transport options: ``{name: what the transport does instead}``. Passing one
#: is refused with that text: a configuration naming it asks for a behaviour the
#: transport does not have, so it is not ignored.
REMOVED_OPTIONS: Mapping[str, str] = {
    "handover": "a consumer waiting on a queue is handed the next message published there "
    "in its wake-up whenever the message allows it (docs: Delivery semantics and "
    "durability, Hand-over)",
}


def _doc(unit: str, text: str) -> dict[str, str]:
    return {"unit": unit, "doc": text}


@dataclass(frozen=True)
class TransportOptions:
    """The transport options in force for one Kombu connection (see the module docstring
    of :mod:`kombu_pgmq.transport` for what each does)."""

    visibility_timeout: float = field(
        default=30.0,
        metadata=_doc(
            "seconds", "invisibility of a delivered, unacked message after its last lease renewal"
        ),
    )
    lease_renewal_interval: float | None = field(
        default=None,
        metadata=_doc(
            "seconds",
            "how often held messages' leases are renewed (None: visibility_timeout / 3; 0: off)",
        ),
    )
    max_deliveries: int | None = field(
        default=None, metadata=_doc("deliveries", "dead-letter after this many deliveries")
    )
    dead_letter_queue: str = field(
        default="kombu_pgmq_dlq", metadata=_doc("queue name", "where dead letters go")
    )
    read_batch_size: int = field(
        default=100, metadata=_doc("messages", "most messages read in one round trip")
    )
    priority_steps: tuple[int, ...] | None = field(
        default=None, metadata=_doc("priorities", "floors of the priority bands")
    )
    eta_lead_seconds: float = field(
        default=2.0, metadata=_doc("seconds", "an ETA task becomes visible this early")
    )
    polling_interval: float = field(
        default=1.0, metadata=_doc("seconds", "fallback poll of every consumed queue")
    )
    durable_acks: bool = field(default=False, metadata=_doc("bool", "commit acks synchronously"))
    confirm_publish: bool = field(
        default=True,
        metadata=_doc("bool", "a publish returns once committed (False: once sent; py-amqp's)"),
    )
    visible_before_flush: bool = field(
        default=True,
        metadata=_doc("bool", "a waiting consumer gets a publish before its WAL flush"),
    )
    vacuum_threshold: int = field(
        default=20_000, metadata=_doc("dead tuples", "VACUUM a consumed queue table above this")
    )
    install_schema: bool = field(
        default=True, metadata=_doc("bool", "install PGMQ and the migrations on connect")
    )
    connection_options: Mapping[str, Any] = field(
        default_factory=dict, metadata=_doc("dict", "extra libpq parameters")
    )
    consumer_heartbeat_interval: float = field(
        default=10.0, metadata=_doc("seconds", "consumer heartbeats and reaper runs")
    )
    max_message_bytes: int = field(
        default=64 * 1024 * 1024,
        metadata=_doc("bytes", "largest message (body and headers as stored) a publish sends"),
    )
    consumer_stale_after: float = field(
        default=30.0, metadata=_doc("seconds", "a consumer without heartbeat counts as gone")
    )
    deduplication_window: float = field(
        default=300.0,
        metadata=_doc("seconds", "a deduplication id is accepted once within this window"),
    )
    queue_limits: Mapping[str, Mapping[str, Any]] = field(
        default_factory=dict,
        metadata=_doc("dict", "fleet-wide limits per queue, set when a worker declares it"),
    )
    pooler: str | None = field(
        default=None,
        metadata=_doc(
            "None, 'session' or 'transaction'",
            "the broker URL is a pooler's (PgBouncer): 'transaction' relies on no session state",
        ),
    )
    direct_url: str | None = field(
        default=None,
        repr=False,  # may hold a password
        metadata=_doc("libpq URL", "with pooler='transaction': LISTEN here (None: consumers poll)"),
    )
    pooler_prepared_statements: bool = field(
        default=False,
        metadata=_doc("bool", "with pooler='transaction': it keeps prepared statements (1.21+)"),
    )

    @property
    def vt_seconds(self) -> int:
        """The visibility timeout in whole seconds (PGMQ's unit), at least 1."""
        return max(1, round(self.visibility_timeout))

    @property
    def renewal_interval_seconds(self) -> float:
        """Seconds between lease renewal rounds (0: renewal off)."""
        if self.lease_renewal_interval is None:
            return self.visibility_timeout / 3.0
        return self.lease_renewal_interval

    @classmethod
    def parse(cls, options: Mapping[str, Any] | None) -> TransportOptions:
        """Validate ``options`` (a transport options dict) once.

        Raises:
            ConfigurationError: an unknown option (the message suggests the closest
                known name), or an option with a bad value (the message names the
                option, the value and what is expected).
        """
        _refuse_unknown(options or {})
        given = {f.name: options[f.name] for f in fields(cls) if options and f.name in options}
        values = {**{f.name: _default(f) for f in fields(cls)}, **given}

        def bad(name: str, want: str) -> ConfigurationError:
            return ConfigurationError(
                f"transport option {name}={values[name]!r} is invalid: expected {want}"
                f" (default: {OPTIONS[name][1]!r})"
            )

        vt = _number(values["visibility_timeout"])
        if vt is None or not 1 <= vt <= MAX_VISIBILITY_TIMEOUT_SECONDS:
            raise bad("visibility_timeout", f"seconds from 1 to {MAX_VISIBILITY_TIMEOUT_SECONDS}")
        renewal = values["lease_renewal_interval"]
        if renewal is not None:
            renewal = _number(renewal)
            if renewal is None or not 0 <= renewal < vt:
                raise ConfigurationError(
                    f"transport option lease_renewal_interval="
                    f"{values['lease_renewal_interval']!r} is invalid: expected seconds below "
                    f"visibility_timeout ({vt:g}), e.g. {vt / 3:g}; 0 turns lease renewal off"
                )
        md = values["max_deliveries"]
        if md is not None and (not _is_int(md) or md < 1):
            raise bad("max_deliveries", "an int >= 1, or None for unlimited")
        if not _is_int(values["read_batch_size"]) or values["read_batch_size"] < 1:
            raise bad("read_batch_size", "an int >= 1")
        if not isinstance(values["dead_letter_queue"], str) or not values["dead_letter_queue"]:
            raise bad("dead_letter_queue", "a queue name")
        steps = validate_steps(values["priority_steps"])
        lead = _number(values["eta_lead_seconds"])
        if lead is None or lead < 0:
            raise bad("eta_lead_seconds", "seconds >= 0")
        polling = _number(values["polling_interval"])
        if polling is None or polling <= 0:
            raise bad("polling_interval", "seconds > 0")
        for name in (
            "durable_acks",
            "confirm_publish",
            "visible_before_flush",
            "install_schema",
        ):
            if not isinstance(values[name], bool):
                raise bad(name, "True or False")
        threshold = values["vacuum_threshold"]
        if not _is_int(threshold) or threshold < 0:
            raise bad(
                "vacuum_threshold",
                "a number of dead tuples >= 0 (0: never vacuum, leave it to autovacuum)",
            )
        max_bytes = values["max_message_bytes"]
        if not _is_int(max_bytes) or not 1024 <= max_bytes <= JSONB_MAX_BYTES:
            raise bad("max_message_bytes", f"bytes from 1024 to {JSONB_MAX_BYTES} (jsonb's limit)")
        conn_opts = values["connection_options"] or {}
        if not isinstance(conn_opts, Mapping):
            raise bad("connection_options", "a dict of libpq parameters")
        timing = {}
        for name, most in (
            ("consumer_heartbeat_interval", None),
            ("consumer_stale_after", MAX_CONSUMER_STALE_AFTER_SECONDS),
            ("deduplication_window", MAX_DEDUPLICATION_WINDOW_SECONDS),
        ):
            number = _number(values[name])
            if number is None or number <= 0:
                raise bad(name, "seconds > 0")
            if most is not None and number > most:
                raise bad(name, f"seconds > 0, at most {most} (the server caps it there)")
            timing[name] = number
        limits = values["queue_limits"] or {}
        if not isinstance(limits, Mapping):
            raise bad("queue_limits", "a dict {queue: {'concurrency': 20, 'rate': '100/s'}}")
        queue_limits = {
            str(queue): validate_limits(str(queue), each) for queue, each in limits.items()
        }
        pooler, direct_url = validate_pooler(
            values["pooler"], values["direct_url"], "transport option"
        )
        prepared = validate_pooler_prepared(
            values["pooler_prepared_statements"], pooler, "transport option"
        )
        return cls(
            pooler=pooler,
            direct_url=direct_url,
            pooler_prepared_statements=prepared,
            queue_limits=queue_limits,
            visibility_timeout=vt,
            lease_renewal_interval=renewal,
            max_deliveries=md,
            dead_letter_queue=values["dead_letter_queue"],
            read_batch_size=values["read_batch_size"],
            priority_steps=steps,
            eta_lead_seconds=lead,
            polling_interval=polling,
            durable_acks=values["durable_acks"],
            confirm_publish=values["confirm_publish"],
            visible_before_flush=values["visible_before_flush"],
            vacuum_threshold=threshold,
            install_schema=values["install_schema"],
            connection_options=dict(conn_opts),
            max_message_bytes=max_bytes,
            **timing,
        )


def validate_pooler(pooler: Any, direct_url: Any, source: str) -> tuple[str | None, str | None]:
    """Check the ``pooler`` and ``direct_url`` options (``source`` names where they were
    given in messages, e.g. ``"transport option"``); returns them (``"session"`` as
    None: nothing special).

    Raises:
        ConfigurationError: ``pooler`` is not one of None, "session", "transaction";
            ``direct_url`` is not a PostgreSQL URL (password masked), or is given without
            ``pooler="transaction"``.
    """
    if pooler not in POOLERS:
        raise ConfigurationError(
            f"{source} pooler={pooler!r} is invalid: expected None (no pooler), 'session' "
            "(a pooler in session mode: nothing changes) or 'transaction' (PgBouncer's "
            "pool_mode = transaction)"
        )
    if direct_url is None:
        return (pooler if pooler == "transaction" else None), None
    if pooler != "transaction":
        raise ConfigurationError(
            f"{source} direct_url is given but pooler={pooler!r}: direct_url is the direct "
            "connection for LISTEN behind a transaction pooler; set pooler='transaction' "
            "too, or remove direct_url"
        )
    if not isinstance(direct_url, str) or not conninfo.is_ours(direct_url):
        shown = conninfo.redact(direct_url) if isinstance(direct_url, str) else direct_url
        raise ConfigurationError(
            f"{source} direct_url={shown!r} is invalid: expected a PostgreSQL URL straight "
            "to the server (not through the pooler), postgresql://user@host:5432/dbname"
        )
    conninfo.url_to_params(direct_url)  # raises, password masked, if unparseable
    return pooler, direct_url


def validate_pooler_prepared(value: Any, pooler: str | None, source: str) -> bool:
    """Check the ``pooler_prepared_statements`` option against ``pooler`` (as
    :func:`validate_pooler` returned it).

    Raises:
        ConfigurationError: not a bool, or True without ``pooler="transaction"``.
    """
    if not isinstance(value, bool):
        raise ConfigurationError(
            f"{source} pooler_prepared_statements={value!r} is invalid: expected True or "
            "False (default: False)"
        )
    if value and pooler != "transaction":
        raise ConfigurationError(
            f"{source} pooler_prepared_statements=True needs pooler='transaction' (a "
            "direct connection always prepares): set pooler='transaction', or remove it"
        )
    return value


def _default(f: Any) -> Any:
    return f.default_factory() if callable(f.default_factory) else f.default


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value: Any) -> float | None:
    """``value`` as a finite float (None: not a number, a bool, NaN or infinite)."""
    if isinstance(value, bool):
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if math.isfinite(number) else None


def _refuse_unknown(options: Mapping[str, Any]) -> None:
    """Raise :class:`ConfigurationError` for removed names (:data:`REMOVED_OPTIONS`), then
    for names neither ours nor kombu's."""
    removed = sorted(str(name) for name in options if name in REMOVED_OPTIONS)
    if removed:
        raise ConfigurationError(
            "; ".join(
                f"transport option {name!r} was removed: {REMOVED_OPTIONS[name]}; remove it"
                for name in removed
            )
        )
    known = [*OPTIONS, *sorted(KOMBU_OPTIONS)]
    unknown = sorted(
        str(name) for name in options if name not in OPTIONS and name not in KOMBU_OPTIONS
    )
    if not unknown:
        return
    parts: list[tuple[str, str | None]] = []
    for name in unknown:
        matches = difflib.get_close_matches(name, known, n=1)
        parts.append((name, matches[0] if matches else None))
    ours = ", ".join(OPTIONS)
    if len(parts) == 1:
        name, close = parts[0]
        hint = (
            f"did you mean {close!r}?"
            if close
            else "not an option of kombu_pgmq or kombu: remove it"
        )
        raise ConfigurationError(
            f"unknown transport option {name!r}: {hint} (kombu_pgmq's options: {ours})"
        )
    listed = ", ".join(
        f"{name!r} (did you mean {close!r}?)" if close else repr(name) for name, close in parts
    )
    raise ConfigurationError(
        f"unknown transport options {listed}: fix or remove them (kombu_pgmq's options: {ours})"
    )


#: ``{name: (unit, default, doc)}`` of every transport option (README's table).
OPTIONS: dict[str, tuple[str, Any, str]] = {
    f.name: (f.metadata["unit"], _default(f), f.metadata["doc"]) for f in fields(TransportOptions)
}
