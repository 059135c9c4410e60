-- Due messages wake consumers like new ones (issue 25, item 5). A delayed message
-- (x-delay, a Celery countdown/ETA) used to wake nobody when it became due: only the
-- consumers' fallback poll (polling_interval, 1 s) found it, so a message whose TTL
-- (x-message-ttl, expiration; counted from when it became visible) was shorter than that
-- lag was deleted unseen.
--
-- Now consumers learn when a delayed message becomes due and read it then:
-- * a delayed publish to a queue a consumer waits on NOTIFYs the queue's channel with
--   the due time as payload (seconds since the epoch, server clock; an empty payload
--   still means "visible now"); inside an application's transaction the wake-up waits
--   for its commit as before (kombu_pgmq.commit_wakeups gains the due time, the earliest
--   of the transaction's publishes to that queue);
-- * a consumer going to sleep on queues (kombu_pgmq.wait_for_due, replacing wait_for in
--   the client) gets, per queue, how long until its next delayed message is due.
-- A consumer woken at a due time reads the queue and, if it finds it empty again, asks
-- for the next due time the same way.

ALTER TABLE kombu_pgmq.commit_wakeups ADD COLUMN due timestamptz;  -- NULL: visible now

-- NOTIFY payload of a wake-up: '' (visible now) or the due time as epoch seconds.
CREATE FUNCTION kombu_pgmq.due_payload(due timestamptz) RETURNS text
LANGUAGE sql IMMUTABLE AS $$
    SELECT CASE WHEN due IS NULL THEN '' ELSE extract(epoch FROM due)::text END
$$;

-- Wake the consumers waiting on a queue: a message there is visible now (due NULL) or
-- will be at due. Now if this statement is its own transaction, else at the commit of the
-- transaction it is part of (migration 0011's commit trigger).
CREATE FUNCTION kombu_pgmq.wake_due(pgmq_name text, due timestamptz) RETURNS void
LANGUAGE plpgsql AS $$
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

CREATE OR REPLACE FUNCTION kombu_pgmq.wake(pgmq_name text) RETURNS void
LANGUAGE sql AS $$
    SELECT kombu_pgmq.wake_due(pgmq_name, NULL)
$$;

-- The commit trigger reads the row as it is at commit (its due may have been lowered or
-- cleared by a later publish of the same transaction).
CREATE OR REPLACE FUNCTION kombu_pgmq.wake_at_commit() RETURNS trigger
LANGUAGE plpgsql AS $$
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

-- The wake-up of a direct publish (migration 0013's notify_waiting), due NULL: visible now.
CREATE FUNCTION kombu_pgmq.notify_waiting(pgmq_name text, due timestamptz) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM kombu_pgmq.waiting w WHERE w.pgmq_queue = pgmq_name) THEN
        PERFORM pg_notify('kombu_pgmq.' || pgmq_name, kombu_pgmq.due_payload(due));
    END IF;
END
$$;

-- Publish (migration 0011's function): a delayed message wakes waiting consumers with its
-- due time.
CREATE OR REPLACE FUNCTION kombu_pgmq.publish(
    queue text, message jsonb, headers jsonb, delay_seconds integer DEFAULT 0,
    deduplication_window double precision DEFAULT 300
) RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    sent bigint;
    dedup record;
BEGIN
    SELECT * INTO dedup FROM kombu_pgmq.deduplication_of(queue, headers);
    IF dedup.dedup_id IS NOT NULL
       AND NOT kombu_pgmq.claim_deduplication(dedup.scope, dedup.dedup_id, deduplication_window) THEN
        RETURN NULL;
    END IF;
    PERFORM pg_advisory_xact_lock_shared(1802530161, hashtext(queue));
    sent := pgmq.send(queue, message, headers, delay_seconds);
    PERFORM kombu_pgmq.wake_due(queue, CASE WHEN delay_seconds > 0 THEN
        clock_timestamp() + make_interval(secs => delay_seconds) END);
    RETURN sent;
END
$$;

-- Send to several queues (migration 0011's function, behind publish_routed and
-- send_task): the same.
CREATE OR REPLACE FUNCTION kombu_pgmq.send_to(
    queues text[], message jsonb, headers jsonb, delay_seconds integer DEFAULT 0,
    deduplication_window double precision DEFAULT 300
) RETURNS bigint[]
LANGUAGE plpgsql AS $$
DECLARE
    q text;
    dedup record;
    duplicate text[] := '{}';
    msg_ids bigint[] := '{}';
BEGIN
    FOR q IN SELECT DISTINCT u FROM unnest(queues) AS u ORDER BY u LOOP
        PERFORM pg_advisory_xact_lock_shared(1802530161, hashtext(q));
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

-- A consumer found these queues empty and goes to sleep on them (migration 0006's
-- wait_for), and learns per queue how long until its next delayed message is due
-- (never-read messages whose vt is ahead; NULL: none), by the server's clock, with the
-- server's time (epoch seconds) to convert NOTIFY payloads. unsettled: a publisher to
-- the queue was still in its transaction (poll it). A queue whose table is locked or
-- gone reports no due time.
CREATE FUNCTION kombu_pgmq.wait_for_due(owner text, queues text[], max_wait_ms integer DEFAULT 50)
RETURNS TABLE (queue text, unsettled boolean, due_in_seconds double precision,
               server_epoch double precision)
LANGUAGE plpgsql AS $$
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

INSERT INTO kombu_pgmq.grantable (function, kind, definer) VALUES
    ('kombu_pgmq.wait_for_due(text, text[], integer)', 'worker', true),
    ('kombu_pgmq.wake_due(text, timestamptz)', 'owner', true),
    ('kombu_pgmq.notify_waiting(text, timestamptz)', 'owner', true),
    ('kombu_pgmq.due_payload(timestamptz)', 'owner', false);
SELECT kombu_pgmq.secure_functions();
