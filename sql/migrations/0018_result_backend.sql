-- Celery's result backend in PostgreSQL (issue 27): task results and saved groups, chord
-- counters per header task id, durable revocations. kombu_pgmq.results (Python) is the
-- only caller; roles reach the tables only through these SECURITY DEFINER functions.

-- -- durable revocations (table; functions below) -------------------------------------

-- Celery task ids revoked (AsyncResult.revoke(), celery control revoke, kombu-pgmq task
-- cancel), kept until expires_at: workers started later load them, and a result backend
-- read of a revoked task with no result reports REVOKED.
CREATE TABLE kombu_pgmq.revoked (
    task_id text PRIMARY KEY,
    revoked_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    revoked_by text NOT NULL DEFAULT session_user,
    expires_at timestamptz
);

-- -- results ----------------------------------------------------------------------------

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
LANGUAGE plpgsql AS $$
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
LANGUAGE plpgsql AS $$
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
LANGUAGE sql STABLE AS $$
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
LANGUAGE sql AS $$
    WITH gone AS (DELETE FROM kombu_pgmq.results WHERE key = ANY(result_keys) RETURNING 1)
    SELECT count(*)::integer FROM gone
$$;

-- Set the expiry of keys (seconds from now; NULL or 0: never).
CREATE FUNCTION kombu_pgmq.results_expire_at(result_keys text[], expires_seconds double precision)
RETURNS void
LANGUAGE sql AS $$
    UPDATE kombu_pgmq.results
    SET expires_at = CASE WHEN expires_seconds > 0
                          THEN clock_timestamp() + make_interval(secs => expires_seconds) END
    WHERE key = ANY(result_keys)
$$;

-- Delete up to batch expired results (and expired chords and revocations); returns the
-- results removed. Rows locked by a concurrent sweep are skipped.
CREATE FUNCTION kombu_pgmq.results_expire(batch integer) RETURNS integer
LANGUAGE plpgsql AS $$
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
LANGUAGE sql STABLE AS $$
    SELECT r.state, count(*), min(r.date_done), sum(octet_length(r.meta))::bigint,
           count(*) FILTER (WHERE r.expires_at <= clock_timestamp())
    FROM kombu_pgmq.results r GROUP BY r.state ORDER BY r.state
$$;

-- -- chords --------------------------------------------------------------------------------

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

-- A new run of chord group_id (apply_chord, before its header is published): forget a
-- previous run of the same (frozen, re-applied) group id.
CREATE FUNCTION kombu_pgmq.chord_start(chord_group text, expires_seconds double precision)
RETURNS void
LANGUAGE sql AS $$
    DELETE FROM kombu_pgmq.chords WHERE group_id = chord_group;
    INSERT INTO kombu_pgmq.chords (group_id, expires_at)
    VALUES (chord_group, CASE WHEN expires_seconds > 0
                              THEN clock_timestamp() + make_interval(secs => expires_seconds) END);
$$;

-- The number of header tasks (set_chord_size); added_parts: Task.add_to_chord.
CREATE FUNCTION kombu_pgmq.chord_size(chord_group text, chord_size integer, added_parts integer,
                                      expires_seconds double precision)
RETURNS void
LANGUAGE sql AS $$
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
LANGUAGE plpgsql AS $$
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
LANGUAGE sql STABLE AS $$
    SELECT p.task_id, p.state, p.result FROM kombu_pgmq.chord_parts p
    WHERE p.group_id = chord_group ORDER BY p.group_index NULLS LAST, p.ctid
$$;

-- After the callback was published: drop the parts (the chord row stays until it expires,
-- with fired_at set, so a late copy of a header task never fires it again).
CREATE FUNCTION kombu_pgmq.chord_done(chord_group text, expires_seconds double precision)
RETURNS void
LANGUAGE sql AS $$
    DELETE FROM kombu_pgmq.chord_parts WHERE group_id = chord_group;
    UPDATE kombu_pgmq.chords
    SET expires_at = clock_timestamp() + make_interval(secs => greatest(coalesce(expires_seconds, 0), 300))
    WHERE group_id = chord_group;
$$;

-- -- durable revocations -------------------------------------------------------------------

-- Record revocations (idempotent) and NOTIFY kombu_pgmq_results with each task's result
-- key prefix-free id (payload "revoked\n<task id>"), so a waiting get() wakes.
CREATE FUNCTION kombu_pgmq.revoke_tasks(task_ids text[], expires_seconds double precision)
RETURNS integer
LANGUAGE plpgsql AS $$
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
LANGUAGE sql STABLE AS $$
    SELECT v.task_id, v.revoked_at, v.expires_at FROM kombu_pgmq.revoked v
    WHERE v.expires_at IS NULL OR v.expires_at > clock_timestamp()
    ORDER BY v.revoked_at DESC LIMIT max_rows
$$;

-- -- grants ---------------------------------------------------------------------------------

-- A worker writes results, counts chords, expires and revokes; a producer (the client
-- that applies tasks, chords and groups, and waits for them) reads results, saves groups
-- (no other key), starts chords, forgets keys and revokes. Neither has any privilege on the tables: no
-- role but the owner can read all results, truncate or drop them.
INSERT INTO kombu_pgmq.grantable (function, kind, definer) VALUES
    ('kombu_pgmq.results_store(text, text, bytea, double precision, boolean)', 'worker', true),
    ('kombu_pgmq.results_save_group(text, bytea, double precision)', 'producer', true),
    ('kombu_pgmq.results_get(text[], text[])', 'producer', true),
    ('kombu_pgmq.results_delete(text[])', 'producer', true),
    ('kombu_pgmq.results_expire_at(text[], double precision)', 'producer', true),
    ('kombu_pgmq.chord_start(text, double precision)', 'producer', true),
    ('kombu_pgmq.chord_size(text, integer, integer, double precision)', 'producer', true),
    ('kombu_pgmq.revoke_tasks(text[], double precision)', 'producer', true),
    ('kombu_pgmq.chord_part(text, text, integer, text, bytea, integer, double precision)', 'worker', true),
    ('kombu_pgmq.chord_results(text)', 'worker', true),
    ('kombu_pgmq.chord_done(text, double precision)', 'worker', true),
    ('kombu_pgmq.results_expire(integer)', 'worker', true),
    ('kombu_pgmq.revoked_tasks(integer)', 'worker', true),
    ('kombu_pgmq.results_stats()', 'producer', true);
SELECT kombu_pgmq.secure_functions();
