-- kombu_pgmq schema, version 2: exchanges and bindings shared by every process, and
-- queue lifetime (auto_delete, x-expires, x-message-ttl) across processes.

-- Queue arguments as declared (AMQP/Kombu): lifetime of the queue and of its messages.
ALTER TABLE kombu_pgmq.queues
    ADD COLUMN durable boolean NOT NULL DEFAULT true,
    ADD COLUMN auto_delete boolean NOT NULL DEFAULT false,
    ADD COLUMN expires_ms bigint,          -- x-expires: drop after this long unused
    ADD COLUMN message_ttl_ms bigint,      -- x-message-ttl: older messages are not delivered
    ADD COLUMN had_consumer boolean NOT NULL DEFAULT false,
    ADD COLUMN last_used_at timestamptz NOT NULL DEFAULT now();

-- Exchanges by name (Kombu exchange names are global in a database, as in a vhost).
CREATE TABLE kombu_pgmq.exchanges (
    exchange text PRIMARY KEY,
    type text NOT NULL CHECK (type IN ('direct', 'topic', 'fanout')),
    durable boolean NOT NULL DEFAULT true,
    auto_delete boolean NOT NULL DEFAULT false,
    created_at timestamptz NOT NULL DEFAULT now()
);

-- queue_bind: messages published to exchange with a matching routing key go to queue.
-- Deleting a queue (its kombu_pgmq.queues row) deletes its bindings.
CREATE TABLE kombu_pgmq.bindings (
    exchange text NOT NULL,
    routing_key text NOT NULL,
    queue text NOT NULL REFERENCES kombu_pgmq.queues (queue) ON DELETE CASCADE,
    created_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (exchange, routing_key, queue)
);
CREATE INDEX bindings_queue_idx ON kombu_pgmq.bindings (queue);

-- One counter, bumped by every change to exchanges or bindings. Processes cache the
-- routing table with the version it was read at; a publish carries that version and
-- sends nothing if it changed (then the process reloads and publishes again).
CREATE TABLE kombu_pgmq.routing_version (
    singleton boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    version bigint NOT NULL
);
INSERT INTO kombu_pgmq.routing_version (version) VALUES (1);

CREATE FUNCTION kombu_pgmq.bump_routing_version() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    UPDATE kombu_pgmq.routing_version SET version = version + 1;
    RETURN NULL;
END
$$;

CREATE TRIGGER bindings_changed AFTER INSERT OR UPDATE OR DELETE OR TRUNCATE
    ON kombu_pgmq.bindings FOR EACH STATEMENT EXECUTE FUNCTION kombu_pgmq.bump_routing_version();
CREATE TRIGGER exchanges_changed AFTER INSERT OR UPDATE OR DELETE OR TRUNCATE
    ON kombu_pgmq.exchanges FOR EACH STATEMENT EXECUTE FUNCTION kombu_pgmq.bump_routing_version();

-- Live consumers (their queues' lifetime depends on them: auto_delete, x-expires).
-- A process refreshes heartbeat_at of its rows while it runs; each row counts as live
-- until heartbeat_at + stale_after_seconds (the owner's own setting, so a process with
-- short heartbeats cannot declare another process's consumers dead). Rows of a process
-- that died go stale and are removed by kombu_pgmq.reap().
CREATE TABLE kombu_pgmq.consumers (
    queue text NOT NULL REFERENCES kombu_pgmq.queues (queue) ON DELETE CASCADE,
    owner text NOT NULL,           -- host:pid:uuid of the Kombu connection
    consumer_tag text NOT NULL,
    heartbeat_at timestamptz NOT NULL DEFAULT now(),
    stale_after_seconds double precision NOT NULL,
    PRIMARY KEY (queue, owner, consumer_tag)
);
CREATE INDEX consumers_owner_idx ON kombu_pgmq.consumers (owner);

-- Drop one queue: PGMQ tables, our row (bindings and consumers cascade).
CREATE FUNCTION kombu_pgmq.drop_queue(kombu_queue text) RETURNS boolean
LANGUAGE plpgsql AS $$
DECLARE
    target text;
BEGIN
    DELETE FROM kombu_pgmq.queues WHERE queue = kombu_queue RETURNING pgmq_queue INTO target;
    IF target IS NULL THEN
        RETURN false;
    END IF;
    PERFORM pgmq.drop_queue(target);
    RETURN true;
END
$$;

-- Remove stale consumers, then drop queues that AMQP would have deleted by now:
--   auto_delete queues that had a consumer and have no live one left;
--   queues with x-expires unused (no live consumer, not declared or read) for that long.
-- Returns the Kombu names dropped. Safe to run from many processes at once.
CREATE FUNCTION kombu_pgmq.reap()
RETURNS SETOF text
LANGUAGE plpgsql AS $$
DECLARE
    victim record;
BEGIN
    DELETE FROM kombu_pgmq.consumers
    WHERE heartbeat_at + make_interval(secs => stale_after_seconds) < clock_timestamp();
    FOR victim IN
        SELECT q.queue FROM kombu_pgmq.queues q
        WHERE NOT EXISTS (SELECT 1 FROM kombu_pgmq.consumers c WHERE c.queue = q.queue)
          AND ((q.auto_delete AND q.had_consumer)
               OR (q.expires_ms IS NOT NULL
                   AND q.last_used_at + q.expires_ms * interval '1 millisecond' < clock_timestamp()))
        FOR UPDATE SKIP LOCKED
    LOOP
        IF kombu_pgmq.drop_queue(victim.queue) THEN
            RETURN NEXT victim.queue;
        END IF;
    END LOOP;
END
$$;

-- basic_cancel: forget one consumer; AMQP auto_delete drops the queue when its last
-- consumer goes. Returns true if the queue was dropped.
CREATE FUNCTION kombu_pgmq.release_consumer(kombu_queue text, owner_id text, tag text)
RETURNS boolean
LANGUAGE plpgsql AS $$
BEGIN
    DELETE FROM kombu_pgmq.consumers
    WHERE queue = kombu_queue AND owner = owner_id AND consumer_tag = tag;
    PERFORM 1 FROM kombu_pgmq.queues WHERE queue = kombu_queue AND auto_delete FOR UPDATE;
    IF FOUND AND NOT EXISTS (SELECT 1 FROM kombu_pgmq.consumers WHERE queue = kombu_queue) THEN
        RETURN kombu_pgmq.drop_queue(kombu_queue);
    END IF;
    RETURN false;
END
$$;
