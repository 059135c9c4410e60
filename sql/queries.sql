-- kombu_pgmq's statements, one named block each ("-- name: <name>").
-- Loaded by kombu_pgmq/_db/queries.py and sent only by kombu_pgmq/_db/connector.py (the
-- operation groups _db/broker.py, _db/admin.py and _db/spark_store.py name them).
-- Placeholders: %(name)s are bound parameters; {queue_table} is a PGMQ queue table
-- (pgmq.q_<name>) composed with psycopg.sql.Identifier, never string formatting.
-- Result rows are decoded by column name (psycopg row factories), never by position
-- (PGMQ 1.11 inserted last_read_at before vt in pgmq.message_record): every column a
-- caller reads has a name here.
-- Rows of a queue table are found by msg_id = ANY(array) (an index condition on the
-- primary key), never by a join to unnest(...) or to a CTE: after a VACUUM behind a long
-- transaction, pg_class.reltuples counts the few live rows, and the planner then drove
-- such joins by a scan of the whole primary key index, every dead entry included
-- (38 ms an ack, measured).

-- name: send
-- Publish one message (pgmq.send; visible after delay_seconds, PGMQ's native delay) and
-- NOTIFY the queue's channel if a consumer waits on it (kombu_pgmq.publish). msg_id
-- NULL: a duplicate within its deduplication window, not sent.
SELECT kombu_pgmq.publish(%(queue)s, %(message)s::jsonb, %(headers)s::jsonb,
                          %(delay_seconds)s::integer,
                          %(deduplication_window)s::float8) AS msg_id

-- name: send_queue
-- Publish one message without deduplication through the queue's own function,
-- {function} = kombu_pgmq.send_q_<queue> (static SQL, plan-cached by PL/pgSQL; its
-- template, with the hand-off, the routing guard and the commit modes, is
-- kombu_pgmq.send_template()). %(version)s: a routed publish's routing
-- version (no row: the routes changed, nothing was written), NULL for a publish to the
-- queue. %(handoff)s: the hand-off's NOTIFY tail (kombu_pgmq/_db/handoff.py), NULL for
-- none. %(commit)s: 'async' (confirm_publish=False), 'off' (visible_before_flush: column
-- flush says the caller must wait for the WAL flush, statement flush_commits) or NULL.
-- Also sent without waiting for the result (Broker.send_nowait: $1... in the order of
-- nowait._SEND_PARAMS).
SELECT s.msg_id, s.notified, s.flush
FROM {function}(%(message)s::jsonb, %(headers)s::jsonb, %(delay_seconds)s::integer,
                %(handoff)s::text, %(commit)s::text, %(version)s::bigint) AS s

-- name: read
-- Deliver up to qty visible messages of one queue, hiding them for vt_seconds
-- (kombu_pgmq.read: FOR UPDATE SKIP LOCKED, concurrent consumers never get the same
-- message; the walk of the vt index starts at the queue's position, %(positions)s, as in
-- read_many). message and headers come back as text: the JSON body goes to Kombu
-- unparsed. age_seconds (server clock) serves x-message-ttl and per-message expiration.
SELECT queue, msg_id, read_ct, enqueued_at, message, headers, age_seconds,
       snapshot, read_xid, read_at, scan_from, scanned_to
FROM kombu_pgmq.read(ARRAY[%(queue)s]::text[], %(vt_seconds)s::integer, %(qty)s::integer,
                     positions => %(positions)s::jsonb, stamp => %(stamp)s::boolean)

-- name: read_many
-- Archive acked messages (receipt handles: queue, msg_id, read_ct, enqueued_at; a stale
-- one is not applied), then read up to qty messages from several queues, in the order
-- given, in one round trip (kombu_pgmq.read). Rows carry their PGMQ queue name. ack_holds
-- (aligned with the acks): acks whose tasks run on; their concurrency slots are held for
-- hold_seconds (kombu_pgmq.ack). A queue without limits is read from its position
-- (%(positions)s: kombu_pgmq/_db/positions.py, {PGMQ queue: {scan_from, watch_xids,
-- watch_bounds}}) and its position row follows its rows (msg_id NULL, snapshot set;
-- %(stamp)s: assign the read a transaction id).
SELECT queue, msg_id, read_ct, enqueued_at, message, headers, age_seconds,
       snapshot, read_xid, read_at, scan_from, scanned_to
FROM kombu_pgmq.read(%(queues)s::text[], %(vt_seconds)s::integer, %(qty)s::integer,
                     %(ack_queues)s::text[], %(ack_ids)s::bigint[], %(ack_cts)s::integer[],
                     %(ack_enqueued)s::timestamptz[], %(durable_acks)s::boolean,
                     %(ack_holds)s::boolean[], %(hold_seconds)s::integer,
                     %(positions)s::jsonb, %(stamp)s::boolean)

-- name: read_queue
-- The read of one queue through its own function, {function} = kombu_pgmq.read_q_<queue>
-- (static SQL, plan-cached by PL/pgSQL; the same statements for a least-privilege worker
-- and the owner; its template is kombu_pgmq.read_template()): settle
-- the ack receipts riding along (rows acked true), then deliver up to qty visible rows
-- from the queue's position (kombu_pgmq/_db/positions.py: scan_from, watch_xids,
-- watch_bounds; stamp: assign the read a transaction id), the last row (acked NULL)
-- saying where the read got to. A limited queue delivers within its limits and adds its
-- marker row (msg_id NULL, acked false). holds (aligned with the acks): acks whose
-- tasks run on, their concurrency slots held for hold_seconds. commit: 'off', the
-- transaction commits without waiting for the WAL flush (a crash may forget the reads
-- and acks: delivered again), NULL the session's setting.
SELECT msg_id, read_ct, enqueued_at, message, headers, age_seconds, acked,
       snapshot, read_xid, read_at, scan_from, scanned_to
FROM {function}(%(vt_seconds)s::integer, %(qty)s::integer, %(ack_ids)s::bigint[],
                %(ack_cts)s::integer[], %(ack_enqueued)s::timestamptz[],
                %(holds)s::boolean[], %(hold_seconds)s::integer, %(commit)s::text,
                %(scan_from)s::float8, %(watch_xids)s::text[], %(watch_bounds)s::float8[],
                %(stamp)s::boolean)

-- name: ack_queue
-- Acks of one queue through its own function, {function} = kombu_pgmq.ack_q_<queue>:
-- archive the rows these receipts (msg_id, read_ct, enqueued_at) still hold, a stale one
-- left out; holds/hold_seconds and commit as read_queue's. Also sent without waiting for
-- the result (Broker.ack_nowait: $1... in the order of nowait._ACK_PARAMS). Returns the
-- msg_ids settled.
SELECT a.msg_id
FROM {function}(%(ack_ids)s::bigint[], %(ack_cts)s::integer[],
                %(ack_enqueued)s::timestamptz[], %(holds)s::boolean[],
                %(hold_seconds)s::integer, NULL, %(commit)s::text) AS a(msg_id)

-- name: synchronous_commit_off
-- Session setting of the statement connection for reads and acks that need no WAL flush
-- (a crash redelivers them; see Broker.read_many); RESET restores the session default
-- (connection_options may set it).
SET synchronous_commit = off

-- name: synchronous_commit_reset
RESET synchronous_commit

-- name: toast_compression_lz4
-- Session setting of connections that write large values (messages, results): values
-- PostgreSQL compresses (TOAST, over about 2 kB) use lz4, about twice as fast as pglz on
-- 20 MB (publish, result store), when the server was built with lz4 (pg_settings.enumvals)
-- and neither its configuration, the database, the role nor the connection names a method
-- (source 'default'). Readers decompress either method; a value keeps its method when
-- copied (an ack's archive). No row: the session keeps the server's method.
SELECT pg_catalog.set_config('default_toast_compression', 'lz4', false)
FROM pg_catalog.pg_settings
WHERE name = 'default_toast_compression' AND source = 'default' AND 'lz4' = ANY (enumvals)

-- name: flush_commits
-- After a publish that committed without waiting for the WAL flush (send_queue's column
-- flush; Broker.send), in a transaction of its own: a
-- transactional logical decoding message (prefix 'kombu_pgmq.flush', empty; callable by
-- every role) takes a transaction id and writes a WAL record, so the commit writes a
-- commit record and, in the session's commit mode, waits for the WAL flush up to it: that
-- covers the publish's commit record, written before. (A transaction id alone writes no
-- WAL: PostgreSQL then commits it without a flush.)
SELECT pg_logical_emit_message(true, 'kombu_pgmq.flush', '')

-- name: wait_for
-- This connection found the queues empty and sleeps on their NOTIFY channels. No
-- wake-up is lost (kombu_pgmq.wait_for): a publisher holds the queue's advisory lock
-- shared until it commits and this takes it exclusive after recording the waiting row, so
-- a publisher that missed the row has committed when this returns. Read the queues once
-- more afterwards. unsettled: a publisher is still in its transaction after a short
-- wait: its message is found by the fallback poll. due_in_seconds: when the queue's next
-- delayed message becomes visible (NULL: none), server_epoch: the server's clock (epoch
-- seconds).
SELECT queue, unsettled, due_in_seconds, server_epoch
FROM kombu_pgmq.wait_for_due(%(owner)s, %(queues)s::text[])

-- name: wait_for_handoff
-- wait_for, offering one hand-off slot on those of the queues whose
-- consumers take messages with acks: publishes then hand a message to this connection in
-- its NOTIFY (channel, held by the session advisory lock lock_key on the LISTEN
-- connection, claimed on its sequence kombu_pgmq.handoff_<seq>), delivered with a
-- visibility timeout of vt_seconds.
SELECT queue, unsettled, due_in_seconds, server_epoch
FROM kombu_pgmq.wait_for_handoff(%(owner)s, %(queues)s::text[], %(handoff_queues)s::text[],
                                 %(channel)s, %(lock_key)s::bigint, %(vt_seconds)s::integer,
                                 %(seq)s::integer)

-- name: rearm_handoff
-- Offer this connection's hand-off slot again on queues: the
-- queues it offers from now on; returns those it still waits on.
SELECT queue FROM kombu_pgmq.rearm_handoff(%(owner)s, %(queues)s::text[]) AS queue

-- name: visible_probe
-- One branch of a probe for visible rows: {queue_name} (a literal) if PGMQ queue table
-- {queue_table} holds a visible message. Branches are joined with UNION ALL, one per
-- queue. The fallback poll sends its probe on the LISTEN connection without waiting for
-- the result (a lapsed visibility timeout, a publish whose wake-up was missed: Celery's
-- event loop goes on while the server looks, and reads only the queues named); the
-- heartbeat thread sends its looks below the read positions on its own connection.
-- One probe of PGMQ's vt index per branch, from {scan_from} up to before {scan_to} ($n
-- placeholders: epoch seconds, '-inf'/'inf' for no bound) and (SELECT
-- clock_timestamp()), computed once; nothing is locked or changed. {below}: false for a
-- fallback poll's branch (from the oldest vt the queue's next read may take:
-- kombu_pgmq/_db/positions.py), true for a look below its position (a visible row there
-- rewinds its reads).
SELECT {queue_name}::text AS queue, {below}::boolean AS below
WHERE EXISTS (SELECT 1 FROM {queue_table}
              WHERE vt >= to_timestamp({scan_from}::float8)
                AND vt < to_timestamp({scan_to}::float8)
                AND vt <= (SELECT clock_timestamp()))

-- name: handoff_lock
-- The LISTEN connection's session advisory lock, held while it listens for hand-offs
-- (publishers skip the slots of a connection that no longer holds it), and the lease of
-- the sequence its slot is claimed on (kombu_pgmq.handoff_<seq>), for the life of the
-- session.
SELECT kombu_pgmq.handoff_lease(%(lock_key)s::bigint) AS seq

-- name: round_trip
-- Nothing but a round trip: notifications committed before it are read before its result.
SELECT 1

-- name: stop_waiting
-- The queues have a backlog: publishers need not notify this connection any more.
-- Asynchronous commit: forgetting this in a crash costs only useless NOTIFYs.
WITH gone AS (
    DELETE FROM kombu_pgmq.waiting
    WHERE owner = %(owner)s AND pgmq_queue = ANY(%(queues)s::text[])
    RETURNING 1
)
SELECT set_config('synchronous_commit', 'off', true) AS synchronous_commit,
       (SELECT count(*) FROM gone) AS deleted

-- name: stop_waiting_all
DELETE FROM kombu_pgmq.waiting WHERE owner = %(owner)s

-- name: listen
-- {channel} is "kombu_pgmq.<pgmq queue>", composed with psycopg.sql.Identifier.
LISTEN {channel}

-- name: unlisten
UNLISTEN {channel}

-- name: pop
-- Deliver and delete up to qty visible messages (basic_get with no_ack).
SELECT queue, msg_id, read_ct, enqueued_at, message, headers, age_seconds
FROM kombu_pgmq.pop(%(queue)s, %(qty)s::integer)

-- name: renew
-- Lease renewal (kombu_pgmq.renew): push the visibility timeout of held messages to now +
-- vt_seconds, all queues in one round trip. Returns the (queue, msg_id) renewed; a held
-- message missing from the result lost its lease (read again by another consumer after
-- its visibility timeout passed, or gone).
SELECT queue, msg_id
FROM kombu_pgmq.renew(%(queues)s::text[], %(msg_ids)s::bigint[], %(read_cts)s::integer[],
                      %(enqueued)s::timestamptz[], %(vt_seconds)s::integer)

-- name: ack
-- Ack with receipt handles (msg_id, read_ct, enqueued_at): archive the rows these
-- deliveries still hold; returns the (queue, msg_id) settled, a stale handle is left out.
-- holds (aligned): acks whose tasks run on, their concurrency slots held for hold_seconds.
SELECT queue, msg_id
FROM kombu_pgmq.ack(%(queues)s::text[], %(msg_ids)s::bigint[], %(read_cts)s::integer[],
                    %(enqueued)s::timestamptz[], %(holds)s::boolean[],
                    %(hold_seconds)s::integer)

-- name: archive_expired_rows
-- archive_expired for roles without rights on PGMQ's tables: the same
-- marks, through a function run as its owner; returns the (queue, msg_id) archived.
SELECT queue, msg_id
FROM kombu_pgmq.archive_expired(%(queues)s::text[], %(msg_ids)s::bigint[],
                                %(read_cts)s::integer[], %(enqueued)s::timestamptz[])

-- name: ack_async
-- The same with an asynchronous commit (durable_acks=False).
SELECT queue, msg_id, set_config('synchronous_commit', 'off', true) AS synchronous_commit
FROM kombu_pgmq.ack(%(queues)s::text[], %(msg_ids)s::bigint[], %(read_cts)s::integer[],
                    %(enqueued)s::timestamptz[], %(holds)s::boolean[],
                    %(hold_seconds)s::integer)

-- name: requeue
-- Reject with requeue, restore, a failed delivery: visible in vt_seconds if the
-- delivery still holds the row; uncount counts the delivery as a restore in the
-- x-kombu-restored header (the application never ran it; read_ct only grows, so no two
-- deliveries share a receipt). Returns the (queue, msg_id) settled.
SELECT queue, msg_id
FROM kombu_pgmq.requeue(%(queues)s::text[], %(msg_ids)s::bigint[], %(read_cts)s::integer[],
                        %(enqueued)s::timestamptz[], %(vt_seconds)s::integer,
                        %(uncount)s::boolean)

-- name: declare_queue
-- Create the PGMQ queue if missing (UNLOGGED if not durable) and its priority bands, with
-- their own functions (kombu_pgmq.queue_functions), and record the Kombu name and the
-- declared arguments. The first
-- declaration's arguments stay (a redeclare without them, as plain consumers do, must
-- not turn a TTL off); a redeclare counts as use (x-expires). Returns the arguments in
-- force.
SELECT d.message_ttl_ms, d.expires_ms, d.max_priority, d.priority_bands, d.band_queues,
       d.fifo_groups, d.deduplicate_task_id
FROM kombu_pgmq.declare_queue(%(kombu_queue)s, %(queue)s, %(durable)s, %(auto_delete)s,
                              %(expires_ms)s, %(message_ttl_ms)s, %(max_priority)s,
                              %(priority_bands)s::smallint[], %(band_queues)s::text[],
                              %(fifo_groups)s, %(deduplicate_task_id)s) AS d,
     LATERAL (SELECT count(*) AS created
              FROM unnest(array_append(coalesce(d.band_queues, '{}'), %(queue)s::text)) AS b,
                   LATERAL kombu_pgmq.queue_functions(b)) AS f

-- name: queue_bands
-- Priority bands of a Kombu queue (NULL arrays: no priorities) and whether it is a FIFO
-- queue; no row: unknown queue.
SELECT max_priority, priority_bands, band_queues, fifo_groups, deduplicate_task_id
FROM kombu_pgmq.queues
WHERE queue = %(kombu_queue)s

-- name: drop_queue
-- Drops pgmq.q_<queue>, its archive, its own functions, our row, its bindings and
-- consumers; false if it did not exist. A PGMQ queue unknown to kombu_pgmq.queues is
-- dropped all the same.
SELECT CASE WHEN kombu_pgmq.drop_queue(%(kombu_queue)s) THEN true
            ELSE pgmq.drop_queue(%(queue)s) END AS dropped,
       kombu_pgmq.drop_queue_functions(%(queue)s) AS functions_dropped

-- name: drop_transient_queue
-- A worker's queue_delete: only a non-durable, auto_delete or x-expires queue; false if
-- there is no such queue.
SELECT kombu_pgmq.drop_transient_queue(%(kombu_queue)s) AS dropped

-- name: message_ttl
SELECT message_ttl_ms, expires_ms FROM kombu_pgmq.queues WHERE queue = %(kombu_queue)s

-- name: touch_queue
-- basic_get counts as use of an x-expires queue (AMQP's basic.get does).
UPDATE kombu_pgmq.queues SET last_used_at = clock_timestamp()
WHERE queue = %(kombu_queue)s AND expires_ms IS NOT NULL

-- name: discard
-- What a no_ack consumer was handed: deleted for good if these deliveries still hold it
-- (receipt handles). Expired messages are archived instead (archive_expired).
SELECT kombu_pgmq.discard(%(queue)s, %(msg_ids)s::bigint[], %(read_cts)s::integer[],
                          %(enqueued)s::timestamptz[]) AS msg_id

-- name: archive_expired
-- Expired messages (x-message-ttl, a message's own expiration) settled through the
-- queue's ack function, {function} = kombu_pgmq.ack_q_<queue>: the rows these
-- deliveries still hold move to the archive with the headers x-archive-reason "expired"
-- and x-expired-at (kombu-pgmq task find shows the reason), never deleted unseen.
-- Returns the msg_ids archived.
SELECT a.msg_id
FROM {function}(%(ack_ids)s::bigint[], %(ack_cts)s::integer[],
                %(ack_enqueued)s::timestamptz[], %(holds)s::boolean[],
                %(hold_seconds)s::integer,
                jsonb_build_object('x-archive-reason', 'expired',
                                   'x-expired-at', clock_timestamp())) AS a(msg_id)

-- name: queue_functions
-- Create the queue's own functions if missing (kombu_pgmq.queue_functions: a queue made
-- by plain pgmq.create has none); undefined_table (QueueNotFound) if the queue is gone.
SELECT kombu_pgmq.queue_functions(%(queue)s)

-- name: queue_exists
-- pgmq.meta has one row per queue (unique index on queue_name).
SELECT EXISTS (SELECT 1 FROM pgmq.meta WHERE queue_name = %(queue)s) AS found

-- name: size
-- Ready (visible) messages, as AMQP's message_count: unacked ones are not counted.
SELECT kombu_pgmq.size(%(queue)s) AS size

-- name: purge
-- AMQP purge removes ready messages only; returns how many.
SELECT kombu_pgmq.purge(%(queue)s) AS purged

-- name: dead_letter
-- Move messages to the dead-letter queue atomically, the rows these deliveries still hold
-- (receipt handles), each with an "x-dead-letter" header.
SELECT kombu_pgmq.dead_letter(%(queue)s, %(msg_ids)s::bigint[], %(read_cts)s::integer[],
                              %(enqueued)s::timestamptz[], %(errors)s::text[],
                              %(dead_letter_queue)s, %(reason)s, %(kombu_queue)s) AS msg_id

-- name: pgmq_extension_version
SELECT extversion AS version FROM pg_extension WHERE extname = 'pgmq'

-- name: pgmq_extension_available
SELECT default_version AS version FROM pg_available_extensions WHERE name = 'pgmq'

-- name: pgmq_schema_present
-- A SQL-only PGMQ install has the pgmq.meta table but no pg_extension row.
SELECT to_regclass('pgmq.meta') IS NOT NULL AS present

-- name: pgmq_missing_functions
-- The PGMQ functions (with these signatures) kombu_pgmq calls; returns the missing ones.
SELECT wanted AS signature
FROM unnest(ARRAY[
    'pgmq.send(text,jsonb,jsonb)',
    'pgmq.send(text,jsonb,jsonb,integer)',
    'pgmq.read(text,integer,integer,jsonb)',
    'pgmq.pop(text,integer)',
    'pgmq.archive(text,bigint[])',
    'pgmq.set_vt(text,bigint[],integer)',
    'pgmq.create(text)',
    'pgmq.drop_queue(text)'
]) AS wanted
WHERE to_regprocedure(wanted) IS NULL

-- name: create_extension
CREATE EXTENSION IF NOT EXISTS pgmq

-- name: bootstrap_lock
-- Serializes bootstrap across processes until the transaction ends.
SELECT pg_advisory_xact_lock(%(key)s::bigint)

-- name: applied_migrations
SELECT version FROM kombu_pgmq.migrations ORDER BY version

-- name: schema_version
-- Fast path before taking the bootstrap lock: false when kombu_pgmq is not installed
-- (to_regclass does not fail on a missing table, unlike a query on it).
SELECT to_regclass('kombu_pgmq.migrations') IS NOT NULL AS present

-- name: record_migration
INSERT INTO kombu_pgmq.migrations (version, name) VALUES (%(version)s, %(name)s)

-- name: record_pgmq_install
INSERT INTO kombu_pgmq.settings (key, value) VALUES ('pgmq_sql_version', %(version)s)
ON CONFLICT (key) DO UPDATE SET value = excluded.value

-- name: apply_grants
-- After migrations: the privileges of every role granted with kombu_pgmq.grant_role,
-- so the functions a migration added reach them.
SELECT kombu_pgmq.apply_grants() AS role

-- name: grant_role
SELECT kombu_pgmq.grant_role(%(role)s, %(kind)s)

-- name: revoke_role
SELECT kombu_pgmq.revoke_role(%(role)s) AS revoked

-- name: granted_roles
SELECT role, kind FROM kombu_pgmq.roles ORDER BY role

-- name: binding_exists
SELECT EXISTS (SELECT 1 FROM kombu_pgmq.bindings
               WHERE exchange = %(exchange)s AND routing_key = %(routing_key)s
                 AND queue = %(kombu_queue)s) AS found

-- name: database_identity
-- Which database a connection reaches (kombu_pgmq.using: the application's connection and
-- the broker's must be to the same one).
SELECT current_database() AS name, pg_postmaster_start_time() AS started

-- name: pgmq_sql_version
SELECT value AS version FROM kombu_pgmq.settings WHERE key = 'pgmq_sql_version'

-- name: session_lock
SELECT pg_advisory_lock(%(key)s::bigint)

-- name: session_unlock
SELECT pg_advisory_unlock(%(key)s::bigint)

-- name: database_exists
SELECT EXISTS (SELECT 1 FROM pg_database WHERE datname = %(name)s) AS found

-- name: create_database
CREATE DATABASE {database}

-- name: declare_exchange
-- Returns the exchange's type as stored (the first declaration wins, as in AMQP).
WITH inserted AS (
    INSERT INTO kombu_pgmq.exchanges (exchange, type, durable, auto_delete)
    VALUES (%(exchange)s, %(type)s, %(durable)s, %(auto_delete)s)
    ON CONFLICT (exchange) DO NOTHING
    RETURNING type
)
SELECT type FROM inserted
UNION ALL
SELECT type FROM kombu_pgmq.exchanges WHERE exchange = %(exchange)s
LIMIT 1

-- name: exchange_type
SELECT type FROM kombu_pgmq.exchanges WHERE exchange = %(exchange)s

-- name: delete_exchange
WITH unbound AS (DELETE FROM kombu_pgmq.bindings WHERE exchange = %(exchange)s)
DELETE FROM kombu_pgmq.exchanges WHERE exchange = %(exchange)s

-- name: bind
INSERT INTO kombu_pgmq.bindings (exchange, routing_key, queue)
VALUES (%(exchange)s, %(routing_key)s, %(kombu_queue)s)
ON CONFLICT DO NOTHING

-- name: unbind
DELETE FROM kombu_pgmq.bindings
WHERE exchange = %(exchange)s AND routing_key = %(routing_key)s AND queue = %(kombu_queue)s

-- name: routing_table
-- The whole routing table and its version, from one snapshot.
SELECT v.version,
       coalesce((SELECT jsonb_object_agg(e.exchange, e.type) FROM kombu_pgmq.exchanges e),
                '{}'::jsonb) AS exchanges,
       coalesce((SELECT jsonb_agg(jsonb_build_object(
                            'exchange', b.exchange, 'routing_key', b.routing_key,
                            'queue', b.queue, 'pgmq_queue', q.pgmq_queue,
                            'priority_bands', q.priority_bands, 'band_queues', q.band_queues,
                            'deduplicate_task_id', q.deduplicate_task_id))
                 FROM kombu_pgmq.bindings b JOIN kombu_pgmq.queues q USING (queue)),
                '[]'::jsonb) AS bindings
FROM kombu_pgmq.routing_version v

-- name: pooler_keeps_prepared
-- Sent prepared, through a transaction pooler with pooler_prepared_statements=True, once
-- per connection (kombu_pgmq/_db/pooling.py check_prepared_kept): the names this
-- statement's own text is prepared under on the server connection it runs on. PgBouncer
-- >= 1.21 with max_prepared_statements > 0 renames each client's statements
-- (PGBOUNCER_<n>); a pooler that passes psycopg's own names through (_pg3_<n>) does not
-- keep them per client.
SELECT name FROM pg_prepared_statements WHERE statement = current_query()

-- name: routing_version
-- Cheap freshness check of a cached routing table (one-row table).
SELECT version FROM kombu_pgmq.routing_version

-- name: send_many
-- Many publishes in one call, in order (kombu_pgmq.publish_many).
-- %(batch)s: a JSON array of {"queues": [...], "message": {...}, "headers": {...},
-- "delay_seconds": n, "visible_at": "...", "deduplication_window": s} (one JSON text: no
-- per-element array escaping). sent is false (nothing was sent) when the routing table
-- is no longer at %(version)s (NULL: no routed publish in the batch).
SELECT kombu_pgmq.publish_many(%(batch)s::jsonb, %(version)s::bigint) AS sent

-- name: send_routed
-- Publish one message to every queue an exchange routed it to, in one transaction (so
-- in all of them or in none), only if the routing table is still at %(version)s: the
-- caller's cached routes are then exact. Returns the current version and the msg_ids
-- (empty when the version moved: reload the table and publish again). delay_seconds > 0
-- uses PGMQ's native delay.
SELECT version, msg_ids
FROM kombu_pgmq.publish_routed(%(queues)s::text[], %(message)s::jsonb, %(headers)s::jsonb,
                               %(version)s::bigint, %(delay_seconds)s::integer,
                               %(deduplication_window)s::float8)

-- name: register_consumer
WITH used AS (
    UPDATE kombu_pgmq.queues SET had_consumer = true, last_used_at = clock_timestamp()
    WHERE queue = %(kombu_queue)s RETURNING queue
)
INSERT INTO kombu_pgmq.consumers (queue, owner, consumer_tag, stale_after_seconds)
SELECT queue, %(owner)s, %(consumer_tag)s, %(stale_after_seconds)s::float8 FROM used
ON CONFLICT (queue, owner, consumer_tag) DO UPDATE SET heartbeat_at = clock_timestamp()

-- name: release_consumer
-- Returns true when the queue was dropped (auto_delete, and this was its last consumer).
SELECT kombu_pgmq.release_consumer(%(kombu_queue)s, %(owner)s, %(consumer_tag)s) AS dropped

-- name: dead_tuples
-- Dead row versions of queue tables (cumulative statistics, a few seconds behind), of
-- the tables this role may VACUUM (their owner, or a member of it; superusers), left out
-- if a VACUUM (ours, another process's, autovacuum) ended less than min_interval_seconds
-- ago: the statistics lag, and 64 consumers of one table ran 2.6 VACUUMs a second on it
-- (measured), one after the other.
SELECT s.relname, s.n_dead_tup
FROM pg_stat_user_tables s JOIN pg_class c ON c.oid = s.relid
WHERE s.schemaname = 'pgmq' AND s.relname = ANY(%(tables)s::text[])
  AND pg_has_role(c.relowner, 'USAGE')
  AND coalesce(greatest(s.last_vacuum, s.last_autovacuum), '-infinity')
      < now() - make_interval(secs => %(min_interval_seconds)s::float8)

-- name: xmin_horizon
-- Who holds this database's xmin horizon (what VACUUM may remove, what index scans may
-- skip): the holder with the oldest xmin among sessions of this database (a snapshot:
-- backend_xmin; a transaction that wrote: backend_xid), WAL senders (a standby with
-- hot_standby_feedback), replication slots (xmin: physical slots; a logical slot holds
-- only catalog_xmin, not queue tables) and prepared transactions of this database; none
-- when nothing but this session holds one. age_seconds: since the holder's transaction
-- started (NULL where pg_stat_activity hides it from this role: grant pg_read_all_stats;
-- since PREPARE for a prepared transaction); state and query likewise.
WITH holders AS (
    SELECT 'session'::text AS kind, a.pid, a.application_name, a.usename::text AS role,
           a.state, coalesce(a.backend_xmin, a.backend_xid) AS xmin, a.xact_start AS since,
           left(a.query, 200) AS query, NULL::text AS name
    FROM pg_stat_activity a
    WHERE a.pid <> pg_backend_pid()
      AND (a.datname = current_database() OR a.backend_type = 'walsender')
      AND coalesce(a.backend_xmin, a.backend_xid) IS NOT NULL
    UNION ALL
    SELECT 'replication_slot', s.active_pid, NULL, NULL,
           CASE WHEN s.active THEN 'active' ELSE 'inactive' END, s.xmin, NULL, NULL,
           s.slot_name::text
    FROM pg_replication_slots s
    WHERE s.xmin IS NOT NULL
    UNION ALL
    SELECT 'prepared_transaction', NULL, NULL, p.owner::text, 'prepared', p.transaction,
           p.prepared, NULL, p.gid
    FROM pg_prepared_xacts p
    WHERE p.database = current_database()
)
SELECT kind, pid, application_name, role, state, xmin::text AS xmin,
       age(xmin) AS xmin_age_xids,
       extract(epoch FROM clock_timestamp() - since)::float8 AS age_seconds, query, name
FROM holders
ORDER BY age(xmin) DESC, since
LIMIT 1

-- name: queue_table_dead_tuples
-- Dead row versions of every PGMQ queue table (cumulative statistics, a few seconds
-- behind; readable by any role).
SELECT substr(s.relname, 3) AS pgmq_queue, s.n_dead_tup AS dead_tuples
FROM pg_stat_user_tables s
WHERE s.schemaname = 'pgmq' AND left(s.relname, 2) = 'q_'

-- name: vacuum
-- {queue_table} composed with psycopg.sql.Identifier. SKIP_LOCKED: another consumer's
-- VACUUM (or autovacuum) is already at it. Cannot run inside a transaction block.
VACUUM (SKIP_LOCKED) {queue_table}

-- name: heartbeat
-- Keeps this process's consumers live and their queues used (x-expires). A queue marked
-- used less than a second ago (a quarter of its x-expires if shorter) is left alone: with
-- a hundred consumers of one queue, every heartbeat updated its one row and waited for
-- the others' row locks (11 ms a heartbeat at 128 consumers, measured).
WITH beat AS (
    UPDATE kombu_pgmq.consumers SET heartbeat_at = clock_timestamp()
    WHERE owner = %(owner)s RETURNING queue
)
UPDATE kombu_pgmq.queues SET last_used_at = clock_timestamp()
WHERE queue IN (SELECT queue FROM beat)
  AND last_used_at < clock_timestamp()
                     - least(1000, coalesce(expires_ms / 4, 1000)) * interval '1 millisecond'

-- name: reap
-- Also forgets the waiting rows (kombu_pgmq.waiting) of connections without consumers;
-- a data-modifying WITH runs even though nothing reads it.
-- Expired deduplication claims (kombu_pgmq.deduplication) go too, in a bounded batch.
WITH forgotten AS (
    DELETE FROM kombu_pgmq.waiting w
    WHERE NOT EXISTS (SELECT 1 FROM kombu_pgmq.consumers c WHERE c.owner = w.owner)
), expired AS (
    SELECT kombu_pgmq.forget_deduplications() AS n
)
SELECT kombu_pgmq.reap() AS queue FROM expired

-- name: dead_letters
-- Dead letters of a dead-letter queue ({queue_table}), oldest first, filtered by
-- msg_ids, original Kombu queue, reason and task name (NULL: any), from after_id on;
-- any_header false: only rows with an x-dead-letter header (replayable ones).
SELECT msg_id, read_ct, enqueued_at, message::text AS message, headers::text AS headers
FROM {queue_table}
WHERE msg_id > %(after_id)s
  AND (%(msg_ids)s::bigint[] IS NULL OR msg_id = ANY(%(msg_ids)s::bigint[]))
  AND (%(queue)s::text IS NULL OR headers -> 'x-dead-letter' ->> 'queue' = %(queue)s::text)
  AND (%(reason)s::text IS NULL OR headers -> 'x-dead-letter' ->> 'reason' = %(reason)s::text)
  AND (%(task)s::text IS NULL OR headers ->> 'task' = %(task)s::text)
  AND (%(any_header)s::boolean OR headers ? 'x-dead-letter')
ORDER BY msg_id
LIMIT %(limit)s

-- name: take_dead_letters
-- Remove up to limit matching dead letters (same filters as dead_letters) and return
-- them, for a replay in the same transaction; rows another session holds are skipped.
WITH taken AS (
    DELETE FROM {queue_table}
    WHERE msg_id IN (
        SELECT msg_id FROM {queue_table}
        WHERE msg_id > %(after_id)s
          AND (%(msg_ids)s::bigint[] IS NULL OR msg_id = ANY(%(msg_ids)s::bigint[]))
          AND (%(queue)s::text IS NULL OR headers -> 'x-dead-letter' ->> 'queue' = %(queue)s::text)
          AND (%(reason)s::text IS NULL OR headers -> 'x-dead-letter' ->> 'reason' = %(reason)s::text)
          AND (%(task)s::text IS NULL OR headers ->> 'task' = %(task)s::text)
          AND (%(any_header)s::boolean OR headers ? 'x-dead-letter')
        ORDER BY msg_id
        LIMIT %(limit)s
        FOR UPDATE SKIP LOCKED
    )
    RETURNING msg_id, read_ct, enqueued_at, message, headers
)
SELECT msg_id, read_ct, enqueued_at, message::text AS message, headers::text AS headers
FROM taken ORDER BY msg_id

-- name: queue_tables
-- Every PGMQ queue (name, and whether its archive table exists).
SELECT m.queue_name AS queue,
       to_regclass('pgmq.' || quote_ident('a_' || m.queue_name)) IS NOT NULL AS archived
FROM pgmq.meta m ORDER BY m.queue_name

-- name: prune_archive
-- Archive retention: delete up to batch_size archived messages older than
-- older_than_seconds from {archive_table} (oldest first, by its archived_at index).
-- Each batch is its own short transaction; SKIP LOCKED never waits for another pruner.
WITH doomed AS (
    SELECT msg_id FROM {archive_table}
    WHERE archived_at < clock_timestamp() - make_interval(secs => %(older_than_seconds)s::float8)
    ORDER BY archived_at
    LIMIT %(batch_size)s
    FOR UPDATE SKIP LOCKED
), gone AS (
    DELETE FROM {archive_table} a USING doomed WHERE a.msg_id = doomed.msg_id RETURNING 1
)
SELECT count(*) AS deleted FROM gone

-- name: open_write
-- Spark writer: register a write on the queue (kombu_pgmq.spark_writes); returns
-- after_id.
SELECT kombu_pgmq.open_write(%(write_id)s, %(queue)s) AS after_id

-- name: stage_messages
-- Stage a batch of a task attempt hidden for 10 years (refused unless the write is open).
SELECT kombu_pgmq.stage_write(%(write_id)s, %(messages)s::jsonb[], %(headers)s::jsonb[])
    AS staged

-- name: commit_write
SELECT kombu_pgmq.commit_write(%(write_id)s, %(attempts)s::text[]) AS committed

-- name: abort_write
SELECT kombu_pgmq.abort_write(%(write_id)s) AS deleted

-- name: msg_id_range
-- Lowest and highest msg_id (primary key) of a queue or archive table, NULLs when empty.
SELECT min(msg_id) AS lo, max(msg_id) AS hi FROM {table}

-- name: snapshot
-- Rows of a queue or archive table with lo < msg_id <= hi, by primary key, read without
-- consuming. {last_read_at} / {archived_at} are the column, or NULL where the table has
-- none (queue tables have no archived_at; PGMQ < 1.11 has no last_read_at).
SELECT msg_id, read_ct, enqueued_at, {last_read_at} AS last_read_at, vt,
       {archived_at} AS archived_at, headers ->> 'task' AS task, headers ->> 'id' AS task_id,
       message::text AS message, headers::text AS headers
FROM {table}
WHERE msg_id > %(lo)s AND msg_id <= %(hi)s
ORDER BY msg_id

-- name: table_columns
SELECT attname FROM pg_attribute
WHERE attrelid = %(table)s::regclass AND attnum > 0 AND NOT attisdropped

-- name: stream_horizon
SELECT kombu_pgmq.stream_horizon(%(queue)s, %(after_id)s, %(max_rows)s,
                                 %(wait_seconds)s) AS msg_id

-- name: archive_range
-- Streaming reader's commit: archive the messages lo < msg_id <= hi (primary key range).
SELECT count(*) AS archived
FROM pgmq.archive(%(queue)s, ARRAY(SELECT msg_id FROM {queue_table}
                                   WHERE msg_id > %(lo)s AND msg_id <= %(hi)s))

-- name: queue_stats
-- Per PGMQ queue (priority band) of every queue: ready, in_flight, delayed, oldest age,
-- archive size, consumers, dead letters, paused. One statement.
SELECT queue, pgmq_queue, band, ready, in_flight, delayed, oldest_age_seconds, archived,
       archived_estimated, consumers, dead_letters, paused
FROM kombu_pgmq.queue_stats(%(dead_letter_queue)s, %(exact_archive_below)s::bigint)

-- name: pause_queue
-- Consumers stop receiving from the Kombu queue (every band); publishes still land.
SELECT q AS pgmq_queue FROM kombu_pgmq.pause(%(kombu_queue)s) AS q

-- name: resume_queue
SELECT q AS pgmq_queue FROM kombu_pgmq.resume(%(kombu_queue)s) AS q

-- name: peek
-- Messages of a Kombu queue without consuming them.
SELECT pgmq_queue, band, state, msg_id, read_ct, enqueued_at, visible_at, message, headers
FROM kombu_pgmq.peek(%(kombu_queue)s, %(qty)s::integer)

-- name: find_task
-- A Celery task's messages by task id, in queues and (archives) archives.
SELECT queue, pgmq_queue, state, msg_id, read_ct, enqueued_at, visible_at, archived_at,
       reason, headers
FROM kombu_pgmq.find_task(%(task_id)s, %(archives)s)

-- name: cancel_task
-- Durable revoke: remove the task's undelivered messages, archived with reason cancelled.
SELECT queue, pgmq_queue, msg_id FROM kombu_pgmq.cancel_task(%(task_id)s)

-- name: operations_installed
-- The statistics, pause and cancel functions (kombu_pgmq.queue_stats...) are installed.
SELECT to_regprocedure('kombu_pgmq.queue_stats(text, bigint)') IS NOT NULL AS installed

-- name: results_installed
-- The result backend's tables and functions (kombu_pgmq.results...) are installed.
SELECT to_regprocedure('kombu_pgmq.results_stats()') IS NOT NULL AS installed

-- -- result backend (kombu_pgmq.results; tables kombu_pgmq.results, chords, revoked) ----

-- name: results_store
-- Store one key's encoded meta (NOTIFY kombu_pgmq_results); false: a SUCCESS was kept.
SELECT kombu_pgmq.results_store(%(key)s, %(state)s, %(meta)s, %(expires_seconds)s::float8,
                                %(keep_success)s) AS stored

-- name: results_save_group
-- Store a saved GroupResult (the only key a producer role may write).
SELECT kombu_pgmq.results_save_group(%(key)s, %(meta)s, %(expires_seconds)s::float8) AS stored

-- name: results_get
-- Stored meta by key (primary key lookups); revoked: no result, but the task is revoked.
SELECT key, meta, revoked FROM kombu_pgmq.results_get(%(keys)s::text[], %(task_ids)s::text[])

-- name: results_delete
SELECT kombu_pgmq.results_delete(%(keys)s::text[]) AS removed

-- name: results_expire_at
SELECT kombu_pgmq.results_expire_at(%(keys)s::text[], %(expires_seconds)s::float8)

-- name: results_expire
-- One batch of the expiry sweep (partial index results_expires_at_idx).
SELECT kombu_pgmq.results_expire(%(batch)s) AS removed

-- name: results_stats
SELECT state, results, oldest, bytes, expired FROM kombu_pgmq.results_stats()

-- name: chord_start
SELECT kombu_pgmq.chord_start(%(group_id)s, %(expires_seconds)s::float8)

-- name: chord_size
SELECT kombu_pgmq.chord_size(%(group_id)s, %(size)s::integer, %(added)s::integer,
                             %(expires_seconds)s::float8)

-- name: chord_part
-- Count one header task (once per task id); fire: this call completed the chord.
SELECT fire, done, total FROM kombu_pgmq.chord_part(
    %(group_id)s, %(task_id)s, %(group_index)s::integer, %(state)s, %(result)s,
    %(fallback_size)s::integer, %(expires_seconds)s::float8)

-- name: chord_results
SELECT task_id, state, result FROM kombu_pgmq.chord_results(%(group_id)s)

-- name: chord_done
SELECT kombu_pgmq.chord_done(%(group_id)s, %(expires_seconds)s::float8)

-- name: revoke_tasks
SELECT kombu_pgmq.revoke_tasks(%(task_ids)s::text[], %(expires_seconds)s::float8) AS added

-- name: revoked_tasks
SELECT task_id, revoked_at, expires_at FROM kombu_pgmq.revoked_tasks(%(max_rows)s)

-- name: listen_results
LISTEN kombu_pgmq_results

-- -- beat (kombu_pgmq.beat; tables kombu_pgmq.beat_entries, beat_ticks, beat_leader) ---

-- name: beat_installed
-- The beat scheduler's tables and functions (kombu_pgmq.beat_list...) are installed.
SELECT to_regprocedure('kombu_pgmq.beat_list()') IS NOT NULL AS installed

-- name: beat_elect
-- One election round: renew the lead, take a free lock, or depose a hung leader.
SELECT leader, epoch, leader_identity, leader_pid, heartbeat_age, deposed
FROM kombu_pgmq.beat_elect(%(me)s, %(stale_seconds)s::float8)

-- name: beat_resign
SELECT kombu_pgmq.beat_resign() AS resigned

-- name: beat_leader_info
SELECT identity, backend_pid, epoch, since, heartbeat_at, heartbeat_age, alive
FROM kombu_pgmq.beat_leader_info()

-- name: beat_claim
-- Claim ticks in the publishing transaction (NULL: this session is not the leader).
SELECT kombu_pgmq.beat_claim(
    %(epoch)s::bigint, %(me)s, %(entries)s::text[], %(due_ats)s::timestamptz[],
    %(expected)s::timestamptz[], %(next_runs)s::timestamptz[], %(task_ids)s::text[],
    %(kinds)s::text[], %(missed)s::integer[]) AS claimed

-- name: beat_note
SELECT kombu_pgmq.beat_note(%(epoch)s::bigint, %(entries)s::text[],
                            %(next_runs)s::timestamptz[], %(errors)s::text[]) AS noted

-- name: beat_sync_config
SELECT written, removed FROM kombu_pgmq.beat_sync_config(%(config)s::jsonb)

-- name: beat_upsert
SELECT kombu_pgmq.beat_upsert(
    %(name)s, %(task)s, %(schedule_kind)s, %(schedule)s::jsonb, %(args)s::jsonb,
    %(kwargs)s::jsonb, %(options)s::jsonb, %(enabled)s, %(catch_up)s, %(replace)s) AS added

-- name: beat_set_enabled
SELECT kombu_pgmq.beat_set_enabled(%(name)s, %(enabled)s) AS found

-- name: beat_remove
SELECT kombu_pgmq.beat_remove(%(name)s) AS found

-- name: beat_run_now
SELECT kombu_pgmq.beat_run_now(%(name)s) AS requested_at

-- name: beat_list
SELECT * FROM kombu_pgmq.beat_list()

-- name: beat_entry
SELECT * FROM kombu_pgmq.beat_get(%(name)s)

-- name: beat_history
SELECT * FROM kombu_pgmq.beat_history(%(name)s, %(max_rows)s::integer)

-- name: beat_prune
SELECT kombu_pgmq.beat_prune(%(keep_seconds)s::float8, %(batch)s::integer) AS pruned

-- name: listen_beat
LISTEN kombu_pgmq_beat

-- name: limits_installed
-- Queue limits (kombu_pgmq.queue_limits, kombu_pgmq.limits_info...) are installed.
SELECT to_regprocedure('kombu_pgmq.limits_info(text)') IS NOT NULL AS installed

-- name: kombu_queue_declared
-- The Kombu queue is declared (kombu_pgmq.queues' primary key).
SELECT EXISTS (SELECT 1 FROM kombu_pgmq.queues WHERE queue = %(queue)s) AS found

-- name: set_queue_limits
-- Set a Kombu queue's limits (JSON, a null removes one; replace: the ones
-- not given are removed). A row back: the queue is limited.
SELECT queue FROM kombu_pgmq.set_queue_limits(%(queue)s, %(limits)s::jsonb, %(replace)s)

-- name: limits_info
-- Every limited queue (or one) with its limits and their use now.
SELECT queue, concurrency, rate, rate_per_second, burst, limit_key, key_concurrency, key_rate,
       key_rate_per_second, key_burst, ordered_keys, in_flight, tokens, keys_in_flight,
       keys_at_limit, throttled_concurrency, throttled_rate, throttled_keys, updated_at,
       updated_by
FROM kombu_pgmq.limits_info(%(queue)s)

-- name: renew_slots
-- Push held slots to now + hold_seconds; returns the (queue, msg_id) still held.
SELECT queue, msg_id
FROM kombu_pgmq.renew_slots(%(queues)s::text[], %(msg_ids)s::bigint[], %(hold_seconds)s::integer)

-- name: release_slots
-- Release held slots (their tasks finished) and wake consumers waiting on their queues;
-- its transaction commits without waiting for the WAL flush (a release a crash forgets
-- lapses with its slot, one visibility timeout after the last renewal).
SELECT kombu_pgmq.release_slots(%(queues)s::text[], %(msg_ids)s::bigint[]) AS released,
       set_config('synchronous_commit', 'off', true) AS synchronous_commit
