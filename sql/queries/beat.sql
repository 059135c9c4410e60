-- Beat (kombu_pgmq.beat; tables kombu_pgmq.beat_entries, beat_ticks, beat_leader):
-- periodic tasks, ticks, the leader. Sent by kombu_pgmq/_db/beat.py. schema.sql area:
-- Beat.

-- name: beat_installed
-- The beat scheduler's tables and functions (kombu_pgmq.beat_list...) are installed.
SELECT to_regprocedure('kombu_pgmq.beat_list()') IS NOT NULL AS installed

-- name: beat_elect
-- One election round: renew the lead, take a free lock, or depose a hung leader.
SELECT leader, epoch, leader_identity, leader_pid, heartbeat_age, deposed
FROM kombu_pgmq.beat_elect(%(me)s, %(stale_seconds)s::float8)

-- name: beat_resign
SELECT kombu_pgmq.beat_resign() AS resigned

-- name: beat_leader_info
SELECT identity, backend_pid, epoch, since, heartbeat_at, heartbeat_age, alive
FROM kombu_pgmq.beat_leader_info()

-- name: beat_claim
-- Claim ticks in the publishing transaction (NULL: this session is not the leader).
SELECT kombu_pgmq.beat_claim(
    %(epoch)s::bigint, %(me)s, %(entries)s::text[], %(due_ats)s::timestamptz[],
    %(expected)s::timestamptz[], %(next_runs)s::timestamptz[], %(task_ids)s::text[],
    %(kinds)s::text[], %(missed)s::integer[]) AS claimed

-- name: beat_note
SELECT kombu_pgmq.beat_note(%(epoch)s::bigint, %(entries)s::text[],
                            %(next_runs)s::timestamptz[], %(errors)s::text[]) AS noted

-- name: beat_sync_config
SELECT written, removed FROM kombu_pgmq.beat_sync_config(%(config)s::jsonb)

-- name: beat_upsert
SELECT kombu_pgmq.beat_upsert(
    %(name)s, %(task)s, %(schedule_kind)s, %(schedule)s::jsonb, %(args)s::jsonb,
    %(kwargs)s::jsonb, %(options)s::jsonb, %(enabled)s, %(catch_up)s, %(replace)s) AS added

-- name: beat_set_enabled
SELECT kombu_pgmq.beat_set_enabled(%(name)s, %(enabled)s) AS found

-- name: beat_remove
SELECT kombu_pgmq.beat_remove(%(name)s) AS found

-- name: beat_run_now
SELECT kombu_pgmq.beat_run_now(%(name)s) AS requested_at

-- name: beat_list
SELECT * FROM kombu_pgmq.beat_list()

-- name: beat_entry
SELECT * FROM kombu_pgmq.beat_get(%(name)s)

-- name: beat_history
SELECT * FROM kombu_pgmq.beat_history(%(name)s, %(max_rows)s::integer)

-- name: beat_prune
SELECT kombu_pgmq.beat_prune(%(keep_seconds)s::float8, %(batch)s::integer) AS pruned

-- name: listen_beat
LISTEN kombu_pgmq_beat
