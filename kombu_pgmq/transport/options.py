"""Transport options: one frozen, validated :class:`TransportOptions`, parsed once per
Kombu connection from ``Connection(transport_options=...)`` / Celery's
``broker_transport_options``.

Each field carries its unit and its documentation (``metadata``): the Transport Options
of :mod:`kombu_pgmq.transport`'s docstring and the docs' table of transport options are
generated from them (:func:`option_docs`), so no copy can drift.
The options kombu itself reads from the same dict (:data:`KOMBU_OPTIONS`) are accepted
and left to it; a removed option (:data:`REMOVED_OPTIONS`) is refused, saying what
replaced it; any other name is refused, with the closest known name (a typo such as
``visibilty_timeout`` would otherwise pass silently and leave the default in force).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from .. import _conninfo as conninfo
from .._db.pooling import POOLERS
from .._option_docs import OptionDoc, field_docs, refuse_unknown, rst_list
from .._option_docs import default_of as _default
from .._option_docs import field_doc as _doc
from .._option_docs import finite_number as _number
from .._priorities import validate_steps
from ..errors import ConfigurationError
from ..limits import validate_limits

__all__ = [
    "JSONB_MAX_BYTES",
    "KOMBU_OPTIONS",
    "OPTIONS",
    "OPTIONS_MARKER",
    "REMOVED_OPTIONS",
    "OptionDoc",
    "TransportOptions",
    "option_docs",
    "options_rst",
]

#: Largest value a jsonb column holds (PostgreSQL's limit, 255 MiB).
JSONB_MAX_BYTES = 268_435_455
#: Caps the server enforces on windows a caller sets (its CHECK constraints): a visibility
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
    "durability, Hand-off)",
}


@dataclass(frozen=True)
class TransportOptions:
    """The transport options in force for one Kombu connection. Each field's ``metadata``
    documents it (:func:`option_docs`): the Transport Options of :mod:`kombu_pgmq.transport`
    and the docs' table are made from it."""

    visibility_timeout: float = field(
        default=30.0,
        metadata=_doc(
            "seconds",
            "how long a delivered, unacked message stays invisible after its last lease "
            "renewal before it is delivered again: how long a crashed worker's tasks wait "
            "before they run again. Tasks may run far longer (held messages' leases are "
            "renewed). Lower it for a faster redelivery after a crash; raise it to ride out "
            "longer stalls of a process or of the database (a renewal must come within it). "
            "From 1 to 43200 (12 hours, SQS's maximum; the server refuses more).",
        ),
    )
    lease_renewal_interval: float | None = field(
        default=None,
        metadata=_doc(
            "seconds",
            "how often a connection pushes the visibility timeout of every message it holds "
            "(running, prefetched, waiting for an ETA) to now + ``visibility_timeout``, in one "
            "statement. Below ``visibility_timeout``: the margin is how long a stalled "
            "process or a database outage may last before a held message is delivered "
            "again, and a shorter interval widens it at one statement more per round. 0 "
            "turns renewal off (a task running longer than ``visibility_timeout`` then runs "
            "again).",
            default="visibility_timeout / 3",
        ),
    )
    max_deliveries: int | None = field(
        default=None,
        metadata=_doc(
            "deliveries",
            "after this many deliveries the next read moves the message to "
            "``dead_letter_queue`` instead of delivering it (SQS's ``maxReceiveCount``), so "
            "that a message whose task kills its worker every time stops being retried. "
            "Restored deliveries (a channel closed, a delivery callback failed) do not count. "
            "None: unlimited.",
        ),
    )
    dead_letter_queue: str = field(
        default="kombu_pgmq_dlq",
        metadata=_doc(
            "",
            "Kombu name of the queue dead letters go to (a PGMQ queue; each copy has an "
            "``x-dead-letter`` header with the original queue, ``msg_id``, ``read_ct``, the "
            "reason and times); applications sharing a database may each have their own. "
            "Not kombu's ``deadletter_queue``, which is for unroutable messages.",
            see=(("Long tasks, countdowns, priorities, dead letters", "guides/long-tasks.md"),),
        ),
    )
    read_batch_size: int = field(
        default=100,
        metadata=_doc(
            "messages",
            "most messages read in one round trip: a consumer reads up to its free "
            "prefetch, and this caps a read when the prefetch is unlimited (kombu's "
            "``prefetch_count`` 0). Lower it so that such a consumer holds fewer messages at "
            "once (other consumers get the rest); raise it for fewer round trips while it "
            "drains a backlog.",
        ),
    )
    priority_steps: tuple[int, ...] | None = field(
        default=None,
        metadata=_doc(
            "priorities",
            "floors of the priority bands (0 to 9) of a queue *first declared* by this "
            "process with ``x-max-priority``, e.g. ``[0, 3, 6, 9]``: 4 tables instead of "
            "one per priority level, so a read visits fewer tables, for coarser priorities "
            "(as kombu's Redis transport). None: a band per priority level.",
        ),
    )
    eta_lead_seconds: float = field(
        default=2.0,
        metadata=_doc(
            "seconds",
            "a Celery countdown/ETA task waits in its queue table (PGMQ's native delay) until "
            "this long before its ETA; then a worker receives it and Celery runs it at the "
            "ETA (waiting consumers are woken when it becomes due). Raise it when ETA tasks "
            "start late (busy workers, a publisher's clock behind the database server's); "
            "lower it to keep them out of workers' prefetch for less time.",
        ),
    )
    polling_interval: float = field(
        default=1.0,
        metadata=_doc(
            "seconds",
            "fallback poll of every consumed queue, for messages that become visible without "
            "a publish (a lapsed visibility timeout); in a worker, a probe sent on the LISTEN "
            "connection without waiting (which queues hold a visible message), then a read "
            "of those only. New messages, and delayed ones when they become due, wake "
            "consumers at once (LISTEN/NOTIFY); behind a transaction pooler without "
            "``direct_url`` consumers poll at this interval. Longer: fewer statements from "
            "idle consumers, later redelivery of lapsed messages.",
        ),
    )
    durable_acks: bool = field(
        default=False,
        metadata=_doc(
            "",
            "commit acks synchronously. By default deliveries and acks commit "
            "asynchronously: a server crash (PostgreSQL or the machine) may forget the last "
            "~600 ms of them (3 x ``wal_writer_delay``), and those messages are delivered "
            "again, never lost. True: an acked task never runs again for that reason, at one "
            "WAL flush per batch of acks.",
            see=(("Delivery semantics and durability", "guides/delivery.md#durability"),),
        ),
    )
    confirm_publish: bool = field(
        default=True,
        metadata=_doc(
            "",
            "a publish returns once the server committed it and its commit is on disk. "
            "False: it commits without waiting for the WAL flush (``synchronous_commit = "
            "off`` for its transaction), and a publish to the default exchange (Celery's "
            "``apply_async``) returns once its statement is sent (the server's answer is read "
            "before the connection's next statement; a publish the server refuses is "
            "published again, logged as a warning, at the next publish or when the channel "
            "closes). Faster producers; what it risks: a server crash forgets the publishes "
            "of its last moments, at most ~600 ms (3 x ``wal_writer_delay``; 0.4 to 273 ms "
            "measured over 10 crashes), as RabbitMQ without publisher confirms or Redis "
            "without ``appendfsync always``, and a refused last publish of a process that "
            "exits without closing its connection is lost. py-amqp's option of the same name "
            "(there False is the default). Publishes in the application's transaction "
            "commit with it.",
            see=(
                ("Delivery semantics and durability", "guides/delivery.md#durability"),
                ("Benchmarks", "benchmarks.md"),
            ),
        ),
    )
    visible_before_flush: bool = field(
        default=True,
        metadata=_doc(
            "",
            "a direct publish (Celery's ``apply_async``, the default exchange, an exchange "
            "routing to one queue) that a waiting consumer gets commits without waiting for "
            "the WAL flush, so the consumer gets it at once, then waits for the flush in a "
            "second transaction (one logical decoding message, prefix ``kombu_pgmq.flush``): "
            "``publish`` still returns only once the message is on disk. A publish nobody "
            "waits for commits once, synchronously. The consumer gets the message about one "
            "WAL flush sooner, for a second transaction id, a small WAL record and one more "
            "round trip per such publish. False: one transaction per publish, which returns "
            "sooner (a producer publishes more per second), and a task never starts from a "
            "message a server crash then forgets; also for a role that may not run "
            "``pg_logical_emit_message`` (each of its connections otherwise turns the option "
            "off with a warning) and for logical decoding clients that should not see the "
            "``kombu_pgmq.flush`` messages.",
            see=(("Seen before the flush", "guides/delivery.md#seen-before-the-flush"),),
        ),
    )
    vacuum_threshold: int = field(
        default=20_000,
        metadata=_doc(
            "dead tuples",
            "a consuming process VACUUMs a consumed queue's table when it holds more dead row "
            "versions than this (checked every ``consumer_heartbeat_interval``): every "
            "delivery and ack leaves one, and a busy queue collects them faster than "
            "autovacuum (once a minute at best) removes them. Only tables its role owns "
            "(roles granted as workers leave them to autovacuum). While an old transaction "
            "holds the database's xmin horizon, a table already VACUUMed under it is skipped "
            "and the holder is logged once it is a minute old. Lower: smaller tables under "
            "churn, more VACUUMs; 0: never, leave it to autovacuum.",
            see=(("Long transactions", "guides/long-transactions.md"),),
        ),
    )
    install_schema: bool = field(
        default=True,
        metadata=_doc(
            "",
            "on connect, install PGMQ (the extension, or the bundled SQL-only form) and "
            "kombu_pgmq's migrations if missing. False for roles that may not (granted as "
            "producer or worker by ``kombu-pgmq schema grant``): the schema must be there, "
            "and a missing one is a clear error.",
            see=(("Least privilege", "guides/least-privilege.md"),),
        ),
    )
    connection_options: Mapping[str, Any] = field(
        default_factory=dict,
        metadata=_doc(
            "",
            "extra libpq parameters, merged over the URL's, for what the URL should not "
            "carry (e.g. ``{'connect_timeout': 5}``).",
        ),
    )
    consumer_heartbeat_interval: float = field(
        default=10.0,
        metadata=_doc(
            "seconds",
            "how often a consuming process marks its consumers live, runs the reaper of "
            "abandoned queues and checks ``vacuum_threshold``. Shorter: quicker clean-up, "
            "more statements from every consuming process; keep it well below "
            "``consumer_stale_after``.",
        ),
    )
    max_message_bytes: int = field(
        default=64 * 1024 * 1024,
        metadata=_doc(
            "bytes",
            "largest message a publish sends (body and headers as stored; 64 MiB); a larger "
            "one is a ``ConfigurationError`` before anything is sent. From 1024 to 268435455 "
            "(jsonb's limit, 255 MiB): raise it for large arguments, lower it to refuse them "
            "early. A message over about 2 kB is compressed by PostgreSQL (TOAST): with lz4 "
            "on the transport's connection when the server has it and its configuration "
            "names no ``default_toast_compression``.",
        ),
    )
    consumer_stale_after: float = field(
        default=30.0,
        metadata=_doc(
            "seconds",
            "a consumer whose process sent no heartbeat for this long counts as gone (its "
            "process died): its ``auto_delete`` queues are dropped. Shorter: a dead process's "
            "queues go sooner; longer: a process that stalls (a paused VM) keeps them. At "
            "most 86400 (a day).",
        ),
    )
    deduplication_window: float = field(
        default=300.0,
        metadata=_doc(
            "seconds",
            "a message whose ``x-deduplication-id`` header (or, on a queue declared with "
            "``x-deduplicate-task-id``, Celery task id) was published to the same queue less "
            "than this long ago is not enqueued again (SQS FIFO's "
            "``MessageDeduplicationId``); the publish returns as if it had, and logs at debug "
            "level. Longer catches duplicates sent further apart. At most 604800 (7 days; "
            "the server refuses more).",
        ),
    )
    queue_limits: Mapping[str, Mapping[str, Any]] = field(
        default_factory=dict,
        metadata=_doc(
            "",
            "fleet-wide limits per Kombu queue, ``{'queue': {'concurrency': 20, 'rate': "
            "'100/s'}}`` (also ``burst``, ``key_concurrency``, ``key_rate``, ``key_burst``, "
            "``limit_key``; any subset). A worker sets them when it declares the queue, "
            "replacing the limits stored for it (those not named are removed; ``kombu-pgmq "
            "queue limit`` changes them at run time until then). Checked when the "
            "connection is made: an unknown limit or a bad rate is a "
            "``ConfigurationError``.",
            see=(("Limits", "limits.md"),),
        ),
    )
    pooler: str | None = field(
        default=None,
        metadata=_doc(
            "",
            "the broker URL is a connection pooler's: ``'transaction'`` for PgBouncer's "
            "``pool_mode = transaction`` (statements rely on no session state: no prepared "
            "statements unless ``pooler_prepared_statements``, settings per transaction, "
            "LISTEN on ``direct_url``); ``'session'``: nothing changes; None: no pooler.",
            see=(("PgBouncer", "pgbouncer.md"),),
        ),
    )
    direct_url: str | None = field(
        default=None,
        repr=False,  # may hold a password
        metadata=_doc(
            "",
            "with ``pooler='transaction'``: a libpq URL straight to the server (not through "
            "the pooler), for what a transaction pooler cannot carry: consumers' LISTEN "
            "wake-ups and the beat's leader lock. Without it consumers poll every "
            "``polling_interval`` (one WARNING per process says so) and beat refuses to "
            "start. Never shown in logs or ``repr``.",
            see=(("PgBouncer", "pgbouncer.md"),),
        ),
    )
    pooler_prepared_statements: bool = field(
        default=False,
        metadata=_doc(
            "",
            "with ``pooler='transaction'``: the pooler keeps protocol-level prepared "
            "statements (PgBouncer >= 1.21 with ``max_prepared_statements`` > 0, the default "
            "from 1.22), so statements are prepared through it as on a direct connection, "
            "saving their parse and plan on every call. Each new connection checks it first: "
            "a pooler that does not keep them is a ``ConfigurationError`` naming this option "
            "before anything is sent.",
            see=(("PgBouncer", "pgbouncer.md"),),
        ),
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


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


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
    refuse_unknown(
        options,
        list(OPTIONS),
        theirs=KOMBU_OPTIONS,
        what="transport option",
        owners="kombu_pgmq or kombu",
    )


#: ``{name: (unit, default, doc)}`` of every transport option, in the order documented.
OPTIONS: dict[str, tuple[str, Any, str]] = {
    f.name: (f.metadata["unit"], _default(f), f.metadata["doc"]) for f in fields(TransportOptions)
}

#: Where a module docstring lists the transport options (:func:`options_rst`), and the
#: docs page their table (``docs/_ext/hooks.py``).
OPTIONS_MARKER = "<!-- transport-options -->"


def option_docs() -> list[OptionDoc]:
    """Every transport option's documentation, in field order: the one source of the
    Transport Options of :mod:`kombu_pgmq.transport` (:func:`options_rst`) and of the docs'
    table."""
    return field_docs(TransportOptions)


def options_rst(width: int = 88) -> str:
    """The transport options as a reST bullet list, one item per option
    (:func:`kombu_pgmq._option_docs.rst_list`)."""
    return rst_list(option_docs(), width)
