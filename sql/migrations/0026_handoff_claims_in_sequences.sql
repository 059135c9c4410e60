-- Hand-over claims that write no row: a publish claims a waiting consumer's slot with
-- nextval on that consumer's sequence, and the consumer offers it again with setval,
-- instead of two UPDATEs of its kombu_pgmq.waiting rows per message.
--
-- Each UPDATE left a row version that every publish's lookup of the waiting rows then
-- walked while a long transaction anywhere in the database held the xmin horizon
-- (measured: a publish 0.09 -> 2.6 ms, an offer 0.05 -> 0.9 ms mean within 6 minutes at
-- 500 messages/s). Sequences are not versioned: nextval and setval change the value in
-- place, whatever snapshot is open.
--
-- The state of one LISTEN connection's slot is the value of its sequence (one of a pool,
-- kombu_pgmq.handoff_<n>, leased for the life of the connection by a session advisory
-- lock): offered when the value is a multiple of 2^20 (the offer's time in ms times 2^20:
-- the longest offered is claimed first), taken once a publisher's nextval moved it off
-- (the publisher that got offer + 1 owns the claim; a later nextval in the same race gets
-- offer + 2, ... and tries the next consumer). nextval is not rolled back: a publish that
-- claimed and then failed leaves the slot taken, and the consumer is woken the old way
-- until it offers again (its next wait_for_handoff or rearm_handoff). handoff_slots keeps
-- meaning "offered on this queue" (its channel has room), written only when that changes.
-- The pool's sequences are never dropped (a publisher may read one any time); a
-- connection's lease ends with its session.

ALTER TABLE kombu_pgmq.waiting ADD COLUMN handoff_seq regclass;  -- the connection's sequence

-- Lease a pool sequence for this session (the LISTEN connection's) and take its liveness
-- lock lock_key: both session advisory locks, released when the session ends. Returns the
-- sequence's number n (kombu_pgmq.handoff_<n>, created if missing, never dropped).
CREATE FUNCTION kombu_pgmq.handoff_lease(lock_key bigint) RETURNS integer
LANGUAGE plpgsql AS $$
DECLARE
    n integer := 0;
BEGIN
    PERFORM pg_advisory_lock(lock_key);
    WHILE NOT pg_try_advisory_lock(1802530163, n) LOOP
        n := n + 1;
    END LOOP;
    IF to_regclass(format('kombu_pgmq.handoff_%s', n)) IS NULL THEN
        EXECUTE format('CREATE SEQUENCE IF NOT EXISTS kombu_pgmq.%I MINVALUE 0 START 1',
                       'handoff_' || n);
    END IF;
    RETURN n;
END
$$;

-- Offer the slot of sequence seq now (the value: this moment in ms times 2^20).
CREATE FUNCTION kombu_pgmq.handoff_offer(seq regclass) RETURNS bigint
LANGUAGE sql AS $$
    SELECT setval(seq, (extract(epoch FROM clock_timestamp()) * 1000)::bigint * 1048576, true)
$$;

DROP FUNCTION kombu_pgmq.hand_off(text, text);
-- Claim a hand-over slot of a consumer waiting on pgmq_name (called by statement
-- send_queue before it writes the row). payload NULL: the caller hands nothing over (the
-- message is delayed or too large for a NOTIFY), nothing is claimed. Returns the slot's
-- channel and visibility timeout (seconds), or no row: publish and wake as before.
-- Writes nothing but the claimed sequence's value: the waiting rows are only read.
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
    FOR w IN SELECT o.*
             FROM (SELECT x.handoff_channel, x.handoff_lock, x.handoff_vt, x.handoff_seq,
                          pg_sequence_last_value(x.handoff_seq) AS offered
                   FROM kombu_pgmq.waiting x
                   WHERE x.pgmq_queue = pgmq_name AND x.handoff_slots > 0
                     AND x.handoff_seq IS NOT NULL) AS o
             WHERE o.offered % 1048576 = 0
             ORDER BY o.offered LOOP
        -- its LISTEN connection holds the lock while it listens: a lock we get is a gone one
        CONTINUE WHEN pg_try_advisory_xact_lock_shared(w.handoff_lock);
        -- one slot per connection (its offers on every queue): the first nextval claims it
        CONTINUE WHEN nextval(w.handoff_seq) <> w.offered + 1;
        channel := w.handoff_channel;
        vt_seconds := w.handoff_vt;
        RETURN NEXT;
        RETURN;
    END LOOP;
END
$$;

DROP FUNCTION kombu_pgmq.wait_for_handoff(text, text[], text[], text, bigint, integer, integer);
-- wait_for_due, offering one hand-over slot on handoff_queues (those of queues it waits on
-- that its consumer takes with acks) at channel, held by lock_key, with a visibility
-- timeout of vt seconds, claimed on sequence kombu_pgmq.handoff_<seq>
-- (kombu_pgmq.handoff_lease). The waiting rows are written only where they change. Same
-- result as wait_for_due.
CREATE FUNCTION kombu_pgmq.wait_for_handoff(
    owner text, queues text[], handoff_queues text[], channel text, lock_key bigint,
    vt integer, seq integer, max_wait_ms integer DEFAULT 50
) RETURNS TABLE (queue text, unsettled boolean, due_in_seconds double precision,
                 server_epoch double precision)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    s regclass := to_regclass(format('kombu_pgmq.handoff_%s', seq));
BEGIN
    PERFORM kombu_pgmq.check_window('visibility timeout (seconds)', vt, 43200);
    RETURN QUERY SELECT * FROM kombu_pgmq.wait_for_due(owner, queues, max_wait_ms);
    IF s IS NULL THEN
        RETURN;  -- not leased: no slot offered
    END IF;
    UPDATE kombu_pgmq.waiting w
    SET handoff_channel = channel, handoff_lock = lock_key, handoff_vt = vt,
        handoff_seq = s, handoff_slots = 1
    WHERE w.owner = wait_for_handoff.owner AND w.pgmq_queue = ANY(handoff_queues)
      AND (w.handoff_channel, w.handoff_lock, w.handoff_vt, w.handoff_seq, w.handoff_slots)
          IS DISTINCT FROM (channel, lock_key, vt, s, 1);
    PERFORM kombu_pgmq.handoff_offer(s);
END
$$;

CREATE OR REPLACE FUNCTION kombu_pgmq.rearm_handoff(owner text, queues text[])
RETURNS SETOF text
LANGUAGE plpgsql AS $$
#variable_conflict use_column
-- A consumer took its handed message and has room again: offer its slot again on queues,
-- the queues it offers from now on (its other queues are no longer offered), behind the
-- consumers offered longer (asynchronous commit: a crash forgets the offer rows' changes,
-- and the consumer is woken the old way). Returns the queues offered: one left out is no
-- longer waited on (a backlog, the reaper), and is waited on again when next found empty.
DECLARE
    s regclass;
BEGIN
    PERFORM set_config('synchronous_commit', 'off', true);
    UPDATE kombu_pgmq.waiting w
    SET handoff_slots = CASE WHEN w.pgmq_queue = ANY(queues) THEN 1 ELSE 0 END
    WHERE w.owner = rearm_handoff.owner AND w.handoff_channel IS NOT NULL
      AND w.handoff_slots <> CASE WHEN w.pgmq_queue = ANY(queues) THEN 1 ELSE 0 END;
    SELECT min(w.handoff_seq::oid)::regclass INTO s
    FROM kombu_pgmq.waiting w
    WHERE w.owner = rearm_handoff.owner AND w.pgmq_queue = ANY(queues)
      AND w.handoff_channel IS NOT NULL;
    IF s IS NOT NULL THEN
        PERFORM kombu_pgmq.handoff_offer(s);
    END IF;
    RETURN QUERY
        SELECT w.pgmq_queue FROM kombu_pgmq.waiting w
        WHERE w.owner = rearm_handoff.owner AND w.pgmq_queue = ANY(queues)
          AND w.handoff_channel IS NOT NULL AND w.handoff_seq IS NOT NULL;
END
$$;

-- Offers as a publish sees them: each waiting row that offers a slot now (offered on its
-- queue, and its connection's slot not claimed since it was offered).
CREATE VIEW kombu_pgmq.handoff_offers AS
SELECT w.pgmq_queue, w.owner, w.handoff_channel,
       to_timestamp(pg_sequence_last_value(w.handoff_seq) / 1048576 / 1000.0) AS offered_at
FROM kombu_pgmq.waiting w
WHERE w.handoff_slots > 0 AND w.handoff_seq IS NOT NULL
  AND pg_sequence_last_value(w.handoff_seq) % 1048576 = 0;

DELETE FROM kombu_pgmq.grantable
WHERE function = 'kombu_pgmq.wait_for_handoff(text, text[], text[], text, bigint, integer, integer)';
INSERT INTO kombu_pgmq.grantable (function, kind, definer) VALUES
    ('kombu_pgmq.handoff_lease(bigint)', 'worker', true),
    ('kombu_pgmq.wait_for_handoff(text, text[], text[], text, bigint, integer, integer, integer)',
     'worker', true)
ON CONFLICT (function) DO NOTHING;
SELECT kombu_pgmq.secure_functions();
