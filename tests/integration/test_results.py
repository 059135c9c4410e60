"""The Celery result backend (``result_backend = "postgresql://..."``) against a real
PostgreSQL: storage of every state, serializers, limits, expiry, URL handling, waiting
woken by NOTIFY (no polling), reconnects, chord counting and least-privilege roles.

A worker process is not needed here: what a worker does to the backend (``store_result``,
``mark_as_*``, ``on_chord_part_return``) is called directly, from a second app instance
(another backend, another connection) where it matters. ``tests/e2e/test_results_worker.py``
runs the same backend under real ``celery worker`` processes.
"""

from __future__ import annotations

import importlib.util
import json
import pickle
import subprocess
import sys
import threading
import time
import traceback
import uuid
import zlib
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta, timezone
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import psycopg
import pytest
from celery import Celery, states
from celery.backends import base as celery_backends_base
from celery.exceptions import BackendStoreError, ChordError
from celery.exceptions import TimeoutError as CeleryTimeoutError
from celery.result import GroupResult, ResultSet
from kombu import Connection

from kombu_pgmq import errors
from kombu_pgmq._db.results import ResultStore
from kombu_pgmq.results import ResultBackend
from tests.integration.helpers import drain, sql, table, wait_for
from tests.support import pgserver

WAIT_S = 30.0
#: Celery 5.7 and later compress stored results (``result_compression``); 5.5 and 5.6
#: store them uncompressed whatever the setting says.
CELERY_COMPRESSES_RESULTS = hasattr(celery_backends_base, "COMPRESSED_PAYLOAD_MAGIC")


def make_app(broker_url: str, result_backend: str | None = None, **conf: Any) -> Celery:
    app = Celery(f"kpt_results_{uuid.uuid4().hex[:6]}", set_as_current=False)
    app.conf.update(
        broker_url=broker_url,
        result_backend=broker_url if result_backend is None else result_backend,
        result_extended=True,
        broker_connection_retry_on_startup=True,
        **conf,
    )
    return app


def close_app(app: Celery) -> None:
    backend = app.backend
    if isinstance(backend, ResultBackend):
        backend.result_consumer.stop()
        if backend._db is not None:
            backend._db.close()
    app.close()


@pytest.fixture
def apps(db_dsn: str) -> Iterator[Callable[..., Celery]]:
    """``apps(**conf)``: a new Celery app on the test database (broker and results there);
    every app is closed at teardown."""
    made: list[Celery] = []

    def make(**conf: Any) -> Celery:
        made.append(make_app(db_dsn, **conf))
        return made[-1]

    yield make
    for app in made:
        close_app(app)


def row(db_dsn: str, key: str) -> tuple[Any, ...] | None:
    rows = sql(
        db_dsn,
        "SELECT state, meta, date_done, expires_at FROM kombu_pgmq.results WHERE key = %s",
        (key,),
    )
    return rows[0] if rows else None


def task_row(db_dsn: str, task_id: str) -> tuple[Any, ...] | None:
    return row(db_dsn, f"celery-task-meta-{task_id}")


def new_id() -> str:
    return str(uuid.uuid4())


# -- storage ---------------------------------------------------------------------------------


def test_an_unknown_task_is_pending_and_stores_nothing(apps, db_dsn):
    app = apps()
    task_id = new_id()
    result = app.AsyncResult(task_id)
    assert result.state == states.PENDING
    assert result.result is None
    assert task_row(db_dsn, task_id) is None


def _raise(exc: BaseException) -> str:
    try:
        raise exc
    except BaseException:
        return traceback.format_exc()


def test_every_state_is_stored_and_read_back_by_another_process_view(apps, db_dsn):
    """Each state written by one backend (a worker's) reads back, from a fresh app (no
    cache), with its result, traceback and state column."""
    writer, reader = apps().backend, apps()
    ids = {name: new_id() for name in ("received", "started", "retry", "ok", "fail", "rev", "c")}
    writer.store_result(ids["received"], None, states.RECEIVED)
    writer.mark_as_started(ids["started"], pid=4321, hostname="w1@h")
    retry_exc = ValueError("again")
    writer.mark_as_retry(ids["retry"], retry_exc, traceback=_raise(retry_exc))
    writer.mark_as_done(ids["ok"], {"answer": 42})
    fail_exc = KeyError("boom")
    fail_tb = _raise(fail_exc)
    writer.mark_as_failure(ids["fail"], fail_exc, traceback=fail_tb)
    writer.mark_as_revoked(ids["rev"], "by test")
    writer.store_result(ids["c"], {"done": 3, "total": 10}, "PROGRESS")

    def read(task_id: str) -> Any:
        return reader.AsyncResult(task_id)

    assert read(ids["received"]).state == states.RECEIVED
    started = read(ids["started"])
    assert started.state == states.STARTED
    assert started.info == {"pid": 4321, "hostname": "w1@h"}
    retry = read(ids["retry"])
    assert retry.state == states.RETRY
    assert isinstance(retry.info, ValueError) and retry.info.args == ("again",)
    assert "ValueError: again" in retry.traceback
    ok = read(ids["ok"])
    assert (ok.state, ok.result) == (states.SUCCESS, {"answer": 42})
    assert ok.date_done is not None
    fail = read(ids["fail"])
    assert fail.state == states.FAILURE
    assert isinstance(fail.result, KeyError) and fail.result.args == ("boom",)
    assert fail.traceback == fail_tb
    assert read(ids["rev"]).state == states.REVOKED
    custom = read(ids["c"])
    assert (custom.state, custom.info) == ("PROGRESS", {"done": 3, "total": 10})
    # The state column beside the meta (counts by state, the SUCCESS guard) agrees.
    expected = {
        "received": states.RECEIVED,
        "started": states.STARTED,
        "retry": states.RETRY,
        "ok": states.SUCCESS,
        "fail": states.FAILURE,
        "rev": states.REVOKED,
        "c": "PROGRESS",
    }
    for name, task_id in ids.items():
        stored = task_row(db_dsn, task_id)
        assert stored is not None and stored[0] == expected[name], name


def test_update_state_of_a_running_task_is_stored(apps):
    app = apps()

    @app.task(bind=True, name="t.progress", shared=False)
    def progress(self: Any) -> None:
        self.update_state(state="PROGRESS", meta={"step": 1})

    task_id = new_id()
    progress.apply(task_id=task_id, throw=True)  # eager: only update_state stores
    assert apps().AsyncResult(task_id).info == {"step": 1}
    other = new_id()
    progress.update_state(task_id=other, state="PROGRESS", meta={"step": 7})
    assert apps().AsyncResult(other).info == {"step": 7}


def test_result_extended_fields(apps):
    from celery.app.task import Context

    writer = apps().backend
    task_id = new_id()
    request = Context(
        id=task_id,
        task="t.add",
        args=[1, 2],
        kwargs={"z": 3},
        hostname="w9@host",
        retries=2,
        delivery_info={"routing_key": "q.results", "exchange": ""},
    )
    writer.mark_as_done(task_id, 6, request=request)
    result = apps().AsyncResult(task_id)
    assert result.name == "t.add"
    assert result.args == [1, 2]
    assert result.kwargs == {"z": 3}
    assert result.worker == "w9@host"
    assert result.retries == 2
    assert result.queue == "q.results"


SERIALIZERS = ["json", "pickle"]
SERIALIZERS.append(
    pytest.param(
        "msgpack",
        marks=pytest.mark.skipif(
            importlib.util.find_spec("msgpack") is None, reason="msgpack is not installed"
        ),
    )
)


@pytest.mark.parametrize("serializer", SERIALIZERS)
@pytest.mark.parametrize("compression", [None, "zlib"])
def test_serializers_and_compression_round_trip(apps, db_dsn, serializer, compression):
    conf = {
        "result_serializer": serializer,
        "accept_content": [serializer],
        "result_accept_content": [serializer],
        "result_compression": compression,
    }
    value: Any = {"text": "héllo ✓", "n": [1, 2.5, None], "nested": {"x": True}}
    if serializer == "pickle":
        value = {"when": datetime(2026, 1, 2, tzinfo=timezone.utc), "set": {1, 2}}
    writer = apps(**conf).backend
    task_id = new_id()
    writer.mark_as_done(task_id, value)
    assert apps(**conf).AsyncResult(task_id).get(timeout=WAIT_S) == value
    stored = task_row(db_dsn, task_id)
    assert stored is not None
    raw = bytes(stored[1])
    if compression == "zlib" and CELERY_COMPRESSES_RESULTS:
        # compressed as Celery does it
        assert raw.startswith(celery_backends_base.COMPRESSED_PAYLOAD_MAGIC)
        raw = celery_backends_base.decompress_payload(raw)
        assert zlib.compress(raw)  # (zlib is what it was compressed with)
    if serializer == "json":
        assert json.loads(raw)["result"] == value
    elif serializer == "pickle":
        assert pickle.loads(raw)["result"] == value
    else:
        import msgpack

        assert msgpack.unpackb(raw)["result"] == value


def test_a_result_over_the_size_limit_is_refused_clearly(apps, db_dsn):
    options = {"result_backend_transport_options": {"result_max_bytes": 2000}}
    backend = apps(**options).backend
    big, small = new_id(), new_id()
    with pytest.raises(BackendStoreError, match="result_max_bytes=2000") as info:
        backend.mark_as_done(big, "x" * 5000)
    assert info.value.task_id == big
    assert task_row(db_dsn, big) is None
    backend.mark_as_done(small, "x" * 100)
    assert apps(**options).AsyncResult(small).result == "x" * 100


@pytest.mark.parametrize("max_bytes", [0, 2_000_000_000])
def test_an_impossible_size_limit_is_a_configuration_error(db_dsn, max_bytes):
    from kombu_pgmq import errors

    app = make_app(db_dsn, result_backend_transport_options={"result_max_bytes": max_bytes})
    with pytest.raises(errors.ConfigurationError, match="result_max_bytes"):
        app.backend  # noqa: B018
    app.close()


def test_result_expires_sets_expires_at_and_cleanup_deletes_only_expired_rows(apps, db_dsn):
    keep_app = apps(result_expires=None)
    expiring = apps(result_expires=3600)
    forever, soon = new_id(), new_id()
    keep_app.backend.mark_as_done(forever, 1)
    expiring.backend.mark_as_done(soon, 2)
    now = sql(db_dsn, "SELECT clock_timestamp()")[0][0]
    assert task_row(db_dsn, forever)[3] is None
    until = task_row(db_dsn, soon)[3]
    assert timedelta(seconds=3500) < until - now <= timedelta(seconds=3600)
    # Nothing is past its expiry yet: cleanup deletes nothing.
    expiring.backend.cleanup()
    assert task_row(db_dsn, soon) is not None
    # More expired rows than one batch: cleanup loops until all are gone.
    expired = [new_id() for _ in range(7)]
    for task_id in expired:
        expiring.backend.mark_as_done(task_id, task_id)
    sql(
        db_dsn,
        "UPDATE kombu_pgmq.results SET expires_at = clock_timestamp() - interval '1 s'"
        " WHERE key = ANY(%s)",
        ([f"celery-task-meta-{t}" for t in expired],),
    )
    small_batches = apps(result_expires=3600, result_backend_transport_options={"expire_batch": 3})
    small_batches.backend.cleanup()
    assert all(task_row(db_dsn, t) is None for t in expired)
    assert task_row(db_dsn, forever) is not None
    assert task_row(db_dsn, soon) is not None


def test_forget_deletes_the_result(apps, db_dsn):
    app = apps()
    task_id = new_id()
    app.backend.mark_as_done(task_id, "v")
    result = app.AsyncResult(task_id)
    assert result.get(timeout=WAIT_S) == "v"
    result.forget()
    assert task_row(db_dsn, task_id) is None
    assert apps().AsyncResult(task_id).state == states.PENDING


def test_a_stored_success_is_never_overwritten(apps, db_dsn):
    """A redelivered task that runs again (STARTED, RETRY, FAILURE) after its SUCCESS was
    stored never replaces it; other states replace each other."""
    backend = apps().backend
    task_id = new_id()
    backend.mark_as_started(task_id)
    backend.mark_as_failure(task_id, ValueError("first try"))
    assert apps().AsyncResult(task_id).state == states.FAILURE
    backend.mark_as_done(task_id, "first")
    backend.mark_as_started(task_id)
    backend.mark_as_retry(task_id, ValueError("late"))
    backend.mark_as_failure(task_id, ValueError("late"))
    backend.store_result(task_id, {"x": 1}, "PROGRESS")
    result = apps().AsyncResult(task_id)
    assert (result.state, result.result) == (states.SUCCESS, "first")
    assert task_row(db_dsn, task_id)[0] == states.SUCCESS


def test_save_and_restore_group(apps):
    app = apps()
    ids = [new_id() for _ in range(3)]
    group = GroupResult(new_id(), [app.AsyncResult(t) for t in ids], app=app)
    group.save(backend=app.backend)
    restored = GroupResult.restore(group.id, app=apps())
    assert restored is not None
    assert [r.id for r in restored.results] == ids
    restored.delete()
    assert GroupResult.restore(group.id, app=apps()) is None


# -- URLs ------------------------------------------------------------------------------------


@pytest.mark.parametrize("scheme", ["postgresql", "postgres"])
def test_the_scheme_selects_this_backend_through_celerys_entry_point(scheme):
    """In a fresh interpreter, Celery's own ``by_url`` finds the class (entry point
    ``celery.result_backends``) without anything importing kombu_pgmq first."""
    code = (
        "import sys\n"
        "from celery.app.backends import by_url\n"
        "assert 'kombu_pgmq' not in sys.modules\n"
        f"cls, url = by_url('{scheme}://u@h/db')\n"
        "print(cls.__module__ + '.' + cls.__qualname__)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert out.stdout.strip() == "kombu_pgmq.results.backend.ResultBackend"


def test_a_bare_url_means_the_brokers_database(db_dsn):
    app = make_app(db_dsn, result_backend="postgresql://")
    try:
        assert isinstance(app.backend, ResultBackend)
        task_id = new_id()
        app.backend.mark_as_done(task_id, "here")
        assert task_row(db_dsn, task_id)[0] == states.SUCCESS
    finally:
        close_app(app)


def _with_password(url: str, password: str) -> str:
    parts = urlsplit(url)
    netloc = f"{parts.username}:{password}@{parts.hostname}"
    if parts.port:
        netloc += f":{parts.port}"
    return urlunsplit(parts._replace(netloc=netloc))


def test_the_password_never_appears_in_as_uri(db_dsn):
    url = _with_password(db_dsn, "s3cr3t-pw")
    app = make_app(db_dsn, result_backend=url)
    try:
        backend = app.backend
        assert "s3cr3t-pw" not in backend.as_uri()
        assert "s3cr3t-pw" in backend.as_uri(include_password=True)
        assert "s3cr3t-pw" not in repr(backend)
        assert "s3cr3t-pw" in backend.dsn  # libpq still gets it
    finally:
        close_app(app)


def test_a_multi_host_url_with_a_password_is_redacted_and_kept_whole(db_dsn):
    """No connection is made: the URL's hosts reach libpq as a list (primary found on
    connect), the password never shows, and a pickled backend keeps the URL."""
    url = "postgresql://app:s3cr3t-pw@h1:5432,h2:5433/db?sslmode=require"
    app = make_app(db_dsn, result_backend=url)
    try:
        backend = app.backend
        assert backend.as_uri() == "postgresql://app:**@h1:5432,h2:5433/db?sslmode=require"
        params = psycopg.conninfo.conninfo_to_dict(backend.dsn)
        assert (params["host"], params["port"]) == ("h1,h2", "5432,5433")
        assert (params["sslmode"], params["password"]) == ("require", "s3cr3t-pw")
        copy = pickle.loads(pickle.dumps(backend))
        assert copy.url == url
    finally:
        close_app(app)


def test_a_multi_host_url_finds_the_server_behind_a_dead_host(db_dsn):
    """``postgresql://u@dead,alive/db``: the first host refuses connections, the backend
    stores and reads through the second."""
    parts = urlsplit(db_dsn)
    if not parts.hostname or parts.hostname.startswith("/"):
        pytest.skip("the test server is on a unix socket")
    dead = pgserver.free_port()
    netloc = f"{parts.username}@127.0.0.1:{dead},{parts.hostname}:{parts.port or 5432}"
    url = urlunsplit(parts._replace(netloc=netloc))
    app = make_app(db_dsn, result_backend=url)
    try:
        task_id = new_id()
        app.backend.mark_as_done(task_id, "found")
        assert task_row(db_dsn, task_id)[0] == states.SUCCESS
        assert app.AsyncResult(task_id).get(timeout=WAIT_S) == "found"
    finally:
        close_app(app)


# -- waiting without polling ------------------------------------------------------------------


class ReadSpy:
    """Counts the result reads (``ResultStore.get``) made by one thread."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[list[str]] = []
        self.thread: threading.Thread | None = None
        original = ResultStore.get
        spy = self

        def get(store: ResultStore, keys: Any, task_ids: Any) -> Any:
            if threading.current_thread() is spy.thread:
                spy.calls.append(list(keys))
            return original(store, keys, task_ids)

        monkeypatch.setattr(ResultStore, "get", get)


class Waiter(threading.Thread):
    """Runs ``fn()`` in a thread; keeps its return value or exception."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        super().__init__(daemon=True)
        self.fn = fn
        self.value: Any = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.value = self.fn()
        except BaseException as exc:
            self.error = exc

    def result(self, timeout: float = WAIT_S) -> Any:
        self.join(timeout)
        assert not self.is_alive(), "the waiter is still waiting"
        if self.error is not None:
            raise self.error
        return self.value


def wait_subscribed(backend: ResultBackend, task_ids: list[str]) -> None:
    consumer = backend.result_consumer
    wait_for(
        lambda: consumer._listening and set(task_ids) <= consumer._subscribed,
        WAIT_S,
        "the waiter to LISTEN for its tasks",
    )


@pytest.mark.parametrize("size", ["inline", "large"])
def test_get_is_woken_by_the_notification_not_by_polling(apps, monkeypatch, size):
    """While ``get()`` waits nothing is read again; the store's NOTIFY wakes it: a small
    result arrives in the payload (no read), a large one is read once by key."""
    spy = ReadSpy(monkeypatch)
    waiting, writer = apps(), apps()
    task_id = new_id()
    value = "v" if size == "inline" else "L" * 20_000
    backend = waiting.backend  # Celery's backends are per thread: the waiter uses this one
    waiter = Waiter(lambda: waiting.AsyncResult(task_id, backend=backend).get(timeout=WAIT_S))
    spy.thread = waiter
    waiter.start()
    wait_subscribed(backend, [task_id])
    wait_for(lambda: spy.calls, WAIT_S, "the waiter's first read")
    time.sleep(1.0)  # the reads of a starting get() (its state, the subscription's resync)
    reads = len(spy.calls)
    assert reads <= 2, spy.calls
    time.sleep(2.0)  # a polling waiter (Celery's default interval 0.5 s) would read here
    assert len(spy.calls) == reads, spy.calls
    writer.backend.mark_as_done(task_id, value)
    assert waiter.result() == value
    assert len(spy.calls) == reads + (0 if size == "inline" else 1), spy.calls


def test_backends_of_threads_share_one_connection_one_statement_at_a_time(apps, db_dsn):
    """Celery makes a backend instance per thread (per greenlet under gevent): they share
    the app's one result connection, and a transaction of one thread holds the others'
    statements until it ends (never run inside it, nor seeing its writes)."""
    tag = f"kpt_shared_{uuid.uuid4().hex[:8]}"
    app = apps(result_backend_transport_options={"connection_options": {"application_name": tag}})
    backends: list[Any] = []
    opened, committed = threading.Event(), threading.Event()
    seen: list[Any] = []

    def writer() -> None:
        backend = app.backend
        backends.append(backend)
        with backend.store.transaction():
            backend.store_result("uncommitted", 1, states.SUCCESS)
            opened.set()
            time.sleep(0.3)
            committed.set()

    def reader() -> None:
        backend = app.backend
        backends.append(backend)
        opened.wait(WAIT_S)
        seen.append((backend.get_task_meta("uncommitted")["status"], committed.is_set()))

    threads = [threading.Thread(target=writer), threading.Thread(target=reader)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(WAIT_S)
    assert len({id(b) for b in backends}) == 2  # two instances...
    assert len({id(b._db) for b in backends}) == 1  # ...one connection
    assert seen == [(states.SUCCESS, True)]  # read after the commit, not inside it
    names = sql(
        db_dsn,
        "SELECT application_name FROM pg_stat_activity WHERE application_name LIKE %s",
        (tag + ":%",),
    )
    assert names == [(f"{tag}:results",)]
    backends[0]._db.close()  # the main thread's backend never used it: close_app cannot


def test_a_result_stored_before_get_is_found_by_its_first_read(apps):
    waiting, writer = apps(), apps()
    task_id = new_id()
    writer.backend.mark_as_done(task_id, 11)
    assert waiting.AsyncResult(task_id).get(timeout=WAIT_S) == 11


def test_get_timeout_raises_celerys_timeout_error(apps):
    app = apps()
    with pytest.raises(CeleryTimeoutError):
        app.AsyncResult(new_id()).get(timeout=0.3)
    with pytest.raises(CeleryTimeoutError):
        list(app.backend.get_many([new_id(), new_id()], timeout=0.3))


def _store_later(
    writer: Celery, waiting: Celery, ids: list[str], value: Callable[[str], Any]
) -> threading.Thread:
    """Store ``ids`` from a thread once ``waiting``'s backend (this thread's) waits."""
    write, wait = writer.backend, waiting.backend

    def run() -> None:
        wait_subscribed(wait, ids)
        for task_id in ids:
            write.mark_as_done(task_id, value(task_id))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("how", ["get", "join_native", "iter_native", "get_many"])
def test_waiting_for_many_returns_every_result(apps, how):
    waiting, writer = apps(), apps()
    ids = [new_id() for _ in range(6)]
    before = ids[:2]  # stored before waiting starts: found by the first read
    for task_id in before:
        writer.backend.mark_as_done(task_id, ids.index(task_id))
    later = _store_later(writer, waiting, ids[2:], ids.index)
    results = ResultSet([waiting.AsyncResult(t) for t in ids], app=waiting)
    if how == "get":
        got = results.get(timeout=WAIT_S)
    elif how == "join_native":
        got = results.join_native(timeout=WAIT_S)
    elif how == "iter_native":
        pairs = dict(results.iter_native(timeout=WAIT_S))
        got = [pairs[t]["result"] for t in ids]
    else:
        pairs = dict(waiting.backend.get_many(ids, timeout=WAIT_S))
        got = [pairs[t]["result"] for t in ids]
    later.join(WAIT_S)
    assert got == list(range(6))


def test_get_returns_after_its_listen_connection_is_killed(apps, db_dsn):
    """The LISTEN connection is terminated, the result is stored while it is gone: the
    waiter reconnects, re-reads and returns."""
    waiting, writer = apps(), apps()
    task_id = new_id()
    backend = waiting.backend
    waiter = Waiter(lambda: waiting.AsyncResult(task_id, backend=backend).get(timeout=WAIT_S))
    waiter.start()
    wait_subscribed(backend, [task_id])
    consumer = backend.result_consumer
    pid = consumer._listener_pid
    with psycopg.connect(db_dsn, autocommit=True) as admin:
        admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
        # stored while the waiter has no LISTEN (its notification is never delivered)
        writer.backend.mark_as_done(task_id, "after the kill")
    assert waiter.result() == "after the kill"
    assert consumer._listener_pid != pid  # it did reconnect


def test_get_returns_across_a_postgresql_restart():
    """A private server crashes (``pg_ctl stop -m immediate``) and starts again while
    ``get()`` waits; the result stored after the restart is returned."""
    from kombu_pgmq import schema

    try:
        server = pgserver.start_server()
    except pgserver.EmbeddedPostgresMissing as exc:
        pytest.skip(str(exc))
    waiting = writer = None
    try:
        with psycopg.connect(server.dsn, autocommit=True) as admin:
            admin.execute("CREATE DATABASE broker")
        url = pgserver.socket_url(server)
        schema.bootstrap(url)
        pgserver.close_admin_connections(server.dsn)
        waiting, writer = make_app(url), make_app(url)
        task_id = new_id()
        backend = waiting.backend
        waiter = Waiter(lambda: waiting.AsyncResult(task_id, backend=backend).get(timeout=90))
        waiter.start()
        wait_subscribed(backend, [task_id])
        pid = backend.result_consumer._listener_pid
        with psycopg.connect(url, autocommit=True) as admin:
            admin.execute("CHECKPOINT")  # the test server commits asynchronously
        server.crash()
        server.start_again()
        writer.backend.mark_as_done(task_id, "survived")
        assert waiter.result(timeout=90) == "survived"
        assert waiting.backend.result_consumer._listener_pid != pid
    finally:
        for app in (waiting, writer):
            if app is not None:
                close_app(app)
        server.stop()


# -- chords, counted in SQL --------------------------------------------------------------------


def _header_request(app: Celery, group_id: str, task_id: str, index: int, callback: Any):
    from celery.app.task import Context

    return Context(
        id=task_id,
        group=group_id,
        group_index=index,
        chord=callback,
        task="t.header",
        delivery_info={"routing_key": "celery"},
    )


def test_a_chord_part_reported_twice_counts_once_and_fires_exactly_once(apps, db_dsn):
    """``on_chord_part_return`` for the same header task twice (a redelivered header task
    that ran again) neither completes the chord early nor fires it twice; the callback's
    one message carries the header results in header order."""
    app = apps()
    callback = app.signature("t.callback", queue="chord_cb", routing_key="chord_cb")
    callback.freeze()
    group_id = new_id()
    ids = [new_id() for _ in range(3)]
    backend = app.backend
    backend.apply_chord((group_id, [app.AsyncResult(t) for t in ids]), callback)
    backend.set_chord_size(group_id, 3)
    order = [2, 2, 0, 0, 1, 1, 2]  # every part reported twice, out of order
    for index in order:
        request = _header_request(app, group_id, ids[index], index, dict(callback))
        backend.mark_as_done(ids[index], f"r{index}")
        backend.on_chord_part_return(request, states.SUCCESS, f"r{index}")
    # Published synchronously by the part that completed it: one message, no more.
    assert sql(db_dsn, f"SELECT count(*) FROM {table('chord_cb')}") == [(1,)]
    with Connection(db_dsn) as conn:
        messages = drain(conn, "chord_cb", expect=1, timeout=WAIT_S)
    assert len(messages) == 1
    assert messages[0].headers["id"] == callback.id
    args = messages[0].decode()[0]
    assert args == [["r0", "r1", "r2"]]


def test_a_failed_header_part_fails_the_callback_with_chord_error(apps):
    app = apps()
    callback = app.signature("t.callback", queue="chord_cb2", routing_key="chord_cb2")
    callback.freeze()
    group_id = new_id()
    ids = [new_id() for _ in range(2)]
    backend = app.backend
    backend.apply_chord((group_id, [app.AsyncResult(t) for t in ids]), callback)
    backend.set_chord_size(group_id, 2)
    # The failed part first; the part that completes the chord succeeded (it is not
    # inside an exception handler, as a worker's success path is not).
    exc = ValueError("header broke")
    backend.mark_as_failure(ids[1], exc)
    backend.on_chord_part_return(
        _header_request(app, group_id, ids[1], 1, dict(callback)), states.FAILURE, exc
    )
    assert apps().AsyncResult(callback.id).state == states.PENDING
    backend.mark_as_done(ids[0], 1)
    backend.on_chord_part_return(
        _header_request(app, group_id, ids[0], 0, dict(callback)), states.SUCCESS, 1
    )
    result = apps().AsyncResult(callback.id)
    assert result.state == states.FAILURE
    assert isinstance(result.result, ChordError)
    assert ids[1] in str(result.result) and "header broke" in str(result.result)


@pytest.mark.parametrize("commit", [False, True])
def test_a_chord_published_in_the_applications_transaction_commits_or_rolls_back_with_it(
    apps, db_dsn, commit
):
    """A chord and a saved group inside ``with using(conn):``: the chord's row, the saved
    group and the header messages are written in the application's transaction, seen by
    nobody before the commit, and gone with a rollback."""
    from celery import chord

    import kombu_pgmq

    app = apps()
    header = [app.signature("t.part", (i,)) for i in range(3)]
    callback = app.signature("t.callback")

    def written() -> tuple[int, int, int]:
        return sql(
            db_dsn,
            "SELECT (SELECT count(*) FROM kombu_pgmq.chords),"
            " (SELECT count(*) FROM kombu_pgmq.results WHERE key LIKE 'celery-taskset-meta-%%'),"
            " (SELECT count(*) FROM pgmq.q_celery)",
        )[0]

    with (
        psycopg.connect(db_dsn) as pg,
        pg.transaction(force_rollback=not commit),
        kombu_pgmq.using(pg),
    ):
        result = chord(header)(callback)
        app.GroupResult(new_id(), [app.AsyncResult(new_id())]).save()
        assert written() == (0, 0, 0)  # nothing is seen before the commit
        inside = pg.execute(
            "SELECT count(*) FROM kombu_pgmq.chords WHERE group_id = %s", (result.parent.id,)
        ).fetchone()
        assert inside == (1,)
    assert written() == ((1, 1, 3) if commit else (0, 0, 0))


def _chord_row_lifetime_s(db_dsn: str, group_id: str) -> float | None:
    """Seconds from the chord row's last expiry update to its expiry (None: never)."""
    rows = sql(
        db_dsn,
        "SELECT extract(epoch FROM expires_at - clock_timestamp()) FROM kombu_pgmq.chords"
        " WHERE group_id = %s",
        (group_id,),
    )
    assert len(rows) == 1, rows
    return None if rows[0][0] is None else float(rows[0][0])


@pytest.mark.parametrize(
    ("conf", "lifetime_s"),
    [
        ({"result_expires": 3600}, 3600),
        ({"result_expires": timedelta(hours=2)}, 7200),
        ({"result_expires": 3600, "result_chord_expires": 900}, 900),
        ({"result_expires": 3600, "result_chord_expires": timedelta(minutes=20)}, 1200),
        ({"result_expires": 3600, "result_chord_expires": 0}, None),
    ],
)
def test_a_chord_row_expires_after_result_chord_expires_else_result_expires(
    apps, db_dsn, conf, lifetime_s
):
    """A chord (started, sized, completed) keeps its counter row for
    ``result_chord_expires`` seconds when set, else ``result_expires``, on every supported
    Celery (5.5 and 5.6 have no ``result_chord_expires``: ``result_expires`` then)."""
    app = apps(**conf)
    callback = app.signature("t.callback", queue="chord_exp", routing_key="chord_exp")
    callback.freeze()
    group_id, task_id = new_id(), new_id()
    backend = app.backend
    backend.apply_chord((group_id, [app.AsyncResult(task_id)]), callback)
    backend.set_chord_size(group_id, 1)
    started = _chord_row_lifetime_s(db_dsn, group_id)
    backend.mark_as_done(task_id, 1)
    backend.on_chord_part_return(
        _header_request(app, group_id, task_id, 0, dict(callback)), states.SUCCESS, 1
    )
    assert sql(db_dsn, f"SELECT count(*) FROM {table('chord_exp')}") == [(1,)]  # it fired
    fired = _chord_row_lifetime_s(db_dsn, group_id)
    if lifetime_s is None:
        assert started is None
        assert fired is not None and fired <= 300  # a fired chord's row: kept 5 minutes
    else:
        # (seconds elapsed since the row was written: well under the 60 s allowed)
        assert started is not None and lifetime_s - 60 < started <= lifetime_s
        assert fired is not None and lifetime_s - 60 < fired <= lifetime_s


# -- least privilege -----------------------------------------------------------------------------


def _lp_app(broker_url: str) -> Celery:
    return make_app(broker_url, result_backend_transport_options={"install_schema": False})


@pytest.mark.parametrize("least_privilege_db", ["sql_only"], indirect=True)
def test_least_privilege_roles_use_results_but_cannot_touch_the_table(least_privilege_db):
    lp = least_privilege_db
    worker, producer = _lp_app(lp.worker_url), _lp_app(lp.producer_url)
    try:
        callback = producer.signature("t.callback", queue="lp_cb", routing_key="lp_cb")
        callback.freeze()
        group_id, ids = new_id(), [new_id(), new_id()]
        # producer: applies a chord (chord_start, chord_size)
        producer.backend.apply_chord((group_id, [producer.AsyncResult(t) for t in ids]), callback)
        producer.backend.set_chord_size(group_id, 2)
        # worker: stores results and counts the chord's parts (which fires it)
        for index, task_id in enumerate(ids):
            worker.backend.mark_as_done(task_id, index)
            request = _header_request(worker, group_id, task_id, index, dict(callback))
            worker.backend.on_chord_part_return(request, states.SUCCESS, index)
        # producer: reads (get) what the worker stored, saves a group, stores no result
        assert [producer.AsyncResult(t).get(timeout=WAIT_S) for t in ids] == [0, 1]
        saved = producer.GroupResult(new_id(), [producer.AsyncResult(t) for t in ids])
        saved.save()
        assert [r.id for r in producer.GroupResult.restore(saved.id).results] == ids
        with pytest.raises(errors.PermissionDenied, match="function results_store"):
            producer.backend.mark_as_done(new_id(), 42)
        with Connection(lp.owner_url) as conn:
            fired = drain(conn, "lp_cb", expect=1, timeout=WAIT_S)
        assert [m.decode()[0] for m in fired] == [[[0, 1]]]
        for url in (lp.worker_url, lp.producer_url):
            for statement in (
                "SELECT * FROM kombu_pgmq.results",
                "DELETE FROM kombu_pgmq.results",
                "TRUNCATE kombu_pgmq.results",
                "DROP TABLE kombu_pgmq.results",
                "SELECT * FROM kombu_pgmq.chords",
            ):
                with (
                    psycopg.connect(url, autocommit=True) as conn,
                    pytest.raises(psycopg.errors.InsufficientPrivilege),
                ):
                    conn.execute(statement)
        assert (
            sql(lp.owner_url, "SELECT count(*) FROM kombu_pgmq.results")[0][0] == 3
        )  # two results, one saved group
    finally:
        close_app(worker)
        close_app(producer)
