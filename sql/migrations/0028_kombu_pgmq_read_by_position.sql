-- kombu_pgmq.read (several queues or priority bands in one round trip, least-privilege
-- roles) reads a queue that has no limits from a position, as statement read_queue does
-- (kombu_pgmq/_db/positions.py): the walk of PGMQ's vt index starts at the queue's
-- position, so it passes no dead row versions older than that, however many an old
-- snapshot keeps. positions: {PGMQ queue: {"scan_from": epoch seconds or null (the start
-- of the index), "watch_xids": [transaction ids in progress at the last read], "watch_bounds":
-- [their bounds, epoch seconds or null]}}; NULL: every queue from the start and no
-- position rows. stamp: assign this read a transaction id if it has none.
--
-- The read writes what pgmq.read writes (vt, read_ct, last_read_at where the table has
-- it; FOR UPDATE SKIP LOCKED), oldest visibility first on the vt index (as read_queue).
-- After each such queue's rows comes its position row (msg_id NULL, snapshot not NULL):
-- the snapshot of its read, this transaction's id and start (epoch seconds), where the
-- walk started and the vt up to which it took every visible row.
CREATE FUNCTION kombu_pgmq.read_from_position(
    q text, vt integer, qty integer, at_position jsonb, stamp boolean
) RETURNS TABLE (
    msg_id bigint, read_ct integer, enqueued_at timestamptz, message text, headers text,
    age_seconds double precision, snapshot text, read_xid text, read_at double precision,
    scan_from double precision, scanned_to double precision
)
LANGUAGE plpgsql AS $$
DECLARE
    touch text := '';
BEGIN
    IF EXISTS (SELECT 1 FROM pg_attribute a
               WHERE a.attrelid = format('pgmq.%I', 'q_' || q)::regclass
                 AND a.attname = 'last_read_at' AND NOT a.attisdropped) THEN
        touch := ', last_read_at = clock_timestamp()';
    END IF;
    IF stamp THEN
        PERFORM pg_current_xact_id();
    END IF;
    RETURN QUERY EXECUTE format(
        $q$
        WITH bounds AS MATERIALIZED (
            SELECT clock_timestamp() AS scan_to,
                   least(coalesce(to_timestamp(($1 ->> 'scan_from')::float8), '-infinity'),
                         (SELECT min(coalesce(to_timestamp(w.bound::float8), '-infinity'))
                          FROM jsonb_array_elements_text(coalesce($1 -> 'watch_xids', '[]'))
                                   WITH ORDINALITY AS x(xid, i)
                          JOIN jsonb_array_elements_text(coalesce($1 -> 'watch_bounds', '[]'))
                                   WITH ORDINALITY AS w(bound, i) USING (i)
                          WHERE pg_visible_in_snapshot(x.xid::xid8, pg_current_snapshot())))
                       AS scan_from
        ), picked AS (
            SELECT t.msg_id, t.vt FROM pgmq.%1$I AS t
            WHERE t.vt >= (SELECT b.scan_from FROM bounds b)
              AND t.vt <= (SELECT b.scan_to FROM bounds b)
            ORDER BY t.vt, t.msg_id
            LIMIT $3
            FOR UPDATE SKIP LOCKED
        ), delivered AS (
            UPDATE pgmq.%1$I AS m
            SET vt = clock_timestamp() + make_interval(secs => $2),
                read_ct = m.read_ct + 1%2$s
            WHERE m.msg_id = ANY(ARRAY(SELECT p.msg_id FROM picked p))
            RETURNING m.msg_id, m.read_ct, m.enqueued_at, m.message, m.headers
        )
        SELECT d.msg_id, d.read_ct, d.enqueued_at, d.message::text, d.headers::text,
               extract(epoch FROM clock_timestamp() - d.enqueued_at)::float8,
               NULL::text, NULL::text, NULL::float8, NULL::float8, NULL::float8
        FROM delivered d
        UNION ALL
        SELECT NULL, NULL, NULL, NULL, NULL, NULL,
               pg_current_snapshot()::text, pg_current_xact_id_if_assigned()::text,
               extract(epoch FROM transaction_timestamp())::float8,
               extract(epoch FROM b.scan_from)::float8,
               extract(epoch FROM CASE WHEN (SELECT count(*) FROM picked) >= $3
                                       THEN (SELECT max(p.vt) FROM picked p)
                                       ELSE b.scan_to END)::float8
        FROM bounds b
        $q$, 'q_' || q, touch)
        USING at_position, vt, qty;
END
$$;

DROP FUNCTION kombu_pgmq.read(text[], integer, integer, text[], bigint[], integer[],
                              timestamptz[], boolean, text[], boolean[], integer);
CREATE FUNCTION kombu_pgmq.read(
    queues text[], vt integer, qty integer,
    ack_queues text[] DEFAULT '{}', ack_ids bigint[] DEFAULT '{}',
    ack_cts integer[] DEFAULT '{}', ack_enqueued timestamptz[] DEFAULT '{}',
    durable_acks boolean DEFAULT true, ack_holds boolean[] DEFAULT '{}',
    hold_seconds integer DEFAULT 0, positions jsonb DEFAULT NULL, stamp boolean DEFAULT false
) RETURNS TABLE (
    queue text, msg_id bigint, read_ct integer, enqueued_at timestamptz, message text,
    headers text, age_seconds double precision, snapshot text, read_xid text,
    read_at double precision, scan_from double precision, scanned_to double precision
)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    q text;
    kq text;
    remaining integer := qty;
    settled integer;
    owners jsonb;
    done text[] := '{}';
    bands text[];
    r record;
BEGIN
    PERFORM kombu_pgmq.check_window('visibility timeout (seconds)', vt, 43200);
    PERFORM kombu_pgmq.guard_dead_letters(queues, 'SELECT');
    IF coalesce(cardinality(ack_ids), 0) = 0 OR NOT durable_acks THEN
        PERFORM set_config('synchronous_commit', 'off', true);
    END IF;
    IF coalesce(cardinality(ack_ids), 0) > 0 THEN
        -- kombu_pgmq.ack wakes consumers waiting on a limited queue it settled in
        SELECT count(*) INTO settled
        FROM kombu_pgmq.ack(ack_queues, ack_ids, ack_cts, ack_enqueued, ack_holds,
                                 hold_seconds);
        IF settled < cardinality(ack_ids) THEN
            RAISE NOTICE 'kombu_pgmq: % stale ack(s) not applied (the message was delivered again after its visibility timeout, or is gone)',
                cardinality(ack_ids) - settled;
        END IF;
    END IF;
    IF EXISTS (SELECT 1 FROM kombu_pgmq.paused) THEN
        queues := ARRAY(SELECT u FROM unnest(queues) WITH ORDINALITY AS t(u, i)
                        WHERE NOT EXISTS (SELECT 1 FROM kombu_pgmq.paused p
                                          WHERE p.pgmq_queue = t.u)
                        ORDER BY t.i);
    END IF;
    SELECT jsonb_object_agg(l.pgmq_queue, l.queue) INTO owners
    FROM kombu_pgmq.limited l WHERE l.pgmq_queue = ANY(queues);
    IF owners IS NOT NULL THEN
        PERFORM 1 FROM kombu_pgmq.queue_limits ql
        WHERE ql.queue IN (SELECT o.value FROM jsonb_each_text(owners) o)
        ORDER BY ql.queue
        FOR UPDATE;
    END IF;
    FOREACH q IN ARRAY queues LOOP
        EXIT WHEN remaining <= 0;
        CONTINUE WHEN q = ANY(done);
        kq := owners ->> q;
        IF kq IS NOT NULL THEN
            bands := ARRAY(SELECT u FROM unnest(queues) WITH ORDINALITY AS t(u, i)
                           WHERE owners ->> t.u = kq ORDER BY t.i);
            done := done || bands;
            FOR r IN SELECT * FROM kombu_pgmq.read_limited(kq, bands, vt, remaining) LOOP
                queue := r.queue;
                msg_id := r.msg_id;
                read_ct := r.read_ct;
                enqueued_at := r.enqueued_at;
                message := r.message;
                headers := r.headers;
                age_seconds := r.age_seconds;
                snapshot := NULL;
                read_xid := NULL;
                read_at := NULL;
                scan_from := NULL;
                scanned_to := NULL;
                RETURN NEXT;
                IF r.msg_id IS NOT NULL THEN
                    remaining := remaining - 1;
                END IF;
            END LOOP;
        ELSE
            FOR r IN SELECT * FROM kombu_pgmq.read_from_position(
                         q, vt, remaining, coalesce(positions -> q, '{}'),
                         stamp AND positions IS NOT NULL) LOOP
                CONTINUE WHEN r.msg_id IS NULL AND positions IS NULL;
                queue := q;
                msg_id := r.msg_id;
                read_ct := r.read_ct;
                enqueued_at := r.enqueued_at;
                message := r.message;
                headers := r.headers;
                age_seconds := r.age_seconds;
                snapshot := r.snapshot;
                read_xid := r.read_xid;
                read_at := r.read_at;
                scan_from := r.scan_from;
                scanned_to := r.scanned_to;
                RETURN NEXT;
                IF r.msg_id IS NOT NULL THEN
                    remaining := remaining - 1;
                END IF;
            END LOOP;
        END IF;
    END LOOP;
END
$$;

DELETE FROM kombu_pgmq.grantable WHERE function =
    'kombu_pgmq.read(text[], integer, integer, text[], bigint[], integer[], timestamptz[], boolean, text[], boolean[], integer)';
INSERT INTO kombu_pgmq.grantable (function, kind, definer) VALUES
    ('kombu_pgmq.read(text[], integer, integer, text[], bigint[], integer[], timestamptz[], boolean, boolean[], integer, jsonb, boolean)',
     'worker', true),
    ('kombu_pgmq.read_from_position(text, integer, integer, jsonb, boolean)', 'owner', false);
SELECT kombu_pgmq.secure_functions();
