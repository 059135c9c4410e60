-- Celery beat in PostgreSQL (issue 28): the schedule, the leader and each tick once.
-- kombu_pgmq.beat (Python) is the only caller; roles reach the tables only through these
-- SECURITY DEFINER functions.
--
-- Leader: the session that holds the session advisory lock (1802530166, 1650811252)
-- ('kpmq' + 5, "beat": no other kombu_pgmq lock uses class 1802530166); PostgreSQL
-- releases it when the session ends (a killed beat, a cut connection, a restart). A leader that hangs with its session open stops writing heartbeat_at; a
-- follower then ends that session (pg_terminate_backend) and takes the lock.
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
LANGUAGE sql STABLE AS $$
    SELECT EXISTS (
        SELECT 1 FROM pg_catalog.pg_locks l
        WHERE l.locktype = 'advisory' AND l.classid = 1802530166 AND l.objid = 1650811252
          AND l.objsubid = 2 AND l.granted AND l.pid = pg_catalog.pg_backend_pid())
$$;

-- One election round of a beat process (every second or so): the lock holder renews its
-- heartbeat; another session takes the lock if it is free (a new epoch), else, when the
-- holder's heartbeat is older than stale_seconds, ends the holder's session (deposed:
-- the lock is free at a next round).
CREATE FUNCTION kombu_pgmq.beat_elect(me text, stale_seconds double precision)
RETURNS TABLE (leader boolean, epoch bigint, leader_identity text, leader_pid integer,
               heartbeat_age double precision, deposed boolean)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    held boolean := kombu_pgmq.beat_lock_held();
    r kombu_pgmq.beat_leader;
    ended boolean := false;
BEGIN
    IF held THEN
        UPDATE kombu_pgmq.beat_leader SET heartbeat_at = clock_timestamp()
        WHERE id = 1 AND backend_pid = pg_catalog.pg_backend_pid();
    ELSIF pg_catalog.pg_try_advisory_lock(1802530166, 1650811252) THEN
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
        WHERE l.locktype = 'advisory' AND l.classid = 1802530166 AND l.objid = 1650811252
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
LANGUAGE plpgsql AS $$
BEGIN
    IF NOT kombu_pgmq.beat_lock_held() THEN
        RETURN false;
    END IF;
    UPDATE kombu_pgmq.beat_leader SET heartbeat_at = clock_timestamp()
    WHERE id = 1 AND backend_pid = pg_catalog.pg_backend_pid();
    RETURN pg_catalog.pg_advisory_unlock(1802530166, 1650811252);
END
$$;

-- The leader of record, and how old its heartbeat is (seconds).
CREATE FUNCTION kombu_pgmq.beat_leader_info()
RETURNS TABLE (identity text, backend_pid integer, epoch bigint, since timestamptz,
               heartbeat_at timestamptz, heartbeat_age double precision, alive boolean)
LANGUAGE sql STABLE AS $$
    SELECT l.identity, l.backend_pid, l.epoch, l.since, l.heartbeat_at,
           extract(epoch FROM clock_timestamp() - l.heartbeat_at)::double precision,
           EXISTS (SELECT 1 FROM pg_catalog.pg_locks k
                   WHERE k.locktype = 'advisory' AND k.classid = 1802530166
                     AND k.objid = 1650811252 AND k.objsubid = 2 AND k.granted
                     AND k.pid = l.backend_pid)
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
LANGUAGE plpgsql AS $$
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
LANGUAGE plpgsql AS $$
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
LANGUAGE plpgsql AS $$
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
LANGUAGE plpgsql AS $$
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
LANGUAGE sql AS $$
    UPDATE kombu_pgmq.beat_entries
    SET enabled = entry_enabled, updated_at = clock_timestamp()
    WHERE name = entry_name RETURNING true
$$;
CREATE FUNCTION kombu_pgmq.beat_remove(entry_name text) RETURNS boolean
LANGUAGE sql AS $$
    DELETE FROM kombu_pgmq.beat_entries WHERE name = entry_name RETURNING true
$$;
CREATE FUNCTION kombu_pgmq.beat_run_now(entry_name text) RETURNS timestamptz
LANGUAGE sql AS $$
    UPDATE kombu_pgmq.beat_entries
    SET run_requested_at = coalesce(run_requested_at, clock_timestamp())
    WHERE name = entry_name RETURNING run_requested_at
$$;

-- The schedule, as stored.
CREATE FUNCTION kombu_pgmq.beat_list()
RETURNS SETOF kombu_pgmq.beat_entries
LANGUAGE sql STABLE AS $$
    SELECT * FROM kombu_pgmq.beat_entries ORDER BY name
$$;

-- One entry (primary key lookup).
CREATE FUNCTION kombu_pgmq.beat_get(entry_name text)
RETURNS SETOF kombu_pgmq.beat_entries
LANGUAGE sql STABLE AS $$
    SELECT * FROM kombu_pgmq.beat_entries WHERE name = entry_name
$$;

-- Ticks sent (newest first), of one entry or all (entry_name NULL).
CREATE FUNCTION kombu_pgmq.beat_history(entry_name text, max_rows integer)
RETURNS SETOF kombu_pgmq.beat_ticks
LANGUAGE sql STABLE AS $$
    SELECT * FROM kombu_pgmq.beat_ticks
    WHERE entry_name IS NULL OR entry = entry_name
    ORDER BY sent_at DESC, entry LIMIT max_rows
$$;

-- Forget ticks sent more than keep_seconds ago (at most batch rows); how many.
CREATE FUNCTION kombu_pgmq.beat_prune(keep_seconds double precision, batch integer)
RETURNS integer
LANGUAGE plpgsql AS $$
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

-- -- batched publishes (kombu_pgmq._db.batch: a beat tick's tasks, in its transaction) -------

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
LANGUAGE plpgsql AS $$
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
    PERFORM pg_advisory_xact_lock_shared(1802530161, hashtext(x.q))
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

-- -- grants ---------------------------------------------------------------------------------

-- A beat runs as a worker role (it elects, claims and publishes); application code that
-- manages periodic tasks at run time as a producer role (list, add, change, remove,
-- run now, read history and the leader).
INSERT INTO kombu_pgmq.grantable (function, kind, definer) VALUES
    ('kombu_pgmq.beat_lock_held()', 'worker', true),
    ('kombu_pgmq.beat_elect(text, double precision)', 'worker', true),
    ('kombu_pgmq.beat_resign()', 'worker', true),
    ('kombu_pgmq.beat_claim(bigint, text, text[], timestamptz[], timestamptz[], timestamptz[], text[], text[], integer[])', 'worker', true),
    ('kombu_pgmq.beat_note(bigint, text[], timestamptz[], text[])', 'worker', true),
    ('kombu_pgmq.beat_sync_config(jsonb)', 'worker', true),
    ('kombu_pgmq.beat_prune(double precision, integer)', 'worker', true),
    ('kombu_pgmq.beat_upsert(text, text, text, jsonb, jsonb, jsonb, jsonb, boolean, text, boolean)', 'producer', true),
    ('kombu_pgmq.beat_set_enabled(text, boolean)', 'producer', true),
    ('kombu_pgmq.beat_remove(text)', 'producer', true),
    ('kombu_pgmq.beat_run_now(text)', 'producer', true),
    ('kombu_pgmq.beat_list()', 'producer', true),
    ('kombu_pgmq.beat_get(text)', 'producer', true),
    ('kombu_pgmq.beat_history(text, integer)', 'producer', true),
    ('kombu_pgmq.beat_leader_info()', 'producer', true),
    ('kombu_pgmq.publish_many(jsonb, bigint)', 'producer', true);
SELECT kombu_pgmq.secure_functions();
