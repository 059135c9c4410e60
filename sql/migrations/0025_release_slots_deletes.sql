-- A released concurrency slot is deleted, and the sweep of old slot rows moves to the
-- renewal rounds.
--
-- A task's slot (kombu_pgmq.held_slots) is released when the task finishes: once per
-- early-acked task of a concurrency-limited queue, on the worker's hot path. The release
-- deletes the held row. Only a release that reaches the server before the ack that holds
-- the slot (they travel on different connections) writes a row, the tombstone
-- (released = true, held_until = now), which the late hold leaves alone (ON CONFLICT ...
-- WHERE NOT h.released); a hold that commits while the release waits on its row becomes
-- the tombstone (ON CONFLICT DO UPDATE), so no slot outlives its release.
--
-- Rows whose held_until is a minute old (tombstones, slots of workers that died) are
-- swept by the renewal rounds (renew_slots), not by every hold and release: that sweep
-- scanned the table (the planner's choice for a small one) at every call, 0.3-0.8 ms a
-- release as the table grew.

CREATE OR REPLACE FUNCTION kombu_pgmq.release_slots(pgmq_names text[], msg_ids bigint[])
RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    q text;
    gone_queues text[];
    gone_ids bigint[];
BEGIN
    WITH released AS (
        DELETE FROM kombu_pgmq.held_slots h
        USING unnest(pgmq_names, msg_ids) AS s(q, id)
        WHERE h.pgmq_queue = s.q AND h.msg_id = s.id AND NOT h.released
        RETURNING h.pgmq_queue, h.msg_id
    )
    SELECT coalesce(array_agg(r.pgmq_queue), '{}'), coalesce(array_agg(r.msg_id), '{}')
    INTO gone_queues, gone_ids
    FROM released r;
    IF cardinality(gone_ids) < cardinality(msg_ids) THEN  -- released ahead of their holds
        INSERT INTO kombu_pgmq.held_slots AS h (pgmq_queue, msg_id, queue, held_until, released)
        SELECT s.q, s.id, l.queue, clock_timestamp(), true
        FROM unnest(pgmq_names, msg_ids) AS s(q, id)
        JOIN kombu_pgmq.limited l ON l.pgmq_queue = s.q
        WHERE NOT EXISTS (SELECT 1 FROM unnest(gone_queues, gone_ids) AS g(q, id)
                          WHERE g.q = s.q AND g.id = s.id)
        ON CONFLICT (pgmq_queue, msg_id) DO UPDATE
            SET released = true, held_until = excluded.held_until
            WHERE NOT h.released;
    END IF;
    IF EXISTS (SELECT 1 FROM kombu_pgmq.waiting w WHERE w.pgmq_queue = ANY(pgmq_names)) THEN
        FOR q IN SELECT DISTINCT s.q FROM unnest(pgmq_names) AS s(q) ORDER BY 1 LOOP
            PERFORM kombu_pgmq.notify_waiting(q);
        END LOOP;
    END IF;
    RETURN cardinality(gone_ids);
END
$$;

-- Renew held slots (pgmq_names and msg_ids aligned) to now + hold_seconds; returns those
-- renewed (one missing is not held yet, was released, or its queue was dropped). Forgets
-- the rows that stopped counting a minute ago (tombstones, lapsed slots).
CREATE OR REPLACE FUNCTION kombu_pgmq.renew_slots(
    pgmq_names text[], msg_ids bigint[], hold_seconds integer
) RETURNS TABLE (queue text, msg_id bigint)
LANGUAGE sql AS $$
    DELETE FROM kombu_pgmq.held_slots h
    WHERE h.held_until < clock_timestamp() - interval '1 minute';
    UPDATE kombu_pgmq.held_slots h
    SET held_until = clock_timestamp() + make_interval(secs => hold_seconds)
    FROM unnest(pgmq_names, msg_ids) AS s(q, id)
    WHERE h.pgmq_queue = s.q AND h.msg_id = s.id AND NOT h.released
    RETURNING h.pgmq_queue, h.msg_id
$$;

-- Hold slots (kombu_pgmq.ack's, for a flush through the function): as before, without
-- the sweep.
CREATE OR REPLACE FUNCTION kombu_pgmq.hold_slots(
    pgmq_name text, msg_ids bigint[], read_cts integer[], hold_seconds integer
) RETURNS SETOF bigint
LANGUAGE plpgsql AS $$
DECLARE
    lim kombu_pgmq.queue_limits;
BEGIN
    PERFORM kombu_pgmq.check_window('slot hold (seconds)', hold_seconds, 43200);
    SELECT l.* INTO lim FROM kombu_pgmq.queue_limits l
    WHERE l.queue = (SELECT x.queue FROM kombu_pgmq.limited x WHERE x.pgmq_queue = pgmq_name)
      AND (l.concurrency IS NOT NULL OR l.key_concurrency IS NOT NULL);
    IF NOT FOUND OR to_regclass(format('pgmq.%I', 'q_' || pgmq_name)) IS NULL THEN
        RETURN;
    END IF;
    RETURN QUERY EXECUTE format(
        'INSERT INTO kombu_pgmq.held_slots AS h (pgmq_queue, msg_id, queue, key, held_until)
         SELECT %1$L, t.msg_id, %2$L, t.headers ->> %3$L,
                clock_timestamp() + make_interval(secs => $3)
         FROM pgmq.%4$I t
         JOIN unnest($1::bigint[], $2::integer[]) AS d(id, ct)
           ON t.msg_id = d.id AND t.read_ct = d.ct
         ON CONFLICT (pgmq_queue, msg_id) DO UPDATE SET held_until = excluded.held_until
             WHERE NOT h.released
         RETURNING h.msg_id',
        pgmq_name, lim.queue, lim.limit_key, 'q_' || pgmq_name
    ) USING msg_ids, read_cts, hold_seconds;
END
$$;

SELECT kombu_pgmq.secure_functions();
