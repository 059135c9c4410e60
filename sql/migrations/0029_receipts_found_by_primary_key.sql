-- Settling by receipt (ack, requeue and lease renewal, expiry, dead-lettering, discard)
-- finds its rows by msg_id = ANY(ids) on the primary key, as the direct statements do.
-- After a VACUUM behind an old snapshot removes nothing, pg_class.reltuples is the few
-- live rows, and a join of the queue table to unnest(...) may be planned as a scan of the
-- whole primary key index, every dead entry included (thousands per call). Each function
-- is its latest definition with the extra condition t.msg_id = ANY($1) (the receipts'
-- ids, bound as the first parameter of its statement).

CREATE OR REPLACE FUNCTION kombu_pgmq.ack(
    queues text[], msg_ids bigint[], read_cts integer[], enqueued timestamptz[],
    holds boolean[] DEFAULT '{}', hold_seconds integer DEFAULT 0
) RETURNS TABLE (queue text, msg_id bigint)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    q text;
    ids bigint[];
    cts integer[];
    ats timestamptz[];
    held_ids bigint[];
    held_cts integer[];
    cols text;
    stamp text;
    n integer;
BEGIN
    FOR q, ids, cts, ats, held_ids, held_cts IN
        SELECT h.q, array_agg(h.id), array_agg(h.ct), array_agg(h.at),
               array_agg(h.id) FILTER (WHERE h.hold), array_agg(h.ct) FILTER (WHERE h.hold)
        FROM unnest(queues, msg_ids, read_cts, enqueued, holds) AS h(q, id, ct, at, hold)
        WHERE h.q IS NOT NULL
        GROUP BY h.q ORDER BY h.q
    LOOP
        CONTINUE WHEN to_regclass(format('pgmq.%I', 'q_' || q)) IS NULL;
        IF held_ids IS NOT NULL THEN  -- before the archive: the slot is never seen free
            PERFORM kombu_pgmq.hold_slots(q, held_ids, held_cts, hold_seconds);
        END IF;
        cols := 'msg_id, read_ct, enqueued_at, vt, message, headers';
        stamp := 'NULL';
        IF EXISTS (SELECT 1 FROM pg_attribute
                   WHERE attrelid = format('pgmq.%I', 'a_' || q)::regclass
                     AND attname = 'last_read_at' AND NOT attisdropped) THEN
            cols := cols || ', last_read_at';
            stamp := 'moved.last_read_at';
        END IF;
        RETURN QUERY EXECUTE format(
            'WITH moved AS (
                 DELETE FROM pgmq.%1$I AS t
                 USING unnest($1::bigint[], $2::integer[], $3::timestamptz[]) AS h(id, ct, at)
                 WHERE t.msg_id = ANY($1) AND t.msg_id = h.id AND t.read_ct = h.ct
                   AND t.enqueued_at = h.at
                 RETURNING t.*
             ), kept AS (
                 INSERT INTO pgmq.%2$I (%3$s) SELECT %3$s FROM moved
                 ON CONFLICT DO NOTHING
                 RETURNING msg_id
             )
             SELECT %4$L::text, moved.msg_id FROM moved
             WHERE CASE WHEN moved.msg_id IN (SELECT kept.msg_id FROM kept) THEN true
                        ELSE kombu_pgmq.archive_under_new_id(
                                 %4$L, moved.msg_id, moved.read_ct, moved.enqueued_at,
                                 moved.vt, moved.message, moved.headers, %5$s) IS NOT NULL
                   END',
            'q_' || q, 'a_' || q, cols, q, stamp
        ) USING ids, cts, ats;
        GET DIAGNOSTICS n = ROW_COUNT;
        IF n > 0 AND EXISTS (SELECT 1 FROM kombu_pgmq.limited l WHERE l.pgmq_queue = q) THEN
            PERFORM kombu_pgmq.notify_waiting(q);
        END IF;
    END LOOP;
END
$$;

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
             WHERE t.msg_id = ANY($1) AND t.msg_id = h.id AND t.read_ct = h.ct
                   AND t.enqueued_at = h.at
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

CREATE OR REPLACE FUNCTION kombu_pgmq.archive_expired(
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
                 WHERE t.msg_id = ANY($1) AND t.msg_id = h.id AND t.read_ct = h.ct
                   AND t.enqueued_at = h.at
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

CREATE OR REPLACE FUNCTION kombu_pgmq.dead_letter(
    pgmq_name text, msg_ids bigint[], read_cts integer[], enqueued timestamptz[],
    error_texts text[], dead_letter_queue text, reason text, kombu_queue text
) RETURNS SETOF bigint
LANGUAGE plpgsql AS $$
DECLARE
    n integer;
BEGIN
    UPDATE kombu_pgmq.queues q SET dead_letter = true
    WHERE q.pgmq_queue = dead_letter_queue AND NOT q.dead_letter;
    RETURN QUERY EXECUTE format(
        $sql$
        WITH moved AS (
            DELETE FROM pgmq.%I AS t
            USING unnest($1::bigint[], $2::integer[], $3::timestamptz[], $4::text[])
                AS h(id, ct, at, err)
            WHERE t.msg_id = ANY($1) AND t.msg_id = h.id AND t.read_ct = h.ct
                   AND t.enqueued_at = h.at
            RETURNING t.msg_id, t.read_ct, t.enqueued_at, t.message, t.headers, h.err
        )
        SELECT pgmq.send(
            $5,
            moved.message,
            coalesce(moved.headers, '{}'::jsonb) || jsonb_build_object(
                'x-dead-letter', jsonb_build_object(
                    'queue', $7::text,
                    'pgmq_queue', $8::text,
                    'msg_id', moved.msg_id,
                    'read_ct', moved.read_ct,
                    'reason', $6::text,
                    'enqueued_at', moved.enqueued_at,
                    'dead_lettered_at', clock_timestamp()
                ) || CASE WHEN moved.err IS NULL THEN '{}'::jsonb
                          ELSE jsonb_build_object('error', moved.err) END
            )
        )
        FROM moved
        $sql$, 'q_' || pgmq_name
    ) USING msg_ids, read_cts, enqueued, error_texts, dead_letter_queue, reason,
            kombu_queue, pgmq_name;
    GET DIAGNOSTICS n = ROW_COUNT;
    IF n > 0 AND EXISTS (SELECT 1 FROM kombu_pgmq.limited l WHERE l.pgmq_queue = pgmq_name) THEN
        PERFORM kombu_pgmq.notify_waiting(pgmq_name);
    END IF;
END
$$;

CREATE OR REPLACE FUNCTION kombu_pgmq.discard(
    pgmq_name text, msg_ids bigint[], read_cts integer[], enqueued timestamptz[]
) RETURNS SETOF bigint
LANGUAGE plpgsql AS $$
BEGIN
    IF to_regclass(format('pgmq.%I', 'q_' || pgmq_name)) IS NULL THEN
        RETURN;
    END IF;
    RETURN QUERY EXECUTE format(
        'DELETE FROM pgmq.%I AS t
         USING unnest($1::bigint[], $2::integer[], $3::timestamptz[]) AS h(id, ct, at)
         WHERE t.msg_id = ANY($1) AND t.msg_id = h.id AND t.read_ct = h.ct
                   AND t.enqueued_at = h.at
         RETURNING t.msg_id', 'q_' || pgmq_name
    ) USING msg_ids, read_cts, enqueued;
END
$$;

SELECT kombu_pgmq.secure_functions();
