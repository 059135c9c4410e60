-- The Spark stream horizon (migration 0005) waited for in-flight writers of the queue by
-- (pid, xact_start) from pg_stat_activity, which a role without pg_read_all_stats sees as
-- NULL for other users' sessions: it then did not wait, and archived a range holding a
-- row committed late, never delivered to the sink. Writers are now identified by their
-- virtual transaction id in pg_locks, which every role may read.
CREATE OR REPLACE FUNCTION kombu_pgmq.stream_horizon(
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
