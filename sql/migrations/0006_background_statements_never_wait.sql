-- Background statements never wait on an application's locks (issue "one connection per
-- concern"): the reaper skips a queue whose tables are locked, and a consumer going to
-- sleep waits only briefly for publishers still in their transaction.

-- The reaper (heartbeat thread, and once on connect) drops abandoned queues. DROP TABLE
-- needs ACCESS EXCLUSIVE locks, which wait for every open transaction that touched the
-- table (a reader, an application that enqueued and has not committed yet). Such a queue
-- is skipped this round: its tables are locked NOWAIT first, in a subtransaction, and a
-- refused lock (lock_not_available) rolls back only that queue's drop.
CREATE OR REPLACE FUNCTION kombu_pgmq.reap()
RETURNS SETOF text
LANGUAGE plpgsql AS $$
DECLARE
    victim record;
    band text;
BEGIN
    DELETE FROM kombu_pgmq.consumers
    WHERE heartbeat_at + make_interval(secs => stale_after_seconds) < clock_timestamp();
    FOR victim IN
        SELECT q.queue, q.pgmq_queue, q.band_queues FROM kombu_pgmq.queues q
        WHERE NOT EXISTS (SELECT 1 FROM kombu_pgmq.consumers c WHERE c.queue = q.queue)
          AND ((q.auto_delete AND q.had_consumer)
               OR (q.expires_ms IS NOT NULL
                   AND q.last_used_at + q.expires_ms * interval '1 millisecond' < clock_timestamp()))
        FOR UPDATE SKIP LOCKED
    LOOP
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

-- A consumer found these queues empty and is about to sleep: record it, then wait for
-- publishers already past their waiting check (migration 0003), but at most
-- max_wait_ms per queue. A publisher still in its transaction after that (an application
-- that enqueued inside its own long transaction) is not waited for: the queue is
-- returned, and the consumer finds that publisher's message at its fallback poll instead
-- of by a NOTIFY. So no open transaction of an application ever stops a consumer.
DROP FUNCTION kombu_pgmq.wait_for(text, text[]);
CREATE FUNCTION kombu_pgmq.wait_for(owner text, queues text[], max_wait_ms integer DEFAULT 50)
RETURNS SETOF text
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    q text;
BEGIN
    PERFORM set_config('synchronous_commit', 'off', true);
    INSERT INTO kombu_pgmq.waiting (pgmq_queue, owner)
    SELECT DISTINCT u, wait_for.owner FROM unnest(queues) AS u
    ON CONFLICT (pgmq_queue, owner) DO UPDATE SET since = clock_timestamp();
    PERFORM set_config('lock_timeout', max_wait_ms || 'ms', true);
    FOR q IN SELECT DISTINCT u FROM unnest(queues) AS u ORDER BY u LOOP
        BEGIN
            PERFORM pg_advisory_xact_lock(1802530161, hashtext(q));
        EXCEPTION WHEN lock_not_available THEN
            RETURN NEXT q;
        END;
    END LOOP;
END
$$;
