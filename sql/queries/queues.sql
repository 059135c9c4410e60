-- Queues: declared, sized, purged, dropped, their own functions created. Sent by
-- kombu_pgmq/_db/declarations.py (queue_functions: kombu_pgmq/_db/queue_functions.py).
-- schema.sql area: Queues.

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

-- name: queue_functions
-- Create the queue's own functions if missing (kombu_pgmq.queue_functions: a queue made
-- by plain pgmq.create has none); undefined_table (QueueNotFound) if the queue is gone.
SELECT kombu_pgmq.queue_functions(%(queue)s)

-- name: queue_bands
-- Priority bands of a Kombu queue (NULL arrays: no priorities) and whether it is a FIFO
-- queue; no row: unknown queue.
SELECT max_priority, priority_bands, band_queues, fifo_groups, deduplicate_task_id
FROM kombu_pgmq.queues
WHERE queue = %(kombu_queue)s

-- name: queue_exists
-- pgmq.meta has one row per queue (unique index on queue_name).
SELECT EXISTS (SELECT 1 FROM pgmq.meta WHERE queue_name = %(queue)s) AS found

-- name: message_ttl
SELECT message_ttl_ms, expires_ms FROM kombu_pgmq.queues WHERE queue = %(kombu_queue)s

-- name: touch_queue
-- basic_get counts as use of an x-expires queue (AMQP's basic.get does).
UPDATE kombu_pgmq.queues SET last_used_at = clock_timestamp()
WHERE queue = %(kombu_queue)s AND expires_ms IS NOT NULL

-- name: size
-- Ready (visible) messages, as AMQP's message_count: unacked ones are not counted.
SELECT kombu_pgmq.size(%(queue)s) AS size

-- name: purge
-- AMQP purge removes ready messages only; returns how many.
SELECT kombu_pgmq.purge(%(queue)s) AS purged

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
