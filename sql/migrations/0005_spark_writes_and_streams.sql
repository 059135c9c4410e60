-- Spark integration (kombu_pgmq.spark): job-level atomic writes and stream offsets.
--
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

-- Commit: the committed attempts' messages become visible, the rest is deleted.
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
    -- Same wake-up protocol as kombu_pgmq.publish (migration 0003).
    PERFORM pg_advisory_xact_lock_shared(1802530161, hashtext(w.queue));
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
--     consumers' reads and acks, which end in milliseconds).
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
    SELECT array_agg(a.pid || '/' || a.xact_start) INTO writers
    FROM pg_locks l JOIN pg_stat_activity a USING (pid)
    WHERE l.locktype = 'relation' AND l.relation = tbl AND l.mode = 'RowExclusiveLock'
      AND l.granted AND a.pid <> pg_backend_pid();
    WHILE writers IS NOT NULL LOOP
        PERFORM pg_stat_clear_snapshot();  -- pg_stat_activity is cached per transaction
        EXIT WHEN NOT EXISTS (SELECT 1 FROM pg_stat_activity a
                              WHERE (a.pid || '/' || a.xact_start) = ANY (writers));
        IF clock_timestamp() > deadline THEN
            RETURN after_id;
        END IF;
        PERFORM pg_sleep(0.005);
    END LOOP;
    RETURN horizon;
END
$$;
