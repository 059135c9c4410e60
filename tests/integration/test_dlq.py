"""Dead-letter operations (kombu_pgmq.dlq, kombu-pgmq dlq ...) and archive retention
(kombu_pgmq.retention, kombu-pgmq archive prune) against a real PostgreSQL."""

from __future__ import annotations

import json
import subprocess
import sys
from uuid import uuid4

import pytest
from kombu import Producer, Queue

from kombu_pgmq._priorities import band_queue_name
from kombu_pgmq.dlq import DeadLetterQueue
from kombu_pgmq.errors import ConfigurationError, QueueNotFound
from kombu_pgmq.retention import prune_archives
from tests.support.doc_samples import check_sample

from .helpers import connect, drain, publish, sql, table


def _dead_letter(conn, queue: str, bodies: list, **kwargs) -> None:
    """Publish and reject without requeue: straight to the dead-letter queue."""
    publish(conn, queue, bodies, **kwargs)
    channel = conn.channel()
    for _ in bodies:
        channel.basic_get(queue).reject(requeue=False)


@pytest.fixture
def letters(db_dsn):
    with connect(db_dsn) as conn:
        _dead_letter(
            conn, "orders", [{"n": 1}, {"n": 2}], headers={"task": "shop.charge", "id": "t-1"}
        )
        _dead_letter(conn, "emails", ["hello"], headers={"task": "mail.send", "id": "t-2"})
    return db_dsn


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kombu_pgmq", *args], capture_output=True, text=True, timeout=60
    )


def test_list_with_filters(letters):
    with DeadLetterQueue(letters) as dlq:
        every = dlq.list()
        assert [(d.queue, d.task, d.reason, d.read_ct) for d in every] == [
            ("orders", "shop.charge", "rejected", 1),
            ("orders", "shop.charge", "rejected", 1),
            ("emails", "mail.send", "rejected", 1),
        ]
        assert every[0].task_id == "t-1" and json.loads(every[0].body) == {"n": 1}
        assert every[0].deliveries == 1
        assert every[0].dead_lettered_at is not None
        assert [d.queue for d in dlq.list(queue="emails")] == ["emails"]
        assert len(dlq.list(task="shop.charge")) == 2
        assert dlq.list(reason="max_deliveries") == []
        assert [d.msg_id for d in dlq.list(ids=[every[1].msg_id])] == [every[1].msg_id]
        assert len(dlq.list(limit=1)) == 1


def test_task_filter_finds_a_task_whose_name_looks_like_nan(db_dsn):
    """A task named with 'NaN' in it, published with a header jsonb cannot hold (argsrepr
    with a NUL), keeps its readable ``task`` header: ``kombu-pgmq dlq list --task`` finds
    it."""
    with connect(db_dsn) as conn:
        _dead_letter(
            conn,
            "nan",
            [{"n": 1}],
            headers={"task": "stats.NaN_guard", "id": "t-9", "argsrepr": "('\x00',)"},
        )
    with DeadLetterQueue(db_dsn) as dlq:
        [letter] = dlq.list(task="stats.NaN_guard")
    assert (letter.task, letter.task_id) == ("stats.NaN_guard", "t-9")


def test_replay_by_id_returns_the_message_to_its_queue(letters):
    with DeadLetterQueue(letters) as dlq:
        first = dlq.list(queue="orders")[0]
        result = dlq.replay(ids=[first.msg_id])
        assert result.replayed == {"orders": 1} and result.skipped == []
        assert len(dlq.list()) == 2
    with connect(letters) as conn:
        [message] = drain(conn, "orders", expect=1)
        assert message.payload == {"n": 1}
        assert "x-dead-letter" not in message.headers
        assert message.headers["x-dead-letter-replays"] == 1
        assert message.headers["task"] == "shop.charge"
        assert message.delivery_info["pgmq_read_ct"] == 1  # fresh deliveries


def test_replay_all_and_by_filter(letters):
    with DeadLetterQueue(letters) as dlq:
        assert dlq.replay(task="mail.send").replayed == {"emails": 1}
        assert dlq.replay(all=True, batch_size=1).replayed == {"orders": 2}
        assert dlq.list() == []
    assert sql(letters, f"SELECT count(*) FROM {table('orders')}") == [(2,)]


def test_replay_to_a_dropped_queue_keeps_the_dead_letter(letters):
    with connect(letters) as conn:
        conn.channel().queue_delete("emails")
    with DeadLetterQueue(letters) as dlq:
        with pytest.raises(QueueNotFound, match="emails"):
            dlq.replay(queue="emails")
        assert [d.queue for d in dlq.list(queue="emails")] == ["emails"]  # nothing lost


def test_replay_keeps_the_priority_band(db_dsn):
    queue = Queue("urgent.jobs", routing_key="urgent.jobs", max_priority=9)
    with connect(db_dsn) as conn:
        with conn.channel() as channel:
            Producer(channel).publish("hot", routing_key="urgent.jobs", declare=[queue], priority=9)
        conn.channel().basic_get("urgent.jobs").reject(requeue=False)
    with DeadLetterQueue(db_dsn) as dlq:
        [letter] = dlq.list()
        assert letter.queue == "urgent.jobs"
        assert letter.pgmq_queue == band_queue_name("urgent.jobs", 9)
        dlq.replay(all=True)
    band = band_queue_name("urgent.jobs", 9)
    assert sql(db_dsn, f"SELECT count(*) FROM pgmq.q_{band}") == [(1,)]


def test_replay_and_purge_need_a_filter(letters):
    with DeadLetterQueue(letters) as dlq:
        with pytest.raises(ConfigurationError, match="all=True"):
            dlq.replay()
        with pytest.raises(ConfigurationError, match="all=True"):
            dlq.purge()
        assert len(dlq.list()) == 3


def test_purge(letters):
    with DeadLetterQueue(letters) as dlq:
        assert dlq.purge(queue="orders", batch_size=1) == 2
        assert [d.queue for d in dlq.list()] == ["emails"]
        assert dlq.purge(all=True) == 1
        assert dlq.list() == []


def test_missing_dead_letter_queue_has_no_dead_letters(db_dsn):
    with DeadLetterQueue(db_dsn, queue="never.declared") as dlq:
        assert dlq.list() == []
        assert dlq.purge(all=True) == 0


def test_cli_list_replay_purge(letters):
    listed = _cli("dlq", "list", "--url", letters)
    assert listed.returncode == 0, listed.stderr
    assert "shop.charge" in listed.stdout and "mail.send" in listed.stdout
    assert "rejected" in listed.stdout
    rows = [
        json.loads(line)
        for line in _cli("dlq", "list", "--url", letters, "--json").stdout.splitlines()
    ]
    assert [r["queue"] for r in rows] == ["orders", "orders", "emails"]
    replayed = _cli("dlq", "replay", "--url", letters, "--task", "mail.send")
    assert replayed.returncode == 0 and "replayed 1 to emails" in replayed.stdout
    refused = _cli("dlq", "purge", "--url", letters, "--yes")
    assert refused.returncode == 2 and "or --all for every one" in refused.stderr
    purged = _cli("dlq", "purge", "--url", letters, "--all", "--yes")
    assert purged.returncode == 0 and "purged 2" in purged.stdout


def test_the_cli_output_the_docs_show(db_dsn):
    """docs/guides/long-tasks.md shows this output (tests/support/doc_samples.py): a task
    rejected without requeue, and one delivered three times without an ack (its read_ct,
    set here) that the next read moves (max_deliveries=3)."""
    with connect(db_dsn, max_deliveries=3) as conn:
        _dead_letter(conn, "emails", ["hi"], headers={"task": "mail.send", "id": str(uuid4())})
        publish(conn, "celery", [[1]], headers={"task": "etl.explode", "id": str(uuid4())})
        sql(db_dsn, f"UPDATE {table('celery')} SET read_ct = 3")
        assert drain(conn, "celery", expect=1, timeout=2) == []
    sample = []
    for command, comment, code in (
        (["dlq", "list"], "", 0),
        (["dlq", "replay", "--task", "etl.explode"], "# or --id 2, --queue celery, --all", 0),
        (["dlq", "purge", "--reason", "rejected", "--yes"], "", 0),
        (["dlq", "purge"], "# no filter: refused, nothing asked", 2),
    ):
        done = _cli(*command, "--url", db_dsn)
        assert done.returncode == code, done.stderr
        line = f"$ kombu-pgmq {' '.join(command)}"
        shown = done.stdout if code == 0 else done.stderr.strip().splitlines()[-1]
        sample += [f"{line:<47} {comment}".rstrip(), shown.rstrip("\n")]
    check_sample(
        "dlq",
        "\n".join(sample),
        masks=[(r"\b[0-9a-f]{8}(?:-[0-9a-f]{4}){3}-[0-9a-f]{12}\b", "<uuid>"), (r"[━─]+", "━")],
    )


def test_prune_archives_in_batches(db_dsn):
    with connect(db_dsn) as conn:
        publish(conn, "audit", list(range(25)))
        drain(conn, "audit", expect=25)
    archive = table("audit", "a")
    sql(
        db_dsn,
        f"UPDATE {archive} SET archived_at = archived_at - interval '2 days' "
        f"WHERE msg_id IN (SELECT msg_id FROM {archive} ORDER BY msg_id LIMIT 20)",
    )
    assert prune_archives(db_dsn, older_than_seconds=86400, batch_size=7) == {"audit": 20}
    assert sql(db_dsn, f"SELECT count(*) FROM {archive}") == [(5,)]
    assert prune_archives(db_dsn, older_than_seconds=86400, queues=["audit"]) == {}
    with pytest.raises(QueueNotFound, match="nope"):
        prune_archives(db_dsn, older_than_seconds=0, queues=["nope"])
    with pytest.raises(ConfigurationError, match="older_than_seconds"):
        prune_archives(db_dsn, older_than_seconds=-1)


def test_cli_archive_prune(db_dsn):
    with connect(db_dsn) as conn:
        publish(conn, "audit2", list(range(3)))
        drain(conn, "audit2", expect=3)
    kept = _cli("archive", "prune", "--url", db_dsn, "--older-than", "1h")
    assert kept.returncode == 0 and "nothing archived" in kept.stdout
    pruned = _cli("archive", "prune", "--url", db_dsn, "--older-than", "0s", "--queue", "audit2")
    assert pruned.returncode == 0 and "audit2" in pruned.stdout and "3" in pruned.stdout
    bad = _cli("archive", "prune", "--url", db_dsn, "--older-than", "soon")
    assert bad.returncode == 2 and "duration" in bad.stderr


def test_beat_task_is_registered_and_prunes(db_dsn):
    from celery import Celery

    from kombu_pgmq.retention import BEAT_TASK_NAME, add_beat_task

    app = Celery(broker=db_dsn)
    task = add_beat_task(app, older_than_seconds=0, every_seconds=600)
    assert app.conf.beat_schedule[BEAT_TASK_NAME]["schedule"] == 600
    with connect(db_dsn) as conn:
        publish(conn, "audit3", ["x"])
        drain(conn, "audit3", expect=1)
    assert task() == {"audit3": 1}
