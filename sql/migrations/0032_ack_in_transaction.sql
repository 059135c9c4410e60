-- A task's ack inside the application's transaction: kombu_pgmq.ack_in_transaction
-- archives one delivery's message by its receipt or aborts the transaction (SQLSTATE
-- KP001), and counts it per queue in kombu_pgmq.transactional_acks.

-- Messages settled inside an application's transaction (kombu_pgmq.ack_in_transaction:
-- kombu_pgmq.AtomicTask), counted per PGMQ queue and per server process: a session
-- increments only its own row, so no two transactions wait on each other's count.
-- kombu_pgmq.settled_in_transaction sums them.
CREATE TABLE kombu_pgmq.transactional_acks (
    pgmq_queue text NOT NULL,
    backend_pid integer NOT NULL,
    settled bigint NOT NULL DEFAULT 0,
    PRIMARY KEY (pgmq_queue, backend_pid)
);

-- Ack of one delivery inside the caller's transaction (kombu_pgmq.AtomicTask): archive
-- the row this receipt (msg_id, read_ct, enqueued) still holds, as kombu_pgmq.ack does,
-- and count it in transactional_acks; both commit or roll back with the caller's
-- transaction, and the row stays locked by it until then (a read skips it). The fence: a
-- receipt no longer held (the visibility timeout passed and another consumer received
-- the message, it was acked or cancelled, its queue is gone) raises SQLSTATE KP001,
-- which aborts the caller's transaction: nothing of it can commit.
CREATE FUNCTION kombu_pgmq.ack_in_transaction(
    pgmq_name text, msg_id bigint, read_ct integer, enqueued timestamptz
) RETURNS void
LANGUAGE plpgsql
SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    IF NOT EXISTS (SELECT 1 FROM kombu_pgmq.settle(ARRAY[pgmq_name], ARRAY[msg_id],
                                                   ARRAY[read_ct], ARRAY[enqueued],
                                                   '{}', 0, NULL)) THEN
        RAISE EXCEPTION 'kombu_pgmq: message % of PGMQ queue % is no longer held by the delivery with read_ct %',
            msg_id, pgmq_name, read_ct
            USING ERRCODE = 'KP001',
                  HINT = 'its visibility timeout passed and another consumer received it, '
                         'or it was acked, cancelled or removed: this transaction is not '
                         'applied, the other delivery''s is';
    END IF;
    INSERT INTO kombu_pgmq.transactional_acks AS t (pgmq_queue, backend_pid, settled)
    VALUES (pgmq_name, pg_backend_pid(), 1)
    ON CONFLICT (pgmq_queue, backend_pid) DO UPDATE SET settled = t.settled + 1;
END
$$;

-- Messages settled by kombu_pgmq.ack_in_transaction, per PGMQ queue (committed ones).
CREATE FUNCTION kombu_pgmq.settled_in_transaction()
RETURNS TABLE (pgmq_queue text, settled bigint)
LANGUAGE sql STABLE
SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
    SELECT t.pgmq_queue, sum(t.settled)::bigint FROM kombu_pgmq.transactional_acks t
    GROUP BY t.pgmq_queue
$$;

-- Who may call these (see kombu_pgmq.grantable).
INSERT INTO kombu_pgmq.grantable (function, kind, definer) VALUES
    ('kombu_pgmq.ack_in_transaction(text, bigint, integer, timestamptz)', 'worker', true),
    ('kombu_pgmq.settled_in_transaction()', 'producer', true);

SELECT kombu_pgmq.secure_functions();
