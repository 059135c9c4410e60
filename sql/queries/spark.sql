-- Spark: the pgmq data source's job-level atomic writes, snapshots and stream offsets.
-- Sent by kombu_pgmq/_db/spark_store.py. schema.sql area: Spark.

-- name: open_write
-- Spark writer: register a write on the queue (kombu_pgmq.spark_writes); returns
-- after_id.
SELECT kombu_pgmq.open_write(%(write_id)s, %(queue)s) AS after_id

-- name: stage_messages
-- Stage a batch of a task attempt hidden for 10 years (refused unless the write is open).
SELECT kombu_pgmq.stage_write(%(write_id)s, %(messages)s::jsonb[], %(headers)s::jsonb[])
    AS staged

-- name: commit_write
SELECT kombu_pgmq.commit_write(%(write_id)s, %(attempts)s::text[]) AS committed

-- name: abort_write
SELECT kombu_pgmq.abort_write(%(write_id)s) AS deleted

-- name: msg_id_range
-- Lowest and highest msg_id (primary key) of a queue or archive table, NULLs when empty.
SELECT min(msg_id) AS lo, max(msg_id) AS hi FROM {table}

-- name: snapshot
-- Rows of a queue or archive table with lo < msg_id <= hi, by primary key, read without
-- consuming. {last_read_at} / {archived_at} are the column, or NULL where the table has
-- none (queue tables have no archived_at; PGMQ < 1.11 has no last_read_at).
SELECT msg_id, read_ct, enqueued_at, {last_read_at} AS last_read_at, vt,
       {archived_at} AS archived_at, headers ->> 'task' AS task, headers ->> 'id' AS task_id,
       message::text AS message, headers::text AS headers
FROM {table}
WHERE msg_id > %(lo)s AND msg_id <= %(hi)s
ORDER BY msg_id

-- name: table_columns
SELECT attname FROM pg_attribute
WHERE attrelid = %(table)s::regclass AND attnum > 0 AND NOT attisdropped

-- name: stream_horizon
SELECT kombu_pgmq.stream_horizon(%(queue)s, %(after_id)s, %(max_rows)s,
                                 %(wait_seconds)s) AS msg_id

-- name: archive_range
-- Streaming reader's commit: archive the messages lo < msg_id <= hi (primary key range).
SELECT count(*) AS archived
FROM pgmq.archive(%(queue)s, ARRAY(SELECT msg_id FROM {queue_table}
                                   WHERE msg_id > %(lo)s AND msg_id <= %(hi)s))
