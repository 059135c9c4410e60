-- A message requeued to its place (vt = its enqueued_at, in the past) lies below the
-- position where the consumers' reads start (kombu_pgmq/_db/positions.py): the requeue
-- tells them, with NOTIFY payload 'rewind' on the queue's channel (at commit), and their
-- next read of the queue starts at the beginning of the vt index. Every consuming
-- connection listens on its queues' channels, waiting or not. A requeue with a delay
-- (vt > 0) needs no rewind: its vt is now + the delay.
--
-- Migration 0022's function with that one change.
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
        IF n > 0 AND vt <= 0 THEN
            PERFORM pg_notify('kombu_pgmq.' || q, 'rewind');
        END IF;
        IF n > 0 AND EXISTS (SELECT 1 FROM kombu_pgmq.limited l WHERE l.pgmq_queue = q) THEN
            PERFORM kombu_pgmq.notify_waiting(q, CASE WHEN vt > 0 THEN
                clock_timestamp() + make_interval(secs => vt) END);
        END IF;
    END LOOP;
END
$$;

SELECT kombu_pgmq.secure_functions();
