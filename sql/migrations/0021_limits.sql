-- Fleet-wide concurrency and rate limits per queue and per key (issue 29), enforced in the
-- read: a consumer is never handed a message it may not start, whichever worker it is.
--
-- * Per Kombu queue (all its priority bands together): concurrency (messages delivered and
--   not settled whose lease is live: vt in the future and read_ct > 0, PGMQ's own
--   columns; a killed worker's messages stop counting when their visibility timeout
--   passes) and rate (a token bucket: rate_per_second, burst tokens at most).
-- * Per key within a queue: a message's key is its header named by limit_key
--   ('x-limit-key' by default; 'task' keys Celery tasks by task name), with the same two
--   limits per key. Messages without the header have no key limit.
-- * FIFO queues (x-fifo-groups, migration 0011) are the concurrency-1 case: key
--   'x-group-id', key_concurrency 1, ordered_keys (a key's messages go out in msg_id order:
--   one is delivered only while fewer than key_concurrency messages of its key are ahead
--   of it in the queue, in flight or not). kombu_pgmq.read_grouped is gone.
--
-- A limited read locks its queue's limits row (readers of one limited queue take turns;
-- kombu_pgmq.read locks every limited queue it reads in name order, so two readers never
-- wait on each other in a circle), counts what is in flight (or trusts in_flight_bound
-- when it leaves room), takes tokens, and reads no more than that: a refused message is
-- not read, so its read_ct (dead-lettering) does not move. It returns, after its
-- messages, one marker row per band read (msg_id NULL): read_ct 0 = limited, not
-- throttled; 1 = throttled until a message settles (acks, requeues and dead letters wake
-- waiting consumers, see kombu_pgmq.ack below); 2 = throttled until tokens refill,
-- age_seconds = in how many seconds; 3 (statement read_limited_queue only) = the queue
-- has key limits, read it through kombu_pgmq.read. Clients learn from it that a queue is
-- limited. Queue limits alone: statement read_limited_queue (sql/queries.sql) with
-- kombu_pgmq.limit_take and limit_done; key limits: kombu_pgmq.read -> read_limited.

-- -- limits --------------------------------------------------------------------------------

-- One row per limited Kombu queue. rate/key_rate as given ('100/s'), *_per_second parsed;
-- burst NULL: the default, the tokens of 0.1 s and at least 1. tokens/refilled_at: the
-- queue's bucket (NULL: full). in_flight_bound: at least as many messages as are in
-- flight (NULL: unknown): the last exact count plus every delivery since; a read counts
-- again only when the bound leaves less room than it asks for (see limit_take). throttled_*: reads that left visible messages undelivered
-- because of that limit (counters for kombu_pgmq_queue_throttled_total).
CREATE TABLE kombu_pgmq.queue_limits (
    queue text PRIMARY KEY REFERENCES kombu_pgmq.queues (queue) ON DELETE CASCADE,
    concurrency integer CHECK (concurrency > 0),
    rate text,
    rate_per_second double precision CHECK (rate_per_second > 0),
    burst double precision CHECK (burst >= 1),
    limit_key text NOT NULL DEFAULT 'x-limit-key',
    key_concurrency integer CHECK (key_concurrency > 0),
    key_rate text,
    key_rate_per_second double precision CHECK (key_rate_per_second > 0),
    key_burst double precision CHECK (key_burst >= 1),
    ordered_keys boolean NOT NULL DEFAULT false,
    tokens double precision,
    refilled_at timestamptz,
    in_flight_bound bigint,
    throttled_concurrency bigint NOT NULL DEFAULT 0,
    throttled_rate bigint NOT NULL DEFAULT 0,
    throttled_keys bigint NOT NULL DEFAULT 0,
    updated_at timestamptz NOT NULL DEFAULT now(),
    updated_by text NOT NULL DEFAULT session_user
);

-- The PGMQ queues (priority bands) of each limited Kombu queue: one probe by PGMQ name
-- (as kombu_pgmq.paused).
CREATE TABLE kombu_pgmq.limited (
    pgmq_queue text PRIMARY KEY,
    queue text NOT NULL REFERENCES kombu_pgmq.queue_limits (queue) ON DELETE CASCADE
);
CREATE INDEX limited_queue_idx ON kombu_pgmq.limited (queue);

-- Token buckets of keys with a key_rate (a missing row: a full bucket).
CREATE TABLE kombu_pgmq.limit_key_tokens (
    queue text NOT NULL REFERENCES kombu_pgmq.queue_limits (queue) ON DELETE CASCADE,
    key text NOT NULL,
    tokens double precision NOT NULL,
    refilled_at timestamptz NOT NULL,
    PRIMARY KEY (queue, key)
);

-- A rate as Celery writes rate_limit: '100/s', '6000/m', '50/h', or a bare number (per
-- second). NULL in, NULL out.
CREATE FUNCTION kombu_pgmq.rate_per_second(rate text) RETURNS double precision
LANGUAGE plpgsql IMMUTABLE AS $$
DECLARE
    m text[];
    n double precision;
BEGIN
    IF rate IS NULL THEN
        RETURN NULL;
    END IF;
    m := regexp_match(btrim(rate), '^([0-9]+(\.[0-9]+)?)\s*(/\s*([smh]))?$');
    IF m IS NULL THEN
        RAISE EXCEPTION 'kombu_pgmq: rate % is not a rate: write it as 100/s, 6000/m or 50/h',
            quote_literal(rate) USING ERRCODE = 'invalid_parameter_value';
    END IF;
    n := m[1]::double precision;
    IF n <= 0 THEN
        RAISE EXCEPTION 'kombu_pgmq: rate % must be above 0 (clear the limit instead)',
            quote_literal(rate) USING ERRCODE = 'invalid_parameter_value';
    END IF;
    RETURN n / CASE coalesce(m[4], 's') WHEN 's' THEN 1 WHEN 'm' THEN 60 ELSE 3600 END;
END
$$;

-- The burst of a rate: as stored, else the tokens of 0.1 s and at least 1.
CREATE FUNCTION kombu_pgmq.burst_of(burst double precision, per_second double precision)
RETURNS double precision
LANGUAGE sql IMMUTABLE AS $$
    SELECT CASE WHEN per_second IS NULL THEN NULL
                ELSE coalesce(burst, greatest(1, per_second * 0.1)) END
$$;

-- The tokens of a bucket at at_time: those it held at refilled_at (NULL: a full bucket)
-- plus what per_second refilled since, at most burst. Inlined where it is used.
CREATE FUNCTION kombu_pgmq.tokens_at(
    tokens double precision, refilled_at timestamptz, per_second double precision,
    burst double precision, at_time timestamptz
) RETURNS double precision
LANGUAGE sql IMMUTABLE AS $$
    SELECT least(burst, coalesce(tokens, burst) + per_second
                 * greatest(0, extract(epoch FROM at_time - coalesce(refilled_at, at_time))))
$$;

-- Set the limits of Kombu queue kombu_queue. limits: a JSON object with any of
-- concurrency (integer), rate ('100/s'), burst (tokens), key_concurrency, key_rate,
-- key_burst, limit_key (a header name; 'task': Celery's task name); a JSON null or 0
-- removes that limit, a key left out keeps its value (replace: every limit not given is
-- removed). Returns the row, or nothing when no limit is left. Consumers waiting on the
-- queue are woken: a loosened limit takes effect at their next read.
CREATE FUNCTION kombu_pgmq.set_queue_limits(
    kombu_queue text, limits jsonb, replace boolean DEFAULT false
) RETURNS SETOF kombu_pgmq.queue_limits
LANGUAGE plpgsql AS $$
DECLARE
    q kombu_pgmq.queues;
    cur kombu_pgmq.queue_limits;
    found_row boolean;
    unknown text;
    band text;
    fifo_keys text[] := ARRAY['key_concurrency', 'key_rate', 'key_burst', 'limit_key'];
BEGIN
    SELECT * INTO q FROM kombu_pgmq.queues x WHERE x.queue = kombu_queue;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'kombu_pgmq: queue % does not exist: declare it first (start a worker '
                        'that consumes it, or publish to it), then set its limits',
            quote_literal(kombu_queue) USING ERRCODE = 'undefined_object';
    END IF;
    IF limits IS NULL OR jsonb_typeof(limits) <> 'object' THEN
        RAISE EXCEPTION 'kombu_pgmq: the limits of queue % must be a JSON object, not %',
            quote_literal(kombu_queue), coalesce(limits::text, 'NULL')
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    SELECT string_agg(k, ', ') INTO unknown FROM jsonb_object_keys(limits) AS k
    WHERE k NOT IN ('concurrency', 'rate', 'burst', 'key_concurrency', 'key_rate',
                    'key_burst', 'limit_key');
    IF unknown IS NOT NULL THEN
        RAISE EXCEPTION 'kombu_pgmq: unknown limit(s) % for queue %: use concurrency, rate, '
                        'burst, key_concurrency, key_rate, key_burst, limit_key',
            unknown, quote_literal(kombu_queue) USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF q.fifo_groups AND limits ?| fifo_keys THEN
        RAISE EXCEPTION 'kombu_pgmq: queue % is a FIFO queue (x-fifo-groups): each x-group-id '
                        'is delivered one message at a time, in order; key limits belong on '
                        'a queue without x-fifo-groups', quote_literal(kombu_queue)
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    SELECT * INTO cur FROM kombu_pgmq.queue_limits l WHERE l.queue = kombu_queue FOR UPDATE;
    found_row := FOUND;
    IF NOT found_row OR replace THEN
        cur.queue := kombu_queue;
        cur.concurrency := NULL;
        cur.rate := NULL;
        cur.burst := NULL;
        cur.key_concurrency := NULL;
        cur.key_rate := NULL;
        cur.key_burst := NULL;
        cur.limit_key := 'x-limit-key';
        cur.throttled_concurrency := coalesce(cur.throttled_concurrency, 0);
        cur.throttled_rate := coalesce(cur.throttled_rate, 0);
        cur.throttled_keys := coalesce(cur.throttled_keys, 0);
    END IF;
    IF limits ? 'concurrency' THEN
        cur.concurrency := nullif((limits ->> 'concurrency')::integer, 0);
    END IF;
    IF limits ? 'rate' THEN
        cur.rate := nullif(nullif(btrim(limits ->> 'rate'), ''), '0');
    END IF;
    IF limits ? 'burst' THEN
        cur.burst := nullif((limits ->> 'burst')::double precision, 0);
    END IF;
    IF limits ? 'key_concurrency' THEN
        cur.key_concurrency := nullif((limits ->> 'key_concurrency')::integer, 0);
    END IF;
    IF limits ? 'key_rate' THEN
        cur.key_rate := nullif(nullif(btrim(limits ->> 'key_rate'), ''), '0');
    END IF;
    IF limits ? 'key_burst' THEN
        cur.key_burst := nullif((limits ->> 'key_burst')::double precision, 0);
    END IF;
    IF limits ? 'limit_key' THEN
        cur.limit_key := coalesce(nullif(btrim(limits ->> 'limit_key'), ''), 'x-limit-key');
    END IF;
    IF coalesce(cur.concurrency, 1) < 0 OR coalesce(cur.key_concurrency, 1) < 0 THEN
        RAISE EXCEPTION 'kombu_pgmq: a concurrency limit of queue % must be a positive number '
                        '(0 removes it)', quote_literal(kombu_queue)
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    cur.rate_per_second := kombu_pgmq.rate_per_second(cur.rate);
    cur.key_rate_per_second := kombu_pgmq.rate_per_second(cur.key_rate);
    IF cur.burst IS NOT NULL AND cur.rate IS NULL
       OR cur.key_burst IS NOT NULL AND cur.key_rate IS NULL THEN
        RAISE EXCEPTION 'kombu_pgmq: a burst of queue % needs its rate (burst with rate, '
                        'key_burst with key_rate)', quote_literal(kombu_queue)
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF coalesce(cur.burst, 1) < 1 OR coalesce(cur.key_burst, 1) < 1 THEN
        RAISE EXCEPTION 'kombu_pgmq: a burst of queue % must be at least 1 token',
            quote_literal(kombu_queue) USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF q.fifo_groups THEN  -- migration 0011's groups, as a key limit
        cur.limit_key := 'x-group-id';
        cur.key_concurrency := 1;
        cur.key_rate := NULL;
        cur.key_rate_per_second := NULL;
        cur.key_burst := NULL;
        cur.ordered_keys := true;
    ELSE
        cur.ordered_keys := false;
    END IF;
    cur.updated_at := clock_timestamp();
    cur.updated_by := session_user;
    IF cur.concurrency IS NULL AND cur.rate IS NULL AND cur.key_concurrency IS NULL
       AND cur.key_rate IS NULL THEN
        DELETE FROM kombu_pgmq.queue_limits l WHERE l.queue = kombu_queue;
    ELSE
        INSERT INTO kombu_pgmq.queue_limits AS l VALUES (cur.*)
        ON CONFLICT (queue) DO UPDATE
        SET concurrency = excluded.concurrency, rate = excluded.rate,
            rate_per_second = excluded.rate_per_second, burst = excluded.burst,
            limit_key = excluded.limit_key, key_concurrency = excluded.key_concurrency,
            key_rate = excluded.key_rate, key_rate_per_second = excluded.key_rate_per_second,
            key_burst = excluded.key_burst, ordered_keys = excluded.ordered_keys,
            tokens = CASE WHEN excluded.rate_per_second IS NULL THEN NULL ELSE l.tokens END,
            in_flight_bound = NULL,
            refilled_at = CASE WHEN excluded.rate_per_second IS NULL THEN NULL
                               ELSE l.refilled_at END,
            updated_at = excluded.updated_at, updated_by = excluded.updated_by;
        IF cur.key_rate IS NULL THEN
            DELETE FROM kombu_pgmq.limit_key_tokens t WHERE t.queue = kombu_queue;
        END IF;
        FOREACH band IN ARRAY coalesce(q.band_queues, ARRAY[q.pgmq_queue]) LOOP
            INSERT INTO kombu_pgmq.limited (pgmq_queue, queue) VALUES (band, kombu_queue)
            ON CONFLICT (pgmq_queue) DO UPDATE SET queue = excluded.queue;
        END LOOP;
        RETURN QUERY SELECT * FROM kombu_pgmq.queue_limits l WHERE l.queue = kombu_queue;
    END IF;
    FOREACH band IN ARRAY coalesce(q.band_queues, ARRAY[q.pgmq_queue]) LOOP
        PERFORM kombu_pgmq.notify_waiting(band);
    END LOOP;
END
$$;

-- FIFO queues declared from now on get their group limit with their queue row; the ones
-- declared before get it here.
CREATE FUNCTION kombu_pgmq.limit_fifo_groups() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM kombu_pgmq.set_queue_limits(NEW.queue, '{}'::jsonb);
    RETURN NULL;
END
$$;
CREATE TRIGGER queues_fifo_groups_limit
AFTER INSERT ON kombu_pgmq.queues
FOR EACH ROW WHEN (NEW.fifo_groups)
EXECUTE FUNCTION kombu_pgmq.limit_fifo_groups();

SELECT kombu_pgmq.set_queue_limits(q.queue, '{}'::jsonb)
FROM kombu_pgmq.queues q WHERE q.fifo_groups;

-- -- the limited read ------------------------------------------------------------------------

-- What is in flight in limited Kombu queue kombu_queue at at_time (delivered, not settled,
-- lease live; all its bands): total, and by_key {key: count} by the header key_header.
-- Reads pgmq's vt index (vt > at_time: in flight and delayed rows) by an index scan, which
-- marks the entries of acked rows dead and skips them after (a bitmap scan visits them all;
-- a sequential scan reads every row). tolerant: a band whose table is gone or locked
-- counts 0 (for the statistics) instead of raising.
CREATE FUNCTION kombu_pgmq.in_flight_by_key(
    kombu_queue text, key_header text, at_time timestamptz, tolerant boolean,
    OUT total bigint, OUT by_key jsonb
)
LANGUAGE plpgsql SET enable_seqscan = off SET enable_bitmapscan = off AS $$
DECLARE
    b text;
    n bigint;
    band_keys jsonb;
BEGIN
    total := 0;
    by_key := '{}';
    FOR b IN SELECT x.pgmq_queue FROM kombu_pgmq.limited x WHERE x.queue = kombu_queue LOOP
        BEGIN
            EXECUTE format(
                'SELECT coalesce(sum(s.n), 0)::bigint,
                        coalesce(jsonb_object_agg(s.k, s.n) FILTER (WHERE s.k IS NOT NULL),
                                 ''{}'')
                 FROM (SELECT t.headers ->> $2 AS k, count(*) AS n FROM pgmq.%I t
                       WHERE t.vt > $1 AND t.read_ct > 0 GROUP BY 1) s', 'q_' || b)
                INTO n, band_keys USING at_time, key_header;
        EXCEPTION WHEN undefined_table OR lock_not_available THEN
            IF NOT tolerant THEN
                RAISE;
            END IF;
            n := 0;
            band_keys := '{}';
        END;
        total := total + n;
        IF by_key = '{}' THEN
            by_key := band_keys;
        ELSIF band_keys <> '{}' THEN
            by_key := (SELECT jsonb_object_agg(e.k, e.n) FROM (
                SELECT x.key AS k, sum(x.value::bigint) AS n
                FROM (SELECT * FROM jsonb_each_text(by_key)
                      UNION ALL SELECT * FROM jsonb_each_text(band_keys)) x
                GROUP BY x.key) e);
        END IF;
    END LOOP;
END
$$;

-- Read up to qty messages of limited Kombu queue kombu_queue from its PGMQ queues
-- read_bands (in that order: priority bands highest first), within its limits; then one
-- marker row per band (see the top of this file). A queue without limits (cleared
-- meanwhile) is read as pgmq.read reads it, without markers. Queue limits alone: the
-- budget of kombu_pgmq.limit_take (as statement read_limited_queue), then pgmq.read.
-- Key limits: what is in flight is counted at every read (pgmq's vt index: in flight and
-- delayed rows); keyed reads rank at most qty * 16 + 100 visible rows of keys not at
-- their limit per band (ordered keys: every keyed row, as PGMQ's read_grouped_head),
-- skipping over rows of keys at their limit. Either way the limits row is locked (and
-- updated) by the read.
CREATE FUNCTION kombu_pgmq.read_limited(
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
                ), ok AS (
                    (SELECT x.msg_id FROM ranked x
                     WHERE x.vt <= clock_timestamp() AND x.rn <= $4)
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
                USING budget - delivered, vt, lim.limit_key, lim.key_concurrency
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

-- The budget of one read of limited PGMQ queue pgmq_name (a queue without key limits),
-- for statement read_limited_queue (sql/queries.sql: the read straight on PGMQ's tables,
-- as read_queue). Locks the queue's limits row (held to the end of the reader's
-- transaction) and, in statements of its own (a snapshot taken after the lock: the
-- deliveries of the reader before us are counted), counts what is in flight, leaving out
-- acked_ids (acked by the same statement), and takes up to qty tokens. Returns allowed
-- (messages the read may deliver), cut (1 concurrency, 2 rate, 0 none) and the tokens
-- taken; limit_done gives back what was not delivered. allowed NULL: the queue is not
-- limited (read it as any); cut 3: it has key limits (read it through kombu_pgmq.read).
-- ROWS 1 (as limit_done): the planner's default of 1000 rows per function made the
-- statement's estimated cost pass jit_above_cost, and JIT compiling cost 20 ms a read.
-- enable_seqscan off: counting what is in flight reads pgmq's vt index (vt > now: in
-- flight and delayed rows), never the whole table; with a backlog analyzed while it was
-- visible, the planner chose a sequential scan of every row.
CREATE FUNCTION kombu_pgmq.limit_take(pgmq_name text, qty integer, acked_ids bigint[])
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

-- The end of a read_limited_queue: wake the consumers waiting on the queue if it settled
-- messages (acked > 0: their slots are free); if a limit cut the read or it delivered less
-- than allowed, give back the tokens taken and the room in in_flight_bound not used, and
-- count a throttled read (a limit cut it and visible messages were left, other than
-- seen_ids: those delivered or acked by the read); return the read's marker (state as
-- read_limited's markers, 3 for a queue with key limits; retry_seconds: until the rate
-- allows one more, for state 2), none for a queue without limits (allowed NULL).
CREATE FUNCTION kombu_pgmq.limit_done(
    pgmq_name text, allowed integer, cut smallint, taken double precision, delivered integer,
    acked integer, seen_ids bigint[]
) RETURNS TABLE (state smallint, retry_seconds double precision)
LANGUAGE plpgsql ROWS 1 AS $$
#variable_conflict use_column
DECLARE
    lim kombu_pgmq.queue_limits;
    b text;
    more boolean := false;
    throttled boolean;
BEGIN
    IF allowed IS NULL THEN
        RETURN;  -- not limited: no marker
    END IF;
    IF acked > 0 AND EXISTS (SELECT 1 FROM kombu_pgmq.waiting w
                             WHERE w.pgmq_queue = pgmq_name) THEN
        PERFORM pg_notify('kombu_pgmq.' || pgmq_name, '');  -- as kombu_pgmq.notify_waiting
    END IF;
    state := CASE WHEN cut = 3 THEN 3 ELSE 0 END;
    retry_seconds := NULL;
    IF cut = 3 OR (cut = 0 AND delivered >= allowed) THEN
        RETURN NEXT;
        RETURN;
    END IF;
    IF cut > 0 AND delivered >= allowed THEN
        FOR b IN SELECT x.pgmq_queue FROM kombu_pgmq.limited x
                 WHERE x.queue = (SELECT y.queue FROM kombu_pgmq.limited y
                                  WHERE y.pgmq_queue = pgmq_name) LOOP
            EXECUTE format('SELECT EXISTS (SELECT 1 FROM pgmq.%I t
                                           WHERE t.vt <= clock_timestamp()
                                             AND t.msg_id <> ALL($1))', 'q_' || b)
                INTO more USING CASE WHEN b = pgmq_name THEN seen_ids ELSE '{}' END;
            EXIT WHEN more;
        END LOOP;
    END IF;
    throttled := more;
    UPDATE kombu_pgmq.queue_limits l
    SET tokens = CASE WHEN l.rate_per_second IS NOT NULL
                      THEN least(kombu_pgmq.burst_of(l.burst, l.rate_per_second),
                                 l.tokens + greatest(0, taken - delivered)) END,
        in_flight_bound = l.in_flight_bound - greatest(0, allowed - delivered),
        throttled_concurrency = l.throttled_concurrency
            + CASE WHEN throttled AND cut = 1 THEN 1 ELSE 0 END,
        throttled_rate = l.throttled_rate + CASE WHEN throttled AND cut = 2 THEN 1 ELSE 0 END
    WHERE l.queue = (SELECT x.queue FROM kombu_pgmq.limited x WHERE x.pgmq_queue = pgmq_name)
    RETURNING l.* INTO lim;
    IF throttled THEN
        state := cut;
        IF cut = 2 THEN
            retry_seconds := (1 - lim.tokens) / lim.rate_per_second;
        END IF;
    END IF;
    RETURN NEXT;
END
$$;

-- Ack and read in one round trip (migration 0017's function, its checks kept): limited
-- queues (FIFO ones included) are read by kombu_pgmq.read_limited, their limits rows
-- locked first in name order; fifo_queues is no longer needed (kept for older clients,
-- ignored).
CREATE OR REPLACE FUNCTION kombu_pgmq.read(
    queues text[], vt integer, qty integer,
    ack_queues text[] DEFAULT '{}', ack_ids bigint[] DEFAULT '{}',
    ack_cts integer[] DEFAULT '{}', ack_enqueued timestamptz[] DEFAULT '{}',
    durable_acks boolean DEFAULT true, fifo_queues text[] DEFAULT '{}'
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
        FROM kombu_pgmq.ack(ack_queues, ack_ids, ack_cts, ack_enqueued);
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

-- Ack with receipt handles (migration 0014's function), waking the consumers waiting on a
-- limited queue it settled a message of: that message's slot is free.
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
    n integer;
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
        GET DIAGNOSTICS n = ROW_COUNT;
        IF n > 0 AND EXISTS (SELECT 1 FROM kombu_pgmq.limited l WHERE l.pgmq_queue = q) THEN
            PERFORM kombu_pgmq.notify_waiting(q);
        END IF;
    END LOOP;
END
$$;

-- Requeue (migration 0017's function), waking the consumers waiting on a limited queue
-- it settled a delivery of: that delivery's slot is free (at vt: a message visible only
-- then still counts as in flight until then).
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
             SET vt = clock_timestamp() + make_interval(secs => $4),
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

-- Dead-letter (migration 0017's function), waking the consumers waiting on a limited
-- queue it moved a message of: its slot is free.
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
            WHERE t.msg_id = h.id AND t.read_ct = h.ct AND t.enqueued_at = h.at
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

-- -- what is limited, and how much is used -------------------------------------------------

-- Every limited queue with its limits and current use: in_flight (all bands), tokens now
-- (NULL: no rate), keys_in_flight (distinct keys with a message in flight),
-- keys_at_limit (keys at key_concurrency), the throttled counters. For kombu-pgmq
-- queues/queue and the metrics (kombu_pgmq_queue_limit, kombu_pgmq_queue_throttled_total).
CREATE FUNCTION kombu_pgmq.limits_info(only_queue text DEFAULT NULL)
RETURNS TABLE (
    queue text, concurrency integer, rate text, rate_per_second double precision,
    burst double precision, limit_key text, key_concurrency integer, key_rate text,
    key_rate_per_second double precision, key_burst double precision, ordered_keys boolean,
    in_flight bigint, tokens double precision, keys_in_flight bigint, keys_at_limit bigint,
    throttled_concurrency bigint, throttled_rate bigint, throttled_keys bigint,
    updated_at timestamptz, updated_by text
)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    l kombu_pgmq.queue_limits;
    counts jsonb;
    t0 timestamptz := clock_timestamp();
BEGIN
    PERFORM set_config('lock_timeout', '200ms', true);
    FOR l IN SELECT * FROM kombu_pgmq.queue_limits x
             WHERE only_queue IS NULL OR x.queue = only_queue ORDER BY x.queue LOOP
        SELECT c.total, c.by_key INTO in_flight, counts
        FROM kombu_pgmq.in_flight_by_key(l.queue, l.limit_key, t0, true) c;
        queue := l.queue;
        concurrency := l.concurrency;
        rate := l.rate;
        rate_per_second := l.rate_per_second;
        burst := kombu_pgmq.burst_of(l.burst, l.rate_per_second);
        limit_key := l.limit_key;
        key_concurrency := l.key_concurrency;
        key_rate := l.key_rate;
        key_rate_per_second := l.key_rate_per_second;
        key_burst := kombu_pgmq.burst_of(l.key_burst, l.key_rate_per_second);
        ordered_keys := l.ordered_keys;
        tokens := CASE WHEN l.rate_per_second IS NOT NULL THEN
                      kombu_pgmq.tokens_at(l.tokens, l.refilled_at, l.rate_per_second, burst, t0)
                  END;
        keys_in_flight := (SELECT count(*) FROM jsonb_object_keys(counts));
        keys_at_limit := CASE WHEN l.key_concurrency IS NULL THEN 0 ELSE
                             (SELECT count(*) FROM jsonb_each_text(counts) e
                              WHERE e.value::bigint >= l.key_concurrency) END;
        throttled_concurrency := l.throttled_concurrency;
        throttled_rate := l.throttled_rate;
        throttled_keys := l.throttled_keys;
        updated_at := l.updated_at;
        updated_by := l.updated_by;
        RETURN NEXT;
    END LOOP;
END
$$;

DELETE FROM kombu_pgmq.grantable
WHERE function = 'kombu_pgmq.read_grouped(text, integer, integer)';
DROP FUNCTION kombu_pgmq.read_grouped(text, integer, integer);

INSERT INTO kombu_pgmq.grantable (function, kind, definer) VALUES
    ('kombu_pgmq.rate_per_second(text)', 'owner', false),
    ('kombu_pgmq.burst_of(double precision, double precision)', 'owner', false),
    ('kombu_pgmq.in_flight_by_key(text, text, timestamptz, boolean)', 'owner', false),
    ('kombu_pgmq.tokens_at(double precision, timestamptz, double precision, double precision, timestamptz)',
     'owner', false),
    ('kombu_pgmq.set_queue_limits(text, jsonb, boolean)', 'worker', true),
    ('kombu_pgmq.limit_fifo_groups()', 'owner', false),
    ('kombu_pgmq.read_limited(text, text[], integer, integer)', 'owner', true),
    ('kombu_pgmq.limit_take(text, integer, bigint[])', 'owner', true),
    ('kombu_pgmq.limit_done(text, integer, smallint, double precision, integer, integer, bigint[])',
     'owner', true),
    ('kombu_pgmq.limits_info(text)', 'worker', true);
SELECT kombu_pgmq.secure_functions();
