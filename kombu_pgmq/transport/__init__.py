"""PostgreSQL transport for Kombu and Celery, on PGMQ queues.

Each Kombu queue is a PGMQ queue (tables ``pgmq.q_<name>`` and the archive
``pgmq.a_<name>``). Delivery is ``pgmq.read`` with a visibility timeout, ack is
``pgmq.archive`` (the archive is the audit trail), reject with requeue makes the message
visible again in its place (as ``pgmq.set_vt`` would, to its ``enqueued_at``), and reject
without requeue, or too many deliveries, moves the message to a
dead-letter queue (a PGMQ queue too) with the reason recorded.

Connection string
=================

.. code-block:: text

    postgresql://[USER[:PASSWORD]@][HOST][:PORT][/DBNAME][?libpq_param=value&...]
    postgres://...                      (as in a DATABASE_URL)

``import kombu_pgmq`` registers both schemes. Query parameters go to libpq
(``sslmode``, ``application_name``, ``connect_timeout``, ``host=/socket/dir``, ...).
Percent-encode special characters of the password (``p@ss`` -> ``p%40ss``). Celery:
``broker_url = "postgresql://..."`` or ``broker_transport = "kombu_pgmq:Transport"``.

Delivery semantics
==================

* At least once. A delivered message stays in its queue table, invisible, until it is
  acked (archived), rejected, or its visibility timeout passes; then it is delivered
  again (``delivery_info['redelivered']`` is true when ``read_ct > 1``).
* Leases are renewed (:mod:`kombu_pgmq.transport._leases`): while a connection holds a message
  (running, prefetched, or waiting for its ETA) a thread pushes its visibility timeout
  to now + ``visibility_timeout`` every ``lease_renewal_interval`` seconds, one statement
  for all held messages. A healthy task that runs for hours is never delivered twice; a
  killed worker's messages are delivered again at most one visibility timeout (30 s by
  default) after its last renewal. A lease found lost (the message was read again
  elsewhere, e.g. after a database outage longer than the visibility timeout) is logged.
* A lost database connection is not reported to Celery while the server answers again:
  the next statement reconnects (in Celery's event loop, retried every second), so the
  worker keeps its held messages and their leases instead of restarting its consumer
  and requeueing running tasks. ``drain_events`` retries once and then raises.
* Countdown/ETA tasks and ``x-delay`` messages wait in their queue table with a future
  visibility (PGMQ's native delay), not in a worker's memory: see
  :mod:`kombu_pgmq.transport._delays` for the path Celery takes.
* Priorities: a queue declared with ``x-max-priority`` (``Queue(max_priority=9)``) has a
  PGMQ queue per priority band, read highest first in the same round trip; higher
  numbers first, as AMQP (see :mod:`kombu_pgmq._priorities`).
* A consumer reads up to its free prefetch in one round trip, from all of a channel's
  queues at once (``kombu_pgmq.read``; the first queue read rotates, so none starves);
  ``read_batch_size`` caps it when prefetch is unlimited. Consumers with ``no_ack=True``
  get what is read and it is deleted once delivered, as AMQP auto-ack (``basic_get`` of
  one queue uses ``pgmq.pop``).
* Acks. Inside ``drain_events``, the acks its callbacks make are archived in one
  statement per queue before it returns. In Celery's event loop an ack is sent at once,
  from ``ack()``, without waiting for its result, as kombu's AMQP and Redis transports
  write an ack in ``ack()``; acks made within ``acks.ACK_BATCH_SECONDS`` (2 ms) of the
  last ones, or while the statement connection is busy, go together with the next read
  or at a timer. ``message.ack()`` thus returns before the archive commits: if the
  process dies in between, the message is delivered again after its visibility timeout
  (at least once). An ack made outside both (e.g. after ``SimpleQueue.get``) is archived
  at once, waiting for the result.
* Closing a channel archives its batched acks and makes its unacked messages visible at
  once; it never publishes copies, unlike kombu's default ``_restore``. A restored
  delivery (and one whose delivery callback failed) does not count toward
  ``max_deliveries``: it is counted in the header ``x-kombu-restored`` (taken out of the
  headers the application sees), and deliveries are ``read_ct`` less restores
  (``delivery_info["pgmq_deliveries"]``). ``read_ct`` itself only grows, so a receipt
  never matches a later delivery.
* Receipt handles (SQS's model): every ack, requeue, restore,
  dead-letter and lease renewal names the delivery it settles (``msg_id``, ``read_ct``
  and ``enqueued_at``) and touches the row only while that delivery still holds it. A
  stale one (the lease lapsed and the message was delivered again, or an UNLOGGED queue
  emptied by a crash reused the id) is logged as a warning and never applied. An acked
  message whose id is already in the archive (an UNLOGGED queue's ids restart after a
  crash; its archive is logged) is archived under a new id, with the header
  ``x-queue-msg-id`` holding its id in the queue, and the queue's ids move past the
  archive's: an ack is never dropped, nor does it fail the read it
  rides with.
* Dead letters mirror SQS's redrive policy: after ``max_deliveries`` deliveries the next
  read moves the message to ``dead_letter_queue`` instead of delivering it; a reject
  without requeue does the same at once. The copy keeps body and headers and gains an
  ``x-dead-letter`` header ``{queue, pgmq_queue, msg_id, read_ct, reason, enqueued_at,
  dead_lettered_at}`` (and ``error`` for ``"undecodable"`` and ``"consumer_error"``);
  reasons are ``"max_deliveries"``, ``"rejected"``, ``"undecodable"`` (a row that cannot
  become a Kombu message: an envelope of the wrong shape, a ``body-encoding`` kombu does
  not know, a body that does not decode or decompress; the message is built before any
  consumer callback runs, so such a row is dead-lettered at once and the rest of its
  batch is delivered: one bad row never stops a consumer) and ``"consumer_error"`` (in
  Celery's event loop, a consumer callback raised on it, not a broker error: e.g.
  Celery's own ``on_task_received`` on a ``task`` header without ``id``, which would
  otherwise end the worker with "Unrecoverable error"; logged with the traceback; in
  ``drain_events`` the exception reaches the caller, as in kombu's transports). A Celery task
  that kills its pool process (segfault, OOM) is requeued by Celery when it has
  ``acks_late=True, reject_on_worker_lost=True``, and so reaches the dead-letter queue
  after ``max_deliveries``. List, replay and purge dead letters with
  :class:`kombu_pgmq.dlq.DeadLetterQueue` or ``kombu-pgmq dlq list|replay|purge``.
* Acked messages stay in the archive ``pgmq.a_<queue>``; remove old ones with
  :func:`kombu_pgmq.retention.prune_archives` (Celery beat: ``add_beat_task``) or
  ``kombu-pgmq archive prune --older-than 7d``.
* ``queue_purge`` deletes ready messages only (unacked ones stay, as in AMQP) and
  returns the count; ``celery purge`` uses it.

Durability
==========

* Publishes are durable: once ``publish`` returns, the message survives a server crash. A
  publish through the queue's send function (statement ``send_queue``: Celery's
  ``apply_async``, Kombu's default exchange, an exchange routing to one queue) that hands
  its message over or wakes a consumer waiting on the queue commits without waiting for
  the WAL flush, so the consumer gets it at once, then waits for the flush with a second
  transaction that writes one logical decoding message (statement ``flush_commits``: WAL
  is flushed in order, so its flush covers the publish) before it returns; transport
  option ``visible_before_flush``, default True. This is the order RabbitMQ keeps for a
  persistent message under publisher confirms (delivered to a consumer before its fsync,
  confirmed after it). What it risks, only between the commit and the flush: a server
  crash forgets a message a consumer may already have started, and the publish raises
  (Kombu and Celery publish it again): at least once still holds. It costs a second
  transaction id and one more round trip per such publish, not a second WAL flush; a
  publish nobody waits for commits synchronously, once. A role that may not run
  ``pg_logical_emit_message`` (revoked from PUBLIC) turns the option off for its
  connection, with a warning naming the grant. ``visible_before_flush=False``: a message
  is seen only once it is on disk.
* Deliveries and acks commit asynchronously (``synchronous_commit = off`` for those
  transactions): a server crash (PostgreSQL or the machine) may forget the last ones,
  roughly 3 x ``wal_writer_delay`` (600 ms by default); those messages are then delivered
  again. Nothing is lost, and the contract stays at least once. ``durable_acks=True``
  makes acks commit synchronously (an ack is never forgotten; it costs one WAL flush per
  batch of acks).
* Opt-in trade-offs, with the failure each one risks:

  - ``confirm_publish=False``: a publish commits without waiting for its WAL flush
    (``synchronous_commit = off`` for its transaction), as RabbitMQ without publisher
    confirms or Redis without ``appendfsync always``. What it risks: a server crash
    (PostgreSQL or the machine) forgets the publishes of the last moments before it, at
    most three times ``wal_writer_delay`` (600 ms at PostgreSQL's default of 200 ms;
    measured over 10 crashes of the server: 0.4 to 273 ms of publishes lost, none of the
    durable ones, ``benchmarks/publish_loss.py``); a publish that returned may then be
    lost. The
    database stays consistent: a forgotten publish is gone, not half-written. A publish
    to the default exchange (Celery's ``apply_async``) also returns once its statement is
    sent, without waiting for the server's answer, which is read before the
    connection's next statement (one publish in flight); a publish the server refuses
    (its queue table dropped, a connection lost before the answer came) is published
    again, confirmed, at the next publish or when the channel closes (at least once: a
    lost answer may hide a written row, then twice); a refused last publish of a process
    that exits without closing its connection is lost. Deduplicated publishes and
    publishes through an exchange wait for the server's answer (not for the flush);
    publishes in the application's transaction commit with it, as it says.
  - Non-durable queues (``Queue(..., durable=False)``): UNLOGGED tables, no WAL at all.
    Any unclean server stop empties them, and they are not replicated to standbys.
    Celery's reply and event queues are declared this way.

  ``benchmarks/README.md`` measures each.

Statements and batching
=======================

The hot path runs static SQL of its own on PGMQ's tables instead of calling
``pgmq.send``/``read``/``archive``, which build their SQL with ``format()`` +
``EXECUTE`` on every call: each queue has its own functions, ``kombu_pgmq.send_q_<queue>``,
``read_q_<queue>`` and ``ack_q_<queue>`` (``SECURITY DEFINER``, created from templates in
the schema when the queue is declared, or at its first use for a queue made by plain
``pgmq.create``; dropped with the queue), whose statements PL/pgSQL plans once per
session. The owner and least-privilege roles (``kombu-pgmq schema grant``, no rights on
PGMQ's tables) run the same functions. The tables stay exactly PGMQ's: the rows written
are those PGMQ's functions write (``last_read_at`` where the table has it), so
``pgmq.read``, ``pgmq.archive``, ``pgmq.metrics`` and PGMQ's clients keep working on the
same queues, on the extension and on the SQL-only install. A publish through an exchange
that routes to one queue (Kombu's ``Producer(exchange=...)``, Celery with an explicit
exchange) is the same send function, guarded by the routing version: nothing is written
if a binding changed since the routes were cached, and the publish is repeated with the
routes reloaded. Whether a queue deduplicates Celery task ids (``x-deduplicate-task-id``)
is known per transport from its declaration on any channel, else read once from the
stored one, so a connection's second channel (which kombu's ``maybe_declare`` does not
declare again) publishes through the send function too. A message with a deduplication
id, an exchange routing to several queues (``publish_routed``) and a publish inside the
application's transaction go through ``kombu_pgmq.publish`` (``pgmq.send``); reads of
several queues or priority bands in one round trip and of queues with key limits through
``kombu_pgmq.read``, which calls each queue's read function.

Long transactions
=================

A transaction left open anywhere in the database (an analytics query, a session idle in
transaction, ``pg_dump``) keeps every row version deliveries and acks leave. The reads of
one queue start at a position in PGMQ's ``vt`` index instead of its beginning, so they do
not walk those versions (:mod:`kombu_pgmq._db.positions`: a transaction that commits a
message late is still delivered; a message requeued to its place makes the consumers read
from the start, and the heartbeat thread looks below the positions every 30 seconds on
its own connection); a publish hands a message to a waiting consumer by ``nextval`` on
that consumer's sequence, writing no row. Reads of several queues or bands
(``kombu_pgmq.read``), of least-privilege roles and of queues with a rate or concurrency
limit start at positions too; reads of a queue with key limits (FIFO groups included)
still walk them. ``kombu-pgmq
queues``, the metrics and the worker's log name what holds the horizon (docs: Long
transactions).

Reads are coalesced: while a channel holds messages it reads again only once half its
prefetch window is free (the window first set, e.g. Celery's
``worker_prefetch_multiplier`` x concurrency), so a worker draining a backlog reads
several messages per round trip instead of one per ack; with nothing held it reads at
once, so latency is unchanged. An ack rides along with a read made in the same turn of
the event loop; otherwise it is sent at once, without waiting for its result (its
queue's own prepared statement, ``ack_queue``; the result is read before the
connection's next statement), so a finished task's ack is on the server before its
worker can be killed (which would deliver it again: a duplicate per SIGKILL).

Wake-ups
========

Consumers do not poll. A consuming connection LISTENs on ``kombu_pgmq.<pgmq queue>`` for
each queue it consumes (a second PostgreSQL connection,
:mod:`kombu_pgmq.transport._listener`); when a read finds a queue empty it records itself
in ``kombu_pgmq.waiting`` and sleeps, and a publish NOTIFYs that queue only while someone
waits on it, so a busy system sends no notifications (a NOTIFY takes a database-wide lock
at commit, which would serialize all publishers). A shared/exclusive advisory lock per
queue makes sure no wake-up is lost (a publish takes it shared, ``kombu_pgmq.wait_for``
exclusive: sql/schema.sql). A delayed message (x-delay, countdown/ETA) wakes consumers
when it becomes due, like a new one: its publish tells waiting consumers the due time (the
NOTIFY payload), and a consumer going to sleep learns when each queue's next delayed
message is due (``kombu_pgmq.wait_for_due``), so a short TTL after a delay is not spent
waiting for a poll. A fallback poll every ``polling_interval`` seconds finds messages that
become visible without a publish (visibility timeout expiry). In Celery's event loop that
poll first asks, on the LISTEN connection and without waiting, which consumed queues hold
a visible message (one probe of PGMQ's ``vt`` index per queue, statement
``visible_probe``) and reads only those when the answer comes, so the loop is never held
up by reads of empty queues (a hand-off arriving meanwhile would wait behind them); a role
without rights on PGMQ's tables reads every queue instead. An ack that frees a prefetch
slot wakes the consumer at once.

Hand-off: a consumer going to sleep on a queue it takes with acks also offers one
hand-off slot there (its LISTEN connection's own NOTIFY channel, a session advisory lock
that connection holds while it listens, its visibility timeout). A publish (the queue's
send function, statement ``send_queue``: Celery's ``apply_async``, Kombu's default
exchange, an exchange routing to one queue) to such a queue claims the slot of the
consumer waiting longest (``FOR UPDATE SKIP LOCKED``: publishers never wait on each
other), writes the row as delivered to it (``read_ct`` 1, ``vt`` = now + its visibility
timeout, ``last_read_at``, as ``pgmq.read`` leaves a row) and sends the row in that
consumer's NOTIFY: the consumer delivers it without a read (one round trip less after
each wake-up: Celery's latency p50 -0.9 ms on the benchmark machine), and only that
consumer wakes, not every one waiting on the queue. The slot is offered again once the
channel has room (a statement not waited for), so a channel gets at most one message past
its prefetch window this way. In Celery's event loop the round that delivers a handed
message sends nothing more: reads that fell due with it (the fallback poll, another queue
notified) and the new offer wait 1 ms, until the loop's next turn has written the task to
the pool (a read before it held that write, and was most of Celery's latency p99 gap to
Redis). Nothing is lost: a handed row is a delivery; a consumer that dies before taking
it, or whose LISTEN connection drops in that instant (the notification is lost with it),
gets it delivered again after its visibility timeout; a consumer whose LISTEN connection
is gone no longer holds its lock, so publishers skip its slot; rows handed off while a
consumer is cancelled or closed are made visible again at once (not counted as
deliveries). Not handed off: messages over 7800 bytes (a NOTIFY payload's limit),
delayed ones, deduplicated ones, publishes in the application's transaction or to several
queues, paused and limited queues (FIFO groups included), ``no_ack`` consumers.
``kombu_pgmq_handoffs_total`` counts them.

With Celery, the transport runs in the worker's event loop (``asynloop``):
``implements.asynchronous`` is true, and :meth:`Transport.register_with_event_loop`
registers the LISTEN socket and a wake pipe with the loop.

Connections: one per concern, so a statement that blocks on one never holds up another.
Each Kombu connection uses one PostgreSQL connection for its channels' statements
(declare, publish, read, ack), one to LISTEN once it consumes, one for lease renewal while
it holds messages (closed by a renewal round that finds none), and one for heartbeats and
the reaper once it consumes (plus a short-lived one when it VACUUMs a queue table). Each is
named by its role in ``pg_stat_activity`` (``application_name`` ``kombu_pgmq:statements``,
``:listener``, ``:leases``, ``:heartbeat``, ``:vacuum``; a name given in the URL replaces
``kombu_pgmq``). The lease and heartbeat connections set
``lock_timeout`` (1 s): a heartbeat blocked by a lock skips a round, and the reaper skips
a queue whose tables an open transaction holds; an application's open transaction that
enqueued never blocks a consumer's start, read or lease renewal. A Celery worker's main
process (prefork, threads, solo) therefore holds 4 (5 while it holds messages): the
consumer's statements, LISTEN and heartbeat connections and the statements of Celery's
event dispatcher; ``docs/connections.md`` has the table per pool type, with the result
backend and beat, and how to size ``max_connections`` and PgBouncer's pools.

Fork safety: a process that forks (Celery's prefork pool, any application) never has its
connections used, closed or cleaned up by the child: the child's transport forgets the
parent's consumers, held messages and batched acks, abandons the inherited connections
without sending anything, and opens its own on first use (kombu's
``ConnectionPool(close_after_fork=True)`` and a plain ``os.fork()`` alike).

Exchanges and queue lifetime
============================

Exchanges and bindings are rows in ``kombu_pgmq.exchanges`` / ``kombu_pgmq.bindings``,
shared by every process; routing follows AMQP (``direct``, ``fanout``, ``topic`` with
``*`` one word and ``#`` zero or more), see :mod:`kombu_pgmq.transport._routing`. A publish to an
exchange reaches all bound queues in one statement, or none. Queue arguments:
``durable=False`` makes UNLOGGED tables; ``auto_delete``/``exclusive`` queues are
dropped with their last consumer (or when its process stops heartbeating);
``x-expires`` drops a queue unused that long (consumers, declarations, ``basic_get``
and new messages count as use); ``x-message-ttl`` and a message's own
``expiration`` archive older messages (headers ``x-archive-reason: expired``,
``x-expired-at``) instead of delivering them, counting from when the message became
visible (a countdown's TTL starts after its delay); an expired Celery task is delivered
all the same and its worker revokes it (state REVOKED), see
:mod:`kombu_pgmq.transport.reader`. A publish with
``mandatory=True`` that no binding matches raises
:class:`~kombu_pgmq.errors.Unroutable` (AMQP returns it) instead of being dropped. After
a database restart every consumer gets a full ``consumer_stale_after`` before the reaper
judges it (heartbeats could not be sent while the server was down).

Enqueue in the application's transaction: :func:`kombu_pgmq.using` (a psycopg 3,
SQLAlchemy or Django connection) makes publishes part of the application's transaction
(:mod:`kombu_pgmq.transactional`; the connection must be to the broker's database:
both forms check it, and a Celery app's broker that is not kombu_pgmq's is refused);
``kombu_pgmq.send_task(...)`` does it from SQL.
Deduplication: a message with an ``x-deduplication-id`` header (or, on a queue declared
with ``x-deduplicate-task-id``, a Celery task id) is enqueued once per queue within
``deduplication_window`` seconds. FIFO groups: on a queue declared with
``x-fifo-groups`` (no priorities), messages with the same ``x-group-id`` header are
delivered one at a time in publish order, the next once the previous task finished
(whatever its ack mode, as for concurrency limits below); different groups in parallel.
A queue keeps the arguments of its first declaration: a declaration giving
``x-max-priority``, ``x-fifo-groups`` or ``x-deduplicate-task-id`` otherwise raises
``ChannelError`` (406 PRECONDITION_FAILED, as RabbitMQ); one that leaves them out takes
the stored ones.
Fleet-wide limits (:mod:`kombu_pgmq.limits`): a queue's concurrency (tasks delivered and
not finished, across every worker: with Celery's default early ack a worker holds a
task's slot from the ack until the task ends) and rate (a token bucket, ``"100/s"``), and the
same per key (header ``x-limit-key``, or the task name), are enforced in the read: a
worker is never handed a message it may not start. FIFO groups are the key limit of
concurrency 1.

Headers any Python value can hold round-trip exactly: one PostgreSQL's jsonb cannot store
(a NUL character, NaN, a lone surrogate, bytes; Celery puts task arguments in
``argsrepr``) travels as base64 of kombu's JSON in the envelope, the others stay readable
in ``headers`` (text that only looks like those, ``"BANaNa"``, is storable). The headers
kombu_pgmq's SQL reads (``task``, ``id``, ``x-deduplication-id``, ``x-group-id``,
``x-pgmq-group``) always stay readable; a value jsonb cannot hold there is refused with a
:class:`~kombu_pgmq.errors.ConfigurationError` naming the header, never ignored. An
``x-delay`` that is not finite or beyond 2**31 - 1 seconds, or an ETA that far away, is a
:class:`~kombu_pgmq.errors.ConfigurationError` at publish.

A connection the server turns down (the database or the role does not exist, a wrong or
missing password, no ``pg_hba.conf`` entry, a role that may not log in or connect) is a
:class:`~kombu_pgmq.errors.ConnectionRejected` naming the database or the role and the
fix (``createdb``, ``createuser``, where the password goes); a connection error still,
so Celery's worker retries it (``consumer: Cannot connect to ...: PostgreSQL refused the
connection: database "app" does not exist on db:5432: create it (createdb -h db -p 5432
-U app app) ...``) and the CLI prints it as its one ``error:`` line.

Failover: a read-only server (``25006``, a standby after a failover) and a server
shutting down (``57P01``-``57P03``) are connection errors (kombu reconnects). A statement
the server cancels (``57014``: ``statement_timeout``, ``pg_cancel_backend``) is not: it
raises :class:`~kombu_pgmq.errors.StatementCanceled` on the same, still usable
connection (a publish is not retried); a consumer's cancelled read or ack is logged and
tried again at the next fallback poll, its held messages and batched acks kept. List every
host in the URL (``postgresql://u@primary:5432,standby:5432/db`` or ``?host=a,b``):
``target_session_attrs=read-write`` is then the default, so a reconnect finds the new
primary. kombu's failover lists (``url1;url2``, Celery's ``broker_url``) are folded into
that one multi-host connection string (the URLs may differ only in host and port) and
kombu's own switching is turned off for them: libpq tries every host on each connect.

Least privilege: roles granted with ``kombu-pgmq schema grant producer|worker ROLE``
(:mod:`kombu_pgmq.schema`, "Least privilege") have no privilege on PGMQ's tables; a
producer's declarations of queues, exchanges and bindings that exist are passive checks
(Celery declares before its first publish); a refusal is
:class:`~kombu_pgmq.errors.PermissionDenied`. Run them with ``install_schema=False``.

Queue names
===========

Kombu names are mapped to PGMQ names by :func:`kombu_pgmq._naming.pgmq_queue_name`:
plain lower-case names are kept (``celery``), others get a readable slug and a hash
(``celery@host.celery.pidbox`` -> ``celery_host_celery_pidbox__<hash>``), always
within PGMQ's 47 characters. ``kombu_pgmq.queues`` records the Kombu name of each.

Transport Options
=================

Unknown names are refused with the closest known one
(:class:`~kombu_pgmq.errors.ConfigurationError`: ``unknown transport option
'visibilty_timeout': did you mean 'visibility_timeout'? (kombu_pgmq's options: ...)``),
except those kombu reads itself from the same dict
(:data:`~kombu_pgmq.transport.options.KOMBU_OPTIONS`: ``body_encoding``,
``deadletter_queue``, its connect retries and a publish's retry policy). A removed option
(:data:`~kombu_pgmq.transport.options.REMOVED_OPTIONS`) is refused, saying what the
transport does instead. A bad value (wrong type, out of range, NaN or infinite) names the
option, the value, what is expected and the default. ``celery worker`` checks them before
it starts and exits with that one line (:mod:`kombu_pgmq._worker_checks`). The list below
is made from :class:`~kombu_pgmq.transport.options.TransportOptions`, whose fields
document themselves, when this module is imported.

<!-- transport-options -->

PgBouncer
=========

With ``broker_url`` pointing at PgBouncer in transaction mode, set
``broker_transport_options = {"pooler": "transaction", "direct_url": "postgresql://..."}``:

* Statements (publish, read, ack, lease renewal, heartbeats, VACUUM, the schema check)
  go through the pooler without session state: no prepared statements (psycopg's
  ``prepare_threshold=None``; the ack sent without waiting uses the unnamed statement:
  PgBouncer 1.18 has none) unless ``pooler_prepared_statements=True`` says the pooler
  keeps them (PgBouncer >= 1.21), the background services' ``lock_timeout`` set per transaction
  (``set_config(..., true)``), and no session ``SET``: reads and acks set
  ``synchronous_commit`` off for their own transaction in the statement itself, directly
  and through the pooler alike (see Durability).
* LISTEN (one connection per consuming Kombu connection) goes to ``direct_url``.
  Without ``direct_url`` consumers poll every ``polling_interval`` (a new message waits
  up to that long; publishers are not asked to NOTIFY), and one WARNING per process says
  so.
* Celery beat (:mod:`kombu_pgmq.beat`) runs on ``direct_url`` (its leader holds a
  session advisory lock); without it, it refuses to start (``ConfigurationError``).
* The result backend has the same two options in ``result_backend_transport_options``
  (``result_backend = "postgresql://"``, the broker's database, takes the broker's).

``docs/pgbouncer.md`` has the ``pgbouncer.ini`` settings and sizing.
"""

from __future__ import annotations

from .channel import Channel, QoS
from .options import OPTIONS_MARKER, TransportOptions, options_rst
from .transport import Transport

__all__ = ["Channel", "QoS", "Transport", "TransportOptions"]

if __doc__:  # None under python -OO
    __doc__ = __doc__.replace(OPTIONS_MARKER, options_rst())
