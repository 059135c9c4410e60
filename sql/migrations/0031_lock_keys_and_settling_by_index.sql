-- One definition per advisory lock key: each class of the two-integer keys the functions
-- take (and the beat leader's object) is an IMMUTABLE SQL function, folded into a
-- constant by the planner where it is called; the functions that took a literal call it
-- now (the values are the same: locks held across the upgrade keep their meaning). A
-- queue's send function keeps its key as a literal, written in from lock_key_publish()
-- when queue_functions makes it, so the functions of existing queues stay as they are.
--
-- The functions that settle by receipt with a statement planned at each call (EXECUTE):
-- requeue (and lease renewal through it), discard and dead_letter, run with
-- enable_seqscan off, as the queues' read and ack functions do. After a VACUUM behind a
-- held snapshot removes nothing, an ANALYZE records the few live rows of a table of many
-- pages, and the planner then scanned the whole table for the receipts' msg_ids, where
-- the primary key finds them.
--
-- Comments in set_queue_limits and commit_write state what their code does.

CREATE FUNCTION kombu_pgmq.lock_key_publish() RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$ SELECT 1802530161 $$;

CREATE FUNCTION kombu_pgmq.lock_key_sequence() RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$ SELECT 1802530163 $$;

CREATE FUNCTION kombu_pgmq.lock_key_beat() RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$ SELECT 1802530166 $$;

CREATE FUNCTION kombu_pgmq.lock_key_beat_leader() RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$ SELECT 1650811252 $$;

CREATE FUNCTION kombu_pgmq.lock_key_queue_functions() RETURNS integer
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$ SELECT 1802530167 $$;

INSERT INTO kombu_pgmq.grantable (function, kind, definer) VALUES
    ('kombu_pgmq.lock_key_beat()', 'owner', false),
    ('kombu_pgmq.lock_key_beat_leader()', 'owner', false),
    ('kombu_pgmq.lock_key_publish()', 'owner', false),
    ('kombu_pgmq.lock_key_queue_functions()', 'owner', false),
    ('kombu_pgmq.lock_key_sequence()', 'owner', false);

CREATE OR REPLACE FUNCTION kombu_pgmq.wait_for(owner text, queues text[], max_wait_ms integer DEFAULT 50)
RETURNS SETOF text
LANGUAGE plpgsql
SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
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
            PERFORM pg_advisory_xact_lock(kombu_pgmq.lock_key_publish(), hashtext(q));
        EXCEPTION WHEN lock_not_available THEN
            RETURN NEXT q;
        END;
    END LOOP;
END
$$;

CREATE OR REPLACE FUNCTION kombu_pgmq.publish(
    queue text, message jsonb, headers jsonb, delay_seconds integer DEFAULT 0,
    deduplication_window double precision DEFAULT 300
) RETURNS bigint
LANGUAGE plpgsql
SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    sent bigint;
    dedup record;
BEGIN
    SELECT * INTO dedup FROM kombu_pgmq.deduplication_of(queue, headers);
    IF dedup.dedup_id IS NOT NULL
       AND NOT kombu_pgmq.claim_deduplication(dedup.scope, dedup.dedup_id, deduplication_window) THEN
        RETURN NULL;
    END IF;
    PERFORM pg_advisory_xact_lock_shared(kombu_pgmq.lock_key_publish(), hashtext(queue));
    sent := pgmq.send(queue, message, headers, delay_seconds);
    PERFORM kombu_pgmq.wake_due(queue, CASE WHEN delay_seconds > 0 THEN
        clock_timestamp() + make_interval(secs => delay_seconds) END);
    RETURN sent;
END
$$;

CREATE OR REPLACE FUNCTION kombu_pgmq.send_to(
    queues text[], message jsonb, headers jsonb, delay_seconds integer DEFAULT 0,
    deduplication_window double precision DEFAULT 300
) RETURNS bigint[]
LANGUAGE plpgsql
SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    q text;
    dedup record;
    duplicate text[] := '{}';
    msg_ids bigint[] := '{}';
BEGIN
    FOR q IN SELECT DISTINCT u FROM unnest(queues) AS u ORDER BY u LOOP
        PERFORM pg_advisory_xact_lock_shared(kombu_pgmq.lock_key_publish(), hashtext(q));
    END LOOP;
    FOR q IN SELECT DISTINCT u FROM unnest(queues) AS u ORDER BY u LOOP
        SELECT * INTO dedup FROM kombu_pgmq.deduplication_of(q, headers);
        IF dedup.dedup_id IS NOT NULL
           AND NOT kombu_pgmq.claim_deduplication(dedup.scope, dedup.dedup_id,
                                                  deduplication_window) THEN
            duplicate := duplicate || q;
        END IF;
    END LOOP;
    FOREACH q IN ARRAY queues LOOP
        IF q = ANY(duplicate) THEN
            msg_ids := msg_ids || NULL::bigint;
        ELSE
            msg_ids := msg_ids || pgmq.send(q, message, headers, greatest(delay_seconds, 0));
        END IF;
    END LOOP;
    FOR q IN SELECT DISTINCT u FROM unnest(queues) AS u
             WHERE NOT u = ANY(duplicate) ORDER BY u LOOP
        PERFORM kombu_pgmq.wake_due(q, CASE WHEN delay_seconds > 0 THEN
            clock_timestamp() + make_interval(secs => delay_seconds) END);
    END LOOP;
    RETURN msg_ids;
END
$$;

CREATE OR REPLACE FUNCTION kombu_pgmq.publish_many(batch jsonb, expected_version bigint)
RETURNS boolean
LANGUAGE plpgsql
SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    item jsonb;
    q text;
    dedup record;
    visible timestamptz;
    delay integer;
    woken text[] := '{}';
    dues timestamptz[] := '{}';
    due timestamptz;
BEGIN
    IF expected_version IS NOT NULL AND expected_version IS DISTINCT FROM
            (SELECT v.version FROM kombu_pgmq.routing_version v) THEN
        RETURN false;
    END IF;
    PERFORM pg_advisory_xact_lock_shared(kombu_pgmq.lock_key_publish(), hashtext(x.q))
    FROM (SELECT DISTINCT jsonb_array_elements_text(e->'queues') AS q
          FROM jsonb_array_elements(batch) e ORDER BY 1) x;
    FOR item IN SELECT e FROM jsonb_array_elements(batch) e LOOP
        visible := (item->>'visible_at')::timestamptz;
        delay := greatest(coalesce((item->>'delay_seconds')::integer, 0), 0);
        IF visible IS NULL AND delay > 0 THEN
            visible := clock_timestamp() + make_interval(secs => delay);
        ELSIF visible <= clock_timestamp() THEN
            visible := NULL;
        END IF;
        FOR q IN SELECT jsonb_array_elements_text(item->'queues') LOOP
            SELECT * INTO dedup FROM kombu_pgmq.deduplication_of(q, item->'headers');
            CONTINUE WHEN dedup.dedup_id IS NOT NULL
                AND NOT kombu_pgmq.claim_deduplication(dedup.scope, dedup.dedup_id,
                    coalesce((item->>'deduplication_window')::float8, 300));
            IF visible IS NULL THEN
                PERFORM pgmq.send(q, item->'message', item->'headers', 0);
            ELSE
                PERFORM pgmq.send(q, item->'message', item->'headers', visible);
            END IF;
            woken := woken || q;
            dues := dues || visible;
        END LOOP;
    END LOOP;
    FOR q, due IN
        SELECT w.q, CASE WHEN bool_or(w.due IS NULL) THEN NULL ELSE min(w.due) END
        FROM unnest(woken, dues) AS w(q, due) GROUP BY w.q ORDER BY w.q
    LOOP
        PERFORM kombu_pgmq.wake_due(q, due);
    END LOOP;
    RETURN true;
END
$$;

CREATE OR REPLACE FUNCTION kombu_pgmq.archive_under_new_id(
    pgmq_name text, queue_msg_id bigint, read_ct integer, enqueued_at timestamptz,
    vt timestamptz, message jsonb, headers jsonb, last_read_at timestamptz DEFAULT NULL,
    extra_headers jsonb DEFAULT '{}'
) RETURNS bigint
LANGUAGE plpgsql
SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    seq regclass := pg_get_serial_sequence(format('pgmq.%I', 'q_' || pgmq_name), 'msg_id');
    top bigint;
    new_id bigint;
    marked jsonb := headers;
    stamp boolean;
BEGIN
    PERFORM pg_advisory_xact_lock(kombu_pgmq.lock_key_sequence(), hashtext(pgmq_name));
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

CREATE OR REPLACE FUNCTION kombu_pgmq.send_template() RETURNS text
LANGUAGE sql IMMUTABLE AS $t$
SELECT $template$
CREATE OR REPLACE FUNCTION kombu_pgmq.%1$I(
    p_message jsonb, p_headers jsonb, p_delay_seconds integer DEFAULT 0,
    p_handoff text DEFAULT NULL, p_commit text DEFAULT NULL, p_version bigint DEFAULT NULL
) RETURNS TABLE (msg_id bigint, notified text, flush boolean)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $body$
#variable_conflict use_column
BEGIN
    RETURN QUERY
    WITH locked AS (
        SELECT pg_advisory_xact_lock_shared(%6$s, hashtext(%2$L))
        WHERE p_version IS NULL
           OR EXISTS (SELECT 1 FROM kombu_pgmq.routing_version v
                      WHERE v.version = p_version)
    ), handed AS MATERIALIZED (
        SELECT h.channel, h.vt_seconds
        FROM (SELECT p_handoff AS tail FROM locked
              WHERE p_handoff IS NOT NULL
                AND EXISTS (SELECT 1 FROM kombu_pgmq.waiting w
                            WHERE w.pgmq_queue = %2$L AND w.handoff_slots > 0)) AS offer,
             LATERAL kombu_pgmq.hand_off(%2$L, offer.tail) AS h
    ), sent AS (
        INSERT INTO %3$s (vt, message, headers, read_ct%4$s)
        SELECT CASE WHEN h.channel IS NULL
                    THEN clock_timestamp() + make_interval(secs => p_delay_seconds)
                    ELSE clock_timestamp() + make_interval(secs => h.vt_seconds) END,
               p_message, p_headers,
               CASE WHEN h.channel IS NULL THEN 0 ELSE 1 END%5$s
        FROM locked LEFT JOIN handed h ON true
        RETURNING msg_id, vt, enqueued_at
    )
    SELECT s.msg_id,
           CASE WHEN h.channel IS NULL
                THEN kombu_pgmq.notify_waiting(%2$L, CASE WHEN p_delay_seconds > 0
                                                          THEN s.vt END)::text
                ELSE pg_notify(h.channel,
                               %2$L || chr(30) || s.msg_id || chr(30)
                               || to_char(s.enqueued_at AT TIME ZONE 'UTC',
                                          'YYYY-MM-DD"T"HH24:MI:SS.US')
                               || chr(30) || p_handoff)::text
           END,
           CASE WHEN p_commit = 'async'  -- set_config returns 'off', never NULL
                THEN set_config('synchronous_commit', 'off', true) IS NULL
                WHEN p_commit = 'off'
                     AND (h.channel IS NOT NULL
                          OR (p_delay_seconds <= 0
                              AND EXISTS (SELECT 1 FROM kombu_pgmq.waiting w
                                          WHERE w.pgmq_queue = %2$L)))
                THEN set_config('synchronous_commit', 'off', true) = 'off'
                ELSE false
           END
    FROM sent s LEFT JOIN handed h ON true;
END
$body$
$template$
$t$;

CREATE OR REPLACE FUNCTION kombu_pgmq.queue_functions(q text, replace boolean DEFAULT false)
RETURNS void
LANGUAGE plpgsql
SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    ack_fn text := 'ack_q_' || q;
    read_fn text := 'read_q_' || q;
    send_fn text := 'send_q_' || q;
    touch boolean;
    queue_table text := format('pgmq.%I', 'q_' || q);
    archive_table text := format('pgmq.%I', 'a_' || q);
    cols text[];
    r kombu_pgmq.roles;
BEGIN
    IF NOT EXISTS (SELECT 1 FROM pgmq.meta m WHERE m.queue_name = q)
       OR to_regclass(queue_table) IS NULL OR to_regclass(archive_table) IS NULL THEN
        RAISE EXCEPTION 'kombu_pgmq: queue % does not exist (pgmq.meta, %)', q, queue_table
            USING ERRCODE = 'undefined_table';
    END IF;
    IF NOT replace AND kombu_pgmq.queue_functions_exist(q) THEN
        RETURN;
    END IF;
    PERFORM pg_advisory_xact_lock(kombu_pgmq.lock_key_queue_functions(), hashtext(q));
    IF NOT replace AND kombu_pgmq.queue_functions_exist(q) THEN
        RETURN;  -- created by the holder of the lock
    END IF;
    SELECT array_agg(c ORDER BY i) INTO cols
    FROM unnest(ARRAY['msg_id', 'read_ct', 'enqueued_at', 'last_read_at', 'vt', 'message',
                      'headers']) WITH ORDINALITY AS u(c, i)
    WHERE EXISTS (SELECT 1 FROM pg_attribute a
                  WHERE a.attrelid = queue_table::regclass AND a.attname = u.c
                    AND NOT a.attisdropped)
      AND EXISTS (SELECT 1 FROM pg_attribute a
                  WHERE a.attrelid = archive_table::regclass AND a.attname = u.c
                    AND NOT a.attisdropped);
    touch := EXISTS (SELECT 1 FROM pg_attribute a
                     WHERE a.attrelid = queue_table::regclass AND a.attname = 'last_read_at'
                       AND NOT a.attisdropped);
    EXECUTE format(kombu_pgmq.ack_template(), ack_fn, q,
                   kombu_pgmq.settle_fragment(q, cols, 'p_marks'));
    EXECUTE format(kombu_pgmq.read_template(), read_fn, ack_fn, q, queue_table,
                   CASE WHEN touch THEN ', last_read_at = clock_timestamp()' ELSE '' END,
                   kombu_pgmq.settle_fragment(q, cols, 'NULL::jsonb'));
    EXECUTE format(kombu_pgmq.send_template(), send_fn, q, queue_table,
                   CASE WHEN touch THEN ', last_read_at' ELSE '' END,
                   CASE WHEN touch
                        THEN ', CASE WHEN h.channel IS NULL THEN NULL ELSE clock_timestamp() END'
                        ELSE '' END,
                   kombu_pgmq.lock_key_publish());
    EXECUTE format('REVOKE EXECUTE ON FUNCTION kombu_pgmq.%I(bigint[], integer[], timestamptz[], boolean[], integer, jsonb, text, boolean) FROM PUBLIC', ack_fn);
    EXECUTE format('REVOKE EXECUTE ON FUNCTION kombu_pgmq.%I(integer, integer, bigint[], integer[], timestamptz[], boolean[], integer, text, float8, text[], float8[], boolean) FROM PUBLIC', read_fn);
    EXECUTE format('REVOKE EXECUTE ON FUNCTION kombu_pgmq.%I(jsonb, jsonb, integer, text, text, bigint) FROM PUBLIC', send_fn);
    FOR r IN SELECT * FROM kombu_pgmq.roles LOOP
        PERFORM kombu_pgmq.grant_queue_functions(q, r.role);
    END LOOP;
END
$$;

CREATE OR REPLACE FUNCTION kombu_pgmq.handoff_lease(lock_key bigint) RETURNS integer
LANGUAGE plpgsql
SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    n integer := 0;
BEGIN
    PERFORM pg_advisory_lock(lock_key);
    WHILE NOT pg_try_advisory_lock(kombu_pgmq.lock_key_sequence(), n) LOOP
        n := n + 1;
    END LOOP;
    IF to_regclass(format('kombu_pgmq.handoff_%s', n)) IS NULL THEN
        EXECUTE format('CREATE SEQUENCE IF NOT EXISTS kombu_pgmq.%I MINVALUE 0 START 1',
                       'handoff_' || n);
    END IF;
    RETURN n;
END
$$;

CREATE OR REPLACE FUNCTION kombu_pgmq.beat_lock_held() RETURNS boolean
LANGUAGE sql STABLE
SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    SELECT EXISTS (
        SELECT 1 FROM pg_catalog.pg_locks l
        WHERE l.locktype = 'advisory' AND l.classid = kombu_pgmq.lock_key_beat()
          AND l.objid = kombu_pgmq.lock_key_beat_leader()
          AND l.objsubid = 2 AND l.granted AND l.pid = pg_catalog.pg_backend_pid())
$$;

CREATE OR REPLACE FUNCTION kombu_pgmq.beat_elect(me text, stale_seconds double precision)
RETURNS TABLE (leader boolean, epoch bigint, leader_identity text, leader_pid integer,
               heartbeat_age double precision, deposed boolean)
LANGUAGE plpgsql
SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
#variable_conflict use_column
DECLARE
    held boolean := kombu_pgmq.beat_lock_held();
    r kombu_pgmq.beat_leader;
    ended boolean := false;
BEGIN
    IF held THEN
        UPDATE kombu_pgmq.beat_leader SET heartbeat_at = clock_timestamp()
        WHERE id = 1 AND backend_pid = pg_catalog.pg_backend_pid();
    ELSIF pg_catalog.pg_try_advisory_lock(kombu_pgmq.lock_key_beat(),
                                          kombu_pgmq.lock_key_beat_leader()) THEN
        held := true;
        INSERT INTO kombu_pgmq.beat_leader AS l
            (id, identity, backend_pid, epoch, since, heartbeat_at)
        VALUES (1, me, pg_catalog.pg_backend_pid(), 1, clock_timestamp(), clock_timestamp())
        ON CONFLICT (id) DO UPDATE
            SET identity = excluded.identity, backend_pid = excluded.backend_pid,
                epoch = l.epoch + 1, since = excluded.since,
                heartbeat_at = excluded.heartbeat_at;
    END IF;
    SELECT * INTO r FROM kombu_pgmq.beat_leader WHERE id = 1;
    IF NOT held AND r.heartbeat_at < clock_timestamp() - make_interval(secs => stale_seconds) THEN
        SELECT bool_or(pg_catalog.pg_terminate_backend(l.pid)) INTO ended
        FROM pg_catalog.pg_locks l
        WHERE l.locktype = 'advisory' AND l.classid = kombu_pgmq.lock_key_beat()
          AND l.objid = kombu_pgmq.lock_key_beat_leader()
          AND l.objsubid = 2 AND l.granted AND l.pid <> pg_catalog.pg_backend_pid();
        ended := coalesce(ended, false);
    END IF;
    RETURN QUERY SELECT held, r.epoch, r.identity, r.backend_pid,
        extract(epoch FROM clock_timestamp() - r.heartbeat_at)::double precision, ended;
END
$$;

CREATE OR REPLACE FUNCTION kombu_pgmq.beat_resign() RETURNS boolean
LANGUAGE plpgsql
SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    IF NOT kombu_pgmq.beat_lock_held() THEN
        RETURN false;
    END IF;
    UPDATE kombu_pgmq.beat_leader SET heartbeat_at = clock_timestamp()
    WHERE id = 1 AND backend_pid = pg_catalog.pg_backend_pid();
    RETURN pg_catalog.pg_advisory_unlock(kombu_pgmq.lock_key_beat(),
                                         kombu_pgmq.lock_key_beat_leader());
END
$$;

CREATE OR REPLACE FUNCTION kombu_pgmq.beat_leader_info()
RETURNS TABLE (identity text, backend_pid integer, epoch bigint, since timestamptz,
               heartbeat_at timestamptz, heartbeat_age double precision, alive boolean)
LANGUAGE sql STABLE
SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    SELECT l.identity, l.backend_pid, l.epoch, l.since, l.heartbeat_at,
           extract(epoch FROM clock_timestamp() - l.heartbeat_at)::double precision,
           EXISTS (SELECT 1 FROM pg_catalog.pg_locks k
                   WHERE k.locktype = 'advisory' AND k.classid = kombu_pgmq.lock_key_beat()
                     AND k.objid = kombu_pgmq.lock_key_beat_leader() AND k.objsubid = 2
                     AND k.granted AND k.pid = l.backend_pid)
    FROM kombu_pgmq.beat_leader l WHERE l.id = 1
$$;

CREATE OR REPLACE FUNCTION kombu_pgmq.commit_write(write_id text, attempts text[]) RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    w kombu_pgmq.spark_writes;
    committed bigint;
BEGIN
    UPDATE kombu_pgmq.spark_writes s SET state = 'committed', ended_at = clock_timestamp()
    WHERE s.write_id = commit_write.write_id AND s.state = 'open'
    RETURNING * INTO w;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'Spark write % is not open: it cannot commit', commit_write.write_id
            USING ERRCODE = 'object_not_in_prerequisite_state';
    END IF;
    -- The wake-up protocol of kombu_pgmq.publish: the queue's publish lock, shared.
    PERFORM pg_advisory_xact_lock_shared(kombu_pgmq.lock_key_publish(), hashtext(w.queue));
    EXECUTE format(
        'UPDATE pgmq.%I SET vt = clock_timestamp(), headers = headers - ''x-kombu-pgmq-write''
         WHERE msg_id > $1 AND headers ->> ''x-kombu-pgmq-write'' = ANY ($2)', 'q_' || w.queue)
    USING w.after_id, attempts;
    GET DIAGNOSTICS committed = ROW_COUNT;
    PERFORM kombu_pgmq.delete_staged(w);  -- what other (failed) attempts staged
    UPDATE kombu_pgmq.spark_writes s SET published = committed
    WHERE s.write_id = commit_write.write_id;
    IF committed > 0
       AND EXISTS (SELECT 1 FROM kombu_pgmq.waiting x WHERE x.pgmq_queue = w.queue) THEN
        PERFORM pg_notify('kombu_pgmq.' || w.queue, '');
    END IF;
    RETURN committed;
END
$$;

CREATE OR REPLACE FUNCTION kombu_pgmq.requeue(
    queues text[], msg_ids bigint[], read_cts integer[], enqueued timestamptz[],
    vt integer DEFAULT 0, uncount boolean DEFAULT false
) RETURNS TABLE (queue text, msg_id bigint)
LANGUAGE plpgsql SET enable_seqscan = off
SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
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

CREATE OR REPLACE FUNCTION kombu_pgmq.discard(
    pgmq_name text, msg_ids bigint[], read_cts integer[], enqueued timestamptz[]
) RETURNS SETOF bigint
LANGUAGE plpgsql SET enable_seqscan = off
SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
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

CREATE OR REPLACE FUNCTION kombu_pgmq.dead_letter(
    pgmq_name text, msg_ids bigint[], read_cts integer[], enqueued timestamptz[],
    error_texts text[], dead_letter_queue text, reason text, kombu_queue text
) RETURNS SETOF bigint
LANGUAGE plpgsql SET enable_seqscan = off
SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
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

CREATE OR REPLACE FUNCTION kombu_pgmq.set_queue_limits(
    kombu_queue text, limits jsonb, replace boolean DEFAULT false
) RETURNS SETOF kombu_pgmq.queue_limits
LANGUAGE plpgsql
SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
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
    IF q.fifo_groups THEN  -- a FIFO queue (x-fifo-groups): its groups as a key limit
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

SELECT kombu_pgmq.secure_functions();
