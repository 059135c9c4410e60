-- Least privilege (issue "every message accounted for"): the role that installs the schema
-- (the owner) owns every table; roles that only publish (producer) or consume (worker)
-- get EXECUTE on kombu_pgmq's functions and a few privileges on its bookkeeping tables,
-- never a privilege on PGMQ's queue and archive tables. What a producer or a worker may
-- do to messages is exactly what these functions do:
--
--   producer: publish (kombu_pgmq.publish, publish_routed), count ready messages (size),
--             read the routing table and queue metadata; redeclaring a queue, exchange
--             or binding that exists is a passive check on the client side.
--   worker:   what a producer may, and read, ack, requeue, renew leases, dead-letter,
--             discard expired messages, purge ready messages, declare queues (its
--             pidbox, reply and event queues), bind, record consumers and heartbeats,
--             and drop the queues AMQP drops (auto_delete, x-expires: reap,
--             release_consumer) and transient queues (queue_delete of a non-durable,
--             auto_delete or x-expires queue: kombu deletes pidbox reply queues).
--             Not: queue_delete of a durable queue, DDL, the dead-letter admin
--             (kombu-pgmq dlq), archive pruning, schema installs: the owner's.
--
-- The functions that touch PGMQ's tables are SECURITY DEFINER (they run as their owner)
-- with a fixed search_path, and EXECUTE on them is revoked from PUBLIC. Every identifier
-- they build is quoted (format %I), so a queue name cannot reach another table.
-- kombu_pgmq.grant_role(role, 'producer' | 'worker') records a role in
-- kombu_pgmq.roles and applies its privileges; kombu_pgmq.apply_grants() applies them
-- again for every recorded role (the bootstrap calls it after each migration, so a
-- function added by a later migration reaches the roles granted before).
-- The tables stay exactly PGMQ's: these functions read and write rows the way
-- pgmq.read/send/archive/delete/pop do.

-- -- new functions for what the client sent as plain SQL on PGMQ tables ----------------

-- Declare a queue: create its PGMQ queue (UNLOGGED if not durable) only if missing (on an
-- existing queue pgmq.create runs CREATE INDEX IF NOT EXISTS, whose SHARE lock waits for
-- every open transaction that enqueued), record its Kombu name and arguments (the first
-- declaration's stay; a redeclare counts as use for x-expires), then create the PGMQ
-- queues of its priority bands as stored. Returns the queue's row (arguments in force).
CREATE FUNCTION kombu_pgmq.declare_queue(
    kombu_queue text, pgmq_name text, is_durable boolean, is_auto_delete boolean,
    expires_after_ms bigint, ttl_ms bigint, priority_max smallint, floors smallint[],
    band_names text[]
) RETURNS SETOF kombu_pgmq.queues
LANGUAGE plpgsql AS $$
DECLARE
    stored kombu_pgmq.queues;
    band text;
BEGIN
    INSERT INTO kombu_pgmq.queues AS q
        (queue, pgmq_queue, durable, auto_delete, expires_ms, message_ttl_ms, max_priority,
         priority_bands, band_queues)
    VALUES (kombu_queue, pgmq_name, is_durable, is_auto_delete, expires_after_ms, ttl_ms,
            priority_max, floors, band_names)
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

-- Ready (visible) messages of a PGMQ queue, as AMQP's message_count: unacked ones are
-- not counted. Seq scan of the queue table.
CREATE FUNCTION kombu_pgmq.size(pgmq_name text) RETURNS bigint
LANGUAGE plpgsql AS $$
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
-- stay, so their ack or redelivery still works. (pgmq.purge_queue would TRUNCATE them
-- too, and take an ACCESS EXCLUSIVE lock that blocks every consumer meanwhile.)
CREATE FUNCTION kombu_pgmq.purge(pgmq_name text) RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    n bigint;
BEGIN
    EXECUTE format('WITH purged AS (DELETE FROM pgmq.%I WHERE vt <= clock_timestamp()
                                    RETURNING 1)
                    SELECT count(*) FROM purged', 'q_' || pgmq_name)
    INTO n;
    RETURN n;
END
$$;

-- Deliver and delete up to qty visible messages (basic_get with no_ack), as pgmq.pop.
CREATE FUNCTION kombu_pgmq.pop(pgmq_name text, qty integer)
RETURNS TABLE (
    queue text, msg_id bigint, read_ct integer, enqueued_at timestamptz, message text,
    headers text, age_seconds double precision
)
LANGUAGE sql AS $$
    SELECT pgmq_name, r.msg_id, r.read_ct, r.enqueued_at, r.message::text, r.headers::text,
           extract(epoch FROM clock_timestamp() - r.enqueued_at)::float8
    FROM pgmq.pop(pgmq_name, qty) AS r
$$;

-- Delete messages for good (no archive) if these deliveries still hold them (receipt
-- handles, migration 0007): expired messages (x-message-ttl, expiration) and what a
-- no_ack consumer was handed. Returns the msg_ids deleted.
CREATE FUNCTION kombu_pgmq.discard(
    pgmq_name text, msg_ids bigint[], read_cts integer[], enqueued timestamptz[]
) RETURNS SETOF bigint
LANGUAGE plpgsql AS $$
BEGIN
    IF to_regclass(format('pgmq.%I', 'q_' || pgmq_name)) IS NULL THEN
        RETURN;
    END IF;
    RETURN QUERY EXECUTE format(
        'DELETE FROM pgmq.%I AS t
         USING unnest($1::bigint[], $2::integer[], $3::timestamptz[]) AS h(id, ct, at)
         WHERE t.msg_id = h.id AND t.read_ct = h.ct AND t.enqueued_at = h.at
         RETURNING t.msg_id', 'q_' || pgmq_name
    ) USING msg_ids, read_cts, enqueued;
END
$$;

-- Move messages to the dead-letter queue in one statement (so atomically): delete from
-- the source queue table the rows these deliveries still hold (receipt handles), send
-- each to the dead-letter queue with an "x-dead-letter" header recording where it came
-- from and why (and the error, for undecodable rows). Returns the new msg_ids.
CREATE FUNCTION kombu_pgmq.dead_letter(
    pgmq_name text, msg_ids bigint[], read_cts integer[], enqueued timestamptz[],
    error_texts text[], dead_letter_queue text, reason text, kombu_queue text
) RETURNS SETOF bigint
LANGUAGE plpgsql AS $$
BEGIN
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

-- Drop a transient queue (auto_delete, non-durable or with x-expires: a consumer's own
-- pidbox reply and event queues, which kombu deletes after reading the replies); false if
-- there is no such queue or it is durable (only the owner drops those: drop_queue).
CREATE FUNCTION kombu_pgmq.drop_transient_queue(kombu_queue text) RETURNS boolean
LANGUAGE plpgsql AS $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM kombu_pgmq.queues q
                   WHERE q.queue = kombu_queue
                     AND (q.auto_delete OR NOT q.durable OR q.expires_ms IS NOT NULL)) THEN
        RETURN false;
    END IF;
    RETURN kombu_pgmq.drop_queue(kombu_queue);
END
$$;

-- -- who may do what --------------------------------------------------------------------

-- Roles granted by kombu_pgmq.grant_role (applied again by apply_grants after migrations).
CREATE TABLE kombu_pgmq.roles (
    role text PRIMARY KEY,
    kind text NOT NULL CHECK (kind IN ('producer', 'worker')),
    granted_at timestamptz NOT NULL DEFAULT now()
);

-- Functions that run as their owner: no PUBLIC execute, a search_path nobody can plant
-- objects in (every name they use is schema-qualified anyway).
DO $$
DECLARE
    f regprocedure;
BEGIN
    FOREACH f IN ARRAY ARRAY[
        'kombu_pgmq.publish(text, jsonb, jsonb, integer)',
        'kombu_pgmq.publish_routed(text[], jsonb, jsonb, bigint, integer)',
        'kombu_pgmq.read(text[], integer, integer, text[], bigint[], integer[], timestamptz[], boolean)',
        'kombu_pgmq.ack(text[], bigint[], integer[], timestamptz[])',
        'kombu_pgmq.requeue(text[], bigint[], integer[], timestamptz[], integer, boolean)',
        'kombu_pgmq.renew(text[], bigint[], integer[], timestamptz[], integer)',
        'kombu_pgmq.wait_for(text, text[], integer)',
        'kombu_pgmq.drop_queue(text)',
        'kombu_pgmq.drop_transient_queue(text)',
        'kombu_pgmq.reap()',
        'kombu_pgmq.release_consumer(text, text, text)',
        'kombu_pgmq.bump_routing_version()',
        'kombu_pgmq.declare_queue(text, text, boolean, boolean, bigint, bigint, smallint, smallint[], text[])',
        'kombu_pgmq.size(text)',
        'kombu_pgmq.purge(text)',
        'kombu_pgmq.pop(text, integer)',
        'kombu_pgmq.discard(text, bigint[], integer[], timestamptz[])',
        'kombu_pgmq.dead_letter(text, bigint[], integer[], timestamptz[], text[], text, text, text)'
    ]::regprocedure[] LOOP
        EXECUTE format('ALTER FUNCTION %s SECURITY DEFINER SET search_path = pg_catalog, pg_temp', f);
        EXECUTE format('REVOKE EXECUTE ON FUNCTION %s FROM PUBLIC', f);
    END LOOP;
END
$$;

-- Apply the privileges of every recorded role (only_role: just that one). Idempotent;
-- returns the roles done. Run by the owner (the bootstrap runs it after migrations).
CREATE FUNCTION kombu_pgmq.apply_grants(only_role text DEFAULT NULL) RETURNS SETOF text
LANGUAGE plpgsql AS $$
DECLARE
    r kombu_pgmq.roles;
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
        EXECUTE format(
            'GRANT EXECUTE ON FUNCTION
                 kombu_pgmq.publish(text, jsonb, jsonb, integer),
                 kombu_pgmq.publish_routed(text[], jsonb, jsonb, bigint, integer),
                 kombu_pgmq.size(text) TO %I', r.role);
        IF r.kind = 'worker' THEN
            EXECUTE format(
                'GRANT EXECUTE ON FUNCTION
                     kombu_pgmq.read(text[], integer, integer, text[], bigint[], integer[],
                                     timestamptz[], boolean),
                     kombu_pgmq.ack(text[], bigint[], integer[], timestamptz[]),
                     kombu_pgmq.requeue(text[], bigint[], integer[], timestamptz[], integer,
                                        boolean),
                     kombu_pgmq.renew(text[], bigint[], integer[], timestamptz[], integer),
                     kombu_pgmq.wait_for(text, text[], integer),
                     kombu_pgmq.reap(),
                     kombu_pgmq.release_consumer(text, text, text),
                     kombu_pgmq.drop_transient_queue(text),
                     kombu_pgmq.declare_queue(text, text, boolean, boolean, bigint, bigint,
                                              smallint, smallint[], text[]),
                     kombu_pgmq.purge(text),
                     kombu_pgmq.pop(text, integer),
                     kombu_pgmq.discard(text, bigint[], integer[], timestamptz[]),
                     kombu_pgmq.dead_letter(text, bigint[], integer[], timestamptz[], text[],
                                            text, text, text) TO %I', r.role);
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

-- Give a role the privileges of a producer or a worker (see the header); a role granted
-- before gets the new kind (a worker made producer loses the worker's privileges).
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
