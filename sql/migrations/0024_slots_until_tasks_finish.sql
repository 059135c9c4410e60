-- Concurrency limits count a task until it finishes, whatever its ack mode.
--
-- A limit counts what is in flight: PGMQ rows delivered and not settled whose lease is
-- live. Celery acks a task's message when the task starts unless acks_late, so that count
-- alone capped messages waiting in workers, not running tasks. A worker now holds a
-- concurrency slot for a task still running when its message is acked (a row of
-- kombu_pgmq.held_slots, inserted by the ack itself, in its transaction, before it archives
-- the message: kombu_pgmq.ack's holds, the direct statements' hold_slots_cte), renews it
-- with its leases and releases it when the task finishes. The limits count held slots with
-- the rows in flight; a slot whose process died stops counting when held_until passes (one
-- visibility timeout after its last renewal), so no slot is lost for good. The message
-- itself is archived at the ack as before: an early-acked task is never delivered again.
-- A release may reach the server before the ack that holds the slot (they travel on
-- different connections, and a short task ends before its batched ack is sent): it leaves
-- the slot released (released = true, a tombstone kept a minute), and the late hold then
-- changes nothing.

CREATE TABLE kombu_pgmq.held_slots (
    pgmq_queue text NOT NULL,           -- the PGMQ queue (priority band) it was read from
    msg_id bigint NOT NULL,
    queue text NOT NULL REFERENCES kombu_pgmq.queues (queue) ON DELETE CASCADE,
    key text,                           -- its limit key (the limit_key header), NULL: none
    held_until timestamptz NOT NULL,    -- counted until then (renewed while the task runs)
    released boolean NOT NULL DEFAULT false,  -- its task finished: never held again
    PRIMARY KEY (pgmq_queue, msg_id)
);
CREATE INDEX held_slots_queue_idx ON kombu_pgmq.held_slots (queue, held_until);
CREATE INDEX held_slots_until_idx ON kombu_pgmq.held_slots (held_until);

-- Hold a slot for each delivery (msg_ids with the read_cts they were delivered with) of
-- PGMQ queue pgmq_name whose task runs on after its ack, for hold_seconds: called by
-- kombu_pgmq.ack before it archives them (the row is still in flight, so the limit never
-- sees the task's slot free). Only for a queue with a concurrency or key concurrency limit
-- (FIFO groups included); returns the msg_ids held (none: the queue has no such limit, or
-- the deliveries are stale). Forgets slots that lapsed a minute ago.
CREATE FUNCTION kombu_pgmq.hold_slots(
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
    DELETE FROM kombu_pgmq.held_slots h
    WHERE h.held_until < clock_timestamp() - interval '1 minute';
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

-- Renew held slots (pgmq_names and msg_ids aligned) to now + hold_seconds; returns those
-- renewed (one missing is not held yet, was released, or its queue was dropped).
CREATE FUNCTION kombu_pgmq.renew_slots(
    pgmq_names text[], msg_ids bigint[], hold_seconds integer
) RETURNS TABLE (queue text, msg_id bigint)
LANGUAGE sql AS $$
    UPDATE kombu_pgmq.held_slots h
    SET held_until = clock_timestamp() + make_interval(secs => hold_seconds)
    FROM unnest(pgmq_names, msg_ids) AS s(q, id)
    WHERE h.pgmq_queue = s.q AND h.msg_id = s.id AND NOT h.released
    RETURNING h.pgmq_queue, h.msg_id
$$;

-- Release slots (their tasks finished; pgmq_names and msg_ids aligned) and wake the
-- consumers waiting on their queues: the slots are free. A slot not held yet (its ack is
-- still on its way) is released ahead: a tombstone its hold will not overwrite. Forgets
-- slots that ended a minute ago. Returns how many were held.
CREATE FUNCTION kombu_pgmq.release_slots(pgmq_names text[], msg_ids bigint[])
RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    q text;
    n integer;
BEGIN
    UPDATE kombu_pgmq.held_slots h
    SET released = true, held_until = clock_timestamp()
    FROM unnest(pgmq_names, msg_ids) AS s(q, id)
    WHERE h.pgmq_queue = s.q AND h.msg_id = s.id AND NOT h.released;
    GET DIAGNOSTICS n = ROW_COUNT;
    INSERT INTO kombu_pgmq.held_slots (pgmq_queue, msg_id, queue, held_until, released)
    SELECT s.q, s.id, l.queue, clock_timestamp(), true
    FROM unnest(pgmq_names, msg_ids) AS s(q, id)
    JOIN kombu_pgmq.limited l ON l.pgmq_queue = s.q
    ON CONFLICT (pgmq_queue, msg_id) DO NOTHING;
    DELETE FROM kombu_pgmq.held_slots h
    WHERE h.held_until < clock_timestamp() - interval '1 minute';
    FOR q IN SELECT DISTINCT s.q FROM unnest(pgmq_names) AS s(q) ORDER BY 1 LOOP
        PERFORM kombu_pgmq.notify_waiting(q);
    END LOOP;
    RETURN n;
END
$$;

-- What is in flight in limited Kombu queue kombu_queue at at_time: delivered, not settled,
-- lease live (all its bands; pgmq's vt index, vt > at_time: in flight and delayed rows, by
-- an index scan that marks the entries of acked rows dead and skips them after), plus the
-- slots held by tasks still running after their ack; total, and by_key {key: count} by
-- the header key_header. tolerant: a band whose table is gone or locked counts 0 (for the
-- statistics) instead of raising.
CREATE OR REPLACE FUNCTION kombu_pgmq.in_flight_by_key(
    kombu_queue text, key_header text, at_time timestamptz, tolerant boolean,
    OUT total bigint, OUT by_key jsonb
)
LANGUAGE plpgsql SET enable_seqscan = off SET enable_bitmapscan = off AS $$
DECLARE
    b text;
    n bigint;
    part_keys jsonb;
    parts jsonb[] := '{}';
BEGIN
    total := 0;
    FOR b IN SELECT x.pgmq_queue FROM kombu_pgmq.limited x WHERE x.queue = kombu_queue LOOP
        BEGIN
            EXECUTE format(
                'SELECT coalesce(sum(s.n), 0)::bigint,
                        coalesce(jsonb_object_agg(s.k, s.n) FILTER (WHERE s.k IS NOT NULL),
                                 ''{}'')
                 FROM (SELECT t.headers ->> $2 AS k, count(*) AS n FROM pgmq.%I t
                       WHERE t.vt > $1 AND t.read_ct > 0 GROUP BY 1) s', 'q_' || b)
                INTO n, part_keys USING at_time, key_header;
        EXCEPTION WHEN undefined_table OR lock_not_available THEN
            IF NOT tolerant THEN
                RAISE;
            END IF;
            n := 0;
            part_keys := '{}';
        END;
        total := total + n;
        IF part_keys <> '{}' THEN
            parts := parts || part_keys;
        END IF;
    END LOOP;
    SELECT coalesce(sum(s.n), 0)::bigint,
           coalesce(jsonb_object_agg(s.k, s.n) FILTER (WHERE s.k IS NOT NULL), '{}')
    INTO n, part_keys
    FROM (SELECT h.key AS k, count(*) AS n FROM kombu_pgmq.held_slots h
          WHERE h.queue = kombu_queue AND h.held_until > at_time GROUP BY 1) s;
    total := total + n;
    IF part_keys <> '{}' THEN
        parts := parts || part_keys;
    END IF;
    IF cardinality(parts) = 0 THEN
        by_key := '{}';
    ELSIF cardinality(parts) = 1 THEN
        by_key := parts[1];
    ELSE
        by_key := (SELECT jsonb_object_agg(e.key, e.n) FROM (
            SELECT x.key, sum(x.value::bigint) AS n
            FROM unnest(parts) AS p(j), jsonb_each_text(p.j) AS x
            GROUP BY x.key) e);
    END IF;
END
$$;

-- The budget of one read of limited PGMQ queue pgmq_name (a queue without key limits), for
-- statement read_limited_queue: as before, and when it counts what is in flight, the slots
-- held by tasks still running after their ack count too (in_flight_bound, the last count
-- plus every delivery since, covers them: a held slot was a delivery).
CREATE OR REPLACE FUNCTION kombu_pgmq.limit_take(pgmq_name text, qty integer, acked_ids bigint[])
RETURNS TABLE (allowed integer, cut smallint, taken double precision)
LANGUAGE plpgsql ROWS 1 SET enable_seqscan = off SET enable_bitmapscan = off AS $$
#variable_conflict use_column
DECLARE
    lim kombu_pgmq.queue_limits;
    b text;
    n bigint;
    in_flight bigint := 0;
    burst double precision;
    avail double precision;
    t0 timestamptz;
BEGIN
    -- the common case in one UPDATE (its plan cached here): no key limits, room for the
    -- whole read under concurrency by in_flight_bound, tokens for it in the bucket
    UPDATE kombu_pgmq.queue_limits AS l
    SET tokens = CASE WHEN l.rate_per_second IS NOT NULL
                      THEN kombu_pgmq.tokens_at(l.tokens, l.refilled_at, l.rate_per_second,
                                                kombu_pgmq.burst_of(l.burst, l.rate_per_second),
                                                c.now) - qty END,
        refilled_at = CASE WHEN l.rate_per_second IS NOT NULL THEN c.now END,
        in_flight_bound = CASE WHEN l.concurrency IS NOT NULL THEN l.in_flight_bound + qty END
    FROM (SELECT clock_timestamp() AS now) c
    WHERE l.queue = (SELECT x.queue FROM kombu_pgmq.limited x WHERE x.pgmq_queue = pgmq_name)
      AND l.key_concurrency IS NULL AND l.key_rate_per_second IS NULL
      AND (l.concurrency IS NULL OR l.in_flight_bound + qty <= l.concurrency)
      AND (l.rate_per_second IS NULL
           OR floor(kombu_pgmq.tokens_at(l.tokens, l.refilled_at, l.rate_per_second,
                                         kombu_pgmq.burst_of(l.burst, l.rate_per_second),
                                         c.now)) >= qty)
    RETURNING CASE WHEN l.rate_per_second IS NOT NULL THEN qty ELSE 0 END INTO taken;
    IF FOUND THEN
        allowed := greatest(qty, 0);
        cut := 0;
        RETURN NEXT;
        RETURN;
    END IF;
    SELECT l.* INTO lim FROM kombu_pgmq.queue_limits l
    WHERE l.queue = (SELECT x.queue FROM kombu_pgmq.limited x WHERE x.pgmq_queue = pgmq_name)
    FOR UPDATE OF l;
    IF NOT FOUND THEN
        allowed := NULL;
        cut := 0;
        taken := 0;
        RETURN NEXT;
        RETURN;
    END IF;
    IF lim.key_concurrency IS NOT NULL OR lim.key_rate_per_second IS NOT NULL THEN
        allowed := 0;
        cut := 3;
        taken := 0;
        RETURN NEXT;
        RETURN;
    END IF;
    t0 := clock_timestamp();
    allowed := greatest(qty, 0);
    cut := 0;
    taken := 0;
    IF lim.concurrency IS NOT NULL THEN
        IF lim.in_flight_bound IS NOT NULL
           AND lim.in_flight_bound + allowed <= lim.concurrency THEN
            in_flight := lim.in_flight_bound;  -- room enough even if all are still in flight
        ELSE
            FOR b IN SELECT x.pgmq_queue FROM kombu_pgmq.limited x WHERE x.queue = lim.queue LOOP
                -- counted up to the limit: more makes no difference
                EXECUTE format('SELECT count(*) FROM (SELECT FROM pgmq.%I t
                                    WHERE t.vt > $1 AND t.read_ct > 0 AND t.msg_id <> ALL($2)
                                    LIMIT $3) s', 'q_' || b)
                    INTO n USING t0, CASE WHEN b = pgmq_name THEN acked_ids ELSE '{}' END,
                                 lim.concurrency;
                in_flight := in_flight + n;
            END LOOP;
            in_flight := in_flight + (SELECT count(*) FROM kombu_pgmq.held_slots h
                                      WHERE h.queue = lim.queue AND h.held_until > t0);
        END IF;
        IF lim.concurrency - in_flight < allowed THEN
            allowed := greatest(0, lim.concurrency - in_flight)::integer;
            cut := 1;
        END IF;
    END IF;
    IF lim.rate_per_second IS NOT NULL THEN
        burst := kombu_pgmq.burst_of(lim.burst, lim.rate_per_second);
        avail := kombu_pgmq.tokens_at(lim.tokens, lim.refilled_at, lim.rate_per_second, burst, t0);
        IF floor(avail) < allowed THEN
            allowed := floor(avail)::integer;
            cut := 2;
        END IF;
        taken := allowed;
    END IF;
    UPDATE kombu_pgmq.queue_limits l
    SET tokens = CASE WHEN l.rate_per_second IS NOT NULL THEN avail - allowed END,
        refilled_at = CASE WHEN l.rate_per_second IS NOT NULL THEN t0 END,
        in_flight_bound = CASE WHEN l.concurrency IS NOT NULL THEN in_flight + allowed END
    WHERE l.queue = lim.queue;
    RETURN NEXT;
END
$$;

-- Read up to qty messages of limited Kombu queue kombu_queue from its PGMQ queues
-- read_bands within its limits, as before; what is in flight counts the slots held by tasks
-- still running after their ack (kombu_pgmq.in_flight_by_key, which counts the rows in
-- flight before the slots: a task acked between the two is counted twice, never missed),
-- and an ordered key (FIFO groups) delivers a message only while fewer than
-- key_concurrency messages of its key are ahead of it in the queue or running from a held
-- slot (both counted in the statement that reads).
CREATE OR REPLACE FUNCTION kombu_pgmq.read_limited(
    kombu_queue text, read_bands text[], vt integer, qty integer
) RETURNS TABLE (
    queue text, msg_id bigint, read_ct integer, enqueued_at timestamptz, message text,
    headers text, age_seconds double precision
)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    lim kombu_pgmq.queue_limits;
    t0 timestamptz := clock_timestamp();
    b text;
    r record;
    n bigint;
    in_flight bigint := 0;
    key_counts jsonb := '{}';
    got jsonb := '{}';
    saturated text[];
    budget integer := greatest(qty, 0);
    delivered integer := 0;
    avail double precision;  -- the queue's tokens now
    burst double precision;
    key_burst double precision;
    keyed boolean;
    cut smallint := 0;  -- what cut the budget: 1 concurrency, 2 rate
    throttle smallint := 0;
    retry double precision;
    stamp text := '';
    more boolean := false;
BEGIN
    SELECT * INTO lim FROM kombu_pgmq.queue_limits l WHERE l.queue = kombu_queue FOR UPDATE;
    IF NOT FOUND THEN
        FOREACH b IN ARRAY read_bands LOOP
            EXIT WHEN budget - delivered <= 0;
            RETURN QUERY
                SELECT b, p.msg_id, p.read_ct, p.enqueued_at, p.message::text, p.headers::text,
                       extract(epoch FROM clock_timestamp() - p.enqueued_at)::float8
                FROM pgmq.read(b, vt, budget - delivered) AS p;
            GET DIAGNOSTICS n = ROW_COUNT;
            delivered := delivered + n;
        END LOOP;
        RETURN;
    END IF;
    keyed := lim.key_concurrency IS NOT NULL OR lim.key_rate_per_second IS NOT NULL;
    IF NOT keyed THEN
        -- queue limits only: the budget as read_limited_queue takes it
        SELECT t.allowed, t.cut, t.taken INTO budget, cut, avail
        FROM kombu_pgmq.limit_take(read_bands[1], qty, '{}') t;
        FOREACH b IN ARRAY read_bands LOOP
            EXIT WHEN budget - delivered <= 0;
            RETURN QUERY
                SELECT b, p.msg_id, p.read_ct, p.enqueued_at, p.message::text, p.headers::text,
                       extract(epoch FROM clock_timestamp() - p.enqueued_at)::float8
                FROM pgmq.read(b, vt, budget - delivered) AS p;
            GET DIAGNOSTICS n = ROW_COUNT;
            delivered := delivered + n;
        END LOOP;
        SELECT d.state, d.retry_seconds INTO throttle, retry
        FROM kombu_pgmq.limit_done(read_bands[1], budget, cut, avail, delivered, 0, '{}') d;
        FOREACH b IN ARRAY read_bands LOOP
            queue := b;
            msg_id := NULL;
            read_ct := throttle;
            enqueued_at := NULL;
            message := NULL;
            headers := NULL;
            age_seconds := retry;
            RETURN NEXT;
        END LOOP;
        RETURN;
    END IF;
    -- key limits: counted exactly at every read
    -- in flight: delivered and not settled, lease live (a delayed message has read_ct 0)
    IF lim.concurrency IS NOT NULL OR (lim.key_concurrency IS NOT NULL AND NOT lim.ordered_keys)
    THEN
        SELECT c.total, c.by_key INTO in_flight, key_counts
        FROM kombu_pgmq.in_flight_by_key(kombu_queue, lim.limit_key, t0, false) c;
    END IF;
    IF lim.concurrency IS NOT NULL AND lim.concurrency - in_flight < budget THEN
        budget := greatest(0, lim.concurrency - in_flight)::integer;
        cut := 1;
    END IF;
    IF lim.rate_per_second IS NOT NULL THEN
        burst := kombu_pgmq.burst_of(lim.burst, lim.rate_per_second);
        avail := kombu_pgmq.tokens_at(lim.tokens, lim.refilled_at, lim.rate_per_second, burst, t0);
        IF floor(avail) < budget THEN
            budget := floor(avail)::integer;
            cut := 2;
        END IF;
    END IF;
    key_burst := kombu_pgmq.burst_of(lim.key_burst, lim.key_rate_per_second);
    IF EXISTS (SELECT 1 FROM pg_attribute
               WHERE attrelid = format('pgmq.%I', 'q_' || read_bands[1])::regclass
                 AND attname = 'last_read_at' AND NOT attisdropped) THEN
        stamp := ', last_read_at = clock_timestamp()';
    END IF;
    FOREACH b IN ARRAY read_bands LOOP
        EXIT WHEN budget - delivered <= 0;
        IF NOT keyed THEN
            RETURN QUERY
                SELECT b, p.msg_id, p.read_ct, p.enqueued_at, p.message::text, p.headers::text,
                       extract(epoch FROM clock_timestamp() - p.enqueued_at)::float8
                FROM pgmq.read(b, vt, budget - delivered) AS p;
            GET DIAGNOSTICS n = ROW_COUNT;
            delivered := delivered + n;
            CONTINUE;
        END IF;
        IF lim.ordered_keys THEN
            FOR r IN EXECUTE format(
                $sql$
                WITH ranked AS (
                    SELECT t.msg_id, t.vt, t.headers ->> $3 AS k,
                           row_number() OVER (PARTITION BY t.headers ->> $3
                                              ORDER BY t.msg_id) AS rn
                    FROM pgmq.%1$I t
                    WHERE t.headers ? $3
                ), held AS (
                    -- in this statement's snapshot, as ranked: an ack that holds a slot
                    -- and archives its row commits at once, so a task is counted in one
                    -- of the two, never in neither
                    SELECT h.key AS k, count(*) AS n FROM kombu_pgmq.held_slots h
                    WHERE h.queue = $5 AND h.held_until > clock_timestamp()
                    GROUP BY h.key
                ), ok AS (
                    (SELECT x.msg_id FROM ranked x LEFT JOIN held ON held.k = x.k
                     WHERE x.vt <= clock_timestamp()
                       AND x.rn <= $4 - coalesce(held.n, 0))
                    UNION ALL
                    (SELECT t.msg_id FROM pgmq.%1$I t
                     WHERE t.vt <= clock_timestamp() AND NOT coalesce(t.headers ? $3, false)
                     ORDER BY t.msg_id LIMIT $1)
                ), picked AS (
                    SELECT t.msg_id FROM pgmq.%1$I t
                    WHERE t.msg_id IN (SELECT ok.msg_id FROM ok) AND t.vt <= clock_timestamp()
                    ORDER BY t.msg_id
                    LIMIT $1
                    FOR UPDATE SKIP LOCKED
                )
                UPDATE pgmq.%1$I m
                SET vt = clock_timestamp() + make_interval(secs => $2),
                    read_ct = m.read_ct + 1 %2$s
                FROM picked p
                WHERE m.msg_id = p.msg_id
                RETURNING m.msg_id, m.read_ct, m.enqueued_at, m.message, m.headers,
                          m.headers ->> $3 AS k
                $sql$, 'q_' || b, stamp)
                USING budget - delivered, vt, lim.limit_key, lim.key_concurrency, kombu_queue
            LOOP
                queue := b;
                msg_id := r.msg_id;
                read_ct := r.read_ct;
                enqueued_at := r.enqueued_at;
                message := r.message::text;
                headers := r.headers::text;
                age_seconds := extract(epoch FROM clock_timestamp() - r.enqueued_at)::float8;
                RETURN NEXT;
                delivered := delivered + 1;
            END LOOP;
            CONTINUE;
        END IF;
        -- Keys at their limit (concurrency reached, or an empty bucket, counting what this
        -- read delivered) are skipped by the scan itself; the scan is repeated while it
        -- delivers and the budget is not spent, so a key that fills the scan's window and
        -- reaches its limit in it never holds back the keys behind it.
        LOOP
            saturated := ARRAY(
                SELECT e.key
                FROM (SELECT x.key, sum(x.value::bigint) AS n
                      FROM (SELECT * FROM jsonb_each_text(key_counts)
                            UNION ALL SELECT * FROM jsonb_each_text(got)) x
                      GROUP BY x.key) e
                WHERE lim.key_concurrency IS NOT NULL AND e.n >= lim.key_concurrency
                UNION
                SELECT kt.key FROM kombu_pgmq.limit_key_tokens kt
                WHERE lim.key_rate_per_second IS NOT NULL AND kt.queue = kombu_queue
                  AND kombu_pgmq.tokens_at(kt.tokens, kt.refilled_at, lim.key_rate_per_second,
                                           key_burst, clock_timestamp())
                      - coalesce((got ->> kt.key)::integer, 0) < 1
                UNION
                SELECT g.key FROM jsonb_each_text(got) g
                WHERE lim.key_rate_per_second IS NOT NULL AND key_burst - g.value::integer < 1);
            n := 0;
            FOR r IN EXECUTE format(
                $sql$
                WITH cand AS (
                    SELECT t.msg_id, t.headers ->> $3 AS k
                    FROM pgmq.%1$I t
                    WHERE t.vt <= clock_timestamp()
                      AND (t.headers ->> $3 IS NULL OR NOT (t.headers ->> $3 = ANY($4)))
                    ORDER BY t.msg_id
                    LIMIT $10
                ), ranked AS (
                    SELECT c.msg_id, c.k,
                           row_number() OVER (PARTITION BY c.k ORDER BY c.msg_id) AS rn
                    FROM cand c
                ), ok AS (
                    SELECT x.msg_id FROM ranked x
                    LEFT JOIN kombu_pgmq.limit_key_tokens kt ON kt.queue = $9 AND kt.key = x.k
                    WHERE x.k IS NULL
                       OR (($6::integer IS NULL
                            OR x.rn <= $6 - coalesce(($5 ->> x.k)::integer, 0)
                                          - coalesce(($11 ->> x.k)::integer, 0))
                           AND ($8::float8 IS NULL
                                OR x.rn <= floor(kombu_pgmq.tokens_at(kt.tokens, kt.refilled_at,
                                                     $8, $7, clock_timestamp()))
                                           - coalesce(($11 ->> x.k)::integer, 0)))
                    ORDER BY x.msg_id
                    LIMIT $1
                ), picked AS (
                    SELECT t.msg_id FROM pgmq.%1$I t
                    WHERE t.msg_id IN (SELECT ok.msg_id FROM ok) AND t.vt <= clock_timestamp()
                    ORDER BY t.msg_id
                    FOR UPDATE SKIP LOCKED
                )
                UPDATE pgmq.%1$I m
                SET vt = clock_timestamp() + make_interval(secs => $2),
                    read_ct = m.read_ct + 1 %2$s
                FROM picked p
                WHERE m.msg_id = p.msg_id
                RETURNING m.msg_id, m.read_ct, m.enqueued_at, m.message, m.headers,
                          m.headers ->> $3 AS k
                $sql$, 'q_' || b, stamp)
                USING budget - delivered, vt, lim.limit_key, saturated, key_counts,
                      lim.key_concurrency, key_burst, lim.key_rate_per_second, kombu_queue,
                      (budget - delivered) * 16 + 100, got
            LOOP
                queue := b;
                msg_id := r.msg_id;
                read_ct := r.read_ct;
                enqueued_at := r.enqueued_at;
                message := r.message::text;
                headers := r.headers::text;
                age_seconds := extract(epoch FROM clock_timestamp() - r.enqueued_at)::float8;
                RETURN NEXT;
                delivered := delivered + 1;
                n := n + 1;
                IF r.k IS NOT NULL THEN
                    got := jsonb_set(got, ARRAY[r.k],
                                     to_jsonb(coalesce((got ->> r.k)::integer, 0) + 1));
                END IF;
            END LOOP;
            EXIT WHEN n = 0 OR budget - delivered <= 0;
        END LOOP;
    END LOOP;
    -- key buckets: take the tokens of the keys delivered
    IF lim.key_rate_per_second IS NOT NULL AND got <> '{}' THEN
        INSERT INTO kombu_pgmq.limit_key_tokens AS kt (queue, key, tokens, refilled_at)
        SELECT kombu_queue, g.key, key_burst - g.value::integer, clock_timestamp()
        FROM jsonb_each_text(got) g
        ON CONFLICT (queue, key) DO UPDATE
        SET tokens = kombu_pgmq.tokens_at(kt.tokens, kt.refilled_at, lim.key_rate_per_second,
                                          key_burst, excluded.refilled_at)
                     - (key_burst - excluded.tokens),
            refilled_at = excluded.refilled_at;
        IF random() < 0.01 THEN  -- forget full buckets now and then
            DELETE FROM kombu_pgmq.limit_key_tokens kt
            WHERE kt.queue = kombu_queue
              AND kt.refilled_at < t0 - make_interval(secs => key_burst / lim.key_rate_per_second);
        END IF;
    END IF;
    -- throttled: visible messages were left because of a limit
    IF cut > 0 OR keyed THEN
        FOREACH b IN ARRAY read_bands LOOP
            EXECUTE format('SELECT EXISTS (SELECT 1 FROM pgmq.%I t WHERE t.vt <= $1)', 'q_' || b)
                INTO more USING clock_timestamp();
            EXIT WHEN more;
        END LOOP;
    END IF;
    IF more AND cut > 0 AND delivered >= budget THEN
        throttle := CASE WHEN cut = 2 THEN 2 ELSE 1 END;
    ELSIF more AND keyed AND delivered < budget THEN
        throttle := CASE WHEN lim.key_rate_per_second IS NOT NULL THEN 2 ELSE 1 END;
        cut := 3;
    END IF;
    IF throttle = 2 THEN
        retry := CASE WHEN cut = 2 THEN (1 - (avail - delivered)) / lim.rate_per_second
                      ELSE 1 / lim.key_rate_per_second END;
    END IF;
    IF lim.rate_per_second IS NOT NULL OR throttle > 0 THEN
        UPDATE kombu_pgmq.queue_limits l
        SET tokens = CASE WHEN l.rate_per_second IS NOT NULL THEN avail - delivered END,
            refilled_at = CASE WHEN l.rate_per_second IS NOT NULL THEN t0 END,
            throttled_concurrency = l.throttled_concurrency
                + CASE WHEN throttle > 0 AND cut = 1 THEN 1 ELSE 0 END,
            throttled_rate = l.throttled_rate + CASE WHEN throttle > 0 AND cut = 2 THEN 1 ELSE 0 END,
            throttled_keys = l.throttled_keys + CASE WHEN throttle > 0 AND cut = 3 THEN 1 ELSE 0 END
        WHERE l.queue = kombu_queue;
    END IF;
    FOREACH b IN ARRAY read_bands LOOP
        queue := b;
        msg_id := NULL;
        read_ct := throttle;
        enqueued_at := NULL;
        message := NULL;
        headers := NULL;
        age_seconds := retry;
        RETURN NEXT;
    END LOOP;
END
$$;

-- Ack with receipt handles, waking the consumers waiting on a limited queue it settled a
-- message of; holds (aligned with msg_ids; missing: false): the acks whose tasks run on,
-- whose slots kombu_pgmq.hold_slots holds for hold_seconds before the archive.
DROP FUNCTION kombu_pgmq.ack(text[], bigint[], integer[], timestamptz[]);
CREATE FUNCTION kombu_pgmq.ack(
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
        GET DIAGNOSTICS n = ROW_COUNT;
        IF n > 0 AND EXISTS (SELECT 1 FROM kombu_pgmq.limited l WHERE l.pgmq_queue = q) THEN
            PERFORM kombu_pgmq.notify_waiting(q);
        END IF;
    END LOOP;
END
$$;

-- Ack and read in one round trip: ack_holds (aligned with ack_ids) and hold_seconds go to
-- kombu_pgmq.ack.
DROP FUNCTION kombu_pgmq.read(text[], integer, integer, text[], bigint[], integer[],
                              timestamptz[], boolean, text[]);
CREATE FUNCTION kombu_pgmq.read(
    queues text[], vt integer, qty integer,
    ack_queues text[] DEFAULT '{}', ack_ids bigint[] DEFAULT '{}',
    ack_cts integer[] DEFAULT '{}', ack_enqueued timestamptz[] DEFAULT '{}',
    durable_acks boolean DEFAULT true, fifo_queues text[] DEFAULT '{}',
    ack_holds boolean[] DEFAULT '{}', hold_seconds integer DEFAULT 0
) RETURNS TABLE (
    queue text, msg_id bigint, read_ct integer, enqueued_at timestamptz, message text,
    headers text, age_seconds double precision
)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    q text;
    kq text;
    remaining integer := qty;
    n integer;
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
                RETURN NEXT;
                IF r.msg_id IS NOT NULL THEN
                    remaining := remaining - 1;
                END IF;
            END LOOP;
        ELSE
            RETURN QUERY
                SELECT q, p.msg_id, p.read_ct, p.enqueued_at, p.message::text, p.headers::text,
                       extract(epoch FROM clock_timestamp() - p.enqueued_at)::float8
                FROM pgmq.read(q, vt, remaining) AS p;
            GET DIAGNOSTICS n = ROW_COUNT;
            remaining := remaining - n;
        END IF;
    END LOOP;
END
$$;

DELETE FROM kombu_pgmq.grantable WHERE function IN (
    'kombu_pgmq.ack(text[], bigint[], integer[], timestamptz[])',
    'kombu_pgmq.read(text[], integer, integer, text[], bigint[], integer[], timestamptz[], boolean, text[])');
INSERT INTO kombu_pgmq.grantable (function, kind, definer) VALUES
    ('kombu_pgmq.ack(text[], bigint[], integer[], timestamptz[], boolean[], integer)',
     'worker', true),
    ('kombu_pgmq.read(text[], integer, integer, text[], bigint[], integer[], timestamptz[], boolean, text[], boolean[], integer)',
     'worker', true),
    ('kombu_pgmq.hold_slots(text, bigint[], integer[], integer)', 'owner', false),
    ('kombu_pgmq.renew_slots(text[], bigint[], integer)', 'worker', true),
    ('kombu_pgmq.release_slots(text[], bigint[])', 'worker', true);
SELECT kombu_pgmq.secure_functions();
