-- An ack is always recorded (issue 25, item 3). A non-durable queue (UNLOGGED table) is
-- emptied by a crash, and its msg_id sequence (unlogged too) starts again at 1, while its
-- archive is an ordinary logged table that keeps the ids archived before the crash. An
-- ack of a new message whose id is already in the archive used to hit ON CONFLICT DO
-- NOTHING: the row left the queue and never reached the archive (neither queued nor
-- archived). The same held for cancelled messages (kombu_pgmq.cancel_task).
--
-- Now such a message is archived under a fresh msg_id taken from its queue's sequence,
-- after the sequence was moved past the highest archived id (so the queue stops reusing
-- ids; the next message gets a new one), with the header "x-queue-msg-id" holding the id
-- it had in the queue. The tables stay exactly PGMQ's: only the values differ. The
-- common path (no conflict) is unchanged: an extra function call happens only for a
-- conflicting row.

-- Archive one acked (or cancelled) row whose msg_id is already in the archive of
-- pgmq_name; returns the msg_id it was archived under. extra_headers are merged into its
-- headers (cancel_task's marks). Serialized per queue by an advisory lock (key
-- 1802530163 = 'kpmq' + 2), so two sessions never move the sequence past each other.
CREATE FUNCTION kombu_pgmq.archive_under_new_id(
    pgmq_name text, queue_msg_id bigint, read_ct integer, enqueued_at timestamptz,
    vt timestamptz, message jsonb, headers jsonb, last_read_at timestamptz DEFAULT NULL,
    extra_headers jsonb DEFAULT '{}'
) RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    seq regclass := pg_get_serial_sequence(format('pgmq.%I', 'q_' || pgmq_name), 'msg_id');
    top bigint;
    new_id bigint;
    marked jsonb := headers;
    stamp boolean;
BEGIN
    PERFORM pg_advisory_xact_lock(1802530163, hashtext(pgmq_name));
    EXECUTE format('SELECT max(msg_id) FROM pgmq.%I', 'a_' || pgmq_name) INTO top;
    IF top > coalesce(pg_sequence_last_value(seq), 0) THEN
        PERFORM setval(seq, top);  -- the queue's ids restarted below the archive's
    END IF;
    new_id := nextval(seq);
    IF marked IS NULL OR jsonb_typeof(marked) = 'object' THEN
        marked := coalesce(marked, '{}'::jsonb) || extra_headers
                  || jsonb_build_object('x-queue-msg-id', queue_msg_id);
    END IF;
    stamp := EXISTS (SELECT 1 FROM pg_attribute
                     WHERE attrelid = format('pgmq.%I', 'a_' || pgmq_name)::regclass
                       AND attname = 'last_read_at' AND NOT attisdropped);
    EXECUTE format(
        'INSERT INTO pgmq.%I (msg_id, read_ct, enqueued_at, vt, message, headers%s)
         VALUES ($1, $2, $3, $4, $5, $6%s)',
        'a_' || pgmq_name,
        CASE WHEN stamp THEN ', last_read_at' ELSE '' END,
        CASE WHEN stamp THEN ', $7' ELSE '' END
    ) USING new_id, read_ct, enqueued_at, vt, message, marked, last_read_at;
    RETURN new_id;
END
$$;

-- Ack with receipt handles (migration 0007's function): a row whose msg_id is already in
-- the archive is archived under a new one instead of being dropped.
CREATE OR REPLACE FUNCTION kombu_pgmq.ack(
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
    stamp text;
BEGIN
    FOR q, ids, cts, ats IN
        SELECT h.q, array_agg(h.id), array_agg(h.ct), array_agg(h.at)
        FROM unnest(queues, msg_ids, read_cts, enqueued) AS h(q, id, ct, at)
        GROUP BY h.q ORDER BY h.q
    LOOP
        CONTINUE WHEN to_regclass(format('pgmq.%I', 'q_' || q)) IS NULL;
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
                 WHERE t.msg_id = h.id AND t.read_ct = h.ct AND t.enqueued_at = h.at
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
    END LOOP;
END
$$;

-- Durable revoke (migration 0012's function): a cancelled row whose msg_id is already in
-- the archive is archived under a new one, with its cancel marks, instead of dropped.
CREATE OR REPLACE FUNCTION kombu_pgmq.cancel_task(task_id text)
RETURNS TABLE (queue text, pgmq_queue text, msg_id bigint)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    r record;
    cols text;
    stamp text;
    marks jsonb := jsonb_build_object('x-archive-reason', 'cancelled',
                                      'x-cancelled-at', clock_timestamp(),
                                      'x-cancelled-by', session_user);
BEGIN
    FOR r IN SELECT * FROM kombu_pgmq.queue_map() LOOP
        CONTINUE WHEN to_regclass(format('pgmq.%I', 'q_' || r.pgmq_queue)) IS NULL
                   OR to_regclass(format('pgmq.%I', 'a_' || r.pgmq_queue)) IS NULL;
        cols := 'msg_id, read_ct, enqueued_at, vt, message';
        stamp := 'NULL';
        IF EXISTS (SELECT 1 FROM pg_attribute
                   WHERE attrelid = format('pgmq.%I', 'a_' || r.pgmq_queue)::regclass
                     AND attname = 'last_read_at' AND NOT attisdropped) THEN
            cols := cols || ', last_read_at';
            stamp := 'moved.last_read_at';
        END IF;
        RETURN QUERY EXECUTE format(
            'WITH moved AS (
                 DELETE FROM pgmq.%1$I AS t
                 WHERE t.msg_id IN (SELECT c.msg_id FROM pgmq.%1$I c
                                    WHERE c.headers ->> ''id'' = $1
                                      AND (c.vt <= clock_timestamp() OR c.read_ct = 0)
                                    FOR UPDATE SKIP LOCKED)
                 RETURNING t.*
             ), kept AS (
                 INSERT INTO pgmq.%2$I (%3$s, headers)
                 SELECT %3$s, coalesce(headers, ''{}''::jsonb) || $2 FROM moved
                 ON CONFLICT DO NOTHING
                 RETURNING msg_id
             )
             SELECT %4$L::text, %5$L::text, moved.msg_id FROM moved
             WHERE CASE WHEN moved.msg_id IN (SELECT kept.msg_id FROM kept) THEN true
                        ELSE kombu_pgmq.archive_under_new_id(
                                 %5$L, moved.msg_id, moved.read_ct, moved.enqueued_at,
                                 moved.vt, moved.message, moved.headers, %6$s, $2) IS NOT NULL
                   END',
            'q_' || r.pgmq_queue, 'a_' || r.pgmq_queue, cols, r.queue, r.pgmq_queue, stamp
        ) USING task_id, marks;
    END LOOP;
END
$$;

INSERT INTO kombu_pgmq.grantable (function, kind, definer) VALUES
    ('kombu_pgmq.archive_under_new_id(text, bigint, integer, timestamptz, timestamptz, jsonb, jsonb, timestamptz, jsonb)', 'owner', true);
SELECT kombu_pgmq.secure_functions();
