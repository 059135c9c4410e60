-- Migration 0013: what the direct statements on PGMQ's tables need (issue 17).
--
-- The transport now publishes and reads with its own plan-cached statements on PGMQ's
-- queue and archive tables (sql/queries.sql: send_queue, read_queue) instead of calling
-- pgmq.send/read/archive, which build their SQL with format() + EXECUTE on every call.
-- The tables are left exactly as PGMQ made them.
--
-- notify_waiting: the wake-up of a direct publish. A volatile PL/pgSQL function, so its
-- look at kombu_pgmq.waiting takes a snapshot after the publish's shared advisory lock
-- was granted (migration 0003's protocol: a consumer that started waiting before that is
-- seen, one that starts later waits for this publish to commit). Unlike kombu_pgmq.wake
-- it never defers the NOTIFY to a commit trigger: the direct publish runs only on the
-- transport's own autocommit connection, where the statement is the transaction.

CREATE FUNCTION kombu_pgmq.notify_waiting(pgmq_name text) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM kombu_pgmq.waiting w WHERE w.pgmq_queue = pgmq_name) THEN
        PERFORM pg_notify('kombu_pgmq.' || pgmq_name, '');
    END IF;
END
$$;

INSERT INTO kombu_pgmq.grantable (function, kind, definer) VALUES
    ('kombu_pgmq.notify_waiting(text)', 'owner', true);
SELECT kombu_pgmq.secure_functions();
