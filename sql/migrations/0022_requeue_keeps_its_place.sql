-- A requeued message goes back to its place in the queue (issue 30, item 5).
--
-- The direct reads (statements read_queue, read_queue_without_acks, read_limited_queue)
-- now take visible rows oldest visibility first (vt, then msg_id), on PGMQ's vt index:
-- rows in flight (vt in the future) are never walked past, where the msg_id order walked
-- past every delivered, unacked row at the queue's head (consumers x prefetch of them).
-- In that order a message requeued at once (Kombu's reject with requeue, a channel closed
-- with unacked messages, a warm shutdown's prefetched tasks) with vt = now would go behind
-- every message that became visible before it; with vt = its enqueued_at it goes back to
-- where it was, as the msg_id order put it and as AMQP's requeue does ("placed back in its
-- original position", RabbitMQ). A requeue with a delay (vt > 0) becomes visible then, as
-- before. PGMQ's own functions read in msg_id order and are not affected: a vt in the past
-- is visible to them like any other.
--
-- Migration 0021's function (which wakes the consumers waiting on a limited queue it
-- settled a delivery of), with that one change.
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
    n integer;
BEGIN
    PERFORM kombu_pgmq.check_window('visibility timeout (seconds)', vt, 43200);
    FOR q, ids, cts, ats IN
        SELECT h.q, array_agg(h.id), array_agg(h.ct), array_agg(h.at)
        FROM unnest(queues, msg_ids, read_cts, enqueued) AS h(q, id, ct, at)
        GROUP BY h.q ORDER BY h.q
    LOOP
        CONTINUE WHEN to_regclass(format('pgmq.%I', 'q_' || q)) IS NULL;
        RETURN QUERY EXECUTE format(
            'UPDATE pgmq.%I AS t
             SET vt = CASE WHEN $4 > 0 THEN clock_timestamp() + make_interval(secs => $4)
                           ELSE least(t.enqueued_at, clock_timestamp()) END,
                 headers = CASE WHEN $5 THEN kombu_pgmq.count_restore(t.headers)
                                ELSE t.headers END
             FROM unnest($1::bigint[], $2::integer[], $3::timestamptz[]) AS h(id, ct, at)
             WHERE t.msg_id = h.id AND t.read_ct = h.ct AND t.enqueued_at = h.at
             RETURNING %L::text, t.msg_id',
            'q_' || q, q
        ) USING ids, cts, ats, vt, uncount;
        GET DIAGNOSTICS n = ROW_COUNT;
        IF n > 0 AND EXISTS (SELECT 1 FROM kombu_pgmq.limited l WHERE l.pgmq_queue = q) THEN
            PERFORM kombu_pgmq.notify_waiting(q, CASE WHEN vt > 0 THEN
                clock_timestamp() + make_interval(secs => vt) END);
        END IF;
    END LOOP;
END
$$;

SELECT kombu_pgmq.secure_functions();
