"""Coalesced reads: while a channel holds messages it reads again only once
half its prefetch window is free, so a backlog is read several messages per round trip;
an ack made while the read is put off is sent at once, without waiting for its result."""

from __future__ import annotations

import contextlib
import time
from typing import Any

from kombu import Consumer, Queue

from tests.integration.helpers import connect, publish, sql


def test_reads_wait_for_half_the_prefetch_window(db_dsn: str) -> None:
    with connect(db_dsn) as conn:
        publish(conn, "coalesce", list(range(20)))
        got: list[Any] = []
        channel = conn.channel()
        queue = Queue("coalesce", routing_key="coalesce")
        with Consumer(channel, [queue], on_message=got.append, prefetch_count=8):
            while len(got) < 8:
                conn.drain_events(timeout=5)
            assert len(got) == 8  # the window is full
            # one slot free while 7 are held: no read, but the ack is archived anyway
            got[0].ack()
            with contextlib.suppress(TimeoutError):
                conn.drain_events(timeout=0.5)
            assert len(got) == 8
            assert channel.reader.deferred_reads >= 1
            assert sql(db_dsn, "SELECT count(*) FROM pgmq.a_coalesce") == [(1,)]
            # half the window free: one read fills it (4 messages at once)
            for message in got[1:4]:
                message.ack()
            conn.drain_events(timeout=5)
            assert len(got) == 12
            for message in got[4:]:
                message.ack()
            deadline = time.monotonic() + 10
            while len(got) < 20 and time.monotonic() < deadline:
                with contextlib.suppress(TimeoutError):
                    conn.drain_events(timeout=0.5)
                for message in got:
                    if not message.acknowledged:
                        message.ack()
            assert len(got) == 20
            for message in got:
                if not message.acknowledged:
                    message.ack()
            with contextlib.suppress(TimeoutError):
                conn.drain_events(timeout=0.3)
    assert sorted(int(m.body) for m in got) == list(range(20))
    assert sql(db_dsn, "SELECT count(*) FROM pgmq.a_coalesce") == [(20,)]


def test_floor_follows_the_first_window_not_celerys_eta_widening(db_dsn: str) -> None:
    """Celery widens the prefetch window by one for each ETA task it holds: the floor stays
    half the window first set, so held ETA tasks never hold back reads."""
    with connect(db_dsn) as conn:
        channel = conn.channel()
        channel.basic_qos(prefetch_count=8)
        assert channel.reader.read_floor == 4
        channel.basic_qos(prefetch_count=108)
        assert channel.reader.read_floor == 4
        channel.basic_qos(prefetch_count=2)  # narrowed (autoscale down): half of it
        assert channel.reader.read_floor == 1
        channel.basic_qos(prefetch_count=0)  # unlimited: reads as they come
        assert channel.reader.read_floor == 1


KILLED_CONSUMER = r"""
import os, signal, sys
from kombu import Connection, Consumer, Queue
from kombu.asynchronous import Hub
import kombu_pgmq

got = []
with Connection(sys.argv[1]) as conn:
    hub = Hub()
    conn.transport.register_with_event_loop(conn.connection, hub)
    consumer = Consumer(conn, [Queue("killed_acks")], on_message=got.append, prefetch_count=8)
    consumer.consume()
    loop = hub.create_loop()
    while len(got) < 8:
        next(loop)
    got[0].ack()  # one slot of 8 free: the next read is put off (coalesced reads)
    next(loop)  # one turn of the event loop: the ack's wake-up
    os.kill(os.getpid(), signal.SIGKILL)  # the worker dies right after
"""


def test_an_ack_is_on_the_server_before_the_worker_can_die(db_dsn: str) -> None:
    """In Celery's event loop an ack made while the read is put off is sent at the
    loop's next turn (without waiting for the result), not with the read: it is archived
    even though the process is killed right after that turn. An ack that waited for the
    read (up to 0.1 s) would let a worker SIGKILLed in that window run the finished task
    again."""
    import subprocess
    import sys

    with connect(db_dsn) as conn:
        publish(conn, "killed_acks", list(range(8)))
    proc = subprocess.run(
        [sys.executable, "-c", KILLED_CONSUMER, db_dsn], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == -9, proc.stderr
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        if sql(db_dsn, "SELECT count(*) FROM pgmq.a_killed_acks") == [(1,)]:
            break
        time.sleep(0.05)
    assert sql(db_dsn, "SELECT count(*) FROM pgmq.a_killed_acks") == [(1,)]
    assert sql(db_dsn, "SELECT count(*) FROM pgmq.q_killed_acks") == [(7,)]
