-- The reaper judges consumers and x-expires queues fairly (issue "every message accounted
-- for"):
--   * after the database restarts, every consumer gets a full stale_after_seconds from the
--     restart (pg_postmaster_start_time) before it counts as gone: live workers could not
--     send heartbeats while the server was down, and the first process to reconnect must
--     not drop their auto_delete queues with the messages in them;
--   * a queue with x-expires counts as used while it receives messages: its newest message
--     (by msg_id, the primary key: one index probe) younger than x-expires keeps it, so
--     publishes need no extra write. basic_get marks it used explicitly (touch_queue).
CREATE OR REPLACE FUNCTION kombu_pgmq.reap()
RETURNS SETOF text
LANGUAGE plpgsql AS $$
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
