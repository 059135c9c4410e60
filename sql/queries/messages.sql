-- Messages: publishing (one queue, routed, many in a transaction), reading, and settling
-- deliveries by receipt handle (ack, requeue, lease renewal, discard, expiry, dead
-- letter). Sent by kombu_pgmq/_db/broker.py (through the queues' own functions:
-- kombu_pgmq/_db/queue_functions.py; send_many: kombu_pgmq/_db/batch.py). schema.sql
-- areas: Publishing; Consuming and settling; Per-queue functions.

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

-- name: send_many
-- Many publishes in one call, in order (kombu_pgmq.publish_many).
-- %(batch)s: a JSON array of {"queues": [...], "message": {...}, "headers": {...},
-- "delay_seconds": n, "visible_at": "...", "deduplication_window": s} (one JSON text: no
-- per-element array escaping). sent is false (nothing was sent) when the routing table
-- is no longer at %(version)s (NULL: no routed publish in the batch).
SELECT kombu_pgmq.publish_many(%(batch)s::jsonb, %(version)s::bigint) AS sent

-- name: flush_commits
-- After a publish that committed without waiting for the WAL flush (send_queue's column
-- flush; Broker.send), in a transaction of its own: a
-- transactional logical decoding message (prefix 'kombu_pgmq.flush', empty; callable by
-- every role) takes a transaction id and writes a WAL record, so the commit writes a
-- commit record and, in the session's commit mode, waits for the WAL flush up to it: that
-- covers the publish's commit record, written before. (A transaction id alone writes no
-- WAL: PostgreSQL then commits it without a flush.)
SELECT pg_logical_emit_message(true, 'kombu_pgmq.flush', '')

-- name: database_identity
-- Which database a connection reaches (kombu_pgmq.using: the application's connection and
-- the broker's must be to the same one).
SELECT current_database() AS name, pg_postmaster_start_time() AS started

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

-- name: pop
-- Deliver and delete up to qty visible messages (basic_get with no_ack).
SELECT queue, msg_id, read_ct, enqueued_at, message, headers, age_seconds
FROM kombu_pgmq.pop(%(queue)s, %(qty)s::integer)

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

-- name: ack
-- Ack with receipt handles (msg_id, read_ct, enqueued_at): archive the rows these
-- deliveries still hold; returns the (queue, msg_id) settled, a stale handle is left out.
-- holds (aligned): acks whose tasks run on, their concurrency slots held for hold_seconds.
SELECT queue, msg_id
FROM kombu_pgmq.ack(%(queues)s::text[], %(msg_ids)s::bigint[], %(read_cts)s::integer[],
                    %(enqueued)s::timestamptz[], %(holds)s::boolean[],
                    %(hold_seconds)s::integer)

-- name: ack_in_transaction
-- Ack of one delivery in the caller's open transaction (an AtomicTask's): archived with
-- the transaction, or SQLSTATE KP001 (the receipt is no longer held) aborts it.
SELECT kombu_pgmq.ack_in_transaction(%(queue)s, %(msg_id)s::bigint, %(read_ct)s::integer,
                                     %(enqueued)s::timestamptz)

-- name: ack_in_transaction_commit
-- ack_in_transaction, then the COMMIT of its transaction, in one round trip, on a
-- connection of kombu_pgmq's own (an AtomicTask's default): {placeholders} are literals
-- quoted by psycopg, and the text goes without parameters (the simple query protocol,
-- which takes two statements). A stale receipt (SQLSTATE KP001) stops it before the
-- COMMIT: the transaction is left aborted, to be rolled back.
SELECT kombu_pgmq.ack_in_transaction({queue}, {msg_id}, {read_ct}, {enqueued});
COMMIT

-- name: ack_async
-- The same with an asynchronous commit (durable_acks=False).
SELECT queue, msg_id, set_config('synchronous_commit', 'off', true) AS synchronous_commit
FROM kombu_pgmq.ack(%(queues)s::text[], %(msg_ids)s::bigint[], %(read_cts)s::integer[],
                    %(enqueued)s::timestamptz[], %(holds)s::boolean[],
                    %(hold_seconds)s::integer)

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

-- name: archive_expired_rows
-- archive_expired for roles without rights on PGMQ's tables: the same
-- marks, through a function run as its owner; returns the (queue, msg_id) archived.
SELECT queue, msg_id
FROM kombu_pgmq.archive_expired(%(queues)s::text[], %(msg_ids)s::bigint[],
                                %(read_cts)s::integer[], %(enqueued)s::timestamptz[])

-- name: renew
-- Lease renewal (kombu_pgmq.renew): push the visibility timeout of held messages to now +
-- vt_seconds, all queues in one round trip. Returns the (queue, msg_id) renewed; a held
-- message missing from the result lost its lease (read again by another consumer after
-- its visibility timeout passed, or gone).
SELECT queue, msg_id
FROM kombu_pgmq.renew(%(queues)s::text[], %(msg_ids)s::bigint[], %(read_cts)s::integer[],
                      %(enqueued)s::timestamptz[], %(vt_seconds)s::integer)

-- name: requeue
-- Reject with requeue, restore, a failed delivery: visible in vt_seconds if the
-- delivery still holds the row; uncount counts the delivery as a restore in the
-- x-kombu-restored header (the application never ran it; read_ct only grows, so no two
-- deliveries share a receipt). Returns the (queue, msg_id) settled.
SELECT queue, msg_id
FROM kombu_pgmq.requeue(%(queues)s::text[], %(msg_ids)s::bigint[], %(read_cts)s::integer[],
                        %(enqueued)s::timestamptz[], %(vt_seconds)s::integer,
                        %(uncount)s::boolean)

-- name: discard
-- What a no_ack consumer was handed: deleted for good if these deliveries still hold it
-- (receipt handles). Expired messages are archived instead (archive_expired).
SELECT kombu_pgmq.discard(%(queue)s, %(msg_ids)s::bigint[], %(read_cts)s::integer[],
                          %(enqueued)s::timestamptz[]) AS msg_id

-- name: dead_letter
-- Move messages to the dead-letter queue atomically, the rows these deliveries still hold
-- (receipt handles), each with an "x-dead-letter" header.
SELECT kombu_pgmq.dead_letter(%(queue)s, %(msg_ids)s::bigint[], %(read_cts)s::integer[],
                              %(enqueued)s::timestamptz[], %(errors)s::text[],
                              %(dead_letter_queue)s, %(reason)s, %(kombu_queue)s) AS msg_id
