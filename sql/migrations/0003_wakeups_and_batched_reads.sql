-- Wake-ups without serializing publishers, and fewer round trips per delivery.
--
-- NOTIFY is a hint, not the message (DESIGN.md §4): committing a transaction that
-- notified takes a database-wide lock, so a NOTIFY on every publish serializes every
-- publishing commit (measured: 4 publishers fall from ~2,000-3,500 to ~1,200 sends/s).
-- Publishers therefore notify a queue only while a consumer waits on it; consumers busy
-- with a backlog do not wait, so under load no publish notifies.
--
-- Lost wake-ups are excluded by a shared/exclusive advisory lock per queue:
--   publisher: lock SHARED; send; check kombu_pgmq.waiting (a later statement, so a
--              newer snapshot than the lock); notify if a waiter is there; commit.
--   consumer:  insert its waiting row and take the lock EXCLUSIVE (one transaction,
--              committed); then read the queue once more, then sleep on LISTEN.
-- A publisher that checked before the waiting row was committed held its shared lock
-- then, so the consumer's exclusive lock waited for that publisher's commit and the
-- consumer's final read sees its message. A publisher that checked later notifies.
-- Publishers never wait for each other (shared locks); they wait only for a consumer's
-- short transition transaction.
--
-- Advisory lock keys: (1802530161 = 'kpmq', hashtext(pgmq queue name)); collisions
-- only cost a spurious wait. Several queues are always locked in name order.

-- One row per (queue, consuming connection) that found the queue empty and sleeps on
-- LISTEN "kombu_pgmq.<pgmq queue>". Rows of dead connections are reaped with their
-- consumers; a stale row only costs publishers a useless NOTIFY.
CREATE TABLE kombu_pgmq.waiting (
    pgmq_queue text NOT NULL,
    owner text NOT NULL,             -- host:pid:uuid of the Kombu connection
    since timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (pgmq_queue, owner)
);

-- Publish one message (pgmq.send), waking waiting consumers. delay_seconds > 0 sends
-- with a future visibility (PGMQ's native delay); those wake no one (the consumers'
-- fallback poll finds them).
CREATE FUNCTION kombu_pgmq.publish(
    queue text, message jsonb, headers jsonb, delay_seconds integer DEFAULT 0
) RETURNS bigint
LANGUAGE plpgsql AS $$
DECLARE
    sent bigint;
BEGIN
    PERFORM pg_advisory_xact_lock_shared(1802530161, hashtext(queue));
    sent := pgmq.send(queue, message, headers, delay_seconds);
    IF delay_seconds <= 0
       AND EXISTS (SELECT 1 FROM kombu_pgmq.waiting w WHERE w.pgmq_queue = queue) THEN
        PERFORM pg_notify('kombu_pgmq.' || queue, '');
    END IF;
    RETURN sent;
END
$$;

-- Publish one message to several queues (an exchange's routes) in one transaction, only
-- if the routing table is still at expected_version (else send nothing). Returns the
-- current version and the msg_ids.
CREATE FUNCTION kombu_pgmq.publish_routed(
    queues text[], message jsonb, headers jsonb, expected_version bigint,
    OUT version bigint, OUT msg_ids bigint[]
)
LANGUAGE plpgsql AS $$
DECLARE
    q text;
BEGIN
    msg_ids := '{}';
    FOR q IN SELECT DISTINCT u FROM unnest(queues) AS u ORDER BY u LOOP
        PERFORM pg_advisory_xact_lock_shared(1802530161, hashtext(q));
    END LOOP;
    SELECT v.version INTO version FROM kombu_pgmq.routing_version v;
    IF version <> expected_version THEN
        RETURN;
    END IF;
    FOREACH q IN ARRAY queues LOOP
        msg_ids := msg_ids || pgmq.send(q, message, headers);
    END LOOP;
    FOR q IN SELECT DISTINCT w.pgmq_queue FROM kombu_pgmq.waiting w
             WHERE w.pgmq_queue = ANY(queues) LOOP
        PERFORM pg_notify('kombu_pgmq.' || q, '');
    END LOOP;
END
$$;

-- A consumer found these queues empty and is about to sleep: record it, and wait for
-- publishers already past their waiting check (see the header). The caller reads the
-- queues once more after this commits. The commit is asynchronous: the row is visible at
-- commit all the same, and a server crash that forgets it also ends the consumer's
-- connections (it records itself again when it reconnects).
CREATE FUNCTION kombu_pgmq.wait_for(owner text, queues text[]) RETURNS void
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    q text;
BEGIN
    PERFORM set_config('synchronous_commit', 'off', true);
    INSERT INTO kombu_pgmq.waiting (pgmq_queue, owner)
    SELECT DISTINCT u, wait_for.owner FROM unnest(queues) AS u
    ON CONFLICT (pgmq_queue, owner) DO UPDATE SET since = clock_timestamp();
    FOR q IN SELECT DISTINCT u FROM unnest(queues) AS u ORDER BY u LOOP
        PERFORM pg_advisory_xact_lock(1802530161, hashtext(q));
    END LOOP;
END
$$;

-- Ack and read in one round trip and one transaction: archive the acked messages
-- (ack_queues[i] holds ack_ids[i]), then read up to qty messages from the queues in the
-- order given (the caller rotates it for fairness), hiding them for vt seconds.
-- The commit is asynchronous (synchronous_commit off) unless there are acks and
-- durable_acks: a server crash can then forget the last deliveries and acks, which only
-- delivers those messages again (at least once); it never loses a message, since
-- publishes always commit synchronously.
CREATE FUNCTION kombu_pgmq.read(
    queues text[], vt integer, qty integer,
    ack_queues text[] DEFAULT '{}', ack_ids bigint[] DEFAULT '{}',
    durable_acks boolean DEFAULT true
) RETURNS TABLE (
    queue text, msg_id bigint, read_ct integer, message text, headers text,
    age_seconds double precision
)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    q text;
    ids bigint[];
    remaining integer := qty;
    n integer;
BEGIN
    IF coalesce(cardinality(ack_ids), 0) = 0 OR NOT durable_acks THEN
        PERFORM set_config('synchronous_commit', 'off', true);
    END IF;
    IF coalesce(cardinality(ack_ids), 0) > 0 THEN
        FOR q, ids IN
            SELECT a.q, array_agg(a.id) FROM unnest(ack_queues, ack_ids) AS a(q, id)
            GROUP BY a.q ORDER BY a.q
        LOOP
            PERFORM pgmq.archive(q, ids);
        END LOOP;
    END IF;
    FOREACH q IN ARRAY queues LOOP
        EXIT WHEN remaining <= 0;
        RETURN QUERY
            SELECT q, r.msg_id, r.read_ct, r.message::text, r.headers::text,
                   extract(epoch FROM clock_timestamp() - r.enqueued_at)::float8
            FROM pgmq.read(q, vt, remaining) AS r;
        GET DIAGNOSTICS n = ROW_COUNT;
        remaining := remaining - n;
    END LOOP;
END
$$;
