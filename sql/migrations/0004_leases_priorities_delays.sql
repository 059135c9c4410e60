-- Lease renewal, priority bands, and delayed routed publishes.

-- Priorities (AMQP x-max-priority) are one PGMQ queue per priority band. A band holds
-- the priorities from its floor up to the next band's floor; band 0 is the queue's own
-- PGMQ queue (pgmq_queue), so messages without a priority go where they always went.
-- Consumers read the bands highest first. The layout is fixed by the queue's first
-- declaration and read by every producer and consumer from here, so all agree on it.
ALTER TABLE kombu_pgmq.queues
    ADD COLUMN max_priority smallint,       -- x-max-priority; NULL: no priorities
    ADD COLUMN priority_bands smallint[],   -- band floors, ascending, starting at 0
    ADD COLUMN band_queues text[];          -- PGMQ queue of each band (band_queues[1] = pgmq_queue)

-- Drop one queue: PGMQ tables of every band, our row (bindings and consumers cascade).
CREATE OR REPLACE FUNCTION kombu_pgmq.drop_queue(kombu_queue text) RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    target text;
    bands text[];
    band text;
BEGIN
    DELETE FROM kombu_pgmq.queues WHERE queue = kombu_queue
    RETURNING pgmq_queue, band_queues INTO target, bands;
    IF target IS NULL THEN
        RETURN false;
    END IF;
    PERFORM pgmq.drop_queue(target);
    FOREACH band IN ARRAY coalesce(bands, '{}') LOOP
        IF band <> target AND EXISTS (SELECT 1 FROM pgmq.meta WHERE queue_name = band) THEN
            PERFORM pgmq.drop_queue(band);
        END IF;
    END LOOP;
    RETURN true;
END
$$;

-- Routed publishes gain PGMQ's native delay (ETA/countdown, x-delay): the message is
-- sent with a future visibility and wakes no one (the consumers' fallback poll finds it).
DROP FUNCTION kombu_pgmq.publish_routed(text[], jsonb, jsonb, bigint);
CREATE FUNCTION kombu_pgmq.publish_routed(
    queues text[], message jsonb, headers jsonb, expected_version bigint,
    delay_seconds integer DEFAULT 0,
    OUT version bigint, OUT msg_ids bigint[]
)
LANGUAGE plpgsql AS $$
DECLARE
    q text;
BEGIN
    msg_ids := '{}';
    FOR q IN SELECT DISTINCT u FROM unnest(queues) AS u ORDER BY u LOOP
        PERFORM pg_advisory_xact_lock_shared(1802530161, hashtext(q));
    END LOOP;
    SELECT v.version INTO version FROM kombu_pgmq.routing_version v;
    IF version <> expected_version THEN
        RETURN;
    END IF;
    FOREACH q IN ARRAY queues LOOP
        msg_ids := msg_ids || pgmq.send(q, message, headers, greatest(delay_seconds, 0));
    END LOOP;
    IF delay_seconds <= 0 THEN
        FOR q IN SELECT DISTINCT w.pgmq_queue FROM kombu_pgmq.waiting w
                 WHERE w.pgmq_queue = ANY(queues) LOOP
            PERFORM pg_notify('kombu_pgmq.' || q, '');
        END LOOP;
    END IF;
END
$$;

-- Lease renewal: push the visibility timeout of held messages to now + vt seconds, in one
-- round trip for all of a connection's queues (one UPDATE per queue). A message is
-- renewed only if its read_ct is still the one its holder read: if the lease ran out
-- and another consumer read it meanwhile (read_ct moved on), or it is gone (acked,
-- dead-lettered, purged, its queue dropped), it is not returned: the caller reports the
-- lease as lost. queues[i] holds msg_ids[i], read with read_cts[i].
-- Asynchronous commit: a server crash ends the holder's connection anyway; it renews
-- again once reconnected.
CREATE FUNCTION kombu_pgmq.renew(
    queues text[], msg_ids bigint[], read_cts integer[], vt integer
) RETURNS TABLE (queue text, msg_id bigint)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    q text;
    ids bigint[];
    cts integer[];
BEGIN
    PERFORM set_config('synchronous_commit', 'off', true);
    FOR q, ids, cts IN
        SELECT h.q, array_agg(h.id), array_agg(h.ct)
        FROM unnest(queues, msg_ids, read_cts) AS h(q, id, ct)
        GROUP BY h.q ORDER BY h.q
    LOOP
        CONTINUE WHEN to_regclass(format('pgmq.%I', 'q_' || q)) IS NULL;
        RETURN QUERY EXECUTE format(
            'UPDATE pgmq.%I AS t SET vt = clock_timestamp() + make_interval(secs => $3)
             FROM unnest($1::bigint[], $2::integer[]) AS h(id, ct)
             WHERE t.msg_id = h.id AND t.read_ct = h.ct
             RETURNING %L::text, t.msg_id',
            'q_' || q, q
        ) USING ids, cts, vt;
    END LOOP;
END
$$;
