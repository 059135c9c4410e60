-- The result backend (kombu_pgmq.results; tables kombu_pgmq.results, chords, revoked):
-- results, chord counters, durable revocations. Sent by kombu_pgmq/_db/results.py
-- (results_installed: kombu_pgmq/_db/admin.py). schema.sql areas: Revocations; Results
-- and chords.

-- name: results_installed
-- The result backend's tables and functions (kombu_pgmq.results...) are installed.
SELECT to_regprocedure('kombu_pgmq.results_stats()') IS NOT NULL AS installed

-- name: results_store
-- Store one key's encoded meta (NOTIFY kombu_pgmq_results); false: a SUCCESS was kept.
SELECT kombu_pgmq.results_store(%(key)s, %(state)s, %(meta)s, %(expires_seconds)s::float8,
                                %(keep_success)s) AS stored

-- name: results_save_group
-- Store a saved GroupResult (the only key a producer role may write).
SELECT kombu_pgmq.results_save_group(%(key)s, %(meta)s, %(expires_seconds)s::float8) AS stored

-- name: results_get
-- Stored meta by key (primary key lookups); revoked: no result, but the task is revoked.
SELECT key, meta, revoked FROM kombu_pgmq.results_get(%(keys)s::text[], %(task_ids)s::text[])

-- name: results_delete
SELECT kombu_pgmq.results_delete(%(keys)s::text[]) AS removed

-- name: results_expire_at
SELECT kombu_pgmq.results_expire_at(%(keys)s::text[], %(expires_seconds)s::float8)

-- name: results_expire
-- One batch of the expiry sweep (partial index results_expires_at_idx).
SELECT kombu_pgmq.results_expire(%(batch)s) AS removed

-- name: results_stats
SELECT state, results, oldest, bytes, expired FROM kombu_pgmq.results_stats()

-- name: chord_start
SELECT kombu_pgmq.chord_start(%(group_id)s, %(expires_seconds)s::float8)

-- name: chord_size
SELECT kombu_pgmq.chord_size(%(group_id)s, %(size)s::integer, %(added)s::integer,
                             %(expires_seconds)s::float8)

-- name: chord_part
-- Count one header task (once per task id); fire: this call completed the chord.
SELECT fire, done, total FROM kombu_pgmq.chord_part(
    %(group_id)s, %(task_id)s, %(group_index)s::integer, %(state)s, %(result)s,
    %(fallback_size)s::integer, %(expires_seconds)s::float8)

-- name: chord_results
SELECT task_id, state, result FROM kombu_pgmq.chord_results(%(group_id)s)

-- name: chord_done
SELECT kombu_pgmq.chord_done(%(group_id)s, %(expires_seconds)s::float8)

-- name: revoke_tasks
SELECT kombu_pgmq.revoke_tasks(%(task_ids)s::text[], %(expires_seconds)s::float8) AS added

-- name: revoked_tasks
SELECT task_id, revoked_at, expires_at FROM kombu_pgmq.revoked_tasks(%(max_rows)s)

-- name: listen_results
LISTEN kombu_pgmq_results
