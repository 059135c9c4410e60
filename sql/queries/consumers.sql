-- Consumers and wake-ups: the consumer registry, heartbeats and the reaper, waiting rows
-- and hand-off slots, LISTEN, the fallback poll's probe, VACUUM of consumed tables. Sent
-- by kombu_pgmq/_db/consumers.py. schema.sql areas: Consumers and wake-ups; Hand-off.

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

-- name: handoff_lock
-- The LISTEN connection's session advisory lock, held while it listens for hand-offs
-- (publishers skip the slots of a connection that no longer holds it), and the lease of
-- the sequence its slot is claimed on (kombu_pgmq.handoff_<seq>), for the life of the
-- session.
SELECT kombu_pgmq.handoff_lease(%(lock_key)s::bigint) AS seq

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
-- rewinds its reads). The statement sent for a fallback poll of queue celery and a look
-- below its position (kombu_pgmq/_db/consumers.py _visible_probe):
--   SELECT 'celery'::text AS queue, false::boolean AS below
--   WHERE EXISTS (SELECT 1 FROM "pgmq"."q_celery"
--                 WHERE vt >= to_timestamp($1::float8)
--                   AND vt < to_timestamp($2::float8)
--                   AND vt <= (SELECT clock_timestamp()))
--   UNION ALL
--   SELECT 'celery'::text AS queue, true::boolean AS below
--   WHERE EXISTS (SELECT 1 FROM "pgmq"."q_celery"
--                 WHERE vt >= to_timestamp($3::float8)
--                   AND vt < to_timestamp($4::float8)
--                   AND vt <= (SELECT clock_timestamp()))
SELECT {queue_name}::text AS queue, {below}::boolean AS below
WHERE EXISTS (SELECT 1 FROM {queue_table}
              WHERE vt >= to_timestamp({scan_from}::float8)
                AND vt < to_timestamp({scan_to}::float8)
                AND vt <= (SELECT clock_timestamp()))

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

-- name: vacuum
-- {queue_table} composed with psycopg.sql.Identifier. SKIP_LOCKED: another consumer's
-- VACUUM (or autovacuum) is already at it. Cannot run inside a transaction block.
VACUUM (SKIP_LOCKED) {queue_table}
