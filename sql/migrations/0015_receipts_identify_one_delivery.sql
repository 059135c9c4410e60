-- A receipt identifies one delivery forever (issue 25, item 4). A receipt handle is
-- (msg_id, read_ct, enqueued_at) (migration 0007). Restores (a channel closed with
-- prefetched messages, a delivery whose callback failed) used to take their delivery
-- back from read_ct (read_ct - 1), so that they do not count toward max_deliveries. That
-- made read_ct go back to a value an earlier delivery had: after B returned a message
-- (read_ct 2 -> 1), A's stale receipt from its own, lapsed delivery (read_ct 1) matched
-- again, and A's late reject dead-lettered B's message.
--
-- Now read_ct only grows, as PGMQ means it (every read adds one): no two deliveries of a
-- message share a read_ct. A restore counts itself in the message's headers instead, as
-- "x-kombu-restored" (an integer; only on headers that are a JSON object, or none), and
-- the transport counts deliveries toward max_deliveries as read_ct - x-kombu-restored.
-- The transport takes the header out of the headers the application sees.

-- The headers of a restored message: x-kombu-restored + 1 (a value that is not a
-- number counts as 0, one above 10^9 as 10^9; headers that are not a JSON object stay
-- as they are).
CREATE FUNCTION kombu_pgmq.count_restore(headers jsonb) RETURNS jsonb
LANGUAGE sql IMMUTABLE AS $$
    SELECT CASE
        WHEN headers IS NULL OR jsonb_typeof(headers) = 'object' THEN
            coalesce(headers, '{}'::jsonb) || jsonb_build_object(
                'x-kombu-restored',
                CASE WHEN jsonb_typeof(headers -> 'x-kombu-restored') = 'number'
                     THEN least(floor((headers ->> 'x-kombu-restored')::numeric), 1e9)::bigint + 1
                     ELSE 1 END)
        ELSE headers
    END
$$;

-- Requeue (migration 0007's function): uncount no longer lowers read_ct; it counts the
-- restore in the headers (kombu_pgmq.count_restore).
CREATE OR REPLACE FUNCTION kombu_pgmq.requeue(
    queues text[], msg_ids bigint[], read_cts integer[], enqueued timestamptz[],
    vt integer DEFAULT 0, uncount boolean DEFAULT false
) RETURNS TABLE (queue text, msg_id bigint)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    q text;
    ids bigint[];
    cts integer[];
    ats timestamptz[];
BEGIN
    FOR q, ids, cts, ats IN
        SELECT h.q, array_agg(h.id), array_agg(h.ct), array_agg(h.at)
        FROM unnest(queues, msg_ids, read_cts, enqueued) AS h(q, id, ct, at)
        GROUP BY h.q ORDER BY h.q
    LOOP
        CONTINUE WHEN to_regclass(format('pgmq.%I', 'q_' || q)) IS NULL;
        RETURN QUERY EXECUTE format(
            'UPDATE pgmq.%I AS t
             SET vt = clock_timestamp() + make_interval(secs => $4),
                 headers = CASE WHEN $5 THEN kombu_pgmq.count_restore(t.headers)
                                ELSE t.headers END
             FROM unnest($1::bigint[], $2::integer[], $3::timestamptz[]) AS h(id, ct, at)
             WHERE t.msg_id = h.id AND t.read_ct = h.ct AND t.enqueued_at = h.at
             RETURNING %L::text, t.msg_id',
            'q_' || q, q
        ) USING ids, cts, ats, vt, uncount;
    END LOOP;
END
$$;

INSERT INTO kombu_pgmq.grantable (function, kind, definer) VALUES
    ('kombu_pgmq.count_restore(jsonb)', 'owner', false);
SELECT kombu_pgmq.secure_functions();
