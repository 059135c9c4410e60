-- Queue limits: set and read, concurrency slots renewed and released. Sent by
-- kombu_pgmq/_db/limits.py (limits_installed, kombu_queue_declared:
-- kombu_pgmq/management.py). schema.sql area: Limits.

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
