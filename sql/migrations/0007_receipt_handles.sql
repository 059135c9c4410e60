-- Receipt handles (SQS's model, issue "every message accounted for"): every ack, requeue,
-- restore, dead-letter and lease renewal names the delivery it settles, as
-- (msg_id, read_ct, enqueued_at), and touches the row only if that delivery still holds
-- it. A stale one (the lease lapsed and another consumer read the message: read_ct moved
-- on; or an UNLOGGED queue was emptied by a crash and its msg_id reused by a new message:
-- enqueued_at differs) is never applied. The tables stay exactly PGMQ's: these statements
-- only delete, update and insert rows the way pgmq.archive and pgmq.set_vt do.

-- Ack: move the held rows to the archive (as pgmq.archive: same columns, last_read_at
-- where the PGMQ release has it). An archive row with the same msg_id (an UNLOGGED queue
-- reused ids after a crash; its archive is logged) is kept, and the ack still settles:
-- an ack conflict never fails the statement (nor the read it rides with).
-- Returns the (queue, msg_id) settled.
CREATE FUNCTION kombu_pgmq.ack(
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
BEGIN
    FOR q, ids, cts, ats IN
        SELECT h.q, array_agg(h.id), array_agg(h.ct), array_agg(h.at)
        FROM unnest(queues, msg_ids, read_cts, enqueued) AS h(q, id, ct, at)
        GROUP BY h.q ORDER BY h.q
    LOOP
        CONTINUE WHEN to_regclass(format('pgmq.%I', 'q_' || q)) IS NULL;
        cols := 'msg_id, read_ct, enqueued_at, vt, message, headers';
        IF EXISTS (SELECT 1 FROM pg_attribute
                   WHERE attrelid = format('pgmq.%I', 'a_' || q)::regclass
                     AND attname = 'last_read_at' AND NOT attisdropped) THEN
            cols := cols || ', last_read_at';
        END IF;
        RETURN QUERY EXECUTE format(
            'WITH moved AS (
                 DELETE FROM pgmq.%I AS t
                 USING unnest($1::bigint[], $2::integer[], $3::timestamptz[]) AS h(id, ct, at)
                 WHERE t.msg_id = h.id AND t.read_ct = h.ct AND t.enqueued_at = h.at
                 RETURNING t.*
             ), kept AS (
                 INSERT INTO pgmq.%I (%s) SELECT %s FROM moved
                 ON CONFLICT DO NOTHING
             )
             SELECT %L::text, moved.msg_id FROM moved',
            'q_' || q, 'a_' || q, cols, cols, q
        ) USING ids, cts, ats;
    END LOOP;
END
$$;

-- Requeue (reject with requeue, restore on channel close, a delivery that failed before
-- the application saw it): visible again in vt seconds, if the delivery still holds the
-- row. uncount: the delivery is taken back from read_ct (the application never ran it),
-- so max_deliveries counts only deliveries that reached the application.
CREATE FUNCTION kombu_pgmq.requeue(
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
                 read_ct = CASE WHEN $5 THEN greatest(t.read_ct - 1, 0) ELSE t.read_ct END
             FROM unnest($1::bigint[], $2::integer[], $3::timestamptz[]) AS h(id, ct, at)
             WHERE t.msg_id = h.id AND t.read_ct = h.ct AND t.enqueued_at = h.at
             RETURNING %L::text, t.msg_id',
            'q_' || q, q
        ) USING ids, cts, ats, vt, uncount;
    END LOOP;
END
$$;

-- Lease renewal with receipt handles (replaces kombu_pgmq.renew of migration 0004).
DROP FUNCTION kombu_pgmq.renew(text[], bigint[], integer[], integer);
CREATE FUNCTION kombu_pgmq.renew(
    queues text[], msg_ids bigint[], read_cts integer[], enqueued timestamptz[], vt integer
) RETURNS TABLE (queue text, msg_id bigint)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
BEGIN
    PERFORM set_config('synchronous_commit', 'off', true);
    RETURN QUERY SELECT r.queue, r.msg_id
                 FROM kombu_pgmq.requeue(queues, msg_ids, read_cts, enqueued, vt, false) AS r;
END
$$;

-- Ack and read in one round trip (replaces kombu_pgmq.read of migration 0003): the acks
-- are receipt handles; a stale one is not applied and is reported with a NOTICE
-- ("kombu_pgmq: ..."), which the client logs. Rows carry enqueued_at (their receipt).
DROP FUNCTION kombu_pgmq.read(text[], integer, integer, text[], bigint[], boolean);
CREATE FUNCTION kombu_pgmq.read(
    queues text[], vt integer, qty integer,
    ack_queues text[] DEFAULT '{}', ack_ids bigint[] DEFAULT '{}',
    ack_cts integer[] DEFAULT '{}', ack_enqueued timestamptz[] DEFAULT '{}',
    durable_acks boolean DEFAULT true
) RETURNS TABLE (
    queue text, msg_id bigint, read_ct integer, enqueued_at timestamptz, message text,
    headers text, age_seconds double precision
)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    q text;
    remaining integer := qty;
    n integer;
    settled integer;
BEGIN
    IF coalesce(cardinality(ack_ids), 0) = 0 OR NOT durable_acks THEN
        PERFORM set_config('synchronous_commit', 'off', true);
    END IF;
    IF coalesce(cardinality(ack_ids), 0) > 0 THEN
        SELECT count(*) INTO settled
        FROM kombu_pgmq.ack(ack_queues, ack_ids, ack_cts, ack_enqueued);
        IF settled < cardinality(ack_ids) THEN
            RAISE NOTICE 'kombu_pgmq: % stale ack(s) not applied (the message was delivered again after its visibility timeout, or is gone)',
                cardinality(ack_ids) - settled;
        END IF;
    END IF;
    FOREACH q IN ARRAY queues LOOP
        EXIT WHEN remaining <= 0;
        RETURN QUERY
            SELECT q, r.msg_id, r.read_ct, r.enqueued_at, r.message::text, r.headers::text,
                   extract(epoch FROM clock_timestamp() - r.enqueued_at)::float8
            FROM pgmq.read(q, vt, remaining) AS r;
        GET DIAGNOSTICS n = ROW_COUNT;
        remaining := remaining - n;
    END LOOP;
END
$$;
