"""One connection per concern and fork safety, against a real PostgreSQL. Each test
fails on the defect it names: a shared connection lets a blocked statement starve lease
renewal, a forked child ends its parent's session, close leaks a connection, a LISTEN
socket above fd 1024 makes drain_events spin, an unexpected error kills the heartbeat
thread, rows decoded by position break."""

from __future__ import annotations

import contextlib
import os
import resource
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from typing import Any

import psycopg
import pytest
from kombu import Consumer, Queue
from kombu.asynchronous import Hub

from kombu_pgmq._db.connector import Connector
from kombu_pgmq._db.queries import queries

from .helpers import connect, drain, publish, sql, table, wait_for

VT = 2  # seconds: the visibility timeout of the lease tests


def _hold_one(conn: Any, queue: str, held: list[Any]) -> Consumer:
    """A consumer that keeps (never acks) what it receives, as a worker running a task."""
    consumer = Consumer(conn.channel(), [Queue(queue)], on_message=held.append, prefetch_count=2)
    consumer.consume()
    return consumer


def _drain_for(conn: Any, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        with contextlib.suppress(TimeoutError):
            conn.drain_events(timeout=0.2)


def _thief(db_dsn: str, queue: str, seconds: float, stolen: list[Any], ready: threading.Event):
    """Another consumer polling the queue meanwhile: must never get the held message."""
    with connect(db_dsn) as other:
        channel = other.channel()
        ready.set()
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            got = channel.basic_get(queue)
            if got is not None:
                stolen.append(got.delivery_info["pgmq_msg_id"])
            time.sleep(0.1)


def test_open_enqueue_transaction_starves_no_lease(db_dsn):
    """An application's transaction that enqueued stays open for 3 x VT while a worker
    starts, receives a task, goes to sleep on the empty queue and holds the task: the
    task is never delivered a second time (the lease thread has its own connection, and
    going to sleep does not wait for the application's commit)."""
    with connect(db_dsn) as setup:
        setup.channel().queue_declare("jobs")
    stolen: list[Any] = []
    held: list[Any] = []
    ready = threading.Event()
    with psycopg.connect(db_dsn) as app:  # the application's transaction, left open
        app.execute("SELECT kombu_pgmq.publish('jobs', '{\"from\": \"app\"}', '{}')")
        options = {"visibility_timeout": VT, "lease_renewal_interval": 0.5}
        with connect(db_dsn, **options) as worker:  # starts while the transaction is open
            publish(worker, "jobs", ["task"])
            _hold_one(worker, "jobs", held)
            _drain_for(worker, 0.5)  # received; the queue is empty now: it goes to sleep
            assert [m.payload for m in held] == ["task"]
            thief = threading.Thread(target=_thief, args=(db_dsn, "jobs", 3 * VT, stolen, ready))
            thief.start()
            ready.wait(10)
            _drain_for(worker, 3 * VT)
            thief.join()
            assert stolen == []
            assert worker.transport.leases.rounds >= 3
            held[0].ack()
        app.commit()
    assert sql(db_dsn, f"SELECT read_ct FROM {table('jobs', 'a')}") == [(1,)]


def test_locked_table_of_the_heartbeat_starves_no_lease(db_dsn):
    """A session holds ACCESS EXCLUSIVE on kombu_pgmq.consumers for 3 x VT (the heartbeat
    blocks on it) while a worker holds a task: the task runs once."""
    stolen: list[Any] = []
    held: list[Any] = []
    ready = threading.Event()
    options = {
        "visibility_timeout": VT,
        "lease_renewal_interval": 0.5,
        "consumer_heartbeat_interval": 0.2,
    }
    with connect(db_dsn, **options) as worker:
        publish(worker, "locked", ["task"])
        _hold_one(worker, "locked", held)
        _drain_for(worker, 0.5)
        assert [m.payload for m in held] == ["task"]
        thief = threading.Thread(target=_thief, args=(db_dsn, "locked", 3 * VT, stolen, ready))
        thief.start()
        ready.wait(10)  # connected (and reaped) before the lock is taken
        with psycopg.connect(db_dsn) as locker:
            locker.execute("LOCK TABLE kombu_pgmq.consumers IN ACCESS EXCLUSIVE MODE")
            _drain_for(worker, 3 * VT)
            locker.rollback()
        thief.join()
        assert stolen == []
        held[0].ack()
    assert sql(db_dsn, f"SELECT read_ct FROM {table('locked', 'a')}") == [(1,)]


def test_reaper_skips_a_queue_locked_by_a_reader(db_dsn):
    """The reaper's DROP would wait for a reader's open transaction: it skips the queue
    this round instead (it locks NOWAIT), and drops it once the reader is done."""
    with connect(db_dsn) as conn:
        Queue("expiring.locked", expires=0.3)(conn.channel()).declare()
        time.sleep(0.5)
        with psycopg.connect(db_dsn) as reader:
            reader.execute(f"SELECT count(*) FROM {table('expiring.locked')}")  # ACCESS SHARE
            done: list[list[str]] = []
            reaper = threading.Thread(target=lambda: done.append(conn.transport.reap()))
            start = time.monotonic()
            reaper.start()
            reaper.join(5)
            assert done == [[]], "the reaper waited for the reader's transaction"
            assert time.monotonic() - start < 3
            reader.rollback()
        assert conn.transport.reap() == ["expiring.locked"]


FORK_SCRIPT = textwrap.dedent(
    """
    import multiprocessing, sys
    import kombu_pgmq
    from kombu import Connection, Consumer, Producer, Queue

    url = sys.argv[1]
    queue = Queue("forked")
    pool = Connection(url).Pool(limit=2)  # close_after_fork=True, as Celery's producer pool

    def publish(n):
        with pool.acquire(block=True) as conn:
            Producer(conn.default_channel).publish({"n": n}, routing_key="forked", declare=[queue])
            return conn.transport.broker().db.backend_pid

    def child():  # the pool closed the inherited connections: a new one, as Celery's
        with Connection(url) as conn:
            Producer(conn.default_channel).publish({"n": 1}, routing_key="forked", declare=[queue])

    pid_before = publish(0)
    proc = multiprocessing.get_context("fork").Process(target=child)
    proc.start()
    proc.join(30)
    assert proc.exitcode == 0, proc.exitcode
    pid_after = publish(2)
    got = []
    with pool.acquire(block=True) as conn:
        def on_message(m):
            got.append(m.payload["n"])
            m.ack()

        with Consumer(conn.default_channel, [queue], on_message=on_message):
            while len(got) < 3:
                conn.drain_events(timeout=10)
    print("PIDS", pid_before, pid_after, "GOT", sorted(got))
    """
)


def test_forked_child_never_speaks_on_the_parents_connection(db_dsn, tmp_path):
    """A process publishes, forks (kombu's pool closes inherited connections in the
    child), the child publishes and exits; the parent publishes and consumes afterwards
    with no error and the same backend pid."""
    script = tmp_path / "fork.py"
    script.write_text(FORK_SCRIPT)
    proc = subprocess.run(
        [sys.executable, str(script), db_dsn], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("PIDS"))
    _, before, after, _, *got = line.replace("[", "").replace("]", "").replace(",", "").split()
    assert before == after
    assert [int(n) for n in got] == [0, 1, 2]


def test_connector_in_a_forked_child_sends_nothing(db_dsn):
    """psycopg-style pid check: a child that closes (or uses) an inherited connector
    abandons the parent's connection; the parent's session lives on."""
    connector = Connector(db_dsn)
    pid = connector.backend_pid
    child = os.fork()
    if child == 0:  # pragma: no cover - the child
        code = 0
        try:
            assert connector.backend_pid != pid  # its own connection
            connector.close()
        except BaseException:
            code = 1
        os._exit(code)
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert connector.backend_pid == pid
    assert connector.scalar(psycopg.sql.SQL("SELECT 1")) == 1
    connector.close()


def _backends(db_dsn: str, application_name: str) -> int:
    """Backends named ``application_name`` or ``application_name:<role>``, once none is
    left (or after 5 s)."""
    query = (
        "SELECT count(*) FROM pg_stat_activity"
        " WHERE application_name = %s OR application_name LIKE %s || ':%%'"
    )
    deadline = time.monotonic() + 5
    while True:
        n = sql(db_dsn, query, (application_name, application_name))[0][0]
        if n == 0 or time.monotonic() > deadline:
            return int(n)
        time.sleep(0.1)


def _roles(db_dsn: str, application_name: str) -> dict[str, int]:
    """``{role: backends}`` of the connections named ``<application_name>:<role>``."""
    rows = sql(
        db_dsn,
        "SELECT split_part(application_name, ':', 2), count(*) FROM pg_stat_activity"
        " WHERE application_name LIKE %s || ':%%' GROUP BY 1",
        (application_name,),
    )
    return {str(role): int(n) for role, n in rows}


def test_each_connection_is_named_by_its_role(db_dsn):
    """application_name is the connection string's plus ':<role>': a consumer holding a
    message has its statements, listener, lease and heartbeat connections, each named."""
    name = f"kpt_roles_{uuid.uuid4().hex[:8]}"
    with connect(
        db_dsn,
        connection_options={"application_name": name},
        lease_renewal_interval=0.05,
        consumer_heartbeat_interval=0.05,
    ) as conn:
        publish(conn, "roles", ["x"])
        held: list[Any] = []
        _hold_one(conn, "roles", held)
        wait_for(lambda: (_drain_for(conn, 0.2), held)[1], 10, "a delivery")
        expected = {"statements": 1, "listener": 1, "leases": 1, "heartbeat": 1}
        wait_for(lambda: _roles(db_dsn, name) == expected, 10, f"{expected}")
    assert _backends(db_dsn, name) == 0


def test_lease_connection_is_closed_while_nothing_is_held(db_dsn):
    """No idle connection for lease renewal: a round with nothing held closes it, the next
    held message opens one again."""
    name = f"kpt_lease_{uuid.uuid4().hex[:8]}"
    with connect(
        db_dsn, connection_options={"application_name": name}, lease_renewal_interval=0
    ) as conn:
        publish(conn, "lease_idle", ["x", "y"])
        leases = conn.transport.leases
        message = conn.channel().basic_get("lease_idle")
        assert message is not None
        assert leases.renew().renewed == 1
        assert _roles(db_dsn, name).get("leases") == 1
        message.ack()
        assert leases.renew().renewed == 0
        assert not leases.connector.connected
        wait_for(lambda: "leases" not in _roles(db_dsn, name), 5, "the lease connection closed")
        again = conn.channel().basic_get("lease_idle")
        assert again is not None and leases.renew().renewed == 1
        assert _roles(db_dsn, name).get("leases") == 1
        again.ack()


def test_close_with_batched_acks_archives_them_and_leaks_no_connection(db_dsn):
    """An ack sent without waiting is settled before the close returns: another session
    holds the message's row while the ack is sent and for 0.5 s after."""
    name = f"kpt_leak_{uuid.uuid4().hex[:8]}"
    hub = Hub()
    locker = psycopg.connect(db_dsn)
    release = threading.Timer(0.5, locker.rollback)
    try:
        with connect(db_dsn, connection_options={"application_name": name}) as conn:
            publish(conn, "leak", ["x"])
            conn.transport.register_with_event_loop(conn.connection, hub)  # acks batched
            message = conn.channel().basic_get("leak")
            assert message is not None
            locker.execute(f"SELECT 1 FROM {table('leak')} FOR UPDATE")
            release.start()
            message.ack()  # batched, or sent without waiting: archived by the close
        archived = sql(db_dsn, f"SELECT count(*) FROM {table('leak', 'a')}")
    finally:
        hub.close()
        if release.is_alive():
            release.join()
        locker.close()
    assert archived == [(1,)]
    assert _backends(db_dsn, name) == 0


def test_drain_events_does_not_spin_with_a_listen_socket_above_fd_1024(db_dsn):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 2048:
        pytest.skip(f"the hard limit of open files is {hard}: cannot reach fd 1024")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 2048), hard))
    filler = []
    try:
        while not filler or filler[-1] < 1100:
            filler.append(os.open(os.devnull, os.O_RDONLY))
        with connect(db_dsn) as conn:
            got: list[Any] = []
            with Consumer(conn.channel(), [Queue("quiet")], on_message=got.append):
                assert conn.transport.poller.listener().fileno() > 1024
                cpu = time.process_time()
                with pytest.raises(TimeoutError):
                    conn.drain_events(timeout=2)
                used = time.process_time() - cpu
        assert got == []
        assert used < 0.5, f"drain_events(timeout=2) used {used:.2f} s of CPU: a busy loop"
    finally:
        for fd in filler:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_heartbeat_thread_survives_an_unexpected_error(db_dsn, caplog):
    """An unexpected exception in a round (before: the consumers set changing size during
    iteration) is logged and the loop goes on: heartbeats continue."""
    options = {"consumer_heartbeat_interval": 0.1, "consumer_stale_after": 5}
    with connect(db_dsn, **options) as conn:
        maintainer = conn.transport.maintainer
        real = maintainer._consumed_tables
        calls = {"n": 0}

        def flaky() -> list[str]:
            calls["n"] += 1
            if calls["n"] == 2:
                raise RuntimeError("Set changed size during iteration")
            return real()

        maintainer._consumed_tables = flaky

        def heartbeat() -> Any:
            return sql(db_dsn, "SELECT max(heartbeat_at) FROM kombu_pgmq.consumers")[0][0]

        with Consumer(conn.channel(), [Queue("beating")], on_message=lambda m: None):
            wait_for(lambda: calls["n"] > 3, 30, "rounds after the failed one")
            first = wait_for(heartbeat, 30, "a heartbeat")
            wait_for(lambda: heartbeat() > first, 30, "a later heartbeat")
            assert maintainer.running
        assert "Set changed size" in caplog.text


def test_rows_are_decoded_by_column_name(db_dsn, monkeypatch):
    """Reordered result columns (as a PGMQ release once did to message_record) still
    decode into the right fields."""
    statements = queries()
    monkeypatch.setitem(
        statements,
        "read_many",
        "SELECT age_seconds, headers, enqueued_at, message, read_ct, msg_id, queue\n"
        "FROM kombu_pgmq.read(%(queues)s::text[], %(vt_seconds)s::integer, %(qty)s::integer,\n"
        "  %(ack_queues)s::text[], %(ack_ids)s::bigint[], %(ack_cts)s::integer[],\n"
        "  %(ack_enqueued)s::timestamptz[], %(durable_acks)s::boolean)",
    )
    with connect(db_dsn) as conn:
        publish(conn, "shuffled", [{"n": 1}], headers={"task": "t"})
        got = drain(conn, "shuffled", expect=1)
    assert [m.decode() for m in got] == [{"n": 1}]
    assert got[0].headers == {"task": "t"}
    assert got[0].delivery_info["pgmq_read_ct"] == 1
