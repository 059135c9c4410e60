-- One implementation of the hot operations, for every role: each PGMQ queue that
-- kombu_pgmq publishes to, reads or acks gets its own functions, kombu_pgmq.send_q_<queue>,
-- read_q_<queue> and ack_q_<queue>, whose statements name the queue's tables in static SQL
-- (PL/pgSQL prepares and caches their plans per session, where a function shared by
-- every queue must build its statement with format and plan it at each EXECUTE). They
-- run as their owner (SECURITY DEFINER, a fixed search_path), so a least-privilege
-- producer or worker runs the same statements as the owner, and they write PGMQ's tables
-- exactly as pgmq.send, pgmq.read (vt, read_ct, last_read_at) and pgmq.archive (the row
-- moved to the archive) write them.
--
-- The read and ack functions run with enable_seqscan off: PL/pgSQL keeps a generic plan
-- per session, and one made while the table's statistics said it was small scanned the
-- whole heap for the receipts' msg_ids (475 buffers for one ack after 20,000 messages
-- behind a held snapshot, measured), where the primary key finds them.
--
-- kombu_pgmq.queue_functions(queue) creates them from the templates below (callable by
-- producers and workers; the queue must exist), granted to the roles recorded in
-- kombu_pgmq.roles (send_q to producers, all three to workers); kombu_pgmq.drop_queue drops them with the queue. A caller that finds
-- them missing (a queue made by plain pgmq.create) creates them and calls again.

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
-- again), as kombu_pgmq.publish_routed. Hand-over: handoff is the NOTIFY payload's tail
-- (message, chr(30), headers: small enough for a NOTIFY), NULL for a delayed or large
-- message. When a waiting consumer offers a slot (kombu_pgmq.hand_off claims it; asked
-- only when a slot is offered on the queue), the row is written as pgmq.read leaves a
-- delivered one (read_ct 1, vt = now + that consumer's visibility timeout, last_read_at)
-- and the consumer's channel is notified with queue, msg_id, enqueued_at (UTC) and the
-- tail, separated by chr(30); no other consumer is woken. commit: 'async', the
-- transaction commits without waiting for the WAL flush (confirm_publish=False); 'off'
-- (visible_before_flush), so does a publish a waiting consumer gets now (handed over, or
-- woken: not delayed and the queue has a waiting row), and says so in column flush (the
-- caller then waits for the flush with statement flush_commits); NULL: as the session
-- does. notified: what the NOTIFY returned (nothing to read). %1$I function, %2$L queue,
-- %3$s queue table, %4$s/%5$s the handed row's last_read_at column and value (nothing
-- for PGMQ < 1.11).
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
        SELECT pg_advisory_xact_lock_shared(1802530161, hashtext(%2$L))
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

-- Create (or, with replace, recreate) the queue's functions from the templates: the
-- queue's tables and the archive columns it has (PGMQ < 1.11 has no last_read_at), the
-- queue's name as a literal. Owned by the schema owner (this function runs as its
-- owner), no PUBLIC execute, granted to the roles recorded in kombu_pgmq.roles.
-- Creations of one queue's functions take turns (an advisory lock of the transaction);
-- functions that exist are left as they are. Raises undefined_table if the queue does
-- not exist.
CREATE FUNCTION kombu_pgmq.queue_functions(q text, replace boolean DEFAULT false)
RETURNS void
LANGUAGE plpgsql AS $$
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
    PERFORM pg_advisory_xact_lock(1802530167, hashtext(q));
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
                        ELSE '' END);
    EXECUTE format('REVOKE EXECUTE ON FUNCTION kombu_pgmq.%I(bigint[], integer[], timestamptz[], boolean[], integer, jsonb, text, boolean) FROM PUBLIC', ack_fn);
    EXECUTE format('REVOKE EXECUTE ON FUNCTION kombu_pgmq.%I(integer, integer, bigint[], integer[], timestamptz[], boolean[], integer, text, float8, text[], float8[], boolean) FROM PUBLIC', read_fn);
    EXECUTE format('REVOKE EXECUTE ON FUNCTION kombu_pgmq.%I(jsonb, jsonb, integer, text, text, bigint) FROM PUBLIC', send_fn);
    FOR r IN SELECT * FROM kombu_pgmq.roles LOOP
        PERFORM kombu_pgmq.grant_queue_functions(q, r.role);
    END LOOP;
END
$$;

-- Whether the queue's functions exist (with the arguments this schema version calls).
CREATE FUNCTION kombu_pgmq.queue_functions_exist(q text) RETURNS boolean
LANGUAGE sql STABLE AS $$
SELECT to_regprocedure(format('kombu_pgmq.%I(bigint[], integer[], timestamptz[], boolean[], integer, jsonb, text, boolean)', 'ack_q_' || q)) IS NOT NULL
   AND to_regprocedure(format('kombu_pgmq.%I(integer, integer, bigint[], integer[], timestamptz[], boolean[], integer, text, float8, text[], float8[], boolean)', 'read_q_' || q)) IS NOT NULL
   AND to_regprocedure(format('kombu_pgmq.%I(jsonb, jsonb, integer, text, text, bigint)', 'send_q_' || q)) IS NOT NULL
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

-- drop_queue drops the queue's functions with its tables (and its bands').
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

-- kombu_pgmq.read reads a queue without limits through the queue's read function (its
-- position given as jsonb: {"scan_from": epoch seconds or null, "watch_xids": [...],
-- "watch_bounds": [...]}); created first if missing.
CREATE OR REPLACE FUNCTION kombu_pgmq.read_from_position(
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

-- An ack (and an expiry) of several queues settles each through the queue's ack function.
CREATE OR REPLACE FUNCTION kombu_pgmq.ack(
    queues text[], msg_ids bigint[], read_cts integer[], enqueued timestamptz[],
    holds boolean[] DEFAULT '{}', hold_seconds integer DEFAULT 0
) RETURNS TABLE (queue text, msg_id bigint)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
BEGIN
    RETURN QUERY SELECT * FROM kombu_pgmq.settle(queues, msg_ids, read_cts, enqueued, holds,
                                                 hold_seconds, NULL);
END
$$;

CREATE OR REPLACE FUNCTION kombu_pgmq.archive_expired(
    queues text[], msg_ids bigint[], read_cts integer[], enqueued timestamptz[]
) RETURNS TABLE (queue text, msg_id bigint)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
BEGIN
    RETURN QUERY SELECT * FROM kombu_pgmq.settle(
        queues, msg_ids, read_cts, enqueued, '{}', 0,
        jsonb_build_object('x-archive-reason', 'expired', 'x-expired-at', clock_timestamp()));
END
$$;

-- kombu_pgmq.ack and kombu_pgmq.archive_expired: the receipts grouped by queue, each
-- group settled by its queue's ack function (marks: headers added to the archived
-- copies); a queue that is gone settles nothing.
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

-- Apply the privileges of every recorded role (only_role: just that one), the queues'
-- own functions included. Idempotent; returns the roles done. Run by the owner (the
-- bootstrap runs it after migrations).
CREATE OR REPLACE FUNCTION kombu_pgmq.apply_grants(only_role text DEFAULT NULL)
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

DELETE FROM kombu_pgmq.grantable WHERE function IN (
    'kombu_pgmq.read_from_position(text, integer, integer, jsonb, boolean)');
INSERT INTO kombu_pgmq.grantable (function, kind, definer) VALUES
    ('kombu_pgmq.queue_functions(text, boolean)', 'producer', true),
    ('kombu_pgmq.read_from_position(text, integer, integer, jsonb, boolean)', 'owner', false),
    ('kombu_pgmq.settle(text[], bigint[], integer[], timestamptz[], boolean[], integer, jsonb)',
     'owner', false),
    ('kombu_pgmq.queue_functions_exist(text)', 'owner', false),
    ('kombu_pgmq.grant_queue_functions(text, text)', 'owner', false),
    ('kombu_pgmq.drop_queue_functions(text)', 'owner', false),
    ('kombu_pgmq.ack_template()', 'owner', false),
    ('kombu_pgmq.send_template()', 'owner', false),
    ('kombu_pgmq.settle_template()', 'owner', false),
    ('kombu_pgmq.settle_fragment(text, text[], text)', 'owner', false),
    ('kombu_pgmq.read_template()', 'owner', false);
SELECT kombu_pgmq.secure_functions();

-- Every queue that exists gets its functions now.
SELECT kombu_pgmq.queue_functions(m.queue_name) FROM pgmq.meta m
WHERE to_regclass(format('pgmq.%I', 'q_' || m.queue_name)) IS NOT NULL
  AND to_regclass(format('pgmq.%I', 'a_' || m.queue_name)) IS NOT NULL;
