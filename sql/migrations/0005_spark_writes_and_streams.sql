-- Spark integration (kombu_pgmq.spark): job-level atomic writes and stream offsets.
--
-- A Spark write stages its messages hidden (vt 10 years ahead) with the header
-- "x-kombu-pgmq-write" = '<write id>/<partition>/<attempt>', one batch per Spark task
-- attempt. commit_write (on the Spark driver, once every task succeeded) makes the
-- committed attempts' messages visible in one transaction and deletes what other
-- (failed) attempts staged; abort_write deletes everything the write staged. after_id is
-- the queue's highest msg_id before the write began: every staged row is above it, so
-- both scan a primary key range, not the whole queue.

CREATE FUNCTION kombu_pgmq.abort_write(queue text, write_id text, after_id bigint)
RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    deleted integer;
BEGIN
    EXECUTE format(
        'DELETE FROM pgmq.%I WHERE msg_id > $1
         AND starts_with(headers ->> ''x-kombu-pgmq-write'', $2 || ''/'')', 'q_' || queue)
    USING after_id, write_id;
    GET DIAGNOSTICS deleted = ROW_COUNT;
    RETURN deleted;
END
$$;

CREATE FUNCTION kombu_pgmq.commit_write(
    queue text, write_id text, after_id bigint, attempts text[]
) RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    committed integer;
BEGIN
    -- Same wake-up protocol as kombu_pgmq.publish (migration 0003).
    PERFORM pg_advisory_xact_lock_shared(1802530161, hashtext(queue));
    EXECUTE format(
        'UPDATE pgmq.%I SET vt = clock_timestamp(), headers = headers - ''x-kombu-pgmq-write''
         WHERE msg_id > $1 AND headers ->> ''x-kombu-pgmq-write'' = ANY ($2)', 'q_' || queue)
    USING after_id, attempts;
    GET DIAGNOSTICS committed = ROW_COUNT;
    PERFORM kombu_pgmq.abort_write(queue, write_id, after_id);  -- failed attempts' rows
    IF committed > 0
       AND EXISTS (SELECT 1 FROM kombu_pgmq.waiting w WHERE w.pgmq_queue = queue) THEN
        PERFORM pg_notify('kombu_pgmq.' || queue, '');
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
