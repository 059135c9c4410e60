-- The roles are exactly what the README's least-privilege table says, and every window a
-- caller sets is capped (issue 25, item 6). A second audit found:
-- * a worker role could read, drain and purge the dead-letter queue through the generic
--   functions (kombu_pgmq.read / pop / purge on kombu_pgmq_dlq), though the dead-letter
--   queue is the owner's (kombu-pgmq dlq list|replay|purge);
-- * a producer role created queues through kombu_pgmq.send_task(..., 'new_queue'),
--   though creating queues is a worker's or the owner's;
-- * a producer made deduplication claims lasting until the year 33715
--   (publish(..., 1e12)); a worker could hide a message for 68 years with a visibility
--   timeout of 2^31 - 1 seconds, make a lock wait that holds every publisher of a queue,
--   or keep a consumer (and its auto_delete queue) alive forever with its stale_after.
--
-- Who the caller is: the functions run as their owner (SECURITY DEFINER), so they judge
-- the session's role (session_user, which SECURITY DEFINER does not change): a role that
-- may itself read a dead-letter queue's table (the owner, a superuser) or call
-- declare_queue (a worker, the owner) may do the same through these functions.

-- -- dead-letter queues ----------------------------------------------------------------------

-- A queue that dead letters are moved into (kombu_pgmq.dead_letter marks its target; the
-- default name is marked here): only roles that may read its table themselves read,
-- pop or purge it through kombu_pgmq's functions.
ALTER TABLE kombu_pgmq.queues ADD COLUMN dead_letter boolean NOT NULL DEFAULT false;
UPDATE kombu_pgmq.queues SET dead_letter = true WHERE queue = 'kombu_pgmq_dlq';
CREATE INDEX queues_dead_letter_idx ON kombu_pgmq.queues (pgmq_queue) WHERE dead_letter;

-- Raise insufficient_privilege if any of these PGMQ queues is a dead-letter queue whose
-- table the session's role may not `privilege` (SELECT: read, pop; DELETE: purge)
-- itself. One probe of a partial index when none is.
CREATE FUNCTION kombu_pgmq.guard_dead_letters(pgmq_names text[], privilege text)
RETURNS void
LANGUAGE plpgsql STABLE AS $$
DECLARE
    q text;
BEGIN
    FOR q IN SELECT k.pgmq_queue FROM kombu_pgmq.queues k
             WHERE k.dead_letter AND k.pgmq_queue = ANY(pgmq_names) LOOP
        IF NOT has_table_privilege(session_user, format('pgmq.%I', 'q_' || q), privilege) THEN
            RAISE EXCEPTION 'kombu_pgmq: % is a dead-letter queue: role % may not read or purge it (the schema owner does: kombu-pgmq dlq list|replay|purge)',
                q, session_user USING ERRCODE = 'insufficient_privilege';
        END IF;
    END LOOP;
END
$$;

-- -- windows -------------------------------------------------------------------------------

-- Raise invalid_parameter_value unless 0 <= value <= maximum (NaN fails too).
CREATE FUNCTION kombu_pgmq.check_window(what text, value double precision,
                                        maximum double precision)
RETURNS void
LANGUAGE plpgsql IMMUTABLE AS $$
BEGIN
    IF value IS NULL OR NOT (value >= 0 AND value <= maximum) THEN
        RAISE EXCEPTION 'kombu_pgmq: % must be between 0 and %, not %', what, maximum, value
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
END
$$;

-- Deduplication claims (migration 0011's function): the window is at most 7 days.
CREATE OR REPLACE FUNCTION kombu_pgmq.claim_deduplication(
    kombu_queue text, dedup_id text, window_seconds double precision
) RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    until timestamptz;
BEGIN
    PERFORM kombu_pgmq.check_window('deduplication_window (seconds)', window_seconds, 604800);
    until := clock_timestamp() + make_interval(secs => window_seconds);
    INSERT INTO kombu_pgmq.deduplication (queue, deduplication_id, expires_at)
    VALUES (kombu_queue, dedup_id, until)
    ON CONFLICT (queue, deduplication_id) DO NOTHING;
    IF FOUND THEN
        RETURN true;
    END IF;
    UPDATE kombu_pgmq.deduplication d SET expires_at = until
    WHERE d.queue = kombu_queue AND d.deduplication_id = dedup_id
      AND d.expires_at < clock_timestamp();
    RETURN FOUND;
END
$$;

-- Claims made before this migration with a longer window end within 7 days from now.
UPDATE kombu_pgmq.deduplication
SET expires_at = clock_timestamp() + interval '7 days'
WHERE expires_at > clock_timestamp() + interval '7 days';

-- A consumer counts as gone at most a day after its last heartbeat.
UPDATE kombu_pgmq.consumers SET stale_after_seconds = 86400 WHERE stale_after_seconds > 86400;
ALTER TABLE kombu_pgmq.consumers ADD CONSTRAINT consumers_stale_after_capped
    CHECK (stale_after_seconds > 0 AND stale_after_seconds <= 86400);

-- Going to sleep (migration 0006's function): the wait for publishers still in their
-- transaction is at most 1 s (an exclusive lock request queued behind a long
-- transaction makes every later publisher of the queue wait too).
CREATE OR REPLACE FUNCTION kombu_pgmq.wait_for(owner text, queues text[], max_wait_ms integer DEFAULT 50)
RETURNS SETOF text
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    q text;
BEGIN
    PERFORM kombu_pgmq.check_window('max_wait_ms', max_wait_ms, 1000);
    PERFORM set_config('synchronous_commit', 'off', true);
    INSERT INTO kombu_pgmq.waiting (pgmq_queue, owner)
    SELECT DISTINCT u, wait_for.owner FROM unnest(queues) AS u
    ON CONFLICT (pgmq_queue, owner) DO UPDATE SET since = clock_timestamp();
    PERFORM set_config('lock_timeout', max_wait_ms || 'ms', true);
    FOR q IN SELECT DISTINCT u FROM unnest(queues) AS u ORDER BY u LOOP
        BEGIN
            PERFORM pg_advisory_xact_lock(1802530161, hashtext(q));
        EXCEPTION WHEN lock_not_available THEN
            RETURN NEXT q;
        END;
    END LOOP;
END
$$;

-- Requeue and lease renewal (migration 0015's function): the visibility timeout is at most
-- 12 hours (SQS's maximum).
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
    END LOOP;
END
$$;

-- Ack and read (migration 0012's function): the visibility timeout is at most 12 hours;
-- dead-letter queues only for the roles that may read them.
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
    PERFORM kombu_pgmq.check_window('visibility timeout (seconds)', vt, 43200);
    PERFORM kombu_pgmq.guard_dead_letters(queues, 'SELECT');
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

-- basic_get with no_ack (migration 0012's function): not from a dead-letter queue.
CREATE OR REPLACE FUNCTION kombu_pgmq.pop(pgmq_name text, qty integer)
RETURNS TABLE (
    queue text, msg_id bigint, read_ct integer, enqueued_at timestamptz, message text,
    headers text, age_seconds double precision
)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
BEGIN
    PERFORM kombu_pgmq.guard_dead_letters(ARRAY[pgmq_name], 'SELECT');
    RETURN QUERY
        SELECT pgmq_name, r.msg_id, r.read_ct, r.enqueued_at, r.message::text,
               r.headers::text, extract(epoch FROM clock_timestamp() - r.enqueued_at)::float8
        FROM pgmq.pop(pgmq_name,
                      CASE WHEN EXISTS (SELECT 1 FROM kombu_pgmq.paused p
                                        WHERE p.pgmq_queue = pgmq_name) THEN 0
                           ELSE qty END) AS r;
END
$$;

-- AMQP purge (migration 0010's function): not of a dead-letter queue.
CREATE OR REPLACE FUNCTION kombu_pgmq.purge(pgmq_name text) RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    n bigint;
BEGIN
    PERFORM kombu_pgmq.guard_dead_letters(ARRAY[pgmq_name], 'DELETE');
    EXECUTE format('WITH purged AS (DELETE FROM pgmq.%I WHERE vt <= clock_timestamp()
                                    RETURNING 1)
                    SELECT count(*) FROM purged', 'q_' || pgmq_name)
    INTO n;
    RETURN n;
END
$$;

-- Dead-lettering (migration 0010's function): the target is marked a dead-letter queue.
CREATE OR REPLACE FUNCTION kombu_pgmq.dead_letter(
    pgmq_name text, msg_ids bigint[], read_cts integer[], enqueued timestamptz[],
    error_texts text[], dead_letter_queue text, reason text, kombu_queue text
) RETURNS SETOF bigint
LANGUAGE plpgsql AS $$
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
END
$$;

-- -- creating queues -----------------------------------------------------------------------

-- The PGMQ queue of a Kombu queue's message of this priority (migration 0011's function,
-- behind send_task): a queue not declared yet is created only if the session's role may
-- declare queues itself (a worker, the owner); a producer gets insufficient_privilege.
CREATE OR REPLACE FUNCTION kombu_pgmq.queue_for(kombu_queue text, priority integer DEFAULT 0)
RETURNS text
LANGUAGE plpgsql AS $$
DECLARE
    q kombu_pgmq.queues;
    i integer;
BEGIN
    SELECT * INTO q FROM kombu_pgmq.queues WHERE queue = kombu_queue;
    IF NOT FOUND THEN
        IF kombu_queue ~ '^[a-z0-9_]{1,47}$' AND position('__' IN kombu_queue) = 0 THEN
            IF NOT has_function_privilege(
                session_user,
                'kombu_pgmq.declare_queue(text, text, boolean, boolean, bigint, bigint, smallint, smallint[], text[], boolean, boolean)',
                'EXECUTE') THEN
                RAISE EXCEPTION 'kombu_pgmq: queue % is not declared and role % may not create queues: a worker declares it when it starts consuming it (or the schema owner, kombu-pgmq schema grant worker)',
                    kombu_queue, session_user USING ERRCODE = 'insufficient_privilege';
            END IF;
            SELECT * INTO q FROM kombu_pgmq.declare_queue(kombu_queue, kombu_queue, true, false,
                                                          NULL, NULL, NULL, NULL, NULL);
        ELSE
            RETURN NULL;
        END IF;
    END IF;
    IF q.priority_bands IS NULL OR q.band_queues IS NULL OR coalesce(priority, 0) <= 0 THEN
        RETURN q.pgmq_queue;
    END IF;
    FOR i IN REVERSE cardinality(q.priority_bands) .. 1 LOOP
        IF q.priority_bands[i] <= priority THEN
            RETURN q.band_queues[i];
        END IF;
    END LOOP;
    RETURN q.pgmq_queue;
END
$$;

INSERT INTO kombu_pgmq.grantable (function, kind, definer) VALUES
    ('kombu_pgmq.guard_dead_letters(text[], text)', 'owner', true),
    ('kombu_pgmq.check_window(text, double precision, double precision)', 'owner', false);
SELECT kombu_pgmq.secure_functions();
