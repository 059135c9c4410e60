-- The connection's own statements: session settings (commit mode, TOAST compression),
-- the transaction pooler's check, a round trip. Sent by kombu_pgmq/_db/connector.py
-- (round_trip: the Listener, kombu_pgmq/transport/_listener.py).

-- name: synchronous_commit_off
-- Session setting of the statement connection for reads and acks that need no WAL flush
-- (a crash redelivers them; see Broker.read_many); RESET restores the session default
-- (connection_options may set it).
SET synchronous_commit = off

-- name: synchronous_commit_reset
RESET synchronous_commit

-- name: toast_compression_lz4
-- Session setting of connections that write large values (messages, results): values
-- PostgreSQL compresses (TOAST, over about 2 kB) use lz4, about twice as fast as pglz on
-- 20 MB (publish, result store), when the server was built with lz4 (pg_settings.enumvals)
-- and neither its configuration, the database, the role nor the connection names a method
-- (source 'default'). Readers decompress either method; a value keeps its method when
-- copied (an ack's archive). No row: the session keeps the server's method.
SELECT pg_catalog.set_config('default_toast_compression', 'lz4', false)
FROM pg_catalog.pg_settings
WHERE name = 'default_toast_compression' AND source = 'default' AND 'lz4' = ANY (enumvals)

-- name: pooler_keeps_prepared
-- Sent prepared, through a transaction pooler with pooler_prepared_statements=True, once
-- per connection (kombu_pgmq/_db/pooling.py check_prepared_kept): the names this
-- statement's own text is prepared under on the server connection it runs on. PgBouncer
-- >= 1.21 with max_prepared_statements > 0 renames each client's statements
-- (PGBOUNCER_<n>); a pooler that passes psycopg's own names through (_pg3_<n>) does not
-- keep them per client.
SELECT name FROM pg_prepared_statements WHERE statement = current_query()

-- name: round_trip
-- Nothing but a round trip: notifications committed before it are read before its result.
SELECT 1

-- name: begin
-- A transaction on a connection of kombu_pgmq's own (autocommit) that an AtomicTask runs
-- in (kombu_pgmq/atomic.py): it ends with ack_in_transaction_commit, commit or rollback.
BEGIN

-- name: commit
COMMIT

-- name: rollback
ROLLBACK
