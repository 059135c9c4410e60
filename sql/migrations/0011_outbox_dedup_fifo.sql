-- Enqueue inside the application's transaction, from SQL, exactly once (issue 15):
-- deduplication ids, FIFO groups, and kombu_pgmq.send_task (a Celery task from SQL).
-- Also: which role may call which function is now data (kombu_pgmq.grantable), so a
-- migration that adds a function adds a row instead of rewriting apply_grants.

-- -- who may call what, as data ----------------------------------------------------------

-- Functions of kombu_pgmq by the least role that may call them: 'producer', 'worker'
-- (and so the worker's superset), or 'owner' (internal or the owner's own: granted to
-- nobody). definer: the function runs as its owner (SECURITY DEFINER, fixed search_path,
-- no PUBLIC execute; see migration 0010). Signatures as regprocedure text; a row whose
-- function no longer exists is skipped.
CREATE TABLE kombu_pgmq.grantable (
    function text PRIMARY KEY,
    kind text NOT NULL CHECK (kind IN ('producer', 'worker', 'owner')),
    definer boolean NOT NULL DEFAULT true
);

-- Make every definer function of kombu_pgmq.grantable run as its owner, with no PUBLIC
-- execute (idempotent; each migration that creates or replaces one runs it: CREATE OR
-- REPLACE FUNCTION resets SECURITY DEFINER and SET).
CREATE FUNCTION kombu_pgmq.secure_functions() RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    f regprocedure;
BEGIN
    FOR f IN SELECT to_regprocedure(g.function) FROM kombu_pgmq.grantable g
             WHERE g.definer AND to_regprocedure(g.function) IS NOT NULL LOOP
        EXECUTE format('ALTER FUNCTION %s SECURITY DEFINER SET search_path = pg_catalog, pg_temp', f);
        EXECUTE format('REVOKE EXECUTE ON FUNCTION %s FROM PUBLIC', f);
    END LOOP;
END
$$;

-- The privileges of every recorded role (only_role: just that one), from
-- kombu_pgmq.grantable (replaces migration 0010's list). Idempotent; returns the roles.
CREATE OR REPLACE FUNCTION kombu_pgmq.apply_grants(only_role text DEFAULT NULL)
RETURNS SETOF text
LANGUAGE plpgsql AS $$
DECLARE
    r kombu_pgmq.roles;
    f regprocedure;
BEGIN
    FOR r IN SELECT * FROM kombu_pgmq.roles
             WHERE only_role IS NULL OR role = only_role ORDER BY role LOOP
        -- A GRANT without the grant option only warns: say what is missing instead (the
        -- pgmq extension created by another role, e.g. a superuser, owns schema pgmq).
        IF NOT (has_schema_privilege('pgmq', 'USAGE WITH GRANT OPTION')
                AND has_table_privilege('pgmq.meta', 'SELECT WITH GRANT OPTION')) THEN
            RAISE EXCEPTION 'kombu_pgmq: role % cannot pass on USAGE on schema pgmq and SELECT on pgmq.meta (owned by %): as that role run GRANT USAGE ON SCHEMA pgmq TO % WITH GRANT OPTION; GRANT SELECT ON pgmq.meta TO % WITH GRANT OPTION',
                current_user,
                (SELECT pg_get_userbyid(nspowner) FROM pg_namespace WHERE nspname = 'pgmq'),
                quote_ident(current_user), quote_ident(current_user)
                USING ERRCODE = 'object_not_in_prerequisite_state';
        END IF;
        EXECUTE format('GRANT USAGE ON SCHEMA kombu_pgmq, pgmq TO %I', r.role);
        EXECUTE format(
            'GRANT SELECT ON kombu_pgmq.queues, kombu_pgmq.exchanges, kombu_pgmq.bindings,
                             kombu_pgmq.routing_version, kombu_pgmq.migrations,
                             kombu_pgmq.settings, pgmq.meta TO %I', r.role);
        FOR f IN SELECT to_regprocedure(g.function) FROM kombu_pgmq.grantable g
                 WHERE (g.kind = 'producer' OR (g.kind = 'worker' AND r.kind = 'worker'))
                   AND to_regprocedure(g.function) IS NOT NULL LOOP
            EXECUTE format('GRANT EXECUTE ON FUNCTION %s TO %I', f, r.role);
        END LOOP;
        IF r.kind = 'worker' THEN
            EXECUTE format(
                'GRANT SELECT, INSERT, UPDATE, DELETE ON kombu_pgmq.consumers,
                                                         kombu_pgmq.waiting TO %I', r.role);
            EXECUTE format('GRANT UPDATE (last_used_at, had_consumer) ON kombu_pgmq.queues TO %I',
                           r.role);
            EXECUTE format('GRANT INSERT ON kombu_pgmq.exchanges TO %I', r.role);
            EXECUTE format('GRANT INSERT, DELETE ON kombu_pgmq.bindings TO %I', r.role);
        END IF;
        RETURN NEXT r.role;
    END LOOP;
END
$$;

-- -- queue arguments ----------------------------------------------------------------------

-- x-fifo-groups: messages with the same x-group-id header are delivered one at a time, in
-- publish order (SQS FIFO's MessageGroupId); x-deduplicate-task-id: a Celery task id
-- counts as a deduplication id (SQS's content-based deduplication, keyed by task id).
ALTER TABLE kombu_pgmq.queues
    ADD COLUMN fifo_groups boolean NOT NULL DEFAULT false,
    ADD COLUMN deduplicate_task_id boolean NOT NULL DEFAULT false;

-- declare_queue gains the two arguments (the first declaration's stay, as the others).
DROP FUNCTION kombu_pgmq.declare_queue(text, text, boolean, boolean, bigint, bigint, smallint,
                                      smallint[], text[]);
CREATE FUNCTION kombu_pgmq.declare_queue(
    kombu_queue text, pgmq_name text, is_durable boolean, is_auto_delete boolean,
    expires_after_ms bigint, ttl_ms bigint, priority_max smallint, floors smallint[],
    band_names text[], is_fifo boolean DEFAULT false, dedup_task_id boolean DEFAULT false
) RETURNS SETOF kombu_pgmq.queues
LANGUAGE plpgsql AS $$
DECLARE
    stored kombu_pgmq.queues;
    band text;
BEGIN
    INSERT INTO kombu_pgmq.queues AS q
        (queue, pgmq_queue, durable, auto_delete, expires_ms, message_ttl_ms, max_priority,
         priority_bands, band_queues, fifo_groups, deduplicate_task_id)
    VALUES (kombu_queue, pgmq_name, is_durable, is_auto_delete, expires_after_ms, ttl_ms,
            priority_max, floors, band_names, is_fifo, dedup_task_id)
    ON CONFLICT (queue) DO UPDATE SET last_used_at = clock_timestamp()
    RETURNING q.* INTO stored;
    -- band_queues[1] is the queue's own PGMQ queue
    FOREACH band IN ARRAY coalesce(stored.band_queues, ARRAY[stored.pgmq_queue]) LOOP
        IF NOT EXISTS (SELECT 1 FROM pgmq.meta m WHERE m.queue_name = band) THEN
            IF is_durable THEN
                PERFORM pgmq.create(band);
            ELSE
                PERFORM pgmq.create_unlogged(band);
            END IF;
        END IF;
    END LOOP;
    RETURN NEXT stored;
END
$$;

-- The Kombu queue a PGMQ queue (or one of its priority bands) belongs to: the scope of
-- deduplication ids, and its flags. One index probe for a plain queue or band 0.
CREATE FUNCTION kombu_pgmq.queue_of(pgmq_name text)
RETURNS TABLE (queue text, fifo_groups boolean, deduplicate_task_id boolean)
LANGUAGE sql STABLE AS $$
    (SELECT q.queue, q.fifo_groups, q.deduplicate_task_id FROM kombu_pgmq.queues q
     WHERE q.pgmq_queue = pgmq_name)
    UNION ALL
    (SELECT q.queue, q.fifo_groups, q.deduplicate_task_id FROM kombu_pgmq.queues q
     WHERE q.band_queues @> ARRAY[pgmq_name] AND q.pgmq_queue <> pgmq_name)
    LIMIT 1
$$;

-- -- deduplication ------------------------------------------------------------------------

-- A deduplication id (header x-deduplication-id, or the Celery task id of a queue declared
-- with x-deduplicate-task-id) is accepted once per Kombu queue until expires_at (SQS
-- FIFO's MessageDeduplicationId; window: transport option deduplication_window). A second
-- publish within the window sends nothing. Concurrent publishers of one id: the unique key
-- makes the second wait for the first's transaction; if that commits, the second is a
-- duplicate, if it rolls back, the second goes through. Expired rows are removed by
-- forget_deduplications (the consumers' reaper round) or replaced on the next claim.
CREATE TABLE kombu_pgmq.deduplication (
    queue text NOT NULL,
    deduplication_id text NOT NULL,
    expires_at timestamptz NOT NULL,
    PRIMARY KEY (queue, deduplication_id)
);
CREATE INDEX deduplication_expires_idx ON kombu_pgmq.deduplication (expires_at);

-- Claim (queue, id) for window_seconds; true if this publish may send (no live claim).
CREATE FUNCTION kombu_pgmq.claim_deduplication(
    kombu_queue text, dedup_id text, window_seconds double precision
) RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    until timestamptz := clock_timestamp() + make_interval(secs => window_seconds);
BEGIN
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

-- The deduplication id of a message for a PGMQ queue (NULL: none), and its scope.
CREATE FUNCTION kombu_pgmq.deduplication_of(pgmq_name text, headers jsonb,
                                            OUT scope text, OUT dedup_id text)
LANGUAGE plpgsql STABLE AS $$
DECLARE
    owner_queue record;
BEGIN
    dedup_id := headers ->> 'x-deduplication-id';
    IF dedup_id IS NULL AND NOT (headers ? 'id') THEN
        RETURN;
    END IF;
    SELECT * INTO owner_queue FROM kombu_pgmq.queue_of(pgmq_name);
    scope := coalesce(owner_queue.queue, pgmq_name);
    IF dedup_id IS NULL AND owner_queue.deduplicate_task_id THEN
        dedup_id := 'task:' || (headers ->> 'id');
    END IF;
END
$$;

-- Remove expired claims, at most batch rows (the reaper's round); returns how many.
CREATE FUNCTION kombu_pgmq.forget_deduplications(batch integer DEFAULT 10000)
RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    n integer;
BEGIN
    DELETE FROM kombu_pgmq.deduplication
    WHERE ctid IN (SELECT ctid FROM kombu_pgmq.deduplication
                   WHERE expires_at < clock_timestamp() LIMIT batch);
    GET DIAGNOSTICS n = ROW_COUNT;
    RETURN n;
END
$$;

-- -- wake-ups at commit ----------------------------------------------------------------------

-- A publish inside an application's transaction (kombu_pgmq.using, send_task from a
-- trigger) commits later, perhaps much later. Its NOTIFY is delivered at commit anyway,
-- but a consumer that went to sleep between the publish and the commit was not waiting
-- when the publish looked, and would only find the message at its fallback poll. So such
-- a publish records the queue here, and a deferred constraint trigger looks for waiting
-- consumers at the commit itself (and notifies, delivered as the commit completes). One
-- row per transaction and queue, deleted by the trigger; UNLOGGED: nothing to keep.
CREATE UNLOGGED TABLE kombu_pgmq.commit_wakeups (
    xid xid8 NOT NULL DEFAULT pg_current_xact_id(),
    pgmq_queue text NOT NULL,
    PRIMARY KEY (xid, pgmq_queue)
);

CREATE FUNCTION kombu_pgmq.wake_at_commit() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM kombu_pgmq.waiting w WHERE w.pgmq_queue = NEW.pgmq_queue) THEN
        PERFORM pg_notify('kombu_pgmq.' || NEW.pgmq_queue, '');
    END IF;
    DELETE FROM kombu_pgmq.commit_wakeups
    WHERE xid = NEW.xid AND pgmq_queue = NEW.pgmq_queue;
    RETURN NULL;
END
$$;

CREATE CONSTRAINT TRIGGER commit_wakeup AFTER INSERT ON kombu_pgmq.commit_wakeups
    DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION kombu_pgmq.wake_at_commit();

-- Wake the consumers waiting on a queue a message was just sent to: now, if this
-- statement is its own transaction (it commits right after), else at the commit of the
-- transaction it is part of (statement_timestamp() differs from transaction_timestamp()
-- from the second statement of a transaction block on).
CREATE FUNCTION kombu_pgmq.wake(pgmq_name text) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    IF statement_timestamp() = transaction_timestamp() THEN
        IF EXISTS (SELECT 1 FROM kombu_pgmq.waiting w WHERE w.pgmq_queue = pgmq_name) THEN
            PERFORM pg_notify('kombu_pgmq.' || pgmq_name, '');
        END IF;
    ELSE
        INSERT INTO kombu_pgmq.commit_wakeups (pgmq_queue) VALUES (pgmq_name)
        ON CONFLICT DO NOTHING;
    END IF;
END
$$;

-- -- publish ------------------------------------------------------------------------------

-- Publish one message (migration 0003's protocol: shared advisory lock, pgmq.send, wake
-- a waiting consumer), unless it is a duplicate within its deduplication window: then
-- nothing is sent and NULL is returned. Inside an application's transaction the waiting
-- consumers are looked for at its commit (kombu_pgmq.wake), and a rollback takes the
-- message and the claim back.
DROP FUNCTION kombu_pgmq.publish(text, jsonb, jsonb, integer);
CREATE FUNCTION kombu_pgmq.publish(
    queue text, message jsonb, headers jsonb, delay_seconds integer DEFAULT 0,
    deduplication_window double precision DEFAULT 300
) RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    sent bigint;
    dedup record;
BEGIN
    SELECT * INTO dedup FROM kombu_pgmq.deduplication_of(queue, headers);
    IF dedup.dedup_id IS NOT NULL
       AND NOT kombu_pgmq.claim_deduplication(dedup.scope, dedup.dedup_id, deduplication_window) THEN
        RETURN NULL;
    END IF;
    PERFORM pg_advisory_xact_lock_shared(1802530161, hashtext(queue));
    sent := pgmq.send(queue, message, headers, delay_seconds);
    IF delay_seconds <= 0 THEN
        PERFORM kombu_pgmq.wake(queue);
    END IF;
    RETURN sent;
END
$$;

-- Send one message to several queues in the caller's transaction: shared advisory locks
-- (migration 0003), a deduplication claim per queue (in queue order, so concurrent
-- publishers of one id never deadlock), pgmq.send, NOTIFY waiting consumers. A queue for
-- which the message is a duplicate is skipped: its msg_ids entry is NULL.
CREATE FUNCTION kombu_pgmq.send_to(
    queues text[], message jsonb, headers jsonb, delay_seconds integer DEFAULT 0,
    deduplication_window double precision DEFAULT 300
) RETURNS bigint[]
LANGUAGE plpgsql AS $$
DECLARE
    q text;
    dedup record;
    duplicate text[] := '{}';
    msg_ids bigint[] := '{}';
BEGIN
    FOR q IN SELECT DISTINCT u FROM unnest(queues) AS u ORDER BY u LOOP
        PERFORM pg_advisory_xact_lock_shared(1802530161, hashtext(q));
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
    IF delay_seconds <= 0 THEN
        FOR q IN SELECT DISTINCT u FROM unnest(queues) AS u
                 WHERE NOT u = ANY(duplicate) ORDER BY u LOOP
            PERFORM kombu_pgmq.wake(q);
        END LOOP;
    END IF;
    RETURN msg_ids;
END
$$;

-- Publish one message to several queues (an exchange's routes) in one transaction, if the
-- routing table is still at expected_version (else nothing is sent: the caller reloads
-- its routes and publishes again); duplicates skipped as send_to does.
DROP FUNCTION kombu_pgmq.publish_routed(text[], jsonb, jsonb, bigint, integer);
CREATE FUNCTION kombu_pgmq.publish_routed(
    queues text[], message jsonb, headers jsonb, expected_version bigint,
    delay_seconds integer DEFAULT 0, deduplication_window double precision DEFAULT 300,
    OUT version bigint, OUT msg_ids bigint[]
)
LANGUAGE plpgsql AS $$
BEGIN
    SELECT v.version INTO version FROM kombu_pgmq.routing_version v;
    IF version <> expected_version THEN
        msg_ids := '{}';
        RETURN;
    END IF;
    msg_ids := kombu_pgmq.send_to(queues, message, headers, delay_seconds,
                                  deduplication_window);
END
$$;

-- -- FIFO groups --------------------------------------------------------------------------

-- Deliver up to qty messages of a FIFO queue: a message with an x-group-id header only
-- when it is the oldest message of its group still in the queue (in flight or not), so a
-- group's messages go out one at a time, in msg_id (publish) order, and the next only
-- after the previous was acked or dead-lettered; different groups in parallel. Messages
-- without the header are not grouped. Reads the queue table as pgmq.read does (FOR UPDATE
-- SKIP LOCKED, vt, read_ct, last_read_at where the PGMQ release has it). Cost: a sort of
-- the grouped rows per call (no index on the header: PGMQ's tables stay as they are),
-- as PGMQ's own read_grouped_head.
CREATE FUNCTION kombu_pgmq.read_grouped(pgmq_name text, vt integer, qty integer)
RETURNS TABLE (
    msg_id bigint, read_ct integer, enqueued_at timestamptz, message jsonb, headers jsonb
)
LANGUAGE plpgsql AS $$
DECLARE
    stamp_last_read text := '';
BEGIN
    IF EXISTS (SELECT 1 FROM pg_attribute
               WHERE attrelid = format('pgmq.%I', 'q_' || pgmq_name)::regclass
                 AND attname = 'last_read_at' AND NOT attisdropped) THEN
        stamp_last_read := ', last_read_at = clock_timestamp()';
    END IF;
    RETURN QUERY EXECUTE format(
        $sql$
        WITH heads AS (
            SELECT DISTINCT ON (t.headers ->> 'x-group-id') t.msg_id, t.vt
            FROM pgmq.%1$I t
            WHERE t.headers ? 'x-group-id'
            ORDER BY t.headers ->> 'x-group-id', t.msg_id
        ), candidates AS (
            (SELECT h.msg_id FROM heads h WHERE h.vt <= clock_timestamp())
            UNION ALL
            (SELECT t.msg_id FROM pgmq.%1$I t
             WHERE t.vt <= clock_timestamp() AND NOT (t.headers ? 'x-group-id'))
        ), picked AS (
            SELECT t.msg_id FROM pgmq.%1$I t
            WHERE t.msg_id IN (SELECT c.msg_id FROM candidates c)
              AND t.vt <= clock_timestamp()
            ORDER BY t.msg_id
            LIMIT $1
            FOR UPDATE SKIP LOCKED
        )
        UPDATE pgmq.%1$I m
        SET vt = clock_timestamp() + make_interval(secs => $2), read_ct = m.read_ct + 1 %2$s
        FROM picked p
        WHERE m.msg_id = p.msg_id
        RETURNING m.msg_id, m.read_ct, m.enqueued_at, m.message, m.headers
        $sql$, 'q_' || pgmq_name, stamp_last_read
    ) USING qty, vt;
END
$$;

-- Ack and read in one round trip (replaces migration 0007's kombu_pgmq.read): FIFO queues
-- (fifo_queues) are read with read_grouped, the others with pgmq.read; an ack in a FIFO
-- queue wakes that queue's waiting consumers (the group's next message is free).
DROP FUNCTION kombu_pgmq.read(text[], integer, integer, text[], bigint[], integer[],
                              timestamptz[], boolean);
CREATE FUNCTION kombu_pgmq.read(
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

-- -- routing in SQL (send_task through an exchange) ------------------------------------------

-- AMQP topic matching, as kombu_pgmq/transport/_routing.py: words separated by '.', '*'
-- one word, '#' zero or more ('logs.#' matches 'logs').
CREATE FUNCTION kombu_pgmq.topic_matches(binding_key text, routing_key text) RETURNS boolean
LANGUAGE plpgsql IMMUTABLE AS $$
DECLARE
    pattern text[] := CASE WHEN binding_key = '' THEN '{}'::text[]
                           ELSE string_to_array(binding_key, '.') END;
    words text[] := CASE WHEN routing_key = '' THEN '{}'::text[]
                         ELSE string_to_array(routing_key, '.') END;
    n integer := cardinality(words);
    reachable boolean[] := array_fill(false, ARRAY[n + 1]);  -- [j]: consumed words[:j-1]
    nxt boolean[];
    token text;
    j integer;
BEGIN
    reachable[1] := true;
    FOREACH token IN ARRAY pattern LOOP
        IF token = '#' THEN
            FOR j IN 2 .. n + 1 LOOP
                reachable[j] := reachable[j] OR reachable[j - 1];
            END LOOP;
        ELSE
            nxt := array_fill(false, ARRAY[n + 1]);
            FOR j IN 2 .. n + 1 LOOP
                nxt[j] := reachable[j - 1] AND (token = '*' OR token = words[j - 1]);
            END LOOP;
            reachable := nxt;
        END IF;
    END LOOP;
    RETURN reachable[n + 1];
END
$$;

-- The Kombu queues a message published to exchange_name with routing_key reaches (AMQP
-- direct, fanout and topic, over the stored bindings; an undeclared exchange is direct).
CREATE FUNCTION kombu_pgmq.route(exchange_name text, key text)
RETURNS TABLE (queue text)
LANGUAGE sql STABLE AS $$
    SELECT DISTINCT b.queue
    FROM kombu_pgmq.bindings b
    LEFT JOIN kombu_pgmq.exchanges e ON e.exchange = b.exchange
    WHERE b.exchange = exchange_name
      AND CASE coalesce(e.type, 'direct')
              WHEN 'fanout' THEN true
              WHEN 'direct' THEN b.routing_key = key
              ELSE kombu_pgmq.topic_matches(b.routing_key, key)
          END
$$;

-- The PGMQ queue a Kombu queue's message of this priority goes to (its priority band, as
-- kombu_pgmq/_priorities.py: the band with the highest floor <= priority). A queue not
-- declared yet: created here if its name is plain (kombu_pgmq._naming keeps [a-z0-9_]
-- names of up to 47 characters without '__' as they are); NULL otherwise.
CREATE FUNCTION kombu_pgmq.queue_for(kombu_queue text, priority integer DEFAULT 0)
RETURNS text
LANGUAGE plpgsql AS $$
DECLARE
    q kombu_pgmq.queues;
    i integer;
BEGIN
    SELECT * INTO q FROM kombu_pgmq.queues WHERE queue = kombu_queue;
    IF NOT FOUND THEN
        IF kombu_queue ~ '^[a-z0-9_]{1,47}$' AND position('__' IN kombu_queue) = 0 THEN
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

-- -- a Celery task from SQL ---------------------------------------------------------------

-- Enqueue Celery task `task` with args and kwargs (JSON) in the caller's transaction (so
-- from a trigger or pg_cron too); returns its task id. The message is Celery's protocol 2
-- as Celery itself sends it through kombu_pgmq (body [args, kwargs, embed]; headers task,
-- id, root_id, parent_id, argsrepr, kwargsrepr, origin, eta, expires, retries, ...; the
-- kombu envelope in "x-kombu"), so a stock worker runs it. options (jsonb, all optional):
--   task_id (uuid), countdown (seconds) or eta (timestamptz), expires (seconds, or a
--   timestamptz), priority (0-9, x-max-priority queues), exchange and routing_key (routed
--   through the stored bindings instead of straight to `queue`), deduplication_id and
--   deduplication_window (seconds, default 300), group_id (FIFO queues), headers (more
--   message headers), eta_lead_seconds (default 2, as the transport option).
-- Raises: an unknown non-plain queue, or an exchange routing nowhere (nothing is sent).
-- Returns the task id also when the message was a duplicate (nothing sent).
CREATE FUNCTION kombu_pgmq.send_task(
    task text, args jsonb DEFAULT '[]', kwargs jsonb DEFAULT '{}',
    queue text DEFAULT 'celery', options jsonb DEFAULT '{}'
) RETURNS uuid
LANGUAGE plpgsql AS $$
DECLARE
    task_id uuid := coalesce((options ->> 'task_id')::uuid, gen_random_uuid());
    eta timestamptz;
    expires timestamptz;
    priority integer := coalesce((options ->> 'priority')::integer, 0);
    exchange_name text := coalesce(options ->> 'exchange', '');
    routing_key text := coalesce(options ->> 'routing_key', queue);
    lead double precision := coalesce((options ->> 'eta_lead_seconds')::float8, 2);
    delay integer := 0;
    properties jsonb;
    headers jsonb;
    body jsonb;
    targets text[];
    target text;
BEGIN
    IF task IS NULL OR task = '' THEN
        RAISE EXCEPTION 'kombu_pgmq.send_task: name the task (e.g. ''tasks.confirm'')'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF jsonb_typeof(args) <> 'array' OR jsonb_typeof(kwargs) <> 'object' THEN
        RAISE EXCEPTION 'kombu_pgmq.send_task: args must be a JSON array and kwargs a JSON object (got % and %)',
            jsonb_typeof(args), jsonb_typeof(kwargs) USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF options ? 'eta' THEN
        eta := (options ->> 'eta')::timestamptz;
    ELSIF options ? 'countdown' THEN
        eta := clock_timestamp() + make_interval(secs => (options ->> 'countdown')::float8);
    END IF;
    IF options ? 'expires' THEN
        IF jsonb_typeof(options -> 'expires') = 'number' THEN
            expires := clock_timestamp() + make_interval(secs => (options ->> 'expires')::float8);
        ELSE
            expires := (options ->> 'expires')::timestamptz;
        END IF;
    END IF;
    IF eta IS NOT NULL THEN
        IF extract(epoch FROM eta - clock_timestamp()) - lead > 2147483647 THEN
            RAISE EXCEPTION 'kombu_pgmq.send_task: eta % is more than 2147483647 seconds (68 years) away: PGMQ cannot delay a message that long',
                eta USING ERRCODE = 'invalid_parameter_value';
        END IF;
        delay := greatest(0, floor(extract(epoch FROM eta - clock_timestamp()) - lead))::integer;
    END IF;
    properties := jsonb_build_object(
        'correlation_id', task_id,
        'reply_to', '',
        'delivery_mode', 2,
        'priority', priority,
        'delivery_info', jsonb_build_object('exchange', exchange_name,
                                            'routing_key', routing_key)
    );
    IF delay > 0 THEN
        properties := properties || jsonb_build_object('pgmq_delay_seconds', delay);
    END IF;
    IF expires IS NOT NULL THEN
        properties := properties || jsonb_build_object(
            'expiration',
            greatest(0, round(extract(epoch FROM expires - clock_timestamp()) * 1000))::bigint::text);
    END IF;
    headers := jsonb_build_object(
        'lang', 'py', 'task', task, 'id', task_id, 'shadow', NULL,
        'eta', to_jsonb(eta), 'expires', to_jsonb(expires),
        'group', NULL, 'group_index', NULL, 'retries', 0,
        'timelimit', jsonb_build_array(NULL, NULL),
        'root_id', task_id, 'parent_id', NULL,
        'argsrepr', args::text, 'kwargsrepr', kwargs::text,
        'origin', 'postgresql:' || current_database(),
        'ignore_result', false, 'replaced_task_nesting', 0,
        'stamped_headers', NULL, 'stamps', '{}'::jsonb
    ) || coalesce(options -> 'headers', '{}'::jsonb);
    IF options ? 'deduplication_id' THEN
        headers := headers || jsonb_build_object('x-deduplication-id',
                                                 options ->> 'deduplication_id');
    END IF;
    IF options ? 'group_id' THEN
        headers := headers || jsonb_build_object('x-group-id', options ->> 'group_id');
    END IF;
    headers := headers || jsonb_build_object('x-kombu', jsonb_build_object(
        'content-type', 'application/json', 'content-encoding', 'utf-8',
        'body-encoding', NULL, 'properties', properties));
    body := jsonb_build_array(args, kwargs, jsonb_build_object(
        'callbacks', NULL, 'errbacks', NULL, 'chain', NULL, 'chord', NULL));
    IF exchange_name = '' THEN
        target := kombu_pgmq.queue_for(routing_key, priority);
        IF target IS NULL THEN
            RAISE EXCEPTION 'kombu_pgmq.send_task: queue % is not declared (a worker declares it when it starts consuming it)',
                routing_key USING ERRCODE = 'undefined_object';
        END IF;
        targets := ARRAY[target];
    ELSE
        SELECT array_agg(kombu_pgmq.queue_for(r.queue, priority) ORDER BY r.queue) INTO targets
        FROM kombu_pgmq.route(exchange_name, routing_key) AS r;
        IF targets IS NULL THEN
            RAISE EXCEPTION 'kombu_pgmq.send_task: exchange % routes % to no queue: nothing was sent',
                exchange_name, routing_key USING ERRCODE = 'undefined_object';
        END IF;
    END IF;
    PERFORM kombu_pgmq.send_to(targets, body, headers, delay,
                               coalesce((options ->> 'deduplication_window')::float8, 300));
    RETURN task_id;
END
$$;

-- -- grants -------------------------------------------------------------------------------

INSERT INTO kombu_pgmq.grantable (function, kind, definer) VALUES
    ('kombu_pgmq.publish(text, jsonb, jsonb, integer, double precision)', 'producer', true),
    ('kombu_pgmq.publish_routed(text[], jsonb, jsonb, bigint, integer, double precision)', 'producer', true),
    ('kombu_pgmq.size(text)', 'producer', true),
    ('kombu_pgmq.send_task(text, jsonb, jsonb, text, jsonb)', 'producer', true),
    ('kombu_pgmq.read(text[], integer, integer, text[], bigint[], integer[], timestamptz[], boolean, text[])', 'worker', true),
    ('kombu_pgmq.ack(text[], bigint[], integer[], timestamptz[])', 'worker', true),
    ('kombu_pgmq.requeue(text[], bigint[], integer[], timestamptz[], integer, boolean)', 'worker', true),
    ('kombu_pgmq.renew(text[], bigint[], integer[], timestamptz[], integer)', 'worker', true),
    ('kombu_pgmq.wait_for(text, text[], integer)', 'worker', true),
    ('kombu_pgmq.reap()', 'worker', true),
    ('kombu_pgmq.release_consumer(text, text, text)', 'worker', true),
    ('kombu_pgmq.drop_transient_queue(text)', 'worker', true),
    ('kombu_pgmq.declare_queue(text, text, boolean, boolean, bigint, bigint, smallint, smallint[], text[], boolean, boolean)', 'worker', true),
    ('kombu_pgmq.purge(text)', 'worker', true),
    ('kombu_pgmq.pop(text, integer)', 'worker', true),
    ('kombu_pgmq.discard(text, bigint[], integer[], timestamptz[])', 'worker', true),
    ('kombu_pgmq.dead_letter(text, bigint[], integer[], timestamptz[], text[], text, text, text)', 'worker', true),
    ('kombu_pgmq.forget_deduplications(integer)', 'worker', true),
    ('kombu_pgmq.send_to(text[], jsonb, jsonb, integer, double precision)', 'owner', true),
    ('kombu_pgmq.wake(text)', 'owner', true),
    ('kombu_pgmq.wake_at_commit()', 'owner', true),
    ('kombu_pgmq.drop_queue(text)', 'owner', true),
    ('kombu_pgmq.bump_routing_version()', 'owner', true),
    ('kombu_pgmq.read_grouped(text, integer, integer)', 'owner', true),
    ('kombu_pgmq.claim_deduplication(text, text, double precision)', 'owner', true),
    ('kombu_pgmq.deduplication_of(text, jsonb)', 'owner', true),
    ('kombu_pgmq.queue_of(text)', 'owner', true),
    ('kombu_pgmq.queue_for(text, integer)', 'owner', true);
SELECT kombu_pgmq.secure_functions();
