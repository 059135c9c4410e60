-- Expired messages are archived with their reason by every worker role (issue 27, item 8).
-- The direct statement archive_expired (sql/queries.sql) writes PGMQ's tables itself,
-- which a least-privilege worker role may not: it called kombu_pgmq.ack, which archives
-- the row without the reason. This function is kombu_pgmq.ack (migration 0014) with the
-- headers x-archive-reason "expired" and x-expired-at added, run as its owner.
CREATE FUNCTION kombu_pgmq.archive_expired(
    queues text[], msg_ids bigint[], read_cts integer[], enqueued timestamptz[]
) RETURNS TABLE (queue text, msg_id bigint)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    q text;
    ids bigint[];
    cts integer[];
    ats timestamptz[];
    cols text;
    vals text;
    stamp text;
    marks jsonb := jsonb_build_object('x-archive-reason', 'expired',
                                      'x-expired-at', clock_timestamp());
BEGIN
    FOR q, ids, cts, ats IN
        SELECT h.q, array_agg(h.id), array_agg(h.ct), array_agg(h.at)
        FROM unnest(queues, msg_ids, read_cts, enqueued) AS h(q, id, ct, at)
        GROUP BY h.q ORDER BY h.q
    LOOP
        CONTINUE WHEN to_regclass(format('pgmq.%I', 'q_' || q)) IS NULL;
        cols := 'msg_id, read_ct, enqueued_at, vt, message, headers';
        vals := 'msg_id, read_ct, enqueued_at, vt, message, '
                'CASE WHEN headers IS NULL OR jsonb_typeof(headers) = ''object'' '
                'THEN coalesce(headers, ''{}''::jsonb) || $4 ELSE headers END';
        stamp := 'NULL';
        IF EXISTS (SELECT 1 FROM pg_attribute
                   WHERE attrelid = format('pgmq.%I', 'a_' || q)::regclass
                     AND attname = 'last_read_at' AND NOT attisdropped) THEN
            cols := cols || ', last_read_at';
            vals := vals || ', last_read_at';
            stamp := 'moved.last_read_at';
        END IF;
        RETURN QUERY EXECUTE format(
            'WITH moved AS (
                 DELETE FROM pgmq.%1$I AS t
                 USING unnest($1::bigint[], $2::integer[], $3::timestamptz[]) AS h(id, ct, at)
                 WHERE t.msg_id = h.id AND t.read_ct = h.ct AND t.enqueued_at = h.at
                 RETURNING t.*
             ), kept AS (
                 INSERT INTO pgmq.%2$I (%3$s) SELECT %6$s FROM moved
                 ON CONFLICT DO NOTHING
                 RETURNING msg_id
             )
             SELECT %4$L::text, moved.msg_id FROM moved
             WHERE CASE WHEN moved.msg_id IN (SELECT kept.msg_id FROM kept) THEN true
                        ELSE kombu_pgmq.archive_under_new_id(
                                 %4$L, moved.msg_id, moved.read_ct, moved.enqueued_at,
                                 moved.vt, moved.message, moved.headers, %5$s, $4) IS NOT NULL
                   END',
            'q_' || q, 'a_' || q, cols, q, stamp, vals
        ) USING ids, cts, ats, marks;
    END LOOP;
END
$$;

INSERT INTO kombu_pgmq.grantable (function, kind, definer) VALUES
    ('kombu_pgmq.archive_expired(text[], bigint[], integer[], timestamp with time zone[])',
     'worker', true);
SELECT kombu_pgmq.secure_functions();
