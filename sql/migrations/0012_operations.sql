-- See and steer the broker (issue 16): queue statistics in one statement (metrics,
-- Flower, `kombu-pgmq queues`), paused queues (consumers skip them; publishes still land),
-- and a durable cancel of queued Celery tasks (removed and archived with a reason).

-- -- paused queues ------------------------------------------------------------------------

-- One row per PGMQ queue (priority band) of a paused Kombu queue. Consumers' reads skip
-- these (kombu_pgmq.read, kombu_pgmq.pop below); nothing else changes: publishes land,
-- acks and lease renewals of messages already delivered work, PGMQ's own functions and
-- clients ignore the flag. Dropping the Kombu queue forgets its pause.
CREATE TABLE kombu_pgmq.paused (
    pgmq_queue text PRIMARY KEY,
    queue text NOT NULL REFERENCES kombu_pgmq.queues (queue) ON DELETE CASCADE,
    paused_at timestamptz NOT NULL DEFAULT now(),
    paused_by text NOT NULL DEFAULT session_user
);
CREATE INDEX paused_queue_idx ON kombu_pgmq.paused (queue);

-- Pause a Kombu queue (every priority band); returns its PGMQ queues. Raises
-- undefined_table when kombu_queue was never declared.
CREATE FUNCTION kombu_pgmq.pause(kombu_queue text) RETURNS SETOF text
LANGUAGE plpgsql AS $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM kombu_pgmq.queues q WHERE q.queue = kombu_queue) THEN
        RAISE EXCEPTION 'kombu_pgmq: queue "%" is not declared (see kombu-pgmq queues)',
            kombu_queue USING ERRCODE = 'undefined_table';
    END IF;
    RETURN QUERY
        INSERT INTO kombu_pgmq.paused (pgmq_queue, queue)
        SELECT u, q.queue
        FROM kombu_pgmq.queues q, unnest(coalesce(q.band_queues, ARRAY[q.pgmq_queue])) AS u
        WHERE q.queue = kombu_queue
        ON CONFLICT (pgmq_queue) DO UPDATE SET paused_at = kombu_pgmq.paused.paused_at
        RETURNING pgmq_queue;
END
$$;

-- Resume a Kombu queue; returns the PGMQ queues that were paused and wakes the consumers
-- waiting on them (at commit), so a backlog is delivered at once, not at the next poll.
CREATE FUNCTION kombu_pgmq.resume(kombu_queue text) RETURNS SETOF text
LANGUAGE plpgsql AS $$
DECLARE
    q text;
BEGIN
    IF NOT EXISTS (SELECT 1 FROM kombu_pgmq.queues k WHERE k.queue = kombu_queue) THEN
        RAISE EXCEPTION 'kombu_pgmq: queue "%" is not declared (see kombu-pgmq queues)',
            kombu_queue USING ERRCODE = 'undefined_table';
    END IF;
    FOR q IN DELETE FROM kombu_pgmq.paused p WHERE p.queue = kombu_queue
             RETURNING p.pgmq_queue LOOP
        PERFORM pg_notify('kombu_pgmq.' || q, '');
        RETURN NEXT q;
    END LOOP;
END
$$;

-- Ack and read in one round trip: migration 0011's function, reading nothing from paused
-- queues (one probe of an empty table when nothing is paused).
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
        -- An ack in a FIFO queue frees its group's next message, which no publish
        -- announces: wake the consumers waiting on that queue (at commit).
        FOR q IN SELECT DISTINCT w.pgmq_queue FROM kombu_pgmq.waiting w
                 WHERE w.pgmq_queue = ANY(fifo_queues) AND w.pgmq_queue = ANY(ack_queues) LOOP
            PERFORM pg_notify('kombu_pgmq.' || q, '');
        END LOOP;
    END IF;
    IF EXISTS (SELECT 1 FROM kombu_pgmq.paused) THEN
        queues := ARRAY(SELECT u FROM unnest(queues) WITH ORDINALITY AS t(u, i)
                        WHERE NOT EXISTS (SELECT 1 FROM kombu_pgmq.paused p
                                          WHERE p.pgmq_queue = t.u)
                        ORDER BY t.i);
    END IF;
    FOREACH q IN ARRAY queues LOOP
        EXIT WHEN remaining <= 0;
        IF q = ANY(fifo_queues) THEN
            RETURN QUERY
                SELECT q, r.msg_id, r.read_ct, r.enqueued_at, r.message::text, r.headers::text,
                       extract(epoch FROM clock_timestamp() - r.enqueued_at)::float8
                FROM kombu_pgmq.read_grouped(q, vt, remaining) AS r ORDER BY r.msg_id;
        ELSE
            RETURN QUERY
                SELECT q, r.msg_id, r.read_ct, r.enqueued_at, r.message::text, r.headers::text,
                       extract(epoch FROM clock_timestamp() - r.enqueued_at)::float8
                FROM pgmq.read(q, vt, remaining) AS r;
        END IF;
        GET DIAGNOSTICS n = ROW_COUNT;
        remaining := remaining - n;
    END LOOP;
END
$$;

-- basic_get with no_ack (migration 0010's pop): nothing from a paused queue.
CREATE OR REPLACE FUNCTION kombu_pgmq.pop(pgmq_name text, qty integer)
RETURNS TABLE (
    queue text, msg_id bigint, read_ct integer, enqueued_at timestamptz, message text,
    headers text, age_seconds double precision
)
LANGUAGE sql AS $$
    SELECT pgmq_name, r.msg_id, r.read_ct, r.enqueued_at, r.message::text, r.headers::text,
           extract(epoch FROM clock_timestamp() - r.enqueued_at)::float8
    FROM pgmq.pop(pgmq_name,
                  CASE WHEN EXISTS (SELECT 1 FROM kombu_pgmq.paused p
                                    WHERE p.pgmq_queue = pgmq_name) THEN 0 ELSE qty END) AS r
$$;

-- -- where each PGMQ queue belongs ----------------------------------------------------------

-- Every PGMQ queue with its Kombu queue and priority band floor (a PGMQ queue kombu_pgmq
-- did not declare, e.g. made with pgmq.create, is its own Kombu queue, band 0).
CREATE FUNCTION kombu_pgmq.queue_map()
RETURNS TABLE (pgmq_queue text, queue text, band integer)
LANGUAGE sql STABLE AS $$
    SELECT m.queue_name, coalesce(b.queue, m.queue_name), coalesce(b.band, 0)
    FROM pgmq.meta m
    LEFT JOIN (
        SELECT k.queue, u.name, coalesce(k.priority_bands[u.ord], 0)::integer AS band
        FROM kombu_pgmq.queues k,
             unnest(coalesce(k.band_queues, ARRAY[k.pgmq_queue])) WITH ORDINALITY AS u(name, ord)
    ) b ON b.name = m.queue_name
    ORDER BY 2, 3
$$;

-- -- statistics ----------------------------------------------------------------------------

-- One row per PGMQ queue (priority band; sum them per Kombu queue):
--   ready       visible now (vt <= now): AMQP's message_count
--   in_flight   delivered and held by a consumer's visibility timeout (read_ct > 0)
--   delayed     not visible yet and never delivered (countdown/ETA, x-delay)
--   oldest_age_seconds  age since publish of the oldest ready or in-flight message (NULL:
--               none; delayed messages are not due yet, as SQS ApproximateAgeOfOldestMessage
--               leaves out delay-queue messages)
--   archived    rows of the archive (acked messages); above exact_archive_below rows the
--               planner's estimate (pg_class.reltuples), archived_estimated true
--   consumers   live consumers of the Kombu queue (heartbeat within stale_after)
--   dead_letters messages of dead_letter_queue that came from this Kombu queue
--   paused      kombu-pgmq queue pause
-- One statement for every queue (the counts are one scan of each queue table); never
-- waits more than 200 ms for a lock, and a queue dropped meanwhile is left out.
CREATE FUNCTION kombu_pgmq.queue_stats(
    dead_letter_queue text DEFAULT 'kombu_pgmq_dlq', exact_archive_below bigint DEFAULT 100000
) RETURNS TABLE (
    queue text, pgmq_queue text, band integer, ready bigint, in_flight bigint, delayed bigint,
    oldest_age_seconds double precision, archived bigint, archived_estimated boolean,
    consumers bigint, dead_letters bigint, paused boolean
)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    t0 timestamptz := clock_timestamp();
    dead jsonb := '{}';
    live jsonb;
    stopped text[];
    r record;
    estimate real;
BEGIN
    PERFORM set_config('lock_timeout', '200ms', true);
    IF to_regclass(format('pgmq.%I', 'q_' || dead_letter_queue)) IS NOT NULL THEN
        BEGIN
            EXECUTE format(
                'SELECT coalesce(jsonb_object_agg(s.q, s.n), ''{}'')
                 FROM (SELECT headers -> ''x-dead-letter'' ->> ''queue'' AS q, count(*) AS n
                       FROM pgmq.%I WHERE headers ? ''x-dead-letter'' GROUP BY 1) s
                 WHERE s.q IS NOT NULL', 'q_' || dead_letter_queue) INTO dead;
        EXCEPTION WHEN undefined_table OR lock_not_available THEN
            dead := '{}';
        END;
    END IF;
    SELECT coalesce(jsonb_object_agg(c.queue, c.n), '{}') INTO live
    FROM (SELECT c.queue, count(*) AS n FROM kombu_pgmq.consumers c
          WHERE c.heartbeat_at > t0 - make_interval(secs => c.stale_after_seconds)
          GROUP BY c.queue) c;
    stopped := ARRAY(SELECT p.pgmq_queue FROM kombu_pgmq.paused p);
    FOR r IN SELECT * FROM kombu_pgmq.queue_map() LOOP
        queue := r.queue;
        pgmq_queue := r.pgmq_queue;
        band := r.band;
        BEGIN
            EXECUTE format(
                'SELECT count(*) FILTER (WHERE vt <= $1),
                        count(*) FILTER (WHERE vt > $1 AND read_ct > 0),
                        count(*) FILTER (WHERE vt > $1 AND read_ct = 0),
                        extract(epoch FROM $1 - min(enqueued_at)
                                FILTER (WHERE vt <= $1 OR read_ct > 0))::float8
                 FROM pgmq.%I', 'q_' || r.pgmq_queue)
            INTO ready, in_flight, delayed, oldest_age_seconds USING t0;
        EXCEPTION WHEN undefined_table OR lock_not_available THEN
            CONTINUE;
        END;
        archived := 0;
        archived_estimated := false;
        estimate := NULL;
        SELECT c.reltuples INTO estimate FROM pg_class c
        WHERE c.oid = to_regclass(format('pgmq.%I', 'a_' || r.pgmq_queue));
        IF estimate IS NOT NULL AND estimate >= exact_archive_below THEN
            archived := estimate::bigint;
            archived_estimated := true;
        ELSIF to_regclass(format('pgmq.%I', 'a_' || r.pgmq_queue)) IS NOT NULL THEN
            BEGIN
                EXECUTE format('SELECT count(*) FROM pgmq.%I', 'a_' || r.pgmq_queue)
                INTO archived;
            EXCEPTION WHEN undefined_table OR lock_not_available THEN
                archived := NULL;
            END;
        END IF;
        consumers := coalesce((live ->> r.queue)::bigint, 0);
        dead_letters := coalesce((dead ->> r.queue)::bigint, 0);
        paused := r.pgmq_queue = ANY(stopped);
        RETURN NEXT;
    END LOOP;
END
$$;

-- -- Celery tasks by id --------------------------------------------------------------------

-- Where a Celery task's messages are (protocol 2: the "id" header): in a queue (state
-- ready, in_flight or delayed) or, with archives, in an archive (state archived; reason
-- from the x-archive-reason header, e.g. cancelled). Scans every queue table (and every
-- archive): an operator's lookup, not a hot path.
CREATE FUNCTION kombu_pgmq.find_task(task_id text, archives boolean DEFAULT true)
RETURNS TABLE (
    queue text, pgmq_queue text, state text, msg_id bigint, read_ct integer,
    enqueued_at timestamptz, visible_at timestamptz, archived_at timestamptz, reason text,
    headers text
)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    r record;
BEGIN
    PERFORM set_config('lock_timeout', '1s', true);
    FOR r IN SELECT * FROM kombu_pgmq.queue_map() LOOP
        BEGIN
            RETURN QUERY EXECUTE format(
                'SELECT %L::text, %L::text,
                        CASE WHEN t.vt <= clock_timestamp() THEN ''ready''
                             WHEN t.read_ct > 0 THEN ''in_flight'' ELSE ''delayed'' END,
                        t.msg_id, t.read_ct, t.enqueued_at, t.vt, NULL::timestamptz,
                        t.headers -> ''x-dead-letter'' ->> ''reason'', t.headers::text
                 FROM pgmq.%I t WHERE t.headers ->> ''id'' = $1',
                r.queue, r.pgmq_queue, 'q_' || r.pgmq_queue) USING task_id;
            IF archives AND to_regclass(format('pgmq.%I', 'a_' || r.pgmq_queue)) IS NOT NULL THEN
                RETURN QUERY EXECUTE format(
                    'SELECT %L::text, %L::text, ''archived''::text, t.msg_id, t.read_ct,
                            t.enqueued_at, t.vt, t.archived_at,
                            t.headers ->> ''x-archive-reason'', t.headers::text
                     FROM pgmq.%I t WHERE t.headers ->> ''id'' = $1',
                    r.queue, r.pgmq_queue, 'a_' || r.pgmq_queue) USING task_id;
            END IF;
        EXCEPTION WHEN undefined_table OR lock_not_available THEN
            NULL;
        END;
    END LOOP;
END
$$;

-- A durable revoke: remove a Celery task's messages that no consumer holds (ready,
-- delayed, or whose lease lapsed) from every queue and archive them with the headers
-- x-archive-reason "cancelled", x-cancelled-at and x-cancelled-by. A message being read
-- concurrently is skipped (SKIP LOCKED) and, once delivered, is no longer cancellable:
-- the caller revokes it through Celery's control then. Returns what was cancelled.
CREATE FUNCTION kombu_pgmq.cancel_task(task_id text)
RETURNS TABLE (queue text, pgmq_queue text, msg_id bigint)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    r record;
    cols text;
    marks jsonb := jsonb_build_object('x-archive-reason', 'cancelled',
                                      'x-cancelled-at', clock_timestamp(),
                                      'x-cancelled-by', session_user);
BEGIN
    FOR r IN SELECT * FROM kombu_pgmq.queue_map() LOOP
        CONTINUE WHEN to_regclass(format('pgmq.%I', 'q_' || r.pgmq_queue)) IS NULL
                   OR to_regclass(format('pgmq.%I', 'a_' || r.pgmq_queue)) IS NULL;
        cols := 'msg_id, read_ct, enqueued_at, vt, message';
        IF EXISTS (SELECT 1 FROM pg_attribute
                   WHERE attrelid = format('pgmq.%I', 'a_' || r.pgmq_queue)::regclass
                     AND attname = 'last_read_at' AND NOT attisdropped) THEN
            cols := cols || ', last_read_at';
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
             )
             SELECT %4$L::text, %5$L::text, moved.msg_id FROM moved',
            'q_' || r.pgmq_queue, 'a_' || r.pgmq_queue, cols, r.queue, r.pgmq_queue
        ) USING task_id, marks;
    END LOOP;
END
$$;

-- -- peek ------------------------------------------------------------------------------------

-- Up to qty messages of a Kombu queue without consuming them (no visibility change, no
-- read_ct): higher priority bands first, then publish order. Raises undefined_table for
-- an unknown queue.
CREATE FUNCTION kombu_pgmq.peek(kombu_queue text, qty integer DEFAULT 20)
RETURNS TABLE (
    pgmq_queue text, band integer, state text, msg_id bigint, read_ct integer,
    enqueued_at timestamptz, visible_at timestamptz, message text, headers text
)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    r record;
    found_queue boolean := false;
BEGIN
    FOR r IN SELECT * FROM kombu_pgmq.queue_map() m WHERE m.queue = kombu_queue
             ORDER BY m.band DESC LOOP
        found_queue := true;
        RETURN QUERY EXECUTE format(
            'SELECT %L::text, %s::integer,
                    CASE WHEN t.vt <= clock_timestamp() THEN ''ready''
                         WHEN t.read_ct > 0 THEN ''in_flight'' ELSE ''delayed'' END,
                    t.msg_id, t.read_ct, t.enqueued_at, t.vt, t.message::text, t.headers::text
             FROM pgmq.%I t ORDER BY t.msg_id LIMIT $1',
            r.pgmq_queue, r.band, 'q_' || r.pgmq_queue) USING qty;
    END LOOP;
    IF NOT found_queue THEN
        RAISE EXCEPTION 'kombu_pgmq: queue "%" does not exist (see kombu-pgmq queues)',
            kombu_queue USING ERRCODE = 'undefined_table';
    END IF;
END
$$;

-- -- grants -------------------------------------------------------------------------------

-- Statistics: every granted role (a metrics exporter may run as a producer role); the
-- steering functions: the owner's (operators run kombu-pgmq as the owner).
INSERT INTO kombu_pgmq.grantable (function, kind, definer) VALUES
    ('kombu_pgmq.queue_stats(text, bigint)', 'producer', true),
    ('kombu_pgmq.queue_map()', 'owner', true),
    ('kombu_pgmq.pause(text)', 'owner', true),
    ('kombu_pgmq.resume(text)', 'owner', true),
    ('kombu_pgmq.find_task(text, boolean)', 'owner', true),
    ('kombu_pgmq.cancel_task(text)', 'owner', true),
    ('kombu_pgmq.peek(text, integer)', 'owner', true);
SELECT kombu_pgmq.secure_functions();
