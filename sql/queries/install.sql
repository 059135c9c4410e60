-- Installing: PGMQ present and complete, the bootstrap lock, migrations applied and
-- recorded, role grants. Sent by kombu_pgmq/_db/schema_store.py (for kombu_pgmq.schema).
-- schema.sql areas: Install bookkeeping; Grants and privileges.

-- name: pgmq_extension_version
SELECT extversion AS version FROM pg_extension WHERE extname = 'pgmq'

-- name: pgmq_extension_available
SELECT default_version AS version FROM pg_available_extensions WHERE name = 'pgmq'

-- name: pgmq_schema_present
-- A SQL-only PGMQ install has the pgmq.meta table but no pg_extension row.
SELECT to_regclass('pgmq.meta') IS NOT NULL AS present

-- name: pgmq_missing_functions
-- The PGMQ functions (with these signatures) kombu_pgmq calls; returns the missing ones.
SELECT wanted AS signature
FROM unnest(ARRAY[
    'pgmq.send(text,jsonb,jsonb)',
    'pgmq.send(text,jsonb,jsonb,integer)',
    'pgmq.read(text,integer,integer,jsonb)',
    'pgmq.pop(text,integer)',
    'pgmq.archive(text,bigint[])',
    'pgmq.set_vt(text,bigint[],integer)',
    'pgmq.create(text)',
    'pgmq.drop_queue(text)'
]) AS wanted
WHERE to_regprocedure(wanted) IS NULL

-- name: create_extension
CREATE EXTENSION IF NOT EXISTS pgmq

-- name: bootstrap_lock
-- Serializes bootstrap across processes until the transaction ends.
SELECT pg_advisory_xact_lock(%(key)s::bigint)

-- name: applied_migrations
SELECT version FROM kombu_pgmq.migrations ORDER BY version

-- name: schema_version
-- Fast path before taking the bootstrap lock: false when kombu_pgmq is not installed
-- (to_regclass does not fail on a missing table, unlike a query on it).
SELECT to_regclass('kombu_pgmq.migrations') IS NOT NULL AS present

-- name: record_migration
INSERT INTO kombu_pgmq.migrations (version, name) VALUES (%(version)s, %(name)s)

-- name: record_pgmq_install
INSERT INTO kombu_pgmq.settings (key, value) VALUES ('pgmq_sql_version', %(version)s)
ON CONFLICT (key) DO UPDATE SET value = excluded.value

-- name: apply_grants
-- After migrations: the privileges of every role granted with kombu_pgmq.grant_role,
-- so the functions a migration added reach them.
SELECT kombu_pgmq.apply_grants() AS role

-- name: grant_role
SELECT kombu_pgmq.grant_role(%(role)s, %(kind)s)

-- name: revoke_role
SELECT kombu_pgmq.revoke_role(%(role)s) AS revoked

-- name: granted_roles
SELECT role, kind FROM kombu_pgmq.roles ORDER BY role

-- name: pgmq_sql_version
SELECT value AS version FROM kombu_pgmq.settings WHERE key = 'pgmq_sql_version'
