-- Operations: dead letters, archive retention, statistics, pause and resume, tasks by
-- id, database creation (kombu_pgmq/_db/admin.py); who holds the xmin horizon and the
-- dead rows it keeps (kombu_pgmq/_db/horizon.py). schema.sql area: Operations.

-- name: operations_installed
-- The statistics, pause and cancel functions (kombu_pgmq.queue_stats...) are installed.
SELECT to_regprocedure('kombu_pgmq.queue_stats(text, bigint)') IS NOT NULL AS installed

-- name: queue_stats
-- Per PGMQ queue (priority band) of every queue: ready, in_flight, delayed, oldest age,
-- archive size, consumers, dead letters, paused. One statement.
SELECT queue, pgmq_queue, band, ready, in_flight, delayed, oldest_age_seconds, archived,
       archived_estimated, consumers, dead_letters, paused
FROM kombu_pgmq.queue_stats(%(dead_letter_queue)s, %(exact_archive_below)s::bigint)

-- name: settled_in_transaction_installed
-- The count of messages settled inside an application's transaction is installed.
SELECT to_regprocedure('kombu_pgmq.settled_in_transaction()') IS NOT NULL AS installed

-- name: settled_in_transaction
-- Messages settled inside an application's transaction (AtomicTask), per PGMQ queue.
SELECT pgmq_queue, settled FROM kombu_pgmq.settled_in_transaction()

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

-- name: session_lock
SELECT pg_advisory_lock(%(key)s::bigint)

-- name: session_unlock
SELECT pg_advisory_unlock(%(key)s::bigint)

-- name: database_exists
SELECT EXISTS (SELECT 1 FROM pg_database WHERE datname = %(name)s) AS found

-- name: create_database
CREATE DATABASE {database}
