-- kombu_pgmq's schema as it is now: every table, index, view, function and trigger, each
-- function's body once (its live definition), grouped by area.
--
-- kombu_pgmq.schema.bootstrap runs this file to install kombu_pgmq on a database that
-- has none (in one transaction, under its advisory lock, after PGMQ itself), then records
-- every migration of sql/migrations as applied. A database installed before upgrades
-- through sql/migrations/NNNN_*.sql instead. Both ways give the same schema:
-- tests/integration/test_schema_current.py compares their catalogs. A change of the
-- schema is a new migration (for existing installs) and the same change here (for new
-- ones): docs/development.md.
--
-- Conventions of every area:
-- * The role that installs the schema (the owner) owns every object. Other roles get
--   EXECUTE on functions (kombu_pgmq.grantable: each area ends with its rows), never a
--   privilege on PGMQ's queue and archive tables: what they may do to messages is what
--   the SECURITY DEFINER functions do. Those run as the owner with a fixed search_path,
--   quote every identifier they build (format %I), and have no PUBLIC execute.
-- * The tables stay exactly PGMQ's: these functions read and write queue rows the way
--   pgmq.send, read, set_vt, archive, delete and pop do.
-- * A receipt handle names one delivery of a message: (msg_id, read_ct, enqueued_at). An
--   ack, requeue, lease renewal, dead letter or discard touches the row only if that
--   delivery still holds it; a stale one (the lease lapsed and another consumer read the
--   message: read_ct moved on; an UNLOGGED queue emptied by a crash reused the msg_id:
--   enqueued_at differs) is never applied. Rows are found by msg_id = ANY(ids), an index
--   condition on the queue table's primary key, and every function that settles by
--   receipt runs with enable_seqscan off (the queues' ack and read functions, requeue and
--   so lease renewal, discard, dead_letter): after a VACUUM behind a held snapshot
--   removes nothing, an ANALYZE records the few live rows as the whole table, and the
--   planner then scanned all its pages for the receipts' msg_ids.
-- * Advisory lock keys: each defined once, in area "Advisory lock keys".

CREATE SCHEMA IF NOT EXISTS kombu_pgmq;

-- =========================================================================================
-- Install bookkeeping
-- =========================================================================================

-- Migrations applied (sql/migrations/NNNN_name.sql): every version, on an install from
-- this file.
CREATE TABLE kombu_pgmq.migrations (
    version integer PRIMARY KEY,
    name text NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now()
);

-- Install facts: e.g. pgmq_sql_version when kombu_pgmq installed PGMQ's SQL-only form
-- (no pg_extension row then records the version).
CREATE TABLE kombu_pgmq.settings (
    key text PRIMARY KEY,
    value text NOT NULL
);

-- =========================================================================================
-- Grants and privileges
-- =========================================================================================
--
-- A producer role may publish to queues and exchanges that exist (a redeclaration is a
-- passive check on the client side), count ready messages, read the routing table and
-- queue metadata. A worker role may do what a producer may, and read, ack, requeue,
-- renew leases, dead-letter, discard expired messages, purge ready messages, declare
-- queues (its pidbox, reply and event queues), bind, record consumers and heartbeats,
-- and drop the queues AMQP drops (auto_delete, x-expires: reap, release_consumer) and
-- transient ones (drop_transient_queue: kombu deletes pidbox reply queues). The rest is
-- the owner's: deleting a durable queue, DDL, the dead-letter admin (kombu-pgmq dlq),
-- archive pruning, schema installs and grants.
--
-- Functions that judge the caller (a dead-letter queue, creating queues) look at
-- session_user, which SECURITY DEFINER does not change: a role that may itself read a
-- dead-letter queue's table (the owner, a superuser) or call declare_queue (a worker, the
-- owner) may do the same through these functions.

-- Roles granted by kombu_pgmq.grant_role (apply_grants applies their privileges again
-- after every install or upgrade of the schema).
CREATE TABLE kombu_pgmq.roles (
    role text PRIMARY KEY,
    kind text NOT NULL CHECK (kind IN ('producer', 'worker')),
    granted_at timestamptz NOT NULL DEFAULT now()
);

-- Functions of kombu_pgmq by the least role that may call them: 'producer', 'worker'
-- (and so the worker's superset), or 'owner' (internal or the owner's own: granted to
-- nobody). definer: the function runs as its owner (SECURITY DEFINER, fixed search_path,
-- no PUBLIC execute: secure_functions). Signatures as regprocedure text; a row whose
-- function does not exist is skipped. Each area below ends with the rows of its functions.
CREATE TABLE kombu_pgmq.grantable (
    function text PRIMARY KEY,
    kind text NOT NULL CHECK (kind IN ('producer', 'worker', 'owner')),
    definer boolean NOT NULL DEFAULT true
);

-- Make every definer function of kombu_pgmq.grantable run as its owner (SECURITY
-- DEFINER, search_path pg_catalog, pg_temp), with no PUBLIC execute. Idempotent; run
-- after every change of such a function (CREATE OR REPLACE FUNCTION resets SECURITY
-- DEFINER and SET).
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

-- Apply the privileges of every recorded role (only_role: just that one), the queues'
-- own functions included. Idempotent; returns the roles done. Run by the owner (the
-- bootstrap runs it after every install or upgrade of the schema).
CREATE FUNCTION kombu_pgmq.apply_grants(only_role text DEFAULT NULL)
RETURNS SETOF text
LANGUAGE plpgsql AS $$
DECLARE
    r kombu_pgmq.roles;
    f regprocedure;
    q text;
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
        FOR q IN SELECT m.queue_name FROM pgmq.meta m LOOP
            PERFORM kombu_pgmq.grant_queue_functions(q, r.role);
        END LOOP;
        RETURN NEXT r.role;
    END LOOP;
END
$$;

-- Take every privilege given by kombu_pgmq back from a role (and forget it).
CREATE FUNCTION kombu_pgmq.revoke_role(role_name text) RETURNS boolean
LANGUAGE plpgsql AS $$
BEGIN
    EXECUTE format('REVOKE ALL ON ALL TABLES IN SCHEMA kombu_pgmq FROM %I', role_name);
    EXECUTE format('REVOKE ALL ON ALL FUNCTIONS IN SCHEMA kombu_pgmq FROM %I', role_name);
    EXECUTE format('REVOKE SELECT ON pgmq.meta FROM %I', role_name);
    EXECUTE format('REVOKE USAGE ON SCHEMA kombu_pgmq, pgmq FROM %I', role_name);
    DELETE FROM kombu_pgmq.roles WHERE role = role_name;
    RETURN FOUND;
END
$$;

-- Give a role the privileges of a producer or a worker (see the top of this area); a
-- role granted before gets the new kind (a worker made producer loses the worker's
-- privileges).
CREATE FUNCTION kombu_pgmq.grant_role(role_name text, role_kind text) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    IF role_kind NOT IN ('producer', 'worker') THEN
        RAISE EXCEPTION 'kombu_pgmq: kind must be producer or worker, not %', role_kind
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = role_name) THEN
        RAISE EXCEPTION 'kombu_pgmq: role % does not exist (CREATE ROLE % LOGIN first)',
            role_name, role_name USING ERRCODE = 'undefined_object';
    END IF;
    IF EXISTS (SELECT 1 FROM kombu_pgmq.roles r WHERE r.role = role_name AND r.kind <> role_kind) THEN
        PERFORM kombu_pgmq.revoke_role(role_name);
    END IF;
    INSERT INTO kombu_pgmq.roles (role, kind) VALUES (role_name, role_kind)
    ON CONFLICT (role) DO UPDATE SET kind = excluded.kind, granted_at = now();
    PERFORM kombu_pgmq.apply_grants(role_name);
END
$$;

-- =========================================================================================
-- Advisory lock keys
-- =========================================================================================

-- The advisory locks the functions below take are keyed by two integers (class, object);
-- each class, and the beat leader's object, is defined once here, as an IMMUTABLE
-- function the planner folds into a constant where it is called:
--   (lock_key_publish(), hashtext(pgmq queue))  the wake-up protocol: publishes take it
--       shared, a consumer going to sleep exclusive (area "Consumers and wake-ups")
--   (lock_key_sequence(), hashtext(pgmq queue))  a queue's msg_id sequence moved past its
--       archive (archive_under_new_id)
--   (lock_key_sequence(), n)  the lease of hand-off sequence kombu_pgmq.handoff_<n>
--       (handoff_lease, a session lock)
--   (lock_key_beat(), lock_key_beat_leader())  the beat leader (a session lock)
--   (lock_key_queue_functions(), hashtext(pgmq queue))  creating a queue's own functions
-- The classes are 'kpmq' (0x6b706d71 = 1802530161) plus 0, 2, 5 and 6; the beat leader's
-- object is 'beat'. A send function of a queue (send_template) has its key class written
-- in as a literal when it is made (queue_functions). Keys of one bigint, a separate space
-- (pg_locks.objsubid 1, not 2), are taken by Python: kombu_pgmq/_db/lock_keys.py.

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

-- Who may call these (see kombu_pgmq.grantable).
INSERT INTO kombu_pgmq.grantable (function, kind, definer) VALUES
    ('kombu_pgmq.lock_key_beat()', 'owner', false),
    ('kombu_pgmq.lock_key_beat_leader()', 'owner', false),
    ('kombu_pgmq.lock_key_publish()', 'owner', false),
    ('kombu_pgmq.lock_key_queue_functions()', 'owner', false),
    ('kombu_pgmq.lock_key_sequence()', 'owner', false);

-- =========================================================================================
-- Queues
-- =========================================================================================

-- Kombu queues as the application declared them, next to their PGMQ names
-- (kombu_pgmq._naming maps one way only: 'celery@host.celery.pidbox' becomes
-- 'celery_host_celery_pidbox__<hash>'), with their arguments as declared (AMQP/Kombu;
-- the first declaration's stay).
--
-- Priorities (AMQP x-max-priority) are one PGMQ queue per priority band. A band holds
-- the priorities from its floor up to the next band's floor; band 0 is the queue's own
-- PGMQ queue (pgmq_queue), so messages without a priority go there. Consumers read the
-- bands highest first. The layout is fixed by the queue's first declaration and read by
-- every producer and consumer from here, so all agree on it.
--
-- x-fifo-groups: messages with the same x-group-id header are delivered one at a time, in
-- publish order (SQS FIFO's MessageGroupId; a key limit, see Limits).
-- x-deduplicate-task-id: a Celery task id counts as a deduplication id (SQS's
-- content-based deduplication, keyed by task id). dead_letter: a queue dead letters are
-- moved into (kombu_pgmq.dead_letter marks its target): only roles that may read its
-- table themselves read, pop or purge it through kombu_pgmq's functions.
CREATE TABLE kombu_pgmq.queues (
    queue text PRIMARY KEY,
    pgmq_queue text NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    durable boolean NOT NULL DEFAULT true,
    auto_delete boolean NOT NULL DEFAULT false,
    expires_ms bigint,                      -- x-expires: drop after this long unused
    message_ttl_ms bigint,                  -- x-message-ttl: older messages are not delivered
    had_consumer boolean NOT NULL DEFAULT false,
    last_used_at timestamptz NOT NULL DEFAULT now(),
    max_priority smallint,                  -- x-max-priority; NULL: no priorities
    priority_bands smallint[],              -- band floors, ascending, starting at 0
    band_queues text[],                     -- PGMQ queue of each band (band_queues[1] = pgmq_queue)
    fifo_groups boolean NOT NULL DEFAULT false,
    deduplicate_task_id boolean NOT NULL DEFAULT false,
    dead_letter boolean NOT NULL DEFAULT false
);
CREATE INDEX queues_pgmq_queue_idx ON kombu_pgmq.queues (pgmq_queue);
CREATE INDEX queues_dead_letter_idx ON kombu_pgmq.queues (pgmq_queue) WHERE dead_letter;

-- Declare a queue: create its PGMQ queue (UNLOGGED if not durable) only if missing (on an
-- existing queue pgmq.create runs CREATE INDEX IF NOT EXISTS, whose SHARE lock waits for
-- every open transaction that enqueued), record its Kombu name and arguments (the first
-- declaration's stay; a redeclare counts as use for x-expires), then create the PGMQ
-- queues of its priority bands as stored. Returns the queue's row (arguments in force).
CREATE FUNCTION kombu_pgmq.declare_queue(
    kombu_queue text, pgmq_name text, is_durable boolean, is_auto_delete boolean,
    expires_after_ms bigint, ttl_ms bigint, priority_max smallint, floors smallint[],
    band_names text[], is_fifo boolean DEFAULT false, dedup_task_id boolean DEFAULT false
) RETURNS SETOF kombu_pgmq.queues
LANGUAGE plpgsql
SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
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
LANGUAGE sql STABLE
SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    (SELECT q.queue, q.fifo_groups, q.deduplicate_task_id FROM kombu_pgmq.queues q
     WHERE q.pgmq_queue = pgmq_name)
    UNION ALL
    (SELECT q.queue, q.fifo_groups, q.deduplicate_task_id FROM kombu_pgmq.queues q
     WHERE q.band_queues @> ARRAY[pgmq_name] AND q.pgmq_queue <> pgmq_name)
    LIMIT 1
$$;

-- The PGMQ queue a Kombu queue's message of this priority goes to (behind send_task): its
-- priority band, as kombu_pgmq/_priorities.py (the band with the highest floor <=
-- priority). A queue not declared yet is created here if its name is plain
-- (kombu_pgmq._naming keeps [a-z0-9_] names of up to 47 characters without '__' as they
-- are) and the session's role may declare queues itself (a worker, the owner; a producer
-- gets insufficient_privilege); NULL for a name that is not plain.
CREATE FUNCTION kombu_pgmq.queue_for(kombu_queue text, priority integer DEFAULT 0)
RETURNS text
LANGUAGE plpgsql
SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
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

-- Every PGMQ queue with its Kombu queue and priority band floor (a PGMQ queue kombu_pgmq
-- did not declare, e.g. made with pgmq.create, is its own Kombu queue, band 0).
CREATE FUNCTION kombu_pgmq.queue_map()
RETURNS TABLE (pgmq_queue text, queue text, band integer)
LANGUAGE sql STABLE
SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    SELECT m.queue_name, coalesce(b.queue, m.queue_name), coalesce(b.band, 0)
    FROM pgmq.meta m
    LEFT JOIN (
        SELECT k.queue, u.name, coalesce(k.priority_bands[u.ord], 0)::integer AS band
        FROM kombu_pgmq.queues k,
             unnest(coalesce(k.band_queues, ARRAY[k.pgmq_queue])) WITH ORDINALITY AS u(name, ord)
    ) b ON b.name = m.queue_name
    ORDER BY 2, 3
$$;

-- Ready (visible) messages of a PGMQ queue, as AMQP's message_count: unacked ones are
-- not counted. Seq scan of the queue table.
CREATE FUNCTION kombu_pgmq.size(pgmq_name text) RETURNS bigint
LANGUAGE plpgsql
SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    n bigint;
BEGIN
    EXECUTE format('SELECT count(*) FROM pgmq.%I WHERE vt <= clock_timestamp()',
                   'q_' || pgmq_name)
    INTO n;
    RETURN n;
END
$$;

-- AMQP purge removes ready messages only: messages being processed (vt in the future)
-- stay, so their ack or redelivery still works (pgmq.purge_queue would TRUNCATE them too,
-- and take an ACCESS EXCLUSIVE lock that blocks every consumer meanwhile). Not of a
-- dead-letter queue for a role that may not delete from its table. Returns how many.
CREATE FUNCTION kombu_pgmq.purge(pgmq_name text) RETURNS bigint
LANGUAGE plpgsql
SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
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

-- Drop one Kombu queue: the PGMQ tables of every band and their own functions, and its
-- row (its bindings, consumers, pause, limits and held slots cascade). False if there is
-- no such queue.
CREATE FUNCTION kombu_pgmq.drop_queue(kombu_queue text) RETURNS boolean
LANGUAGE plpgsql
SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
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
    PERFORM kombu_pgmq.drop_queue_functions(target);
    FOREACH band IN ARRAY coalesce(bands, '{}') LOOP
        IF band <> target AND EXISTS (SELECT 1 FROM pgmq.meta WHERE queue_name = band) THEN
            PERFORM pgmq.drop_queue(band);
            PERFORM kombu_pgmq.drop_queue_functions(band);
        END IF;
    END LOOP;
    RETURN true;
END
$$;

-- Drop a transient queue (auto_delete, non-durable or with x-expires: a consumer's own
-- pidbox reply and event queues, which kombu deletes after reading the replies); false if
-- there is no such queue or it is durable (only the owner drops those: drop_queue).
CREATE FUNCTION kombu_pgmq.drop_transient_queue(kombu_queue text) RETURNS boolean
LANGUAGE plpgsql
SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM kombu_pgmq.queues q
                   WHERE q.queue = kombu_queue
                     AND (q.auto_delete OR NOT q.durable OR q.expires_ms IS NOT NULL)) THEN
        RETURN false;
    END IF;
    RETURN kombu_pgmq.drop_queue(kombu_queue);
END
$$;

-- Who may call these (see kombu_pgmq.grantable).
INSERT INTO kombu_pgmq.grantable (function, kind, definer) VALUES
    ('kombu_pgmq.size(text)', 'producer', true),
    ('kombu_pgmq.declare_queue(text, text, boolean, boolean, bigint, bigint, smallint, smallint[], text[], boolean, boolean)', 'worker', true),
    ('kombu_pgmq.drop_transient_queue(text)', 'worker', true),
    ('kombu_pgmq.purge(text)', 'worker', true),
    ('kombu_pgmq.drop_queue(text)', 'owner', true),
    ('kombu_pgmq.queue_for(text, integer)', 'owner', true),
    ('kombu_pgmq.queue_map()', 'owner', true),
    ('kombu_pgmq.queue_of(text)', 'owner', true);

-- =========================================================================================
-- Consumers and wake-ups
-- =========================================================================================
--
-- A consumer that finds its queues empty sleeps on LISTEN "kombu_pgmq.<pgmq queue>" and
-- is woken by a NOTIFY on that channel: a hint, not the message. Committing a transaction
-- that notified takes a database-wide lock, so a NOTIFY on every publish would serialize
-- every publishing commit: publishers notify a queue only while a consumer waits on it
-- (a row of kombu_pgmq.waiting); consumers busy with a backlog do not wait, so under load
-- no publish notifies. Payloads: '' (visible now), a due time in epoch seconds (a delayed
-- message: the consumer reads the queue then), 'rewind' (a message requeued to its place
-- lies below the consumers' read positions: kombu_pgmq.requeue); a handed-off message
-- goes to the consumer's own channel (see Hand-off).
--
-- Lost wake-ups are excluded by a shared/exclusive advisory lock per queue,
-- (kombu_pgmq.lock_key_publish(), hashtext(pgmq queue)):
--   publisher: lock SHARED; send; check kombu_pgmq.waiting (a later statement, so a
--              newer snapshot than the lock); notify if a waiter is there; commit.
--   consumer:  insert its waiting row and take the lock EXCLUSIVE (one transaction,
--              committed: wait_for); then read the queue once more, then sleep on LISTEN.
-- A publisher that checked before the waiting row was committed held its shared lock
-- then, so the consumer's exclusive lock waited for that publisher's commit and the
-- consumer's final read sees its message. A publisher that checked later notifies.
-- Publishers never wait for each other (shared locks); they wait only for a consumer's
-- short transition transaction. Several queues are always locked in name order; a
-- collision of two queues' keys only costs a spurious wait.

-- Live consumers (their queues' lifetime depends on them: auto_delete, x-expires).
-- A process refreshes heartbeat_at of its rows while it runs; each row counts as live
-- until heartbeat_at + stale_after_seconds (the owner's own setting, so a process with
-- short heartbeats cannot declare another process's consumers dead). Rows of a process
-- that died go stale and are removed by kombu_pgmq.reap(). A consumer counts as gone at
-- most a day after its last heartbeat.
CREATE TABLE kombu_pgmq.consumers (
    queue text NOT NULL REFERENCES kombu_pgmq.queues (queue) ON DELETE CASCADE,
    owner text NOT NULL,           -- host:pid:uuid of the Kombu connection
    consumer_tag text NOT NULL,
    heartbeat_at timestamptz NOT NULL DEFAULT now(),
    stale_after_seconds double precision NOT NULL,
    PRIMARY KEY (queue, owner, consumer_tag),
    CONSTRAINT consumers_stale_after_capped
        CHECK (stale_after_seconds > 0 AND stale_after_seconds <= 86400)
);
CREATE INDEX consumers_owner_idx ON kombu_pgmq.consumers (owner);

-- One row per (queue, consuming connection) that found the queue empty and sleeps on
-- LISTEN "kombu_pgmq.<pgmq queue>". Rows of dead connections are reaped with their
-- consumers; a stale row only costs publishers a useless NOTIFY. The handoff_* columns:
-- the connection's hand-off slot (see Hand-off).
CREATE TABLE kombu_pgmq.waiting (
    pgmq_queue text NOT NULL,
    owner text NOT NULL,             -- host:pid:uuid of the Kombu connection
    since timestamptz NOT NULL DEFAULT clock_timestamp(),
    handoff_channel text,            -- NOTIFY channel of the consumer's LISTEN connection
    handoff_lock bigint,             -- advisory lock that connection holds while it listens
    handoff_vt integer,              -- seconds: visibility timeout of a handed message
    handoff_slots integer NOT NULL DEFAULT 0,  -- 1: offered on this queue now
    handoff_seq regclass,            -- the connection's sequence
    PRIMARY KEY (pgmq_queue, owner)
);
-- A connection's offers (its rows) are taken together: found by owner.
CREATE INDEX waiting_owner ON kombu_pgmq.waiting (owner);

-- A publish inside an application's transaction (kombu_pgmq.using, send_task from a
-- trigger) commits later, perhaps much later. Its NOTIFY is delivered at commit anyway,
-- but a consumer that went to sleep between the publish and the commit was not waiting
-- when the publish looked, and would only find the message at its fallback poll. So such
-- a publish records the queue here (with the earliest due time of the transaction's
-- publishes to it), and a deferred constraint trigger looks for waiting consumers at the
-- commit itself (and notifies, delivered as the commit completes). One row per
-- transaction and queue, deleted by the trigger; UNLOGGED: nothing to keep.
CREATE UNLOGGED TABLE kombu_pgmq.commit_wakeups (
    xid xid8 NOT NULL DEFAULT pg_current_xact_id(),
    pgmq_queue text NOT NULL,
    due timestamptz,                 -- NULL: visible now
    PRIMARY KEY (xid, pgmq_queue)
);

-- NOTIFY payload of a wake-up: '' (visible now) or the due time as epoch seconds.
CREATE FUNCTION kombu_pgmq.due_payload(due timestamptz) RETURNS text
LANGUAGE sql IMMUTABLE AS $$
    SELECT CASE WHEN due IS NULL THEN '' ELSE extract(epoch FROM due)::text END
$$;

-- Wake the consumers waiting on a queue: a message there is visible now (due NULL) or
-- will be at due. Now if this statement is its own transaction, else at the commit of the
-- transaction it is part of (kombu_pgmq.commit_wakeups; statement_timestamp() differs
-- from transaction_timestamp() from the second statement of a transaction block on).
CREATE FUNCTION kombu_pgmq.wake_due(pgmq_name text, due timestamptz) RETURNS void
LANGUAGE plpgsql
SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    IF statement_timestamp() = transaction_timestamp() THEN
        IF EXISTS (SELECT 1 FROM kombu_pgmq.waiting w WHERE w.pgmq_queue = pgmq_name) THEN
            PERFORM pg_notify('kombu_pgmq.' || pgmq_name, kombu_pgmq.due_payload(due));
        END IF;
    ELSE
        INSERT INTO kombu_pgmq.commit_wakeups AS c (pgmq_queue, due) VALUES (pgmq_name, due)
        ON CONFLICT (xid, pgmq_queue) DO UPDATE
        SET due = CASE WHEN c.due IS NULL OR excluded.due IS NULL THEN NULL
                       ELSE least(c.due, excluded.due) END;
    END IF;
END
$$;

-- wake_due for a message visible now.
CREATE FUNCTION kombu_pgmq.wake(pgmq_name text) RETURNS void
LANGUAGE sql
SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    SELECT kombu_pgmq.wake_due(pgmq_name, NULL)
$$;

-- The commit trigger of kombu_pgmq.commit_wakeups: it reads the row as it is at commit
-- (its due may have been lowered or cleared by a later publish of the same transaction).
CREATE FUNCTION kombu_pgmq.wake_at_commit() RETURNS trigger
LANGUAGE plpgsql
SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    due_at timestamptz;
BEGIN
    DELETE FROM kombu_pgmq.commit_wakeups c
    WHERE c.xid = NEW.xid AND c.pgmq_queue = NEW.pgmq_queue
    RETURNING c.due INTO due_at;
    IF EXISTS (SELECT 1 FROM kombu_pgmq.waiting w WHERE w.pgmq_queue = NEW.pgmq_queue) THEN
        PERFORM pg_notify('kombu_pgmq.' || NEW.pgmq_queue, kombu_pgmq.due_payload(due_at));
    END IF;
    RETURN NULL;
END
$$;

CREATE CONSTRAINT TRIGGER commit_wakeup AFTER INSERT ON kombu_pgmq.commit_wakeups
    DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION kombu_pgmq.wake_at_commit();

-- Wake the consumers waiting on a queue at once, never at a commit (unlike wake): the
-- wake-up of a direct publish (the queues' send functions run only where the statement
-- is the transaction), of a freed concurrency slot, of changed limits. A volatile
-- PL/pgSQL function, so its look at kombu_pgmq.waiting takes a snapshot after the
-- publish's shared advisory lock was granted (the protocol above: a consumer that
-- started waiting before that is seen, one that starts later waits for this publish to
-- commit).
CREATE FUNCTION kombu_pgmq.notify_waiting(pgmq_name text) RETURNS void
LANGUAGE plpgsql
SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM kombu_pgmq.waiting w WHERE w.pgmq_queue = pgmq_name) THEN
        PERFORM pg_notify('kombu_pgmq.' || pgmq_name, '');
    END IF;
END
$$;

-- The same with a due time (NULL: visible now) in the payload.
CREATE FUNCTION kombu_pgmq.notify_waiting(pgmq_name text, due timestamptz) RETURNS void
LANGUAGE plpgsql
SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM kombu_pgmq.waiting w WHERE w.pgmq_queue = pgmq_name) THEN
        PERFORM pg_notify('kombu_pgmq.' || pgmq_name, kombu_pgmq.due_payload(due));
    END IF;
END
$$;

-- A consumer found these queues empty and is about to sleep: record it, then wait for
-- publishers already past their waiting check (the protocol above), but at most
-- max_wait_ms per queue (at most 1 s: an exclusive lock request queued behind a long
-- transaction makes every later publisher of the queue wait too). A publisher still in
-- its transaction after that (an application that enqueued inside its own long
-- transaction) is not waited for: the queue is returned, and the consumer finds that
-- publisher's message at its fallback poll instead of by a NOTIFY. So no open transaction
-- of an application ever stops a consumer. The caller reads the queues once more after
-- this commits. The commit is asynchronous: the row is visible at commit all the same,
-- and a server crash that forgets it also ends the consumer's connections (it records
-- itself again when it reconnects).
CREATE FUNCTION kombu_pgmq.wait_for(owner text, queues text[], max_wait_ms integer DEFAULT 50)
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

-- A consumer found these queues empty and goes to sleep on them (wait_for), and learns
-- per queue how long until its next delayed message is due (never-read messages whose vt
-- is ahead; NULL: none), by the server's clock, with the server's time (epoch seconds) to
-- convert NOTIFY payloads. unsettled: a publisher to the queue was still in its
-- transaction (poll it). A queue whose table is locked or gone reports no due time.
CREATE FUNCTION kombu_pgmq.wait_for_due(owner text, queues text[], max_wait_ms integer DEFAULT 50)
RETURNS TABLE (queue text, unsettled boolean, due_in_seconds double precision,
               server_epoch double precision)
LANGUAGE plpgsql
SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
#variable_conflict use_column
DECLARE
    q text;
    pending text[];
    due double precision;
BEGIN
    pending := ARRAY(SELECT w FROM kombu_pgmq.wait_for(owner, queues, max_wait_ms) AS w);
    FOR q IN SELECT DISTINCT u FROM unnest(queues) AS u ORDER BY u LOOP
        due := NULL;
        BEGIN
            EXECUTE format(
                'SELECT extract(epoch FROM t.vt - clock_timestamp())::float8
                 FROM pgmq.%I t WHERE t.vt > clock_timestamp() AND t.read_ct = 0
                 ORDER BY t.vt LIMIT 1', 'q_' || q) INTO due;
        EXCEPTION WHEN lock_not_available OR undefined_table THEN
            due := NULL;
        END;
        queue := q;
        unsettled := q = ANY(pending);
        due_in_seconds := due;
        server_epoch := extract(epoch FROM clock_timestamp())::float8;
        RETURN NEXT;
    END LOOP;
END
$$;

-- Remove stale consumers, then drop the queues AMQP would have deleted by now:
-- auto_delete queues that had a consumer and have no live one left, and queues with
-- x-expires unused (no live consumer, not declared or read) for that long. Returns the
-- Kombu names dropped. Safe to run from many processes at once. It judges fairly:
--   * after the database restarts, every consumer gets a full stale_after_seconds from the
--     restart (pg_postmaster_start_time) before it counts as gone: live workers could not
--     send heartbeats while the server was down, and the first process to reconnect must
--     not drop their auto_delete queues with the messages in them;
--   * a queue with x-expires counts as used while it receives messages: its newest message
--     (by msg_id, the primary key: one index probe) younger than x-expires keeps it, so
--     publishes need no extra write. basic_get marks it used explicitly (touch_queue).
-- It never waits on an application's locks (the heartbeat thread runs it, and once each
-- connect): DROP TABLE needs ACCESS EXCLUSIVE locks, which wait for every open
-- transaction that touched the table (a reader, an application that enqueued and has not
-- committed yet). Such a queue is skipped this round: its tables are locked NOWAIT first,
-- in a subtransaction, and a refused lock (lock_not_available) rolls back only that
-- queue's drop.
CREATE FUNCTION kombu_pgmq.reap()
RETURNS SETOF text
LANGUAGE plpgsql
SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    victim record;
    band text;
    newest timestamptz;
    started timestamptz := pg_postmaster_start_time();
BEGIN
    DELETE FROM kombu_pgmq.consumers
    WHERE greatest(heartbeat_at, started) + make_interval(secs => stale_after_seconds)
          < clock_timestamp();
    FOR victim IN
        SELECT q.queue, q.pgmq_queue, q.band_queues, q.auto_delete, q.had_consumer,
               q.expires_ms, q.last_used_at
        FROM kombu_pgmq.queues q
        WHERE NOT EXISTS (SELECT 1 FROM kombu_pgmq.consumers c WHERE c.queue = q.queue)
          AND ((q.auto_delete AND q.had_consumer)
               OR (q.expires_ms IS NOT NULL
                   AND q.last_used_at + q.expires_ms * interval '1 millisecond' < clock_timestamp()))
        FOR UPDATE SKIP LOCKED
    LOOP
        IF NOT (victim.auto_delete AND victim.had_consumer) THEN
            -- x-expires only: still receiving messages counts as use
            newest := NULL;
            FOREACH band IN ARRAY coalesce(victim.band_queues, ARRAY[victim.pgmq_queue]) LOOP
                IF to_regclass(format('pgmq.%I', 'q_' || band)) IS NOT NULL THEN
                    EXECUTE format('SELECT greatest($1, (SELECT enqueued_at FROM pgmq.%I
                                                         ORDER BY msg_id DESC LIMIT 1))',
                                   'q_' || band)
                    INTO newest USING newest;
                END IF;
            END LOOP;
            IF newest IS NOT NULL
               AND newest + victim.expires_ms * interval '1 millisecond' >= clock_timestamp() THEN
                UPDATE kombu_pgmq.queues SET last_used_at = newest WHERE queue = victim.queue;
                CONTINUE;
            END IF;
        END IF;
        BEGIN
            FOREACH band IN ARRAY coalesce(victim.band_queues, ARRAY[victim.pgmq_queue]) LOOP
                IF to_regclass(format('pgmq.%I', 'q_' || band)) IS NOT NULL THEN
                    EXECUTE format('LOCK TABLE pgmq.%I IN ACCESS EXCLUSIVE MODE NOWAIT',
                                   'q_' || band);
                END IF;
                IF to_regclass(format('pgmq.%I', 'a_' || band)) IS NOT NULL THEN
                    EXECUTE format('LOCK TABLE pgmq.%I IN ACCESS EXCLUSIVE MODE NOWAIT',
                                   'a_' || band);
                END IF;
            END LOOP;
            IF kombu_pgmq.drop_queue(victim.queue) THEN
                RETURN NEXT victim.queue;
            END IF;
        EXCEPTION WHEN lock_not_available THEN
            -- in use by an open transaction: the next round tries again
        END;
    END LOOP;
END
$$;

-- basic_cancel: forget one consumer; AMQP auto_delete drops the queue when its last
-- consumer goes. Returns true if the queue was dropped.
CREATE FUNCTION kombu_pgmq.release_consumer(kombu_queue text, owner_id text, tag text)
RETURNS boolean
LANGUAGE plpgsql
SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    DELETE FROM kombu_pgmq.consumers
    WHERE queue = kombu_queue AND owner = owner_id AND consumer_tag = tag;
    PERFORM 1 FROM kombu_pgmq.queues WHERE queue = kombu_queue AND auto_delete FOR UPDATE;
    IF FOUND AND NOT EXISTS (SELECT 1 FROM kombu_pgmq.consumers WHERE queue = kombu_queue) THEN
        RETURN kombu_pgmq.drop_queue(kombu_queue);
    END IF;
    RETURN false;
END
$$;

-- Who may call these (see kombu_pgmq.grantable).
INSERT INTO kombu_pgmq.grantable (function, kind, definer) VALUES
    ('kombu_pgmq.reap()', 'worker', true),
    ('kombu_pgmq.release_consumer(text, text, text)', 'worker', true),
    ('kombu_pgmq.wait_for(text, text[], integer)', 'worker', true),
    ('kombu_pgmq.wait_for_due(text, text[], integer)', 'worker', true),
    ('kombu_pgmq.due_payload(timestamptz)', 'owner', false),
    ('kombu_pgmq.notify_waiting(text)', 'owner', true),
    ('kombu_pgmq.notify_waiting(text, timestamptz)', 'owner', true),
    ('kombu_pgmq.wake(text)', 'owner', true),
    ('kombu_pgmq.wake_at_commit()', 'owner', true),
    ('kombu_pgmq.wake_due(text, timestamptz)', 'owner', true);

-- =========================================================================================
-- Routing: exchanges and bindings
-- =========================================================================================

-- Exchanges by name (Kombu exchange names are global in a database, as in a vhost).
CREATE TABLE kombu_pgmq.exchanges (
    exchange text PRIMARY KEY,
    type text NOT NULL CHECK (type IN ('direct', 'topic', 'fanout')),
    durable boolean NOT NULL DEFAULT true,
    auto_delete boolean NOT NULL DEFAULT false,
    created_at timestamptz NOT NULL DEFAULT now()
);

-- queue_bind: messages published to exchange with a matching routing key go to queue.
-- Deleting a queue (its kombu_pgmq.queues row) deletes its bindings.
CREATE TABLE kombu_pgmq.bindings (
    exchange text NOT NULL,
    routing_key text NOT NULL,
    queue text NOT NULL REFERENCES kombu_pgmq.queues (queue) ON DELETE CASCADE,
    created_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (exchange, routing_key, queue)
);

CREATE INDEX bindings_queue_idx ON kombu_pgmq.bindings (queue);

-- One counter, bumped by every change to exchanges or bindings. Processes cache the
-- routing table with the version it was read at; a publish carries that version and
-- sends nothing if it changed (then the process reloads and publishes again).
CREATE TABLE kombu_pgmq.routing_version (
    singleton boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    version bigint NOT NULL
);

INSERT INTO kombu_pgmq.routing_version (version) VALUES (1);

-- The trigger of every change to exchanges or bindings.
CREATE FUNCTION kombu_pgmq.bump_routing_version() RETURNS trigger
LANGUAGE plpgsql
SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    UPDATE kombu_pgmq.routing_version SET version = version + 1;
    RETURN NULL;
END
$$;

CREATE TRIGGER bindings_changed AFTER INSERT OR UPDATE OR DELETE OR TRUNCATE
    ON kombu_pgmq.bindings FOR EACH STATEMENT EXECUTE FUNCTION kombu_pgmq.bump_routing_version();
CREATE TRIGGER exchanges_changed AFTER INSERT OR UPDATE OR DELETE OR TRUNCATE
    ON kombu_pgmq.exchanges FOR EACH STATEMENT EXECUTE FUNCTION kombu_pgmq.bump_routing_version();

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

-- Who may call these (see kombu_pgmq.grantable).
INSERT INTO kombu_pgmq.grantable (function, kind, definer) VALUES
    ('kombu_pgmq.bump_routing_version()', 'owner', true);

-- =========================================================================================
-- Publishing
-- =========================================================================================

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

-- Raise invalid_parameter_value unless 0 <= value <= maximum (NaN fails too): every
-- window a caller sets is capped (deduplication windows, visibility timeouts, waits,
-- slot holds).
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

-- Claim (queue, id) for window_seconds (at most 7 days); true if this publish may send (no
-- live claim).
CREATE FUNCTION kombu_pgmq.claim_deduplication(
    kombu_queue text, dedup_id text, window_seconds double precision
) RETURNS boolean
LANGUAGE plpgsql
SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
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

-- The deduplication id of a message for a PGMQ queue (NULL: none), and its scope.
CREATE FUNCTION kombu_pgmq.deduplication_of(pgmq_name text, headers jsonb,
                                            OUT scope text, OUT dedup_id text)
LANGUAGE plpgsql STABLE
SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
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
LANGUAGE plpgsql
SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
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

-- Publish one message (the wake-up protocol: shared advisory lock, pgmq.send, wake the
-- waiting consumers; a delayed message, delay_seconds > 0 (PGMQ's native delay), wakes
-- them with its due time), unless it is a duplicate within its deduplication window: then
-- nothing is sent and NULL is returned. Inside an application's transaction the waiting
-- consumers are looked for at its commit (kombu_pgmq.wake_due), and a rollback takes the
-- message and the claim back.
CREATE FUNCTION kombu_pgmq.publish(
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

-- Send one message to several queues in the caller's transaction (behind publish_routed
-- and send_task): shared advisory locks, a deduplication claim per queue (in queue order,
-- so concurrent publishers of one id never deadlock), pgmq.send, wake the waiting
-- consumers (a delayed message with its due time). A queue for which the message is a
-- duplicate is skipped: its msg_ids entry is NULL.
CREATE FUNCTION kombu_pgmq.send_to(
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

-- Publish one message to several queues (an exchange's routes) in one transaction, if the
-- routing table is still at expected_version (else nothing is sent: the caller reloads
-- its routes and publishes again); duplicates skipped as send_to does.
CREATE FUNCTION kombu_pgmq.publish_routed(
    queues text[], message jsonb, headers jsonb, expected_version bigint,
    delay_seconds integer DEFAULT 0, deduplication_window double precision DEFAULT 300,
    OUT version bigint, OUT msg_ids bigint[]
)
LANGUAGE plpgsql
SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
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

-- Publish a batch of messages in one call: batch is a JSON array of {"queues": [...],
-- "message": {...}, "headers": {...}, "delay_seconds": n, "visible_at": timestamptz,
-- "deduplication_window": s}, sent in order as kombu_pgmq.send_to sends each (the
-- queues' shared locks, deduplication, pgmq.send), with two differences: a message with
-- visible_at stays invisible until that instant (pgmq.send's timestamptz delay: sub-second,
-- unlike delay_seconds), and consumers are woken once per queue at the end, for the
-- earliest message (not once per message). Nothing is sent, and false returned, when
-- expected_version (NULL: no check) is not the routing table's version.
CREATE FUNCTION kombu_pgmq.publish_many(batch jsonb, expected_version bigint)
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
LANGUAGE plpgsql
SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
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

-- Who may call these (see kombu_pgmq.grantable).
INSERT INTO kombu_pgmq.grantable (function, kind, definer) VALUES
    ('kombu_pgmq.publish(text, jsonb, jsonb, integer, double precision)', 'producer', true),
    ('kombu_pgmq.publish_many(jsonb, bigint)', 'producer', true),
    ('kombu_pgmq.publish_routed(text[], jsonb, jsonb, bigint, integer, double precision)', 'producer', true),
    ('kombu_pgmq.send_task(text, jsonb, jsonb, text, jsonb)', 'producer', true),
    ('kombu_pgmq.forget_deduplications(integer)', 'worker', true),
    ('kombu_pgmq.check_window(text, double precision, double precision)', 'owner', false),
    ('kombu_pgmq.claim_deduplication(text, text, double precision)', 'owner', true),
    ('kombu_pgmq.deduplication_of(text, jsonb)', 'owner', true),
    ('kombu_pgmq.send_to(text[], jsonb, jsonb, integer, double precision)', 'owner', true);

-- =========================================================================================
-- Consuming and settling
-- =========================================================================================

-- Ack and read in one round trip, several queues or priority bands at once (and any queue
-- for least-privilege roles): settle the acks (ack_queues[i] holds the receipt ack_ids[i],
-- ack_cts[i], ack_enqueued[i]; ack_holds and hold_seconds as kombu_pgmq.ack), then read up
-- to qty messages from the queues in the order given (the caller rotates it for
-- fairness), hiding them for vt seconds (at most 12 hours). A stale ack is not applied
-- and is reported with a NOTICE ("kombu_pgmq: ..."), which the client logs. Paused queues
-- are skipped, dead-letter queues read only by roles that may read their tables. A
-- limited queue is read by kombu_pgmq.read_limited (every limited queue's limits row
-- locked first, in name order), with its marker rows; a queue without limits through its
-- read function from its position (kombu_pgmq/_db/positions.py, read_from_position):
-- positions {PGMQ queue: {"scan_from": epoch seconds or null (the start of the index),
-- "watch_xids": [transaction ids in progress at the last read], "watch_bounds": [their
-- bounds, epoch seconds or null]}}; after each such queue's rows comes its position row
-- (msg_id NULL, snapshot not NULL): the snapshot of its read, this transaction's id
-- (stamp: assign one if it has none) and start (epoch seconds), where the walk started and
-- the vt up to which it took every visible row. positions NULL: every queue from the
-- start, and no position rows. The commit is asynchronous (synchronous_commit off) unless
-- there are acks and durable_acks: a server crash can then forget the last deliveries and
-- acks, which only delivers those messages again (at least once); it never loses a
-- message, since publishes always commit synchronously.
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
LANGUAGE plpgsql
SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
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

-- kombu_pgmq.read of a queue without limits: through the queue's read function (created
-- first if missing), its position given as jsonb ({"scan_from": epoch seconds or null,
-- "watch_xids": [...], "watch_bounds": [...]}); the acks are not its.
CREATE FUNCTION kombu_pgmq.read_from_position(
    q text, vt integer, qty integer, at_position jsonb, stamp boolean
) RETURNS TABLE (
    msg_id bigint, read_ct integer, enqueued_at timestamptz, message text, headers text,
    age_seconds double precision, snapshot text, read_xid text, read_at double precision,
    scan_from double precision, scanned_to double precision
)
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM kombu_pgmq.queue_functions(q);
    RETURN QUERY EXECUTE format(
        'SELECT r.msg_id, r.read_ct, r.enqueued_at, r.message, r.headers, r.age_seconds,
                r.snapshot, r.read_xid, r.read_at, r.scan_from, r.scanned_to
         FROM kombu_pgmq.%I(
             $1, $2, p_scan_from => coalesce(($3 ->> ''scan_from'')::float8, ''-Infinity''),
             p_watch_xids => ARRAY(SELECT jsonb_array_elements_text(
                                       coalesce($3 -> ''watch_xids'', ''[]''))),
             p_watch_bounds => ARRAY(SELECT coalesce(b::float8, ''-Infinity'')
                                     FROM jsonb_array_elements_text(
                                         coalesce($3 -> ''watch_bounds'', ''[]'')) AS b),
             p_stamp => $4) AS r
         WHERE r.acked IS NOT TRUE',
        'read_q_' || q) USING vt, qty, at_position, stamp;
END
$$;

-- Deliver and delete up to qty visible messages (basic_get with no_ack), as pgmq.pop:
-- nothing from a paused queue, nor from a dead-letter queue for a role that may not read
-- its table.
CREATE FUNCTION kombu_pgmq.pop(pgmq_name text, qty integer)
RETURNS TABLE (
    queue text, msg_id bigint, read_ct integer, enqueued_at timestamptz, message text,
    headers text, age_seconds double precision
)
LANGUAGE plpgsql
SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
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

-- kombu_pgmq.ack and kombu_pgmq.archive_expired: the receipts grouped by queue, each
-- group settled by its queue's ack function (created first if missing; marks: headers
-- added to the archived copies); a queue that is gone settles nothing.
CREATE FUNCTION kombu_pgmq.settle(
    queues text[], msg_ids bigint[], read_cts integer[], enqueued timestamptz[],
    holds boolean[], hold_seconds integer, marks jsonb
) RETURNS TABLE (queue text, msg_id bigint)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    q text;
    ids bigint[];
    cts integer[];
    ats timestamptz[];
    held boolean[];
BEGIN
    FOR q, ids, cts, ats, held IN
        SELECT h.q, array_agg(h.id), array_agg(h.ct), array_agg(h.at),
               array_agg(coalesce(h.hold, false))
        FROM unnest(queues, msg_ids, read_cts, enqueued, holds) AS h(q, id, ct, at, hold)
        WHERE h.q IS NOT NULL
        GROUP BY h.q ORDER BY h.q
    LOOP
        CONTINUE WHEN NOT EXISTS (SELECT 1 FROM pgmq.meta m WHERE m.queue_name = q)
                      OR to_regclass(format('pgmq.%I', 'q_' || q)) IS NULL;
        PERFORM kombu_pgmq.queue_functions(q);
        RETURN QUERY EXECUTE format(
            'SELECT %L::text, a.id FROM kombu_pgmq.%I($1, $2, $3, $4, $5, $6) AS a(id)',
            q, 'ack_q_' || q) USING ids, cts, ats, held, hold_seconds, marks;
    END LOOP;
END
$$;

-- Ack (queues[i] holds the receipt msg_ids[i], read_cts[i], enqueued[i]): move the rows
-- these deliveries still hold to the archive, as pgmq.archive does, through each queue's
-- ack function. holds (aligned with msg_ids; missing: false): the acks whose tasks run on,
-- whose concurrency slots kombu_pgmq.hold_slots holds for hold_seconds before the archive.
-- The consumers waiting on a limited queue it settled a message of are woken (the slot is
-- free). Returns the (queue, msg_id) settled: a stale receipt is left out.
CREATE FUNCTION kombu_pgmq.ack(
    queues text[], msg_ids bigint[], read_cts integer[], enqueued timestamptz[],
    holds boolean[] DEFAULT '{}', hold_seconds integer DEFAULT 0
) RETURNS TABLE (queue text, msg_id bigint)
LANGUAGE plpgsql
SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
#variable_conflict use_column
BEGIN
    RETURN QUERY SELECT * FROM kombu_pgmq.settle(queues, msg_ids, read_cts, enqueued, holds,
                                                 hold_seconds, NULL);
END
$$;

-- Archive expired messages (x-message-ttl, per-message expiration) with the headers
-- x-archive-reason "expired" and x-expired-at, as kombu_pgmq.ack archives (any worker
-- role may: it runs as its owner).
CREATE FUNCTION kombu_pgmq.archive_expired(
    queues text[], msg_ids bigint[], read_cts integer[], enqueued timestamptz[]
) RETURNS TABLE (queue text, msg_id bigint)
LANGUAGE plpgsql
SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
#variable_conflict use_column
BEGIN
    RETURN QUERY SELECT * FROM kombu_pgmq.settle(
        queues, msg_ids, read_cts, enqueued, '{}', 0,
        jsonb_build_object('x-archive-reason', 'expired', 'x-expired-at', clock_timestamp()));
END
$$;

-- An ack is always recorded. A non-durable queue (UNLOGGED table) is emptied by a crash,
-- and its msg_id sequence (unlogged too) starts again at 1, while its archive is an
-- ordinary logged table that keeps the ids archived before the crash. So a settled (or
-- cancelled) row whose msg_id is already in the archive of pgmq_name is archived under a
-- fresh msg_id taken from its queue's sequence, after the sequence was moved past the
-- highest archived id (so the queue stops reusing ids), with the header "x-queue-msg-id"
-- holding the id it had in the queue; returns the msg_id it was archived under.
-- extra_headers are merged into its headers (cancel_task's and expiry's marks).
-- Serialized per queue by an advisory lock (lock_key_sequence(), hashtext(pgmq_name)), so
-- two sessions never move the sequence past each other. Called only for a conflicting row.
CREATE FUNCTION kombu_pgmq.archive_under_new_id(
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

-- A receipt identifies one delivery forever: read_ct only grows, as PGMQ means it (every
-- read adds one), so no two deliveries of a message share a read_ct. A restore (a
-- channel closed with prefetched messages, a delivery whose callback failed) counts
-- itself in the message's headers instead, as "x-kombu-restored", and the transport
-- counts deliveries toward max_deliveries as read_ct - x-kombu-restored (it takes the
-- header out of the headers the application sees). This returns the headers of a
-- restored message: x-kombu-restored + 1 (a value that is not a number counts as 0, one
-- above 10^9 as 10^9; headers that are not a JSON object, or none, stay as they are).
CREATE FUNCTION kombu_pgmq.count_restore(headers jsonb) RETURNS jsonb
LANGUAGE sql IMMUTABLE AS $$
    SELECT CASE
        WHEN headers IS NULL OR jsonb_typeof(headers) = 'object' THEN
            coalesce(headers, '{}'::jsonb) || jsonb_build_object(
                'x-kombu-restored',
                CASE WHEN jsonb_typeof(headers -> 'x-kombu-restored') = 'number'
                     THEN least(floor((headers ->> 'x-kombu-restored')::numeric), 1e9)::bigint + 1
                     ELSE 1 END)
        ELSE headers
    END
$$;

-- Requeue (reject with requeue, restore on channel close, a delivery that failed before
-- the application saw it) the rows these deliveries still hold (queues[i] holds the
-- receipt msg_ids[i], read_cts[i], enqueued[i]). vt > 0 (seconds, at most 12 hours):
-- visible again then. vt 0: back to its place in the queue, vt = its enqueued_at, as
-- AMQP's requeue ("placed back in its original position"): the reads take visible rows
-- oldest visibility first (vt, then msg_id, on PGMQ's vt index), where vt = now would put
-- it behind every message that became visible before; that place lies below the
-- consumers' read positions, so the queue's channel gets NOTIFY 'rewind' (at commit) and
-- their next read of the queue starts at the beginning of the vt index. uncount: the
-- delivery is counted as a restore (kombu_pgmq.count_restore). The consumers waiting on a
-- limited queue are woken (the delivery's slot is free; at vt: a message visible only
-- then still counts as in flight until then). Returns the (queue, msg_id) requeued.
CREATE FUNCTION kombu_pgmq.requeue(
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

-- Lease renewal: push the visibility timeout of held messages to now + vt seconds, in one
-- round trip for all of a connection's queues, if these deliveries still hold them (a
-- lease that ran out and another consumer read the message, or a message gone: acked,
-- dead-lettered, purged, its queue dropped, is not returned: the caller reports the lease
-- as lost). Asynchronous commit: a server crash ends the holder's connection anyway; it
-- renews again once reconnected.
CREATE FUNCTION kombu_pgmq.renew(
    queues text[], msg_ids bigint[], read_cts integer[], enqueued timestamptz[], vt integer
) RETURNS TABLE (queue text, msg_id bigint)
LANGUAGE plpgsql
SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
#variable_conflict use_column
BEGIN
    PERFORM set_config('synchronous_commit', 'off', true);
    RETURN QUERY SELECT r.queue, r.msg_id
                 FROM kombu_pgmq.requeue(queues, msg_ids, read_cts, enqueued, vt, false) AS r;
END
$$;

-- Delete messages for good (no archive) if these deliveries still hold them: expired
-- messages and what a no_ack consumer was handed. Returns the msg_ids deleted.
CREATE FUNCTION kombu_pgmq.discard(
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

-- Who may call these (see kombu_pgmq.grantable).
INSERT INTO kombu_pgmq.grantable (function, kind, definer) VALUES
    ('kombu_pgmq.ack(text[], bigint[], integer[], timestamptz[], boolean[], integer)', 'worker', true),
    ('kombu_pgmq.archive_expired(text[], bigint[], integer[], timestamp with time zone[])', 'worker', true),
    ('kombu_pgmq.discard(text, bigint[], integer[], timestamptz[])', 'worker', true),
    ('kombu_pgmq.pop(text, integer)', 'worker', true),
    ('kombu_pgmq.read(text[], integer, integer, text[], bigint[], integer[], timestamptz[], boolean, boolean[], integer, jsonb, boolean)', 'worker', true),
    ('kombu_pgmq.renew(text[], bigint[], integer[], timestamptz[], integer)', 'worker', true),
    ('kombu_pgmq.requeue(text[], bigint[], integer[], timestamptz[], integer, boolean)', 'worker', true),
    ('kombu_pgmq.archive_under_new_id(text, bigint, integer, timestamptz, timestamptz, jsonb, jsonb, timestamptz, jsonb)', 'owner', true),
    ('kombu_pgmq.count_restore(jsonb)', 'owner', false),
    ('kombu_pgmq.read_from_position(text, integer, integer, jsonb, boolean)', 'owner', false),
    ('kombu_pgmq.settle(text[], bigint[], integer[], timestamptz[], boolean[], integer, jsonb)', 'owner', false);

-- Messages settled inside an application's transaction (kombu_pgmq.ack_in_transaction:
-- kombu_pgmq.AtomicTask), counted per PGMQ queue and per server process: a session
-- increments only its own row, so no two transactions wait on each other's count.
-- kombu_pgmq.settled_in_transaction sums them.
CREATE TABLE kombu_pgmq.transactional_acks (
    pgmq_queue text NOT NULL,
    backend_pid integer NOT NULL,
    settled bigint NOT NULL DEFAULT 0,
    PRIMARY KEY (pgmq_queue, backend_pid)
);

-- Ack of one delivery inside the caller's transaction (kombu_pgmq.AtomicTask): archive
-- the row this receipt (msg_id, read_ct, enqueued) still holds, as kombu_pgmq.ack does,
-- and count it in transactional_acks; both commit or roll back with the caller's
-- transaction, and the row stays locked by it until then (a read skips it). The fence: a
-- receipt no longer held (the visibility timeout passed and another consumer received
-- the message, it was acked or cancelled, its queue is gone) raises SQLSTATE KP001,
-- which aborts the caller's transaction: nothing of it can commit.
CREATE FUNCTION kombu_pgmq.ack_in_transaction(
    pgmq_name text, msg_id bigint, read_ct integer, enqueued timestamptz
) RETURNS void
LANGUAGE plpgsql
SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM kombu_pgmq.settle(ARRAY[pgmq_name], ARRAY[msg_id],
                                                   ARRAY[read_ct], ARRAY[enqueued],
                                                   '{}', 0, NULL)) THEN
        RAISE EXCEPTION 'kombu_pgmq: message % of PGMQ queue % is no longer held by the delivery with read_ct %',
            msg_id, pgmq_name, read_ct
            USING ERRCODE = 'KP001',
                  HINT = 'its visibility timeout passed and another consumer received it, '
                         'or it was acked, cancelled or removed: this transaction is not '
                         'applied, the other delivery''s is';
    END IF;
    INSERT INTO kombu_pgmq.transactional_acks AS t (pgmq_queue, backend_pid, settled)
    VALUES (pgmq_name, pg_backend_pid(), 1)
    ON CONFLICT (pgmq_queue, backend_pid) DO UPDATE SET settled = t.settled + 1;
END
$$;

-- Messages settled by kombu_pgmq.ack_in_transaction, per PGMQ queue (committed ones).
CREATE FUNCTION kombu_pgmq.settled_in_transaction()
RETURNS TABLE (pgmq_queue text, settled bigint)
LANGUAGE sql STABLE
SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    SELECT t.pgmq_queue, sum(t.settled)::bigint FROM kombu_pgmq.transactional_acks t
    GROUP BY t.pgmq_queue
$$;

-- Who may call these (see kombu_pgmq.grantable).
INSERT INTO kombu_pgmq.grantable (function, kind, definer) VALUES
    ('kombu_pgmq.ack_in_transaction(text, bigint, integer, timestamptz)', 'worker', true),
    ('kombu_pgmq.settled_in_transaction()', 'producer', true);

-- =========================================================================================
-- Per-queue functions (templates)
-- =========================================================================================

-- Each PGMQ queue that kombu_pgmq publishes to, reads or acks gets its own functions,
-- kombu_pgmq.send_q_<queue>, read_q_<queue> and ack_q_<queue>, made from the templates
-- below: their statements name the queue's tables in static SQL (PL/pgSQL prepares and
-- caches their plans per session, where a function shared by every queue must build its
-- statement with format and plan it at each EXECUTE). They run as their owner (SECURITY
-- DEFINER, a fixed search_path), so a least-privilege producer or worker runs the same
-- statements as the owner, and they write PGMQ's tables exactly as pgmq.send, pgmq.read
-- (vt, read_ct, last_read_at) and pgmq.archive (the row moved to the archive) write them.
--
-- The read and ack functions run with enable_seqscan off: PL/pgSQL keeps a generic plan
-- per session, and one made while the table's statistics said it was small scanned the
-- whole heap for the receipts' msg_ids (475 buffers for one ack after 20,000 messages
-- behind a held snapshot, measured), where the primary key finds them.
--
-- kombu_pgmq.queue_functions(queue) creates them (callable by producers and workers; the
-- queue must exist), granted to the roles recorded in kombu_pgmq.roles (send_q to
-- producers, all three to workers); kombu_pgmq.drop_queue drops them with the queue. A
-- caller that finds them missing (a queue made by plain pgmq.create) creates them and
-- calls again.

-- Settle by receipt, the one delete-then-archive of kombu_pgmq (an ack, the acks riding
-- on a read, an expiry): a fragment of a WITH clause, formatted into the ack and the read
-- templates. It archives the rows the receipts (p_ack_ids, p_ack_cts, p_ack_enqueued:
-- msg_id, read_ct, enqueued_at) still hold; a stale receipt is left out. A row whose
-- msg_id is already archived (an UNLOGGED queue's ids restarted after a crash) is
-- archived under a new id (kombu_pgmq.archive_under_new_id), never dropped. settled: the
-- rows settled (a statement must read it: a SELECT in WITH runs only if read).
-- %1$s queue table, %2$s archive table, %3$s the archive columns the queue table has,
-- %4$s their values (headers with %7$s added, a jsonb expression: marks such as
-- x-archive-reason, NULL for none), %5$L the queue, %6$s the row's last_read_at or NULL.
CREATE FUNCTION kombu_pgmq.settle_template() RETURNS text
LANGUAGE sql IMMUTABLE AS $t$
SELECT $template$
moved AS (
        DELETE FROM %1$s AS t
        WHERE t.msg_id = ANY(p_ack_ids)
          AND (t.msg_id, t.read_ct, t.enqueued_at) IN (
              SELECT * FROM unnest(p_ack_ids, p_ack_cts, p_ack_enqueued))
        RETURNING t.*
    ), kept AS (
        INSERT INTO %2$s (%3$s)
        SELECT %4$s FROM moved
        ON CONFLICT DO NOTHING
        RETURNING msg_id
    ), settled AS (
        SELECT m.msg_id, m.read_ct, m.enqueued_at FROM moved m
        WHERE CASE WHEN m.msg_id IN (SELECT k.msg_id FROM kept k) THEN true
                   ELSE kombu_pgmq.archive_under_new_id(
                            %5$L, m.msg_id, m.read_ct, m.enqueued_at, m.vt, m.message,
                            m.headers, %6$s, coalesce(%7$s, '{}')) IS NOT NULL
              END
    )$template$
$t$;

-- Ack: settle the receipts (settle_template). holds (aligned with the receipts): the
-- acks of tasks that run on hold their concurrency slots for hold_seconds, before the
-- archive (the slot is never seen free). A limited queue's waiting consumers are woken
-- when a message settled (its slot is free). marks: headers added to the archived copies
-- (an expiry's x-archive-reason). commit: synchronous_commit of the transaction ('off': a
-- crash may forget the ack; the message is delivered again), NULL the session's. limited:
-- whether the queue is limited, if the caller knows (NULL: look). Returns the msg_ids
-- settled. %1$I function, %2$L queue, %3$s the settle fragment.
CREATE FUNCTION kombu_pgmq.ack_template() RETURNS text
LANGUAGE sql IMMUTABLE AS $t$
SELECT $template$
CREATE OR REPLACE FUNCTION kombu_pgmq.%1$I(
    p_ack_ids bigint[], p_ack_cts integer[], p_ack_enqueued timestamptz[],
    p_holds boolean[] DEFAULT '{}', p_hold_seconds integer DEFAULT 0,
    p_marks jsonb DEFAULT NULL, p_commit text DEFAULT NULL, p_limited boolean DEFAULT NULL
) RETURNS SETOF bigint
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp
SET enable_seqscan = off AS $body$
DECLARE
    n integer;
BEGIN
    IF p_commit IS NOT NULL THEN
        PERFORM set_config('synchronous_commit', p_commit, true);
    END IF;
    IF true = ANY(p_holds) THEN
        PERFORM kombu_pgmq.hold_slots(
            %2$L,
            ARRAY(SELECT h.id FROM unnest(p_ack_ids, p_holds) AS h(id, hold) WHERE h.hold),
            ARRAY(SELECT h.ct FROM unnest(p_ack_cts, p_holds) AS h(ct, hold) WHERE h.hold),
            p_hold_seconds);
    END IF;
    RETURN QUERY
    WITH %3$s
    SELECT s.msg_id FROM settled s;
    GET DIAGNOSTICS n = ROW_COUNT;
    IF n > 0 AND coalesce(p_limited, EXISTS (SELECT 1 FROM kombu_pgmq.limited l
                                             WHERE l.pgmq_queue = %2$L)) THEN
        PERFORM kombu_pgmq.notify_waiting(%2$L);
    END IF;
END
$body$
$template$
$t$;

-- Deliver (a dead-letter queue only to a role that may read its table itself): settle
-- the acks riding along (rows acked true), then deliver up to qty visible messages,
-- hidden for vt_seconds: oldest visibility first on PGMQ's vt index, msg_id breaking
-- ties, FOR UPDATE SKIP LOCKED (concurrent consumers never get the same message);
-- nothing from a paused queue. The walk of the vt index starts at the read's position
-- (kombu_pgmq/_db/positions.py): scan_from (epoch seconds; -Infinity: the start of the
-- index), or earlier at the bound of a transaction in progress at the last read
-- (watch_xids, watch_bounds) that has committed since, so it passes no dead row versions
-- older than that, however many an old snapshot keeps. A queue without limits: the acks
-- and the read in one statement (each statement costs an executor start: two cost a
-- third more per read); its acks hold no slots. A limited queue: the acks through the
-- queue's ack function (slots held, waiting consumers woken), then no more than its
-- limits allow (kombu_pgmq.limit_take locks the queue's limits row to the end of the
-- transaction and returns the budget; kombu_pgmq.limit_done gives back what was not
-- used), saying what they did in a marker row (msg_id NULL, acked false; read_ct: 0
-- limited, 1 throttled until a message settles, 2 throttled by rate with age_seconds =
-- seconds until it allows more, 3 the queue has key limits: read it through
-- kombu_pgmq.read). With qty > 0 the last row (acked NULL) is the position row: the
-- read's snapshot, its own transaction id (stamp: assign one if it has none), its
-- transaction's start (epoch seconds), scan_from, and scanned_to: the vt up to which
-- every visible row was taken (the last row taken when the batch filled; the first row
-- the limits left; scan_from when a pause took nothing). age_seconds (server clock)
-- serves x-message-ttl and per-message expiration; message and headers come back as
-- text (the JSON body goes to Kombu unparsed). %1$I function, %2$I the queue's ack
-- function, %3$L queue, %4$s queue table, %5$s the columns a delivery sets beyond vt and
-- read_ct (last_read_at), %6$s the settle fragment.
CREATE FUNCTION kombu_pgmq.read_template() RETURNS text
LANGUAGE sql IMMUTABLE AS $t$
SELECT $template$
CREATE OR REPLACE FUNCTION kombu_pgmq.%1$I(
    p_vt_seconds integer, p_qty integer,
    p_ack_ids bigint[] DEFAULT '{}', p_ack_cts integer[] DEFAULT '{}',
    p_ack_enqueued timestamptz[] DEFAULT '{}', p_holds boolean[] DEFAULT '{}',
    p_hold_seconds integer DEFAULT 0, p_commit text DEFAULT NULL,
    p_scan_from float8 DEFAULT '-Infinity', p_watch_xids text[] DEFAULT '{}',
    p_watch_bounds float8[] DEFAULT '{}', p_stamp boolean DEFAULT false
) RETURNS TABLE (
    msg_id bigint, read_ct integer, enqueued_at timestamptz, message text, headers text,
    age_seconds float8, acked boolean, snapshot text, read_xid text, read_at float8,
    scan_from float8, scanned_to float8
)
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp
SET enable_seqscan = off AS $body$
#variable_conflict use_column
DECLARE
    v_from timestamptz;
    v_to timestamptz;
    v_paused boolean;
    v_limited boolean;
    v_dead_letter boolean;
    v_commit text;
BEGIN
    IF p_vt_seconds IS NULL OR NOT (p_vt_seconds BETWEEN 0 AND 43200) THEN
        PERFORM kombu_pgmq.check_window('visibility timeout (seconds)', p_vt_seconds, 43200);
    END IF;
    -- what the read needs to know in one statement, the commit mode set on the way
    SELECT EXISTS (SELECT 1 FROM kombu_pgmq.paused p WHERE p.pgmq_queue = %3$L),
           EXISTS (SELECT 1 FROM kombu_pgmq.limited l WHERE l.pgmq_queue = %3$L),
           EXISTS (SELECT 1 FROM kombu_pgmq.queues k
                   WHERE k.pgmq_queue = %3$L AND k.dead_letter),
           CASE WHEN p_commit IS NOT NULL
                THEN set_config('synchronous_commit', p_commit, true) END
      INTO v_paused, v_limited, v_dead_letter, v_commit;
    IF v_dead_letter THEN
        PERFORM kombu_pgmq.guard_dead_letters(ARRAY[%3$L], 'SELECT');
    END IF;
    IF (v_limited OR v_paused OR p_qty <= 0) AND cardinality(p_ack_ids) > 0 THEN
        RETURN QUERY
        SELECT a.id, NULL::integer, NULL::timestamptz, NULL::text, NULL::text,
               NULL::float8, true, NULL::text, NULL::text, NULL::float8, NULL::float8,
               NULL::float8
        FROM kombu_pgmq.%2$I(p_ack_ids, p_ack_cts, p_ack_enqueued, p_holds,
                             p_hold_seconds, NULL, NULL, v_limited) AS a(id);
        p_ack_ids := '{}';
    END IF;
    IF p_qty <= 0 THEN
        RETURN;
    END IF;
    IF p_stamp THEN
        PERFORM pg_current_xact_id();
    END IF;
    v_to := clock_timestamp();
    v_from := to_timestamp(p_scan_from);
    IF cardinality(p_watch_xids) > 0 THEN
        v_from := least(v_from,
                        (SELECT min(to_timestamp(w.bound))
                         FROM unnest(p_watch_xids::xid8[], p_watch_bounds) AS w(xid, bound)
                         WHERE pg_visible_in_snapshot(w.xid, pg_current_snapshot())));
    END IF;
    IF v_paused THEN
        v_to := v_from;  -- nothing taken: the next read starts here again
    ELSIF NOT v_limited THEN
        RETURN QUERY
        WITH %6$s, picked AS (
            SELECT t.msg_id, t.vt FROM %4$s AS t
            WHERE t.vt >= v_from AND t.vt <= v_to
              AND t.msg_id <> ALL(p_ack_ids)  -- being settled by this statement
            ORDER BY t.vt, t.msg_id
            LIMIT p_qty
            FOR UPDATE SKIP LOCKED
        ), delivered AS (
            -- by msg_id = ANY(ARRAY(...)): always the primary key's index, whatever the
            -- planner estimates of the table (a join FROM picked may turn into a
            -- sequential scan)
            UPDATE %4$s AS m
            SET vt = clock_timestamp() + make_interval(secs => p_vt_seconds),
                read_ct = m.read_ct + 1%5$s
            WHERE m.msg_id = ANY(ARRAY(SELECT p.msg_id FROM picked p))
            RETURNING m.msg_id, m.read_ct, m.enqueued_at, m.message, m.headers
        )
        SELECT d.msg_id, d.read_ct, d.enqueued_at, d.message::text, d.headers::text,
               extract(epoch FROM clock_timestamp() - d.enqueued_at)::float8, false,
               NULL::text, NULL::text, NULL::float8, NULL::float8, NULL::float8
        FROM delivered d
        UNION ALL
        SELECT s.msg_id, s.read_ct, s.enqueued_at, NULL, NULL, NULL, true,
               NULL, NULL, NULL, NULL, NULL
        FROM settled s
        UNION ALL
        SELECT NULL, 0, NULL, NULL, NULL, NULL, NULL,
               pg_current_snapshot()::text, pg_current_xact_id_if_assigned()::text,
               extract(epoch FROM transaction_timestamp())::float8,
               extract(epoch FROM v_from)::float8,
               extract(epoch FROM CASE WHEN (SELECT count(*) FROM picked) >= p_qty
                                       THEN (SELECT max(p.vt) FROM picked p)
                                       ELSE v_to END)::float8;
        RETURN;
    ELSE
        -- picked keeps a constant LIMIT (qty rows locked, the allowed ones delivered):
        -- with the budget as its LIMIT the planner expected a tenth of the table and
        -- joined the UPDATE by a sequential scan
        RETURN QUERY
        WITH budget AS MATERIALIZED (
            SELECT b.allowed, b.cut, b.taken
            FROM kombu_pgmq.limit_take(%3$L, p_qty, '{}') AS b
        ), picked AS (
            SELECT t.msg_id, t.vt FROM %4$s AS t
            WHERE t.vt >= v_from AND t.vt <= v_to
            ORDER BY t.vt, t.msg_id
            LIMIT p_qty
            FOR UPDATE SKIP LOCKED
        ), chosen AS (
            SELECT p.msg_id FROM picked p
            ORDER BY p.vt, p.msg_id
            LIMIT (SELECT coalesce(b.allowed, p_qty) FROM budget b)
        ), delivered AS (
            UPDATE %4$s AS m
            SET vt = clock_timestamp() + make_interval(secs => p_vt_seconds),
                read_ct = m.read_ct + 1%5$s
            WHERE m.msg_id = ANY(ARRAY(SELECT c.msg_id FROM chosen c))
            RETURNING m.msg_id, m.read_ct, m.enqueued_at, m.message, m.headers
        ), marker AS MATERIALIZED (
            SELECT d.state, d.retry_seconds
            FROM budget b,
                 kombu_pgmq.limit_done(%3$L, b.allowed, b.cut, b.taken,
                                       (SELECT count(*) FROM delivered)::integer, 0,
                                       ARRAY(SELECT c.msg_id FROM chosen c)) AS d
        )
        SELECT d.msg_id, d.read_ct, d.enqueued_at, d.message::text, d.headers::text,
               extract(epoch FROM clock_timestamp() - d.enqueued_at)::float8, false,
               NULL::text, NULL::text, NULL::float8, NULL::float8, NULL::float8
        FROM delivered d
        UNION ALL
        SELECT NULL, mk.state::integer, NULL, NULL, NULL, mk.retry_seconds, false,
               NULL, NULL, NULL, NULL, NULL
        FROM marker mk
        UNION ALL
        SELECT NULL, 0, NULL, NULL, NULL, NULL, NULL,
               pg_current_snapshot()::text, pg_current_xact_id_if_assigned()::text,
               extract(epoch FROM transaction_timestamp())::float8,
               extract(epoch FROM v_from)::float8,
               extract(epoch FROM CASE WHEN (SELECT count(*) FROM chosen)
                                            < (SELECT count(*) FROM picked)
                                       THEN (SELECT min(p.vt) FROM picked p
                                             WHERE p.msg_id NOT IN (SELECT c.msg_id
                                                                    FROM chosen c))
                                       WHEN (SELECT count(*) FROM picked) >= p_qty
                                       THEN (SELECT max(p.vt) FROM picked p)
                                       ELSE v_to END)::float8;
        RETURN;
    END IF;
    RETURN QUERY
    SELECT NULL::bigint, 0, NULL::timestamptz, NULL::text, NULL::text, NULL::float8,
           NULL::boolean, pg_current_snapshot()::text,
           pg_current_xact_id_if_assigned()::text,
           extract(epoch FROM transaction_timestamp())::float8,
           extract(epoch FROM v_from)::float8, extract(epoch FROM v_to)::float8;
END
$body$
$template$
$t$;

-- Publish one message without deduplication (what kombu_pgmq.publish does for one, as
-- static SQL instead of pgmq.send's format + EXECUTE): the row pgmq.send writes (vt = now
-- + delay_seconds, message, headers; msg_id and enqueued_at from the table's defaults),
-- written after the shared advisory lock of the queue's publishes, consumers waiting on
-- the queue notified after it (a delayed message with its due time). version: a routed
-- publish (an exchange routing to this queue alone) writes nothing, and returns no row,
-- unless the routing version is still the caller's (reload the routes and publish
-- again), as kombu_pgmq.publish_routed. Hand-off: handoff is the NOTIFY payload's tail
-- (message, chr(30), headers: small enough for a NOTIFY), NULL for a delayed or large
-- message. When a waiting consumer offers a slot (kombu_pgmq.hand_off claims it; asked
-- only when a slot is offered on the queue), the row is written as pgmq.read leaves a
-- delivered one (read_ct 1, vt = now + that consumer's visibility timeout, last_read_at)
-- and the consumer's channel is notified with queue, msg_id, enqueued_at (UTC) and the
-- tail, separated by chr(30); no other consumer is woken. commit: 'async', the
-- transaction commits without waiting for the WAL flush (confirm_publish=False); 'off'
-- (visible_before_flush), so does a publish a waiting consumer gets now (handed off, or
-- woken: not delayed and the queue has a waiting row), and says so in column flush (the
-- caller then waits for the flush with statement flush_commits); NULL: as the session
-- does. notified: what the NOTIFY returned (nothing to read). %1$I function, %2$L queue,
-- %3$s queue table, %4$s/%5$s the handed row's last_read_at column and value (nothing
-- for PGMQ < 1.11), %6$s kombu_pgmq.lock_key_publish() (a literal: the statement a
-- publish runs has no function call to fold).
CREATE FUNCTION kombu_pgmq.send_template() RETURNS text
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

-- settle_template for queue q whose queue and archive tables share the columns cols;
-- marks: the jsonb expression added to the archived headers.
CREATE FUNCTION kombu_pgmq.settle_fragment(q text, cols text[], marks text) RETURNS text
LANGUAGE sql STABLE AS $$
SELECT format(
    kombu_pgmq.settle_template(),
    format('pgmq.%I', 'q_' || q), format('pgmq.%I', 'a_' || q),
    (SELECT string_agg(quote_ident(c), ', ' ORDER BY i)
     FROM unnest(cols) WITH ORDINALITY AS u(c, i)),
    (SELECT string_agg(CASE WHEN c = 'headers'
                            THEN format('CASE WHEN %1$s IS NULL THEN headers '
                                        'WHEN headers IS NULL OR jsonb_typeof(headers) = ''object'' '
                                        'THEN coalesce(headers, ''{}''::jsonb) || %1$s '
                                        'ELSE headers END', marks)
                            ELSE quote_ident(c) END, ', ' ORDER BY i)
     FROM unnest(cols) WITH ORDINALITY AS u(c, i)),
    q,
    CASE WHEN 'last_read_at' = ANY(cols) THEN 'm.last_read_at' ELSE 'NULL' END,
    marks)
$$;

-- Whether the queue's functions exist (with the arguments this schema version calls).
CREATE FUNCTION kombu_pgmq.queue_functions_exist(q text) RETURNS boolean
LANGUAGE sql STABLE AS $$
SELECT to_regprocedure(format('kombu_pgmq.%I(bigint[], integer[], timestamptz[], boolean[], integer, jsonb, text, boolean)', 'ack_q_' || q)) IS NOT NULL
   AND to_regprocedure(format('kombu_pgmq.%I(integer, integer, bigint[], integer[], timestamptz[], boolean[], integer, text, float8, text[], float8[], boolean)', 'read_q_' || q)) IS NOT NULL
   AND to_regprocedure(format('kombu_pgmq.%I(jsonb, jsonb, integer, text, text, bigint)', 'send_q_' || q)) IS NOT NULL
$$;

-- Create (or, with replace, recreate) the queue's functions from the templates: the
-- queue's tables and the archive columns it has (PGMQ < 1.11 has no last_read_at), the
-- queue's name as a literal. Owned by the schema owner (this function runs as its
-- owner), no PUBLIC execute, granted to the roles recorded in kombu_pgmq.roles.
-- Creations of one queue's functions take turns (an advisory lock of the transaction);
-- functions that exist are left as they are. Raises undefined_table if the queue does
-- not exist.
CREATE FUNCTION kombu_pgmq.queue_functions(q text, replace boolean DEFAULT false)
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

-- Let a recorded role run the queue's functions (those that exist): a producer publishes
-- (send_q), a worker also reads and acks.
CREATE FUNCTION kombu_pgmq.grant_queue_functions(q text, role_name text) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    f regprocedure;
    granted text := (SELECT r.kind FROM kombu_pgmq.roles r WHERE r.role = role_name);
BEGIN
    FOR f IN SELECT p.oid::regprocedure FROM pg_proc p
             WHERE p.pronamespace = 'kombu_pgmq'::regnamespace
               AND (p.proname = 'send_q_' || q
                    OR (granted = 'worker' AND p.proname IN ('ack_q_' || q, 'read_q_' || q)))
    LOOP
        EXECUTE format('GRANT EXECUTE ON FUNCTION %s TO %I', f, role_name);
    END LOOP;
END
$$;

-- Drop the queue's functions (with the queue).
CREATE FUNCTION kombu_pgmq.drop_queue_functions(q text) RETURNS void
LANGUAGE plpgsql AS $$
DECLARE
    f regprocedure;
BEGIN
    FOR f IN SELECT p.oid::regprocedure FROM pg_proc p
             WHERE p.pronamespace = 'kombu_pgmq'::regnamespace
               AND p.proname IN ('ack_q_' || q, 'read_q_' || q, 'send_q_' || q) LOOP
        EXECUTE format('DROP FUNCTION %s', f);
    END LOOP;
END
$$;

-- Who may call these (see kombu_pgmq.grantable).
INSERT INTO kombu_pgmq.grantable (function, kind, definer) VALUES
    ('kombu_pgmq.queue_functions(text, boolean)', 'producer', true),
    ('kombu_pgmq.ack_template()', 'owner', false),
    ('kombu_pgmq.drop_queue_functions(text)', 'owner', false),
    ('kombu_pgmq.grant_queue_functions(text, text)', 'owner', false),
    ('kombu_pgmq.queue_functions_exist(text)', 'owner', false),
    ('kombu_pgmq.read_template()', 'owner', false),
    ('kombu_pgmq.send_template()', 'owner', false),
    ('kombu_pgmq.settle_fragment(text, text[], text)', 'owner', false),
    ('kombu_pgmq.settle_template()', 'owner', false);

-- =========================================================================================
-- Hand-off
-- =========================================================================================

-- A publish to a queue an idle consumer waits on hands the message to that consumer in
-- its wake-up, instead of waking it to read: no round trip to the consumer's statement
-- connection after the wake-up, and no other consumer waiting on the queue wakes for
-- nothing.
--
-- A consumer going to sleep on a queue also offers one hand-off slot there: its LISTEN
-- connection's own channel, a session advisory lock that connection holds while it
-- listens (one bigint per LISTEN connection, a 64-bit hash of its channel), its
-- visibility timeout, and its sequence (kombu_pgmq.wait_for_handoff). A direct publish
-- (the queue's send function) to a queue with an offered slot claims it
-- (kombu_pgmq.hand_off) and writes the row as pgmq.read leaves a delivered one (read_ct
-- 1, vt = now + the consumer's visibility timeout, last_read_at), then NOTIFYs the
-- consumer's channel with the row (queue, msg_id, enqueued_at, message, headers) instead
-- of the plain wake-up. The consumer delivers it without a read; its receipt settles it
-- like any delivery. One slot per consuming connection: a claim takes its offers on all
-- its queues (priority bands included), and the consumer offers again on the queues whose
-- channel has room (kombu_pgmq.rearm_handoff), so a channel is never handed more than one
-- message past its prefetch window (a higher priority band published to meanwhile is read
-- first), and idle consumers take turns (the longest offered first).
--
-- A claim writes no row. The state of one LISTEN connection's slot is the value of its
-- sequence (one of a pool, kombu_pgmq.handoff_<n>, leased for the life of the connection
-- by a session advisory lock: kombu_pgmq.handoff_lease): offered when the value is a
-- multiple of 2^20 (the offer's time in ms times 2^20: the longest offered is claimed
-- first), taken once a publisher's nextval moved it off (the publisher that got offer + 1
-- owns the claim; a later nextval in the same race gets offer + 2, ... and tries the next
-- consumer). Sequences are not versioned: nextval and setval change the value in place,
-- whatever snapshot is open, where an UPDATE of the waiting rows per message would leave
-- row versions that every publish's lookup walks while a long transaction anywhere in the
-- database holds the xmin horizon. nextval is not rolled back: a publish that claimed and
-- then failed leaves the slot taken, and the consumer is woken the plain way until it
-- offers again (its next wait_for_handoff or rearm_handoff). handoff_slots means "offered
-- on this queue" (its channel has room), written only when that changes. The pool's
-- sequences are never dropped (a publisher may read one any time); a connection's lease
-- ends with its session.
--
-- Nothing is lost: a handed row is a delivered row. If its consumer dies before taking it
-- (or its LISTEN connection drops in that instant, losing the notification), the row
-- becomes visible again when its visibility timeout passes and is read like any lapsed
-- delivery. A consumer whose LISTEN connection is gone no longer holds its lock, so
-- publishers skip its stale slot (pg_try_advisory_xact_lock_shared succeeds on a lock
-- nobody holds) and wake the queue the plain way. Paused and limited queues (FIFO groups
-- are limited) are never handed off: their reads apply their rules. Delayed publishes,
-- deduplicated ones, publishes in the application's transaction and routed publishes to
-- several queues wake the queue the plain way.

-- Lease a pool sequence for this session (the LISTEN connection's) and take its liveness
-- lock lock_key: both session advisory locks, released when the session ends. Returns the
-- sequence's number n (kombu_pgmq.handoff_<n>, created if missing, never dropped).
CREATE FUNCTION kombu_pgmq.handoff_lease(lock_key bigint) RETURNS integer
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

-- Offer the slot of sequence seq now (the value: this moment in ms times 2^20).
CREATE FUNCTION kombu_pgmq.handoff_offer(seq regclass) RETURNS bigint
LANGUAGE sql AS $$
    SELECT setval(seq, (extract(epoch FROM clock_timestamp()) * 1000)::bigint * 1048576, true)
$$;

-- Claim a hand-off slot of a consumer waiting on pgmq_name (called by the queue's send
-- function before it writes the row). payload NULL: the caller hands nothing over (the
-- message is delayed or too large for a NOTIFY), nothing is claimed. Returns the slot's
-- channel and visibility timeout (seconds), or no row: publish and wake the plain way.
-- Writes nothing but the claimed sequence's value: the waiting rows are only read.
CREATE FUNCTION kombu_pgmq.hand_off(pgmq_name text, payload text)
RETURNS TABLE (channel text, vt_seconds integer)
-- ROWS 1: at most one slot (with the default estimate of 1000 rows the send function's
-- plan cost would pass jit_above_cost: ~8 ms of JIT compilation a publish).
LANGUAGE plpgsql ROWS 1
SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
#variable_conflict use_column
DECLARE
    w record;
BEGIN
    IF payload IS NULL OR NOT EXISTS (
        SELECT 1 FROM kombu_pgmq.waiting x
        WHERE x.pgmq_queue = pgmq_name AND x.handoff_slots > 0
    ) THEN
        RETURN;
    END IF;
    IF EXISTS (SELECT 1 FROM kombu_pgmq.paused p WHERE p.pgmq_queue = pgmq_name)
       OR EXISTS (SELECT 1 FROM kombu_pgmq.limited l WHERE l.pgmq_queue = pgmq_name) THEN
        RETURN;
    END IF;
    FOR w IN SELECT o.*
             FROM (SELECT x.handoff_channel, x.handoff_lock, x.handoff_vt, x.handoff_seq,
                          pg_sequence_last_value(x.handoff_seq) AS offered
                   FROM kombu_pgmq.waiting x
                   WHERE x.pgmq_queue = pgmq_name AND x.handoff_slots > 0
                     AND x.handoff_seq IS NOT NULL) AS o
             WHERE o.offered % 1048576 = 0
             ORDER BY o.offered LOOP
        -- its LISTEN connection holds the lock while it listens: a lock we get is a gone one
        CONTINUE WHEN pg_try_advisory_xact_lock_shared(w.handoff_lock);
        -- one slot per connection (its offers on every queue): the first nextval claims it
        CONTINUE WHEN nextval(w.handoff_seq) <> w.offered + 1;
        channel := w.handoff_channel;
        vt_seconds := w.handoff_vt;
        RETURN NEXT;
        RETURN;
    END LOOP;
END
$$;

-- wait_for_due, offering one hand-off slot on handoff_queues (those of queues it waits on
-- that its consumer takes with acks) at channel, held by lock_key, with a visibility
-- timeout of vt seconds, claimed on sequence kombu_pgmq.handoff_<seq>
-- (kombu_pgmq.handoff_lease; not leased: no slot offered). The waiting rows are written
-- only where they change. Same result as wait_for_due.
CREATE FUNCTION kombu_pgmq.wait_for_handoff(
    owner text, queues text[], handoff_queues text[], channel text, lock_key bigint,
    vt integer, seq integer, max_wait_ms integer DEFAULT 50
) RETURNS TABLE (queue text, unsettled boolean, due_in_seconds double precision,
                 server_epoch double precision)
LANGUAGE plpgsql
SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
#variable_conflict use_column
DECLARE
    s regclass := to_regclass(format('kombu_pgmq.handoff_%s', seq));
BEGIN
    PERFORM kombu_pgmq.check_window('visibility timeout (seconds)', vt, 43200);
    RETURN QUERY SELECT * FROM kombu_pgmq.wait_for_due(owner, queues, max_wait_ms);
    IF s IS NULL THEN
        RETURN;  -- not leased: no slot offered
    END IF;
    UPDATE kombu_pgmq.waiting w
    SET handoff_channel = channel, handoff_lock = lock_key, handoff_vt = vt,
        handoff_seq = s, handoff_slots = 1
    WHERE w.owner = wait_for_handoff.owner AND w.pgmq_queue = ANY(handoff_queues)
      AND (w.handoff_channel, w.handoff_lock, w.handoff_vt, w.handoff_seq, w.handoff_slots)
          IS DISTINCT FROM (channel, lock_key, vt, s, 1);
    PERFORM kombu_pgmq.handoff_offer(s);
END
$$;

CREATE FUNCTION kombu_pgmq.rearm_handoff(owner text, queues text[])
RETURNS SETOF text
LANGUAGE plpgsql
SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
#variable_conflict use_column
-- A consumer took its handed message and has room again: offer its slot again on queues,
-- the queues it offers from now on (its other queues are no longer offered), behind the
-- consumers offered longer (asynchronous commit: a crash forgets the offer rows' changes,
-- and the consumer is woken the old way). Returns the queues offered: one left out is no
-- longer waited on (a backlog, the reaper), and is waited on again when next found empty.
DECLARE
    s regclass;
BEGIN
    PERFORM set_config('synchronous_commit', 'off', true);
    UPDATE kombu_pgmq.waiting w
    SET handoff_slots = CASE WHEN w.pgmq_queue = ANY(queues) THEN 1 ELSE 0 END
    WHERE w.owner = rearm_handoff.owner AND w.handoff_channel IS NOT NULL
      AND w.handoff_slots <> CASE WHEN w.pgmq_queue = ANY(queues) THEN 1 ELSE 0 END;
    SELECT min(w.handoff_seq::oid)::regclass INTO s
    FROM kombu_pgmq.waiting w
    WHERE w.owner = rearm_handoff.owner AND w.pgmq_queue = ANY(queues)
      AND w.handoff_channel IS NOT NULL;
    IF s IS NOT NULL THEN
        PERFORM kombu_pgmq.handoff_offer(s);
    END IF;
    RETURN QUERY
        SELECT w.pgmq_queue FROM kombu_pgmq.waiting w
        WHERE w.owner = rearm_handoff.owner AND w.pgmq_queue = ANY(queues)
          AND w.handoff_channel IS NOT NULL AND w.handoff_seq IS NOT NULL;
END
$$;

-- Offers as a publish sees them: each waiting row that offers a slot now (offered on its
-- queue, and its connection's slot not claimed since it was offered).
CREATE VIEW kombu_pgmq.handoff_offers AS
SELECT w.pgmq_queue, w.owner, w.handoff_channel,
       to_timestamp(pg_sequence_last_value(w.handoff_seq) / 1048576 / 1000.0) AS offered_at
FROM kombu_pgmq.waiting w
WHERE w.handoff_slots > 0 AND w.handoff_seq IS NOT NULL
  AND pg_sequence_last_value(w.handoff_seq) % 1048576 = 0;

-- Who may call these (see kombu_pgmq.grantable).
INSERT INTO kombu_pgmq.grantable (function, kind, definer) VALUES
    ('kombu_pgmq.handoff_lease(bigint)', 'worker', true),
    ('kombu_pgmq.rearm_handoff(text, text[])', 'worker', true),
    ('kombu_pgmq.wait_for_handoff(text, text[], text[], text, bigint, integer, integer, integer)', 'worker', true),
    ('kombu_pgmq.hand_off(text, text)', 'owner', true);

-- =========================================================================================
-- Limits
-- =========================================================================================

-- Fleet-wide concurrency and rate limits per queue and per key, enforced in the read: a
-- consumer is never handed a message it may not start, whichever worker it is.
--
-- * Per Kombu queue (all its priority bands together): concurrency (messages delivered and
--   not settled whose lease is live: vt in the future and read_ct > 0, PGMQ's own
--   columns, plus the slots of tasks still running after their ack; a killed worker's
--   messages and slots stop counting when their visibility timeout passes) and rate (a
--   token bucket: rate_per_second, burst tokens at most).
-- * Per key within a queue: a message's key is its header named by limit_key
--   ('x-limit-key' by default; 'task' keys Celery tasks by task name), with the same two
--   limits per key. Messages without the header have no key limit.
-- * FIFO queues (x-fifo-groups) are the concurrency-1 case: key 'x-group-id',
--   key_concurrency 1, ordered_keys (a key's messages go out in msg_id order: one is
--   delivered only while fewer than key_concurrency messages of its key are ahead of it
--   in the queue, in flight or not, or running from a held slot).
--
-- A limited read locks its queue's limits row (readers of one limited queue take turns;
-- kombu_pgmq.read locks every limited queue it reads in name order, so two readers never
-- wait on each other in a circle), counts what is in flight (or trusts in_flight_bound
-- when it leaves room), takes tokens, and reads no more than that: a refused message is
-- not read, so its read_ct (dead-lettering) does not move. It returns, after its
-- messages, one marker row per band read (msg_id NULL): read_ct 0 = limited, not
-- throttled; 1 = throttled until a message settles (acks, requeues, dead letters and
-- released slots wake waiting consumers); 2 = throttled until tokens refill, age_seconds
-- = in how many seconds; 3 (the queues' read functions only) = the queue has key limits,
-- read it through kombu_pgmq.read. Clients learn from it that a queue is limited. Queue
-- limits alone: the queue's read function with kombu_pgmq.limit_take and limit_done; key
-- limits: kombu_pgmq.read -> read_limited.

-- One row per limited Kombu queue. rate/key_rate as given ('100/s'), *_per_second parsed;
-- burst NULL: the default, the tokens of 0.1 s and at least 1. tokens/refilled_at: the
-- queue's bucket (NULL: full). in_flight_bound: at least as many messages as are in
-- flight (NULL: unknown): the last exact count plus every delivery since; a read counts
-- again only when the bound leaves less room than it asks for (see limit_take).
-- throttled_*: reads that left visible messages undelivered because of that limit
-- (counters for kombu_pgmq_queue_throttled_total).
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

-- Concurrency slots of tasks that run on after their message was acked. Celery acks a
-- task's message when the task starts unless acks_late, so the rows in flight alone would
-- cap the messages waiting in workers, not the running tasks. A worker holds a slot for a
-- task still running when its message is acked (a row here, inserted by the ack itself,
-- in its transaction, before it archives the message: kombu_pgmq.hold_slots from the
-- queue's ack function), renews it with its leases (renew_slots) and releases it when the
-- task finishes (release_slots deletes it). The limits count held slots with the rows in
-- flight; a slot whose process died stops counting when held_until passes (one
-- visibility timeout after its last renewal), so no slot is lost for good. The message
-- itself is archived at the ack: an early-acked task is never delivered again.
-- A release may reach the server before the ack that holds the slot (they travel on
-- different connections, and a short task ends before its batched ack is sent): it then
-- writes a tombstone (released = true, held_until = now) that the late hold leaves alone;
-- a hold that commits while the release waits on its row becomes the tombstone. Rows
-- whose held_until is a minute old (tombstones, slots of workers that died) are swept by
-- the renewal rounds (renew_slots), not by every hold and release.
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

-- A FIFO queue gets its group limit with its queue row.
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

-- What is in flight in limited Kombu queue kombu_queue at at_time: delivered, not settled,
-- lease live (all its bands; pgmq's vt index, vt > at_time: in flight and delayed rows, by
-- an index scan that marks the entries of acked rows dead and skips them after), plus the
-- slots held by tasks still running after their ack; total, and by_key {key: count} by
-- the header key_header. tolerant: a band whose table is gone or locked counts 0 (for the
-- statistics) instead of raising.
CREATE FUNCTION kombu_pgmq.in_flight_by_key(
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

-- Read up to qty messages of limited Kombu queue kombu_queue from its PGMQ queues
-- read_bands (in that order: priority bands highest first), within its limits; then one
-- marker row per band (see the top of this area). A queue without limits (cleared
-- meanwhile) is read as pgmq.read reads it, without markers. Queue limits alone: the
-- budget of kombu_pgmq.limit_take, then pgmq.read. Key limits: what is in flight is
-- counted at every read (kombu_pgmq.in_flight_by_key, which counts the rows in flight
-- before the held slots: a task acked between the two is counted twice, never missed);
-- keyed reads rank at most qty * 16 + 100 visible rows of keys not at their limit per
-- band (ordered keys: every keyed row, as PGMQ's read_grouped_head), skipping over rows of
-- keys at their limit; an ordered key delivers a message only while fewer than
-- key_concurrency messages of its key are ahead of it in the queue or running from a held
-- slot (both counted in the statement that reads). Either way the limits row is locked
-- (and updated) by the read.
CREATE FUNCTION kombu_pgmq.read_limited(
    kombu_queue text, read_bands text[], vt integer, qty integer
) RETURNS TABLE (
    queue text, msg_id bigint, read_ct integer, enqueued_at timestamptz, message text,
    headers text, age_seconds double precision
)
LANGUAGE plpgsql
SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
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

-- The budget of one read of limited PGMQ queue pgmq_name (a queue without key limits), for
-- the queues' read functions. Locks the queue's limits row (held to the end of the
-- reader's transaction) and, in statements of its own (a snapshot taken after the lock:
-- the deliveries of the reader before us are counted), counts what is in flight, leaving
-- out acked_ids (acked by the same statement), and takes up to qty tokens. Held slots
-- count through in_flight_bound (the last count plus every delivery since: a held slot
-- was a delivery). Returns allowed (messages the read may deliver), cut (1 concurrency, 2
-- rate, 0 none) and the tokens taken; limit_done gives back what was not delivered.
-- allowed NULL: the queue is not limited (read it as any); cut 3: it has key limits (read
-- it through kombu_pgmq.read). ROWS 1 (as limit_done): with the planner's default of 1000
-- rows per function the reading statement's estimated cost passes jit_above_cost, and JIT
-- compiling costs 20 ms a read. enable_seqscan off: counting what is in flight reads
-- pgmq's vt index (vt > now: in flight and delayed rows), never the whole table (with a
-- backlog analyzed while it was visible, the planner would choose a sequential scan of
-- every row).
CREATE FUNCTION kombu_pgmq.limit_take(pgmq_name text, qty integer, acked_ids bigint[])
RETURNS TABLE (allowed integer, cut smallint, taken double precision)
LANGUAGE plpgsql ROWS 1 SET enable_seqscan = off SET enable_bitmapscan = off
SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
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

-- The end of a limited read by a queue's read function: wake the consumers waiting on the
-- queue if it settled messages (acked > 0: their slots are free); if a limit cut the read
-- or it delivered less than allowed, give back the tokens taken and the room in
-- in_flight_bound not used, and count a throttled read (a limit cut it and visible
-- messages were left, other than seen_ids: those delivered or acked by the read); return
-- the read's marker (state as read_limited's markers, 3 for a queue with key limits;
-- retry_seconds: until the rate allows one more, for state 2), none for a queue without
-- limits (allowed NULL).
CREATE FUNCTION kombu_pgmq.limit_done(
    pgmq_name text, allowed integer, cut smallint, taken double precision, delivered integer,
    acked integer, seen_ids bigint[]
) RETURNS TABLE (state smallint, retry_seconds double precision)
LANGUAGE plpgsql ROWS 1
SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
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

-- Hold a slot for each delivery (msg_ids with the read_cts they were delivered with) of
-- PGMQ queue pgmq_name whose task runs on after its ack, for hold_seconds: called by the
-- queue's ack function before it archives them (the row is still in flight, so the limit
-- never sees the task's slot free). Only for a queue with a concurrency or key
-- concurrency limit (FIFO groups included); returns the msg_ids held (none: the queue has
-- no such limit, or the deliveries are stale). A tombstone (released ahead) stays.
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
-- renewed (one missing is not held yet, was released, or its queue was dropped). Forgets
-- the rows that stopped counting a minute ago (tombstones, lapsed slots).
CREATE FUNCTION kombu_pgmq.renew_slots(
    pgmq_names text[], msg_ids bigint[], hold_seconds integer
) RETURNS TABLE (queue text, msg_id bigint)
LANGUAGE sql
SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    DELETE FROM kombu_pgmq.held_slots h
    WHERE h.held_until < clock_timestamp() - interval '1 minute';
    UPDATE kombu_pgmq.held_slots h
    SET held_until = clock_timestamp() + make_interval(secs => hold_seconds)
    FROM unnest(pgmq_names, msg_ids) AS s(q, id)
    WHERE h.pgmq_queue = s.q AND h.msg_id = s.id AND NOT h.released
    RETURNING h.pgmq_queue, h.msg_id
$$;

-- Release slots (their tasks finished; pgmq_names and msg_ids aligned): delete them, and
-- wake the consumers waiting on their queues (the slots are free). A slot not held yet
-- (its ack is still on its way) is released ahead: a tombstone its hold will not
-- overwrite. Returns how many were held.
CREATE FUNCTION kombu_pgmq.release_slots(pgmq_names text[], msg_ids bigint[])
RETURNS integer
LANGUAGE plpgsql
SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
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
LANGUAGE plpgsql
SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
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

-- Who may call these (see kombu_pgmq.grantable).
INSERT INTO kombu_pgmq.grantable (function, kind, definer) VALUES
    ('kombu_pgmq.limits_info(text)', 'worker', true),
    ('kombu_pgmq.release_slots(text[], bigint[])', 'worker', true),
    ('kombu_pgmq.renew_slots(text[], bigint[], integer)', 'worker', true),
    ('kombu_pgmq.set_queue_limits(text, jsonb, boolean)', 'worker', true),
    ('kombu_pgmq.burst_of(double precision, double precision)', 'owner', false),
    ('kombu_pgmq.hold_slots(text, bigint[], integer[], integer)', 'owner', false),
    ('kombu_pgmq.in_flight_by_key(text, text, timestamptz, boolean)', 'owner', false),
    ('kombu_pgmq.limit_done(text, integer, smallint, double precision, integer, integer, bigint[])', 'owner', true),
    ('kombu_pgmq.limit_fifo_groups()', 'owner', false),
    ('kombu_pgmq.limit_take(text, integer, bigint[])', 'owner', true),
    ('kombu_pgmq.rate_per_second(text)', 'owner', false),
    ('kombu_pgmq.read_limited(text, text[], integer, integer)', 'owner', true),
    ('kombu_pgmq.tokens_at(double precision, timestamptz, double precision, double precision, timestamptz)', 'owner', false);

-- =========================================================================================
-- Dead letters, paused queues, statistics and tasks by id (operations)
-- =========================================================================================
--
-- The statistics are every granted role's (a metrics exporter may run as a producer
-- role); steering and lookups (pause, resume, find, cancel, peek) are the owner's:
-- operators run kombu-pgmq as the owner. The dead-letter admin (kombu-pgmq dlq) reads
-- the dead-letter queue's table itself.

-- Raise insufficient_privilege if any of these PGMQ queues is a dead-letter queue whose
-- table the session's role may not `privilege` (SELECT: read, pop; DELETE: purge)
-- itself. One probe of a partial index when none is.
CREATE FUNCTION kombu_pgmq.guard_dead_letters(pgmq_names text[], privilege text)
RETURNS void
LANGUAGE plpgsql STABLE
SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
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

-- Move messages to the dead-letter queue in one statement (so atomically): delete from
-- the source queue table the rows these deliveries still hold (receipt handles), send
-- each to the dead-letter queue with an "x-dead-letter" header recording where it came
-- from and why (and the error, for undecodable rows), mark the target a dead-letter queue
-- (kombu_pgmq.queues.dead_letter), and wake the consumers waiting on a limited source
-- queue (the slot is free). Returns the new msg_ids.
CREATE FUNCTION kombu_pgmq.dead_letter(
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

-- One row per PGMQ queue (priority band) of a paused Kombu queue. Consumers' reads skip
-- these (kombu_pgmq.read, kombu_pgmq.pop, the queues' read functions); nothing else
-- changes: publishes land, acks and lease renewals of messages already delivered work,
-- PGMQ's own functions and clients ignore the flag. Dropping the Kombu queue forgets its
-- pause.
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
LANGUAGE plpgsql
SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
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
LANGUAGE plpgsql
SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
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
LANGUAGE plpgsql
SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
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
LANGUAGE plpgsql
SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
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
-- x-archive-reason "cancelled", x-cancelled-at and x-cancelled-by (a row whose msg_id is
-- already archived: under a new one, kombu_pgmq.archive_under_new_id). A message being
-- read concurrently is skipped (SKIP LOCKED) and, once delivered, is no longer
-- cancellable: the caller revokes it through Celery's control then. Returns what was
-- cancelled.
CREATE FUNCTION kombu_pgmq.cancel_task(task_id text)
RETURNS TABLE (queue text, pgmq_queue text, msg_id bigint)
LANGUAGE plpgsql
SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
#variable_conflict use_column
DECLARE
    r record;
    cols text;
    stamp text;
    marks jsonb := jsonb_build_object('x-archive-reason', 'cancelled',
                                      'x-cancelled-at', clock_timestamp(),
                                      'x-cancelled-by', session_user);
BEGIN
    FOR r IN SELECT * FROM kombu_pgmq.queue_map() LOOP
        CONTINUE WHEN to_regclass(format('pgmq.%I', 'q_' || r.pgmq_queue)) IS NULL
                   OR to_regclass(format('pgmq.%I', 'a_' || r.pgmq_queue)) IS NULL;
        cols := 'msg_id, read_ct, enqueued_at, vt, message';
        stamp := 'NULL';
        IF EXISTS (SELECT 1 FROM pg_attribute
                   WHERE attrelid = format('pgmq.%I', 'a_' || r.pgmq_queue)::regclass
                     AND attname = 'last_read_at' AND NOT attisdropped) THEN
            cols := cols || ', last_read_at';
            stamp := 'moved.last_read_at';
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
                 RETURNING msg_id
             )
             SELECT %4$L::text, %5$L::text, moved.msg_id FROM moved
             WHERE CASE WHEN moved.msg_id IN (SELECT kept.msg_id FROM kept) THEN true
                        ELSE kombu_pgmq.archive_under_new_id(
                                 %5$L, moved.msg_id, moved.read_ct, moved.enqueued_at,
                                 moved.vt, moved.message, moved.headers, %6$s, $2) IS NOT NULL
                   END',
            'q_' || r.pgmq_queue, 'a_' || r.pgmq_queue, cols, r.queue, r.pgmq_queue, stamp
        ) USING task_id, marks;
    END LOOP;
END
$$;

-- Up to qty messages of a Kombu queue without consuming them (no visibility change, no
-- read_ct): higher priority bands first, then publish order. Raises undefined_table for
-- an unknown queue.
CREATE FUNCTION kombu_pgmq.peek(kombu_queue text, qty integer DEFAULT 20)
RETURNS TABLE (
    pgmq_queue text, band integer, state text, msg_id bigint, read_ct integer,
    enqueued_at timestamptz, visible_at timestamptz, message text, headers text
)
LANGUAGE plpgsql
SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
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

-- Who may call these (see kombu_pgmq.grantable).
INSERT INTO kombu_pgmq.grantable (function, kind, definer) VALUES
    ('kombu_pgmq.queue_stats(text, bigint)', 'producer', true),
    ('kombu_pgmq.dead_letter(text, bigint[], integer[], timestamptz[], text[], text, text, text)', 'worker', true),
    ('kombu_pgmq.cancel_task(text)', 'owner', true),
    ('kombu_pgmq.find_task(text, boolean)', 'owner', true),
    ('kombu_pgmq.guard_dead_letters(text[], text)', 'owner', true),
    ('kombu_pgmq.pause(text)', 'owner', true),
    ('kombu_pgmq.peek(text, integer)', 'owner', true),
    ('kombu_pgmq.resume(text)', 'owner', true);

-- =========================================================================================
-- Revocations
-- =========================================================================================

-- Celery task ids revoked (AsyncResult.revoke(), celery control revoke, kombu-pgmq task
-- cancel), kept until expires_at: workers started later load them, and a result backend
-- read of a revoked task with no result reports REVOKED.
CREATE TABLE kombu_pgmq.revoked (
    task_id text PRIMARY KEY,
    revoked_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    revoked_by text NOT NULL DEFAULT session_user,
    expires_at timestamptz
);

-- Record revocations (idempotent) and NOTIFY kombu_pgmq_results with each task's result
-- key prefix-free id (payload "revoked\n<task id>"), so a waiting get() wakes.
CREATE FUNCTION kombu_pgmq.revoke_tasks(task_ids text[], expires_seconds double precision)
RETURNS integer
LANGUAGE plpgsql
SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    added integer;
    t text;
BEGIN
    INSERT INTO kombu_pgmq.revoked (task_id, expires_at)
    SELECT DISTINCT i, CASE WHEN expires_seconds > 0
                            THEN clock_timestamp() + make_interval(secs => expires_seconds) END
    FROM unnest(task_ids) AS i
    ON CONFLICT (task_id) DO NOTHING;
    GET DIAGNOSTICS added = ROW_COUNT;
    FOREACH t IN ARRAY task_ids LOOP
        PERFORM pg_catalog.pg_notify('kombu_pgmq_results', E'revoked\n' || t);
    END LOOP;
    RETURN added;
END
$$;

-- Revocations in force (a starting worker loads them), newest first.
CREATE FUNCTION kombu_pgmq.revoked_tasks(max_rows integer)
RETURNS TABLE (task_id text, revoked_at timestamptz, expires_at timestamptz)
LANGUAGE sql STABLE
SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    SELECT v.task_id, v.revoked_at, v.expires_at FROM kombu_pgmq.revoked v
    WHERE v.expires_at IS NULL OR v.expires_at > clock_timestamp()
    ORDER BY v.revoked_at DESC LIMIT max_rows
$$;

-- Who may call these (see kombu_pgmq.grantable).
INSERT INTO kombu_pgmq.grantable (function, kind, definer) VALUES
    ('kombu_pgmq.revoke_tasks(text[], double precision)', 'producer', true),
    ('kombu_pgmq.revoked_tasks(integer)', 'worker', true);

-- =========================================================================================
-- Results and chords (Celery's result backend)
-- =========================================================================================

-- Celery's result backend: task results and saved groups, chord counters per header
-- task id (revocations: the area above). kombu_pgmq.results (Python) is the only caller;
-- roles reach the tables only through these SECURITY DEFINER functions. A worker writes
-- results, counts chords and expires; a producer (the client that applies tasks, chords
-- and groups, and waits for them) reads results, saves groups (no other key), starts
-- chords, forgets keys and revokes. Neither has any privilege on the tables: no role but
-- the owner can read all results, truncate or drop them.

-- One row per Celery key (celery-task-meta-<task id>, celery-taskset-meta-<group id>,
-- with result_backend_transport_options' global_keyprefix in front). meta: Celery's
-- encoded meta (result_serializer, result_compression), never parsed here; state: its
-- status, written beside it (counts by state, the SUCCESS guard). expires_at NULL: kept
-- until forgotten.
CREATE TABLE kombu_pgmq.results (
    key text PRIMARY KEY,
    state text NOT NULL,
    meta bytea NOT NULL,
    date_done timestamptz NOT NULL DEFAULT clock_timestamp(),
    expires_at timestamptz
);

-- The expiry sweep (results_expire) and `kombu-pgmq results` read by expiry and state.
CREATE INDEX results_expires_at_idx ON kombu_pgmq.results (expires_at)
    WHERE expires_at IS NOT NULL;

-- Store (insert or replace) one key's meta and NOTIFY channel kombu_pgmq_results, so a
-- waiting AsyncResult.get() wakes (payload: the key, then a newline and the meta in base64
-- when it fits a notification, else the key alone: the listener reads it). keep_success:
-- a stored SUCCESS is never replaced (Celery's rule in _store_result: a redelivered task
-- must not overwrite its successful result). Returns false when nothing was written.
CREATE FUNCTION kombu_pgmq.results_store(
    result_key text, result_state text, result_meta bytea,
    expires_seconds double precision, keep_success boolean
) RETURNS boolean
LANGUAGE plpgsql
SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    until timestamptz;
BEGIN
    IF expires_seconds IS NOT NULL AND expires_seconds > 0 THEN
        until := clock_timestamp() + make_interval(secs => expires_seconds);
    END IF;
    INSERT INTO kombu_pgmq.results AS r (key, state, meta, date_done, expires_at)
    VALUES (result_key, result_state, result_meta, clock_timestamp(), until)
    ON CONFLICT (key) DO UPDATE
        SET state = excluded.state, meta = excluded.meta, date_done = excluded.date_done,
            expires_at = excluded.expires_at
        WHERE NOT (keep_success AND r.state = 'SUCCESS');
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    IF octet_length(result_meta) <= 5000 THEN
        PERFORM pg_catalog.pg_notify('kombu_pgmq_results',
            result_key || E'\n' || pg_catalog.translate(pg_catalog.encode(result_meta, 'base64'), E'\n', ''));
    ELSE
        PERFORM pg_catalog.pg_notify('kombu_pgmq_results', result_key);
    END IF;
    RETURN true;
END
$$;

-- A saved GroupResult (GroupResult.save(), a chord whose header holds groups): what a
-- producer role may store. Any other key is a worker's to write.
CREATE FUNCTION kombu_pgmq.results_save_group(
    result_key text, result_meta bytea, expires_seconds double precision
) RETURNS boolean
LANGUAGE plpgsql
SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    IF pg_catalog.strpos(result_key, 'celery-taskset-meta-') = 0 THEN
        RAISE EXCEPTION 'kombu_pgmq: % is not a saved group''s key: task results are stored by a worker role (kombu-pgmq schema grant worker ROLE)',
            result_key USING ERRCODE = 'insufficient_privilege';
    END IF;
    RETURN kombu_pgmq.results_store(result_key, 'SUCCESS', result_meta, expires_seconds, false);
END
$$;

-- The stored meta of each key (keys without a row are left out), and for task keys
-- without a row whose task id is in kombu_pgmq.revoked, revoked = true (meta NULL): the
-- caller reports REVOKED. task_ids: the task id of each key (NULL for group keys).
CREATE FUNCTION kombu_pgmq.results_get(result_keys text[], task_ids text[])
RETURNS TABLE (key text, meta bytea, revoked boolean)
LANGUAGE sql STABLE
SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    SELECT k.key, r.meta, (r.key IS NULL)
    FROM unnest(result_keys, task_ids) AS k(key, task_id)
    LEFT JOIN kombu_pgmq.results r ON r.key = k.key
    WHERE r.key IS NOT NULL
       OR (k.task_id IS NOT NULL AND EXISTS (
               SELECT 1 FROM kombu_pgmq.revoked v
               WHERE v.task_id = k.task_id
                 AND (v.expires_at IS NULL OR v.expires_at > clock_timestamp())))
$$;

-- Forget keys (AsyncResult.forget(), GroupResult.delete()). Returns how many were removed.
CREATE FUNCTION kombu_pgmq.results_delete(result_keys text[]) RETURNS integer
LANGUAGE sql
SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    WITH gone AS (DELETE FROM kombu_pgmq.results WHERE key = ANY(result_keys) RETURNING 1)
    SELECT count(*)::integer FROM gone
$$;

-- Set the expiry of keys (seconds from now; NULL or 0: never).
CREATE FUNCTION kombu_pgmq.results_expire_at(result_keys text[], expires_seconds double precision)
RETURNS void
LANGUAGE sql
SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    UPDATE kombu_pgmq.results
    SET expires_at = CASE WHEN expires_seconds > 0
                          THEN clock_timestamp() + make_interval(secs => expires_seconds) END
    WHERE key = ANY(result_keys)
$$;

-- A chord waiting on its header: size from set_chord_size (NULL until the last header
-- task is published), added by Task.add_to_chord / replace, done = header tasks counted.
-- fired_at: when the part that completed it claimed the callback (in the transaction that
-- publishes it), so a copy of a header task that runs again later never fires it twice.
CREATE TABLE kombu_pgmq.chords (
    group_id text PRIMARY KEY,
    size integer,
    added integer NOT NULL DEFAULT 0,
    done integer NOT NULL DEFAULT 0,
    fired_at timestamptz,
    created_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    expires_at timestamptz
);

CREATE INDEX chords_expires_at_idx ON kombu_pgmq.chords (expires_at)
    WHERE expires_at IS NOT NULL;

-- One row per header task counted: the primary key is what makes a redelivered header
-- task (run twice) count once. result: Celery's encoded result of that task.
CREATE TABLE kombu_pgmq.chord_parts (
    group_id text NOT NULL REFERENCES kombu_pgmq.chords ON DELETE CASCADE,
    task_id text NOT NULL,
    group_index integer,
    state text NOT NULL,
    result bytea NOT NULL,
    PRIMARY KEY (group_id, task_id)
);

-- Delete up to batch expired results (and expired chords and revocations); returns the
-- results removed. Rows locked by a concurrent sweep are skipped.
CREATE FUNCTION kombu_pgmq.results_expire(batch integer) RETURNS integer
LANGUAGE plpgsql
SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    removed integer;
BEGIN
    WITH doomed AS (
        SELECT r.key FROM kombu_pgmq.results r
        WHERE r.expires_at <= clock_timestamp()
        ORDER BY r.expires_at LIMIT batch FOR UPDATE SKIP LOCKED
    ), gone AS (
        DELETE FROM kombu_pgmq.results r USING doomed WHERE r.key = doomed.key RETURNING 1
    )
    SELECT count(*)::integer INTO removed FROM gone;
    DELETE FROM kombu_pgmq.chords c
    WHERE c.group_id IN (SELECT c2.group_id FROM kombu_pgmq.chords c2
                         WHERE c2.expires_at <= clock_timestamp()
                         LIMIT batch FOR UPDATE SKIP LOCKED);
    DELETE FROM kombu_pgmq.revoked v
    WHERE v.task_id IN (SELECT v2.task_id FROM kombu_pgmq.revoked v2
                        WHERE v2.expires_at <= clock_timestamp()
                        LIMIT batch FOR UPDATE SKIP LOCKED);
    RETURN removed;
END
$$;

-- Counts, oldest and bytes by state (kombu-pgmq results, metrics).
CREATE FUNCTION kombu_pgmq.results_stats()
RETURNS TABLE (state text, results bigint, oldest timestamptz, bytes bigint, expired bigint)
LANGUAGE sql STABLE
SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    SELECT r.state, count(*), min(r.date_done), sum(octet_length(r.meta))::bigint,
           count(*) FILTER (WHERE r.expires_at <= clock_timestamp())
    FROM kombu_pgmq.results r GROUP BY r.state ORDER BY r.state
$$;

-- A new run of chord group_id (apply_chord, before its header is published): forget a
-- previous run of the same (frozen, re-applied) group id.
CREATE FUNCTION kombu_pgmq.chord_start(chord_group text, expires_seconds double precision)
RETURNS void
LANGUAGE sql
SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    DELETE FROM kombu_pgmq.chords WHERE group_id = chord_group;
    INSERT INTO kombu_pgmq.chords (group_id, expires_at)
    VALUES (chord_group, CASE WHEN expires_seconds > 0
                              THEN clock_timestamp() + make_interval(secs => expires_seconds) END);
$$;

-- The number of header tasks (set_chord_size); added_parts: Task.add_to_chord.
CREATE FUNCTION kombu_pgmq.chord_size(chord_group text, chord_size integer, added_parts integer,
                                      expires_seconds double precision)
RETURNS void
LANGUAGE sql
SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    INSERT INTO kombu_pgmq.chords AS c (group_id, size, added, expires_at)
    VALUES (chord_group, chord_size, coalesce(added_parts, 0),
            CASE WHEN expires_seconds > 0
                 THEN clock_timestamp() + make_interval(secs => expires_seconds) END)
    ON CONFLICT (group_id) DO UPDATE
        SET size = coalesce(excluded.size, c.size), added = c.added + excluded.added;
$$;

-- Count header task task_id of chord chord_group, once per task id (a redelivered task
-- that runs again is not counted again). fire: this call completed the chord and claimed
-- its callback (exactly one call ever gets true); done/total: parts counted and expected.
-- fallback_size: the size the request carries, used when set_chord_size never ran.
CREATE FUNCTION kombu_pgmq.chord_part(
    chord_group text, part_task text, part_index integer, part_state text,
    part_result bytea, fallback_size integer, expires_seconds double precision
) RETURNS TABLE (fire boolean, done integer, total integer)
LANGUAGE plpgsql
SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
#variable_conflict use_column
DECLARE
    c kombu_pgmq.chords;
    expected integer;
BEGIN
    INSERT INTO kombu_pgmq.chords (group_id, size, expires_at)
    VALUES (chord_group, fallback_size,
            CASE WHEN expires_seconds > 0
                 THEN clock_timestamp() + make_interval(secs => expires_seconds) END)
    ON CONFLICT (group_id) DO NOTHING;
    SELECT * INTO c FROM kombu_pgmq.chords WHERE group_id = chord_group FOR UPDATE;
    expected := coalesce(c.size, fallback_size) + c.added;
    INSERT INTO kombu_pgmq.chord_parts (group_id, task_id, group_index, state, result)
    VALUES (chord_group, part_task, part_index, part_state, part_result)
    ON CONFLICT (group_id, task_id) DO NOTHING;
    IF NOT FOUND THEN  -- this header task was counted before
        RETURN QUERY SELECT false, c.done, expected;
        RETURN;
    END IF;
    UPDATE kombu_pgmq.chords SET done = chords.done + 1,
        fired_at = CASE WHEN chords.fired_at IS NULL AND expected IS NOT NULL
                             AND chords.done + 1 >= expected
                        THEN clock_timestamp() ELSE chords.fired_at END
    WHERE group_id = chord_group;
    RETURN QUERY SELECT (c.fired_at IS NULL AND expected IS NOT NULL AND c.done + 1 >= expected),
                        c.done + 1, expected;
END
$$;

-- The counted header results of chord_group in header order (group_index, then the order
-- they were counted in), for the callback. Called once, by the part that fired it.
CREATE FUNCTION kombu_pgmq.chord_results(chord_group text)
RETURNS TABLE (task_id text, state text, result bytea)
LANGUAGE sql STABLE
SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    SELECT p.task_id, p.state, p.result FROM kombu_pgmq.chord_parts p
    WHERE p.group_id = chord_group ORDER BY p.group_index NULLS LAST, p.ctid
$$;

-- After the callback was published: drop the parts (the chord row stays until it expires,
-- with fired_at set, so a late copy of a header task never fires it again).
CREATE FUNCTION kombu_pgmq.chord_done(chord_group text, expires_seconds double precision)
RETURNS void
LANGUAGE sql
SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    DELETE FROM kombu_pgmq.chord_parts WHERE group_id = chord_group;
    UPDATE kombu_pgmq.chords
    SET expires_at = clock_timestamp() + make_interval(secs => greatest(coalesce(expires_seconds, 0), 300))
    WHERE group_id = chord_group;
$$;

-- Who may call these (see kombu_pgmq.grantable).
INSERT INTO kombu_pgmq.grantable (function, kind, definer) VALUES
    ('kombu_pgmq.chord_size(text, integer, integer, double precision)', 'producer', true),
    ('kombu_pgmq.chord_start(text, double precision)', 'producer', true),
    ('kombu_pgmq.results_delete(text[])', 'producer', true),
    ('kombu_pgmq.results_expire_at(text[], double precision)', 'producer', true),
    ('kombu_pgmq.results_get(text[], text[])', 'producer', true),
    ('kombu_pgmq.results_save_group(text, bytea, double precision)', 'producer', true),
    ('kombu_pgmq.results_stats()', 'producer', true),
    ('kombu_pgmq.chord_done(text, double precision)', 'worker', true),
    ('kombu_pgmq.chord_part(text, text, integer, text, bytea, integer, double precision)', 'worker', true),
    ('kombu_pgmq.chord_results(text)', 'worker', true),
    ('kombu_pgmq.results_expire(integer)', 'worker', true),
    ('kombu_pgmq.results_store(text, text, bytea, double precision, boolean)', 'worker', true);

-- =========================================================================================
-- Beat (Celery beat in PostgreSQL)
-- =========================================================================================

-- The schedule, the leader and each tick once. kombu_pgmq.beat (Python) is the only
-- caller; roles reach the tables only through these SECURITY DEFINER functions: a beat
-- runs as a worker role (it elects, claims and publishes); application code that manages
-- periodic tasks at run time as a producer role (list, add, change, remove, run now, read
-- history and the leader).
--
-- Leader: the session that holds the session advisory lock (lock_key_beat(),
-- lock_key_beat_leader()), of a class no other kombu_pgmq lock uses; PostgreSQL releases
-- it when the session ends (a killed beat, a cut connection, a restart). A leader that
-- hangs with its session open stops writing heartbeat_at; a follower then ends that
-- session (pg_terminate_backend) and takes the lock.
-- Fence: a tick is claimed only by the session that holds the lock at the recorded epoch,
-- in the transaction that publishes the task, under the unique key (entry, due_at).

-- One row per periodic task. schedule: the Celery schedule as JSON (schedule_kind
-- interval {"every": seconds, "relative": bool}, crontab {"minute", "hour",
-- "day_of_week", "day_of_month", "month_of_year", "tz"}, solar {"event", "lat", "lon"}).
-- source: config (named by beat_schedule: the config wins at the leader's start) or api.
-- last_run_at: the due time of the last tick sent (the next is computed from it).
CREATE TABLE kombu_pgmq.beat_entries (
    name text PRIMARY KEY CHECK (name <> ''),
    task text NOT NULL CHECK (task <> ''),
    schedule_kind text NOT NULL CHECK (schedule_kind IN ('interval', 'crontab', 'solar')),
    schedule jsonb NOT NULL,
    args jsonb NOT NULL DEFAULT '[]',
    kwargs jsonb NOT NULL DEFAULT '{}',
    options jsonb NOT NULL DEFAULT '{}',
    enabled boolean NOT NULL DEFAULT true,
    catch_up text NOT NULL DEFAULT 'once' CHECK (catch_up IN ('once', 'skip')),
    source text NOT NULL DEFAULT 'api' CHECK (source IN ('config', 'api')),
    last_run_at timestamptz,
    next_run_at timestamptz,
    total_run_count bigint NOT NULL DEFAULT 0,
    missed_ticks bigint NOT NULL DEFAULT 0,
    last_error text,
    run_requested_at timestamptz,
    created_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    updated_at timestamptz NOT NULL DEFAULT clock_timestamp()
);

-- Every tick sent (kind scheduled, catch-up or manual) or skipped (catch_up skip), once:
-- the primary key is the fence a second leader's claim of the same tick runs into.
CREATE TABLE kombu_pgmq.beat_ticks (
    entry text NOT NULL,
    due_at timestamptz NOT NULL,
    sent_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    kind text NOT NULL CHECK (kind IN ('scheduled', 'catch-up', 'manual', 'skipped')),
    missed integer NOT NULL DEFAULT 0,
    task_id text,
    leader text NOT NULL,
    epoch bigint NOT NULL,
    PRIMARY KEY (entry, due_at)
);

CREATE INDEX beat_ticks_sent_at_idx ON kombu_pgmq.beat_ticks (sent_at);
-- The leader of record: its identity (host:pid), session (backend pid), election count
-- (epoch) and last heartbeat.
CREATE TABLE kombu_pgmq.beat_leader (
    id integer PRIMARY KEY CHECK (id = 1),
    identity text NOT NULL,
    backend_pid integer NOT NULL,
    epoch bigint NOT NULL,
    since timestamptz NOT NULL,
    heartbeat_at timestamptz NOT NULL
);

-- A change of what an entry runs, or a run-now request, wakes the leader (one
-- notification per transaction: PostgreSQL folds equal ones).
CREATE FUNCTION kombu_pgmq.beat_notify() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_catalog.pg_notify('kombu_pgmq_beat', 'entries');
    RETURN NULL;
END
$$;

CREATE TRIGGER beat_entries_changed AFTER INSERT OR DELETE ON kombu_pgmq.beat_entries
    FOR EACH ROW EXECUTE FUNCTION kombu_pgmq.beat_notify();

CREATE TRIGGER beat_entries_updated AFTER UPDATE ON kombu_pgmq.beat_entries
    FOR EACH ROW WHEN (
        (OLD.task, OLD.schedule_kind, OLD.schedule, OLD.args, OLD.kwargs, OLD.options,
         OLD.enabled, OLD.catch_up, OLD.last_run_at IS NULL)
        IS DISTINCT FROM
        (NEW.task, NEW.schedule_kind, NEW.schedule, NEW.args, NEW.kwargs, NEW.options,
         NEW.enabled, NEW.catch_up, NEW.last_run_at IS NULL)
        OR (NEW.run_requested_at IS NOT NULL
            AND NEW.run_requested_at IS DISTINCT FROM OLD.run_requested_at))
    EXECUTE FUNCTION kombu_pgmq.beat_notify();

-- True when this session holds the beat lock.
CREATE FUNCTION kombu_pgmq.beat_lock_held() RETURNS boolean
LANGUAGE sql STABLE
SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    SELECT EXISTS (
        SELECT 1 FROM pg_catalog.pg_locks l
        WHERE l.locktype = 'advisory' AND l.classid = kombu_pgmq.lock_key_beat()
          AND l.objid = kombu_pgmq.lock_key_beat_leader()
          AND l.objsubid = 2 AND l.granted AND l.pid = pg_catalog.pg_backend_pid())
$$;

-- One election round of a beat process (every second or so): the lock holder renews its
-- heartbeat; another session takes the lock if it is free (a new epoch), else, when the
-- holder's heartbeat is older than stale_seconds, ends the holder's session (deposed:
-- the lock is free at a next round).
CREATE FUNCTION kombu_pgmq.beat_elect(me text, stale_seconds double precision)
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

-- Give up the lead (a beat that stops): the lock is released, followers take it at once.
-- The heartbeat is renewed, not voided: a follower that finds the lock taken by another
-- in the meantime must not see a stale heartbeat and depose the new leader (and an
-- infinite timestamp breaks the heartbeat's age and psycopg's datetimes).
CREATE FUNCTION kombu_pgmq.beat_resign() RETURNS boolean
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

-- The leader of record, and how old its heartbeat is (seconds).
CREATE FUNCTION kombu_pgmq.beat_leader_info()
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

-- Claim ticks, in the transaction that publishes them. Fenced: NULL (nothing claimed)
-- unless this session holds the lock at leader_epoch. A tick is claimed once per
-- (entry, due_at), and only while the entry is enabled and its last_run_at is still the
-- one the leader computed from (a manual tick: its run_requested_at). Returns the
-- claimed entries (skipped ones included: they advance last_run_at, nothing is sent).
CREATE FUNCTION kombu_pgmq.beat_claim(
    leader_epoch bigint, me text, entries text[], due_ats timestamptz[],
    expected timestamptz[], next_runs timestamptz[], task_ids text[], kinds text[],
    missed integer[]
) RETURNS text[]
LANGUAGE plpgsql
SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
#variable_conflict use_column
DECLARE
    claimed text[];
BEGIN
    IF NOT kombu_pgmq.beat_lock_held() OR NOT EXISTS (
        SELECT 1 FROM kombu_pgmq.beat_leader
        WHERE id = 1 AND backend_pid = pg_catalog.pg_backend_pid() AND epoch = leader_epoch)
    THEN
        RETURN NULL;
    END IF;
    WITH input AS (
        SELECT * FROM unnest(entries, due_ats, expected, next_runs, task_ids, kinds, missed)
            AS u(entry, due_at, expected, next_run, task_id, kind, missed)
    ), ticks AS (
        INSERT INTO kombu_pgmq.beat_ticks (entry, due_at, kind, missed, task_id, leader, epoch)
        SELECT i.entry, i.due_at, i.kind, i.missed, i.task_id, me, leader_epoch
        FROM input i JOIN kombu_pgmq.beat_entries e ON e.name = i.entry
        WHERE e.enabled AND CASE WHEN i.kind = 'manual'
                                 THEN e.run_requested_at = i.expected
                                 ELSE e.last_run_at IS NOT DISTINCT FROM i.expected END
        ON CONFLICT (entry, due_at) DO NOTHING
        RETURNING entry, due_at, kind, missed
    ), updated AS (
        UPDATE kombu_pgmq.beat_entries e
        SET last_run_at = CASE WHEN t.kind = 'manual' THEN e.last_run_at ELSE t.due_at END,
            run_requested_at = CASE WHEN t.kind = 'manual' THEN NULL ELSE e.run_requested_at END,
            total_run_count = e.total_run_count + (t.kind <> 'skipped')::int,
            missed_ticks = e.missed_ticks + t.missed,
            next_run_at = CASE WHEN t.kind = 'manual' THEN e.next_run_at ELSE i.next_run END,
            last_error = NULL
        FROM ticks t JOIN input i ON i.entry = t.entry AND i.due_at = t.due_at
        WHERE e.name = t.entry
        RETURNING e.name
    )
    SELECT coalesce(array_agg(name), '{}') INTO claimed FROM updated;
    RETURN claimed;
END
$$;

-- The leader's bookkeeping after loading the schedule: next run and last error per entry
-- (for `kombu-pgmq beat list` and the metrics). Fenced as beat_claim (false: not leader).
CREATE FUNCTION kombu_pgmq.beat_note(
    leader_epoch bigint, entries text[], next_runs timestamptz[], errors text[]
) RETURNS boolean
LANGUAGE plpgsql
SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    IF NOT kombu_pgmq.beat_lock_held() OR NOT EXISTS (
        SELECT 1 FROM kombu_pgmq.beat_leader
        WHERE id = 1 AND backend_pid = pg_catalog.pg_backend_pid() AND epoch = leader_epoch)
    THEN
        RETURN false;
    END IF;
    UPDATE kombu_pgmq.beat_entries e SET next_run_at = u.next_run, last_error = u.error
    FROM unnest(entries, next_runs, errors) AS u(entry, next_run, error)
    WHERE e.name = u.entry
      AND (e.next_run_at, e.last_error) IS DISTINCT FROM (u.next_run, u.error);
    RETURN true;
END
$$;

-- Sync the entries of beat_schedule (a JSON array of entries): insert or replace what
-- each names (enabled, last run and counts are kept), delete config entries no longer
-- named. Returns how many were written and removed.
CREATE FUNCTION kombu_pgmq.beat_sync_config(config jsonb)
RETURNS TABLE (written integer, removed integer)
LANGUAGE plpgsql
SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    w integer;
    r integer;
BEGIN
    WITH c AS (
        SELECT * FROM jsonb_to_recordset(config) AS x(
            name text, task text, schedule_kind text, schedule jsonb, args jsonb,
            kwargs jsonb, options jsonb, catch_up text)
    )
    INSERT INTO kombu_pgmq.beat_entries AS e
        (name, task, schedule_kind, schedule, args, kwargs, options, catch_up, source)
    SELECT c.name, c.task, c.schedule_kind, c.schedule, coalesce(c.args, '[]'),
           coalesce(c.kwargs, '{}'), coalesce(c.options, '{}'), coalesce(c.catch_up, 'once'),
           'config'
    FROM c
    ON CONFLICT (name) DO UPDATE
        SET task = excluded.task, schedule_kind = excluded.schedule_kind,
            schedule = excluded.schedule, args = excluded.args, kwargs = excluded.kwargs,
            options = excluded.options, catch_up = excluded.catch_up, source = 'config',
            updated_at = clock_timestamp()
        WHERE (e.task, e.schedule_kind, e.schedule, e.args, e.kwargs, e.options,
               e.catch_up, e.source)
              IS DISTINCT FROM (excluded.task, excluded.schedule_kind, excluded.schedule,
                                excluded.args, excluded.kwargs, excluded.options,
                                excluded.catch_up, 'config');
    GET DIAGNOSTICS w = ROW_COUNT;
    DELETE FROM kombu_pgmq.beat_entries e
    WHERE e.source = 'config'
      AND e.name NOT IN (SELECT x->>'name' FROM jsonb_array_elements(config) x);
    GET DIAGNOSTICS r = ROW_COUNT;
    RETURN QUERY SELECT w, r;
END
$$;

-- Add or replace one entry (the Python API and `kombu-pgmq beat add`). replace false:
-- an existing name is an error. A schedule change keeps the last run and counts.
CREATE FUNCTION kombu_pgmq.beat_upsert(
    entry_name text, entry_task text, kind text, entry_schedule jsonb, entry_args jsonb,
    entry_kwargs jsonb, entry_options jsonb, entry_enabled boolean, entry_catch_up text,
    replace boolean
) RETURNS boolean
LANGUAGE plpgsql
SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    INSERT INTO kombu_pgmq.beat_entries AS e
        (name, task, schedule_kind, schedule, args, kwargs, options, enabled, catch_up)
    VALUES (entry_name, entry_task, kind, entry_schedule, entry_args, entry_kwargs,
            entry_options, entry_enabled, entry_catch_up)
    ON CONFLICT (name) DO NOTHING;
    IF FOUND THEN
        RETURN true;
    END IF;
    IF NOT replace THEN
        RAISE EXCEPTION 'kombu_pgmq beat: periodic task % exists already: change it (update) or remove it first', entry_name
            USING ERRCODE = 'unique_violation';
    END IF;
    UPDATE kombu_pgmq.beat_entries
    SET task = entry_task, schedule_kind = kind, schedule = entry_schedule, args = entry_args,
        kwargs = entry_kwargs, options = entry_options, enabled = entry_enabled,
        catch_up = entry_catch_up, updated_at = clock_timestamp()
    WHERE name = entry_name;
    RETURN false;
END
$$;

-- Enable or disable; remove; ask the leader to send one tick now (kept in history as
-- manual; the schedule does not move). Each returns false for an unknown name.
CREATE FUNCTION kombu_pgmq.beat_set_enabled(entry_name text, entry_enabled boolean)
RETURNS boolean
LANGUAGE sql
SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    UPDATE kombu_pgmq.beat_entries
    SET enabled = entry_enabled, updated_at = clock_timestamp()
    WHERE name = entry_name RETURNING true
$$;

CREATE FUNCTION kombu_pgmq.beat_remove(entry_name text) RETURNS boolean
LANGUAGE sql
SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    DELETE FROM kombu_pgmq.beat_entries WHERE name = entry_name RETURNING true
$$;

CREATE FUNCTION kombu_pgmq.beat_run_now(entry_name text) RETURNS timestamptz
LANGUAGE sql
SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    UPDATE kombu_pgmq.beat_entries
    SET run_requested_at = coalesce(run_requested_at, clock_timestamp())
    WHERE name = entry_name RETURNING run_requested_at
$$;

-- The schedule, as stored.
CREATE FUNCTION kombu_pgmq.beat_list()
RETURNS SETOF kombu_pgmq.beat_entries
LANGUAGE sql STABLE
SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    SELECT * FROM kombu_pgmq.beat_entries ORDER BY name
$$;

-- One entry (primary key lookup).
CREATE FUNCTION kombu_pgmq.beat_get(entry_name text)
RETURNS SETOF kombu_pgmq.beat_entries
LANGUAGE sql STABLE
SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    SELECT * FROM kombu_pgmq.beat_entries WHERE name = entry_name
$$;

-- Ticks sent (newest first), of one entry or all (entry_name NULL).
CREATE FUNCTION kombu_pgmq.beat_history(entry_name text, max_rows integer)
RETURNS SETOF kombu_pgmq.beat_ticks
LANGUAGE sql STABLE
SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    SELECT * FROM kombu_pgmq.beat_ticks
    WHERE entry_name IS NULL OR entry = entry_name
    ORDER BY sent_at DESC, entry LIMIT max_rows
$$;

-- Forget ticks sent more than keep_seconds ago (at most batch rows); how many.
CREATE FUNCTION kombu_pgmq.beat_prune(keep_seconds double precision, batch integer)
RETURNS integer
LANGUAGE plpgsql
SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    n integer;
BEGIN
    DELETE FROM kombu_pgmq.beat_ticks t
    WHERE (t.entry, t.due_at) IN (
        SELECT entry, due_at FROM kombu_pgmq.beat_ticks
        WHERE sent_at < clock_timestamp() - make_interval(secs => keep_seconds)
        ORDER BY sent_at LIMIT batch FOR UPDATE SKIP LOCKED);
    GET DIAGNOSTICS n = ROW_COUNT;
    RETURN n;
END
$$;

-- Who may call these (see kombu_pgmq.grantable).
INSERT INTO kombu_pgmq.grantable (function, kind, definer) VALUES
    ('kombu_pgmq.beat_get(text)', 'producer', true),
    ('kombu_pgmq.beat_history(text, integer)', 'producer', true),
    ('kombu_pgmq.beat_leader_info()', 'producer', true),
    ('kombu_pgmq.beat_list()', 'producer', true),
    ('kombu_pgmq.beat_remove(text)', 'producer', true),
    ('kombu_pgmq.beat_run_now(text)', 'producer', true),
    ('kombu_pgmq.beat_set_enabled(text, boolean)', 'producer', true),
    ('kombu_pgmq.beat_upsert(text, text, text, jsonb, jsonb, jsonb, jsonb, boolean, text, boolean)', 'producer', true),
    ('kombu_pgmq.beat_claim(bigint, text, text[], timestamptz[], timestamptz[], timestamptz[], text[], text[], integer[])', 'worker', true),
    ('kombu_pgmq.beat_elect(text, double precision)', 'worker', true),
    ('kombu_pgmq.beat_lock_held()', 'worker', true),
    ('kombu_pgmq.beat_note(bigint, text[], timestamptz[], text[])', 'worker', true),
    ('kombu_pgmq.beat_prune(double precision, integer)', 'worker', true),
    ('kombu_pgmq.beat_resign()', 'worker', true),
    ('kombu_pgmq.beat_sync_config(jsonb)', 'worker', true);

-- =========================================================================================
-- Spark (kombu_pgmq.spark: job-level atomic writes and stream offsets)
-- =========================================================================================

-- A Spark write (one df.write.format("pgmq") job) is a row of kombu_pgmq.spark_writes,
-- opened by the Spark driver. Each Spark task attempt stages its messages hidden (vt 10
-- years ahead) with the header "x-kombu-pgmq-write" = '<write id>/<partition>/<attempt>'.
-- When every Spark task succeeded, the driver commits: the committed attempts' messages
-- become visible in one transaction and what other (failed) attempts staged is deleted;
-- a failed job aborts: everything staged is deleted.
--
-- Stragglers: Spark calls abort while killed tasks may still be inserting. Staging holds
-- a FOR SHARE lock on the write's row and requires state 'open'; commit and abort first
-- update the state (waiting for the staging transactions in flight), so no message can be
-- staged after the write ended. after_id is the queue's highest msg_id when the write
-- opened: every staged row is above it, so commit and abort scan a primary key range.
--
-- The Spark data source reads and writes queue tables directly: these functions are the
-- owner's (no grantable rows).

CREATE TABLE kombu_pgmq.spark_writes (
    write_id text PRIMARY KEY,
    queue text NOT NULL,             -- PGMQ queue name
    after_id bigint NOT NULL,
    state text NOT NULL DEFAULT 'open' CHECK (state IN ('open', 'committed', 'aborted')),
    published bigint,
    opened_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    ended_at timestamptz
);

-- Open a write on queue; returns after_id.
CREATE FUNCTION kombu_pgmq.open_write(write_id text, queue text) RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    after_id bigint;
BEGIN
    EXECUTE format('SELECT coalesce(max(msg_id), 0) FROM pgmq.%I', 'q_' || queue) INTO after_id;
    INSERT INTO kombu_pgmq.spark_writes (write_id, queue, after_id)
    VALUES (open_write.write_id, open_write.queue, after_id);
    RETURN after_id;
END
$$;

-- Stage one batch of a task attempt (marker '<write id>/<partition>/<attempt>' in the
-- headers already); refused once the write is no longer open. Returns the batch size.
CREATE FUNCTION kombu_pgmq.stage_write(
    write_id text, messages jsonb[], headers jsonb[]
) RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    w kombu_pgmq.spark_writes;
BEGIN
    SELECT * INTO w FROM kombu_pgmq.spark_writes s
    WHERE s.write_id = stage_write.write_id FOR SHARE;
    IF NOT FOUND OR w.state <> 'open' THEN
        RAISE EXCEPTION 'Spark write % is %: its messages are not staged',
            stage_write.write_id, coalesce(w.state, 'unknown')
            USING ERRCODE = 'object_not_in_prerequisite_state';
    END IF;
    PERFORM pgmq.send_batch(w.queue, messages, headers, 315360000);
    RETURN coalesce(array_length(messages, 1), 0);
END
$$;

-- Delete the messages a write staged that are still staged (marker present).
CREATE FUNCTION kombu_pgmq.delete_staged(w kombu_pgmq.spark_writes) RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    deleted bigint;
BEGIN
    EXECUTE format(
        'DELETE FROM pgmq.%I WHERE msg_id > $1
         AND starts_with(headers ->> ''x-kombu-pgmq-write'', $2 || ''/'')', 'q_' || w.queue)
    USING w.after_id, w.write_id;
    GET DIAGNOSTICS deleted = ROW_COUNT;
    RETURN deleted;
END
$$;

-- Abort: delete everything the write staged (after waiting for staging in flight).
CREATE FUNCTION kombu_pgmq.abort_write(write_id text) RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    w kombu_pgmq.spark_writes;
BEGIN
    UPDATE kombu_pgmq.spark_writes s SET state = 'aborted', ended_at = clock_timestamp()
    WHERE s.write_id = abort_write.write_id AND s.state = 'open'
    RETURNING * INTO w;
    IF NOT FOUND THEN
        RETURN 0;
    END IF;
    RETURN kombu_pgmq.delete_staged(w);
END
$$;

-- Commit: the committed attempts' messages become visible, the rest is deleted; consumers
-- waiting on the queue are woken (the wake-up protocol of kombu_pgmq.publish).
CREATE FUNCTION kombu_pgmq.commit_write(write_id text, attempts text[]) RETURNS bigint
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

-- Stream offsets: the highest msg_id a streaming reader may take after after_id (at most
-- max_rows messages), such that no message with a smaller id can still appear:
--   * it stops before the first hidden message (delayed, held by a consumer, or staged by
--     a Spark write that has not committed), so those are not skipped;
--   * it waits (up to wait_seconds, else returns after_id: no progress this time) until
--     every transaction that was writing to the queue table has ended: such a transaction
--     may hold a smaller msg_id (taken from the sequence earlier) that it has not
--     committed yet. Writers are the holders of a RowExclusiveLock on the table (also
--     consumers' reads and acks, which end in milliseconds), identified by their virtual
--     transaction id in pg_locks, which every role may read (pg_stat_activity hides other
--     users' sessions from a role without pg_read_all_stats).
CREATE FUNCTION kombu_pgmq.stream_horizon(
    queue text, after_id bigint, max_rows integer, wait_seconds double precision
) RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    tbl regclass := format('pgmq.%I', 'q_' || queue)::regclass;
    first_hidden bigint;
    horizon bigint;
    writers text[];
    deadline timestamptz := clock_timestamp() + make_interval(secs => wait_seconds);
BEGIN
    EXECUTE format(
        'SELECT min(msg_id) FROM pgmq.%I WHERE msg_id > $1 AND vt > clock_timestamp()',
        'q_' || queue)
    INTO first_hidden USING after_id;
    EXECUTE format(
        'SELECT max(msg_id) FROM (SELECT msg_id FROM pgmq.%I
          WHERE msg_id > $1 AND ($2::bigint IS NULL OR msg_id < $2)
          ORDER BY msg_id LIMIT $3) s', 'q_' || queue)
    INTO horizon USING after_id, first_hidden, max_rows;
    IF horizon IS NULL THEN
        RETURN after_id;
    END IF;
    -- Transactions writing to the queue table now (each holds RowExclusiveLock on it
    -- until it ends); their virtual transaction ids never come back.
    SELECT array_agg(DISTINCT l.virtualtransaction) INTO writers
    FROM pg_locks l
    WHERE l.locktype = 'relation' AND l.relation = tbl AND l.mode = 'RowExclusiveLock'
      AND l.granted AND l.pid <> pg_backend_pid();
    WHILE writers IS NOT NULL LOOP
        EXIT WHEN NOT EXISTS (SELECT 1 FROM pg_locks l
                              WHERE l.locktype = 'virtualxid'
                                AND l.virtualxid = ANY (writers));
        IF clock_timestamp() > deadline THEN
            RETURN after_id;
        END IF;
        PERFORM pg_sleep(0.005);
    END LOOP;
    RETURN horizon;
END
$$;

-- =========================================================================================
-- Last: the definer functions secured, the queues that exist given their functions
-- =========================================================================================

-- No PUBLIC execute on the definer functions of kombu_pgmq.grantable (their SECURITY
-- DEFINER and search_path are in their definitions above; this applies them again).
SELECT kombu_pgmq.secure_functions();

-- PGMQ queues that exist already (made by pgmq.create before kombu_pgmq was installed)
-- get their own functions now.
SELECT kombu_pgmq.queue_functions(m.queue_name) FROM pgmq.meta m
WHERE to_regclass(format('pgmq.%I', 'q_' || m.queue_name)) IS NOT NULL
  AND to_regclass(format('pgmq.%I', 'a_' || m.queue_name)) IS NOT NULL;
