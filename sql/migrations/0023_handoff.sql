-- Hand-over at publish (issue 30, item 4): a publish to a queue an idle consumer waits on
-- hands the message to that consumer in its wake-up, instead of waking it to read.
--
-- Until now a waiting consumer (migration 0003) was woken by a NOTIFY with no message in
-- it and then read the queue: a round trip to its statement connection after every
-- wake-up (0.8-0.9 ms p50 on the benchmark machine, most of the gap to Redis's BRPOP),
-- and every consumer waiting on the queue woke and read, all but one for nothing.
--
-- Now a consumer going to sleep on a queue also offers one hand-over slot there: its
-- LISTEN connection's own channel, a session advisory lock that connection holds while it
-- listens, and its visibility timeout (kombu_pgmq.wait_for_handoff). A direct publish
-- (statement send_queue) to a queue with an offered slot claims it
-- (kombu_pgmq.hand_off: FOR UPDATE SKIP LOCKED, so publishers never wait on each other)
-- and writes the row as pgmq.read leaves a delivered one (read_ct 1, vt = now + the
-- consumer's visibility timeout, last_read_at), then NOTIFYs the consumer's channel with
-- the row (queue, msg_id, enqueued_at, message, headers) instead of the plain wake-up.
-- The consumer delivers it without a read; its receipt (msg_id, read_ct, enqueued_at)
-- settles it like any delivery. One slot per consuming connection: a claim takes the
-- offers on all its queues (priority bands included), and the consumer offers again on
-- the queues whose channel has room (kombu_pgmq.rearm_handoff), so a channel is never
-- handed more than one message past its prefetch window (a higher priority band published
-- to meanwhile is read first), and idle consumers take turns (the longest waiting first).
--
-- Nothing is lost: a handed row is a delivered row. If its consumer dies before taking it
-- (or its LISTEN connection drops in that instant, losing the notification), the row
-- becomes visible again when its visibility timeout passes and is read like any lapsed
-- delivery. A consumer whose LISTEN connection is gone no longer holds its lock, so
-- publishers skip its stale slot (pg_try_advisory_xact_lock_shared succeeds on a lock
-- nobody holds) and wake the queue the old way. Paused and limited queues (migrations
-- 0012, 0021: FIFO groups are limited) are never handed over: their reads apply their
-- rules. Delayed publishes, deduplicated ones, publishes in the application's
-- transaction and routed publishes to several queues wake the queue as before.
--
-- Advisory lock keys of the slots: one bigint per LISTEN connection (a 64-bit hash of its
-- channel), not the (1802530161, hashtext(queue)) keys of migration 0003.

ALTER TABLE kombu_pgmq.waiting
    ADD COLUMN handoff_channel text,           -- NOTIFY channel of the consumer's LISTEN connection
    ADD COLUMN handoff_lock bigint,            -- advisory lock that connection holds while it listens
    ADD COLUMN handoff_vt integer,             -- seconds: visibility timeout of a handed message
    ADD COLUMN handoff_slots integer NOT NULL DEFAULT 0;  -- 1: offered on this queue now

-- A connection's offers (its rows) are taken together: found by owner.
CREATE INDEX waiting_owner ON kombu_pgmq.waiting (owner);

-- Claim a hand-over slot of a consumer waiting on pgmq_name (called by statement
-- send_queue before it writes the row). payload NULL: the caller hands nothing over (the
-- message is delayed or too large for a NOTIFY), nothing is claimed. Returns the slot's
-- channel and visibility timeout (seconds), or no row: publish and wake as before.
CREATE FUNCTION kombu_pgmq.hand_off(pgmq_name text, payload text)
RETURNS TABLE (channel text, vt_seconds integer)
-- ROWS 1: at most one slot; with the default estimate (1000 rows) send_queue's plan cost
-- passed jit_above_cost and every publish paid ~8 ms of JIT compilation.
LANGUAGE plpgsql ROWS 1 AS $$
#variable_conflict use_column
DECLARE
    w record;
BEGIN
    IF payload IS NULL OR NOT EXISTS (
        SELECT 1 FROM kombu_pgmq.waiting x
        WHERE x.pgmq_queue = pgmq_name AND x.handoff_slots > 0
    ) THEN
        RETURN;
    END IF;
    IF EXISTS (SELECT 1 FROM kombu_pgmq.paused p WHERE p.pgmq_queue = pgmq_name)
       OR EXISTS (SELECT 1 FROM kombu_pgmq.limited l WHERE l.pgmq_queue = pgmq_name) THEN
        RETURN;
    END IF;
    FOR w IN SELECT x.owner, x.handoff_channel, x.handoff_lock, x.handoff_vt
             FROM kombu_pgmq.waiting x
             WHERE x.pgmq_queue = pgmq_name AND x.handoff_slots > 0
             ORDER BY x.since
             FOR UPDATE SKIP LOCKED LOOP
        -- its LISTEN connection holds the lock while it listens: a lock we get is a gone one
        CONTINUE WHEN pg_try_advisory_xact_lock_shared(w.handoff_lock);
        -- one slot per connection: the offers on its other queues (priority bands, other
        -- queues of its channels) go with it; rows another publisher holds are skipped
        UPDATE kombu_pgmq.waiting x SET handoff_slots = 0
        WHERE x.ctid = ANY (ARRAY(SELECT y.ctid FROM kombu_pgmq.waiting y
                                  WHERE y.owner = w.owner AND y.handoff_slots > 0
                                  FOR UPDATE SKIP LOCKED));
        channel := w.handoff_channel;
        vt_seconds := w.handoff_vt;
        RETURN NEXT;
        RETURN;
    END LOOP;
END
$$;

-- wait_for_due (migration 0016), offering one hand-over slot on handoff_queues (those of
-- queues it waits on that its consumer takes with acks) at channel, held by lock_key,
-- with a visibility timeout of vt seconds. Same result as wait_for_due.
CREATE FUNCTION kombu_pgmq.wait_for_handoff(
    owner text, queues text[], handoff_queues text[], channel text, lock_key bigint,
    vt integer, max_wait_ms integer DEFAULT 50
) RETURNS TABLE (queue text, unsettled boolean, due_in_seconds double precision,
                 server_epoch double precision)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
BEGIN
    PERFORM kombu_pgmq.check_window('visibility timeout (seconds)', vt, 43200);
    RETURN QUERY SELECT * FROM kombu_pgmq.wait_for_due(owner, queues, max_wait_ms);
    UPDATE kombu_pgmq.waiting w
    SET handoff_channel = channel, handoff_lock = lock_key, handoff_vt = vt,
        handoff_slots = 1
    WHERE w.owner = wait_for_handoff.owner AND w.pgmq_queue = ANY(handoff_queues);
END
$$;

-- A consumer took its handed message and has room again: offer one slot again on these
-- of the queues it still waits on, behind the consumers waiting longer (asynchronous commit: a crash forgets it, and the
-- consumer is woken the old way). Returns the queues offered again: one left out is no
-- longer waited on (a backlog, the reaper), and is waited on again when next found empty.
CREATE FUNCTION kombu_pgmq.rearm_handoff(owner text, queues text[])
RETURNS SETOF text
LANGUAGE plpgsql AS $$
#variable_conflict use_column
BEGIN
    PERFORM set_config('synchronous_commit', 'off', true);
    RETURN QUERY
        UPDATE kombu_pgmq.waiting w SET handoff_slots = 1, since = clock_timestamp()
        WHERE w.owner = rearm_handoff.owner AND w.pgmq_queue = ANY(queues)
          AND w.handoff_channel IS NOT NULL
        RETURNING w.pgmq_queue;
END
$$;

INSERT INTO kombu_pgmq.grantable (function, kind, definer) VALUES
    ('kombu_pgmq.hand_off(text, text)', 'owner', true),
    ('kombu_pgmq.wait_for_handoff(text, text[], text[], text, bigint, integer, integer)',
     'worker', true),
    ('kombu_pgmq.rearm_handoff(text, text[])', 'worker', true);
SELECT kombu_pgmq.secure_functions();
