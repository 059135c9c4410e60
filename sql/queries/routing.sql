-- Routing: exchanges and bindings, the routing table and its version. Sent by
-- kombu_pgmq/_db/declarations.py. schema.sql area: Routing.

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

-- name: binding_exists
SELECT EXISTS (SELECT 1 FROM kombu_pgmq.bindings
               WHERE exchange = %(exchange)s AND routing_key = %(routing_key)s
                 AND queue = %(kombu_queue)s) AS found

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

-- name: routing_version
-- Cheap freshness check of a cached routing table (one-row table).
SELECT version FROM kombu_pgmq.routing_version
