-- kombu_pgmq's statements, one named block each ("-- name: <name>").
-- Loaded by kombu_pgmq/queries.py and sent only by kombu_pgmq/client.py.
-- Placeholders: %(name)s are bound parameters; {queue_table} is a PGMQ queue table
-- (pgmq.q_<name>) composed with psycopg.sql.Identifier, never string formatting.
-- Result rows are decoded by column name, never by position (PGMQ 1.11 inserted
-- last_read_at before vt in pgmq.message_record).

-- name: send
-- Publish one message; PGMQ inserts into pgmq.q_<queue> with vt = now.
SELECT pgmq.send(%(queue)s, %(message)s::jsonb, %(headers)s::jsonb) AS msg_id

-- name: send_delayed
-- Publish one message that becomes visible after delay_seconds (PGMQ's native delay).
SELECT pgmq.send(%(queue)s, %(message)s::jsonb, %(headers)s::jsonb, %(delay_seconds)s::integer) AS msg_id

-- name: read
-- Deliver up to qty visible messages, hiding them for vt_seconds (FOR UPDATE SKIP
-- LOCKED inside pgmq.read: concurrent consumers never get the same message).
-- Uses the queue table's primary key order (msg_id) and its vt index.
-- message and headers come back as text: the JSON body goes to Kombu unparsed.
SELECT msg_id, read_ct, message::text AS message, headers::text AS headers
FROM pgmq.read(%(queue)s, %(vt_seconds)s::integer, %(qty)s::integer)

-- name: pop
-- Deliver and delete up to qty visible messages (consumers with no_ack=True).
SELECT msg_id, read_ct, message::text AS message, headers::text AS headers
FROM pgmq.pop(%(queue)s, %(qty)s::integer)

-- name: archive
-- Ack: move messages to pgmq.a_<queue> (the audit trail). Returns archived ids.
SELECT pgmq.archive(%(queue)s, %(msg_ids)s::bigint[]) AS msg_id

-- name: set_vt
-- Requeue (vt_seconds = 0) or extend the lease of messages. Returns updated ids.
SELECT msg_id FROM pgmq.set_vt(%(queue)s, %(msg_ids)s::bigint[], %(vt_seconds)s::integer)

-- name: create_queue
SELECT pgmq.create(%(queue)s)

-- name: register_queue
-- Remember which Kombu name a PGMQ queue stands for (kombu_pgmq.naming is one-way).
INSERT INTO kombu_pgmq.queues (queue, pgmq_queue) VALUES (%(kombu_queue)s, %(queue)s)
ON CONFLICT (queue) DO NOTHING

-- name: drop_queue
-- Drops pgmq.q_<queue> and its archive pgmq.a_<queue>; false if it did not exist.
SELECT pgmq.drop_queue(%(queue)s) AS dropped

-- name: unregister_queue
DELETE FROM kombu_pgmq.queues WHERE pgmq_queue = %(queue)s

-- name: queue_exists
-- pgmq.meta has one row per queue (unique index on queue_name).
SELECT EXISTS (SELECT 1 FROM pgmq.meta WHERE queue_name = %(queue)s) AS found

-- name: size
-- Ready (visible) messages, as AMQP's message_count: unacked ones are not counted.
SELECT count(*) AS size FROM {queue_table} WHERE vt <= clock_timestamp()

-- name: purge
-- AMQP purge removes ready messages only: messages being processed (vt in the future)
-- stay, so their ack or redelivery still works. pgmq.purge_queue would TRUNCATE them
-- too, and take an ACCESS EXCLUSIVE lock that blocks every consumer meanwhile.
WITH purged AS (
    DELETE FROM {queue_table} WHERE vt <= clock_timestamp() RETURNING 1
)
SELECT count(*) AS purged FROM purged

-- name: dead_letter
-- Move messages to the dead-letter queue in one statement (so atomically): delete from
-- the source queue table by primary key, send each to the dead-letter queue with an
-- "x-dead-letter" header recording where it came from and why.
WITH moved AS (
    DELETE FROM {queue_table} WHERE msg_id = ANY(%(msg_ids)s::bigint[])
    RETURNING msg_id, read_ct, enqueued_at, message, headers
)
SELECT pgmq.send(
    %(dead_letter_queue)s,
    moved.message,
    coalesce(moved.headers, '{{}}'::jsonb) || jsonb_build_object(
        'x-dead-letter', jsonb_build_object(
            'queue', %(kombu_queue)s::text,
            'pgmq_queue', %(queue)s::text,
            'msg_id', moved.msg_id,
            'read_ct', moved.read_ct,
            'reason', %(reason)s::text,
            'enqueued_at', moved.enqueued_at,
            'dead_lettered_at', clock_timestamp()
        )
    )
) AS msg_id
FROM moved

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

-- name: migrations_table
CREATE SCHEMA IF NOT EXISTS kombu_pgmq;
CREATE TABLE IF NOT EXISTS kombu_pgmq.migrations (
    version integer PRIMARY KEY,
    name text NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now()
)

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
