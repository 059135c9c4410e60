-- kombu_pgmq schema, version 1.
-- Applied by kombu_pgmq.schema.bootstrap inside one transaction, under an advisory lock.

CREATE SCHEMA IF NOT EXISTS kombu_pgmq;

-- Kombu queue names as the application gave them, next to their PGMQ names
-- (kombu_pgmq.naming maps one way only: 'celery@host.celery.pidbox' becomes
-- 'celery_host_celery_pidbox__<hash>').
CREATE TABLE kombu_pgmq.queues (
    queue text PRIMARY KEY,
    pgmq_queue text NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX queues_pgmq_queue_idx ON kombu_pgmq.queues (pgmq_queue);

-- Install facts: e.g. pgmq_sql_version when kombu_pgmq installed PGMQ's SQL-only form
-- (no pg_extension row then records the version).
CREATE TABLE kombu_pgmq.settings (
    key text PRIMARY KEY,
    value text NOT NULL
);
