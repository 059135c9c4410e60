"""Beat failover end to end: real ``celery beat`` processes with
``kombu_pgmq.beat:Scheduler`` and a real worker, on a private PostgreSQL server (a copy
of the session's bootstrapped one, so the test may crash and restart it).

The e2e app with ``KPT_BEAT=1`` (:mod:`tests.e2e.celery_app`) schedules ``e2e.beat_tick``
every second and every minute (crontab); each run records its task id and entry in
``e2e_beat_runs``. Three beats run; the leader is SIGKILLed, SIGSTOPped (hung past the
takeover time, then continued: it steps down and sends nothing more), its backend is
ended (``pg_terminate_backend``), PostgreSQL is crashed and started (``pg_ctl stop -m
immediate``), then restarted cleanly (``-m fast``). After each event a leader of a new
epoch sends its first tick within ``beat_takeover_seconds`` (plus a tolerance for a
loaded 2-core machine; from the server's start again after a stop). At the end, from
``kombu_pgmq.beat_ticks`` and the runs: every tick's task ran exactly once and nothing
else ran, the every-second entry's due times form an unbroken sequence when the ticks
folded into catch-ups (``missed``) are counted (never a due time sent twice, never one
lost), and the crontab entry ran once per minute boundary passed.

A second, shorter test runs beat inside two workers (``celery worker -B``): one leads,
each tick is sent and run once.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import psycopg
import pytest
from celery import Celery

from tests.e2e.celery_app import BEAT_EVERY_MINUTE, BEAT_EVERY_SECOND, BEAT_RUNS_DDL
from tests.e2e.helpers import REPO_ROOT, Worker, wait_for
from tests.support import pgserver

#: ``beat_takeover_seconds`` of these tests (short: the test is short).
TAKEOVER_S = 6.0
#: Allowance over ``beat_takeover_seconds`` for a loaded 2-core machine (process start-up
#: of the signals' effects, reconnects, scheduling delays).
TOLERANCE_S = 3.0
#: Longest wait for anything a healthy beat does within seconds.
WAIT_S = 60.0
ENTRIES = (BEAT_EVERY_SECOND, BEAT_EVERY_MINUTE)
SECOND = timedelta(seconds=1)


class Beat:
    """One ``celery beat -S kombu_pgmq.beat:Scheduler`` subprocess (its own session)."""

    def __init__(self, name: str, env: dict[str, str], workdir: Path) -> None:
        self.name = name
        self.env = env
        self.workdir = workdir
        self.log_path = workdir / f"{name}.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        cmd = [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "tests.e2e.celery_app",
            "beat",
            "-S",
            "kombu_pgmq.beat:Scheduler",
            "--max-interval",
            "1",
            "-l",
            "info",
            "-s",
            str(self.workdir / f"{self.name}-schedule"),  # unused by this scheduler
        ]
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                cmd,
                cwd=self.workdir,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    @property
    def identity(self) -> str:
        """As ``kombu_pgmq.beat_leader`` names it (``host:pid``)."""
        return f"{socket.gethostname()}:{self.pid}"

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, signum: int) -> None:
        assert self.proc is not None
        os.kill(self.pid, signum)

    def kill(self) -> None:
        """SIGKILL (SIGCONT first: a stopped process too) and reap."""
        if self.proc is None:
            return
        for signum in (signal.SIGCONT, signal.SIGKILL):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, signum)
        self.proc.wait(timeout=10)

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""


class Db:
    """Short-lived connections to the test database (they survive server restarts)."""

    def __init__(self, url: str) -> None:
        self.url = url

    def rows(self, query: str, params: Any = None) -> list[tuple[Any, ...]]:
        with psycopg.connect(self.url, autocommit=True, connect_timeout=5) as conn:
            return conn.execute(query, params).fetchall()

    def value(self, query: str, params: Any = None) -> Any:
        rows = self.rows(query, params)
        return rows[0][0] if rows else None

    def try_value(self, query: str, params: Any = None) -> Any:
        """:meth:`value`, None while the server cannot answer (restarting)."""
        try:
            return self.value(query, params)
        except psycopg.OperationalError:
            return None

    def leader(self) -> tuple[str, int, int] | None:
        """``(identity, backend pid, epoch)`` of a leader whose session holds the lock."""
        rows = self.rows(
            "SELECT identity, backend_pid, epoch FROM kombu_pgmq.beat_leader_info() WHERE alive"
        )
        return (str(rows[0][0]), int(rows[0][1]), int(rows[0][2])) if rows else None

    def ticks(self) -> list[tuple[str, datetime, datetime, str, int, str | None, str, int]]:
        """``(entry, due_at, sent_at, kind, missed, task_id, leader, epoch)`` of the test
        entries, by entry and due time."""
        return [
            (r[0], r[1], r[2], r[3], r[4], r[5], r[6], r[7])
            for r in self.rows(
                "SELECT entry, due_at, sent_at, kind, missed, task_id, leader, epoch"
                " FROM kombu_pgmq.beat_ticks WHERE entry = ANY(%s) ORDER BY entry, due_at",
                (list(ENTRIES),),
            )
        ]

    def runs(self) -> list[tuple[str, str]]:
        """``(task_id, entry)`` of every recorded run."""
        return [(r[0], r[1]) for r in self.rows("SELECT task_id, entry FROM e2e_beat_runs")]

    def created_at(self, entry: str) -> datetime:
        value: datetime = self.value(
            "SELECT created_at FROM kombu_pgmq.beat_entries WHERE name = %s", (entry,)
        )
        return value


def beat_env(broker_url: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KPT_")}
    env.update(
        KPT_BROKER_URL=broker_url,
        KPT_BEAT="1",
        KPT_BEAT_TAKEOVER_SECONDS=str(TAKEOVER_S),
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")])),
        PYTHONUNBUFFERED="1",
    )
    return env


def now() -> datetime:
    return datetime.now(timezone.utc)


def first_tick_after(db: Db, epoch: int) -> tuple[datetime, str, int] | None:
    """``(sent_at, leader, epoch)`` of the first tick of an epoch after ``epoch``."""
    rows = db.rows(
        "SELECT sent_at, leader, epoch FROM kombu_pgmq.beat_ticks WHERE epoch > %s"
        " ORDER BY sent_at LIMIT 1",
        (epoch,),
    )
    return (rows[0][0], str(rows[0][1]), int(rows[0][2])) if rows else None


def measure_takeover(db: Db, since: datetime, epoch: int, event: str) -> tuple[float, str, int]:
    """Wait for the first tick of a new epoch; ``(seconds after since, leader, epoch)``."""

    def probe() -> tuple[datetime, str, int] | None:
        try:
            return first_tick_after(db, epoch)
        except psycopg.OperationalError:  # the server is restarting
            return None

    sent_at, leader, new_epoch = wait_for(probe, WAIT_S, f"a new leader's tick after {event}")
    return (sent_at - since).total_seconds(), leader, new_epoch


def epoch_ticks(db: Db, epoch: int) -> int:
    return int(db.value("SELECT count(*) FROM kombu_pgmq.beat_ticks WHERE epoch = %s", (epoch,)))


def steady(db: Db, epoch: int, ticks: int = 3) -> None:
    """Wait until the leader of ``epoch`` has sent ``ticks`` ticks."""
    wait_for(lambda: epoch_ticks(db, epoch) >= ticks, WAIT_S, f"{ticks} ticks of epoch {epoch}")


def quiet_moment(db: Db) -> None:
    """Wait until the worker ran every tick sent so far and the clock is midway between
    two every-second due times: a crash then interrupts no task's ack (a lost ack
    redelivers a task: the broker's at least once, not beat's concern here)."""
    phase = db.created_at(BEAT_EVERY_SECOND).timestamp() % 1.0

    def midway(latest: float) -> bool:
        return 0.3 <= (now().timestamp() - phase) % 1.0 <= latest

    def quiet() -> bool:
        if not midway(0.6):
            return False
        sent = {t[5] for t in db.ticks()}
        return sent <= {r[0] for r in db.runs()} and midway(0.7)

    wait_for(quiet, WAIT_S, "every sent tick's task to run, between two ticks", interval=0.02)


def check_ticks_and_runs(db: Db, end: datetime) -> dict[str, Any]:
    """The end-of-test invariants (see the module docstring); returns a summary."""
    ticks = db.ticks()
    assert ticks, "no tick was sent"
    keys = Counter((t[0], t[1]) for t in ticks)
    assert [k for k, n in keys.items() if n > 1] == []  # no (entry, due_at) twice
    assert {t[3] for t in ticks} <= {"scheduled", "catch-up"}, ticks  # catch_up once
    task_ids = [t[5] for t in ticks]
    assert None not in task_ids
    assert len(set(task_ids)) == len(task_ids)

    # Every tick's task ran exactly once (the worker drains), and nothing else ran.
    wanted = set(task_ids)
    wait_for(lambda: wanted <= {r[0] for r in db.runs()}, WAIT_S, "every tick's task to run")
    runs = db.runs()
    counts = Counter(r[0] for r in runs)
    assert {i: n for i, n in counts.items() if n != 1} == {}, "a tick's task ran twice"
    assert set(counts) == wanted, "a task ran that no tick sent"
    assert {(t[5], t[0]) for t in ticks} == set(runs)  # each run is its tick's entry

    # Every second: consecutive due times differ by (missed + 1) s from the entry's
    # creation on (interval ticks: created_at + n s): every due time sent once or folded.
    every = [t for t in ticks if t[0] == BEAT_EVERY_SECOND]
    previous = db.created_at(BEAT_EVERY_SECOND)
    for tick in every:
        assert tick[1] - previous == SECOND * (tick[4] + 1), (previous, tick)
        previous = tick[1]
    assert end - every[-1][1] < timedelta(seconds=TAKEOVER_S), "the ticks stopped early"

    # Every minute: one tick per minute boundary passed (sent late after an outage
    # perhaps, never twice, never folded: one boundary at most is missed at a time).
    minute = [t for t in ticks if t[0] == BEAT_EVERY_MINUTE]
    created = db.created_at(BEAT_EVERY_MINUTE)
    first = created.replace(second=0, microsecond=0) + timedelta(minutes=1)
    boundaries = []
    while first <= end:
        boundaries.append(first)
        first += timedelta(minutes=1)
    passed = [b for b in boundaries if b <= every[-1][1]]  # the leader got that far
    dues = [t[1] for t in minute]
    assert dues[: len(passed)] == passed, (dues, boundaries)
    assert set(dues) <= set(boundaries), (dues, boundaries)
    assert all(t[4] == 0 for t in minute), minute
    return {
        "ticks": len(every),
        "due_times": sum(t[4] + 1 for t in every),
        "catch_ups": [(t[1].isoformat(), t[4]) for t in every if t[4]],
        "minutes": len(minute),
        "leaders": sorted({(t[7], t[6]) for t in ticks}),
    }


@pytest.fixture
def beat_server(_primary_source: pgserver.LocalServer) -> Iterator[pgserver.LocalServer]:
    """A private server (database ``broker`` bootstrapped, synchronous commits) the test
    may crash and restart; stopped and deleted after."""
    server = pgserver.copy_server(_primary_source)
    try:
        yield server
    finally:
        server.stop()


@pytest.mark.slow
def test_beat_failover_sends_each_tick_once(
    beat_server: pgserver.LocalServer, tmp_path: Path, reported_logs: list[Any]
) -> None:
    url = pgserver.socket_url(beat_server)
    db = Db(url)
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(BEAT_RUNS_DDL)
    env = beat_env(url)
    worker = Worker("beatrun", env, tmp_path / "worker.log", own_queue=False)
    beats = [Beat(f"beat{i}", env, tmp_path) for i in range(1, 4)]
    reported_logs.extend([worker, *beats])
    takeovers: dict[str, float] = {}

    def by_identity(identity: str) -> Beat:
        return next(b for b in beats if b.identity == identity)

    def event(name: str, since: datetime, epoch: int) -> tuple[str, int]:
        seconds, leader, new_epoch = measure_takeover(db, since, epoch, name)
        takeovers[name] = round(seconds, 2)
        assert seconds <= TAKEOVER_S + TOLERANCE_S, (name, seconds)
        steady(db, new_epoch)
        return leader, new_epoch

    try:
        worker.start()
        for beat in beats:
            beat.start()
        identity, _, epoch = wait_for(db.leader, WAIT_S, "a beat to lead")
        steady(db, epoch)
        assert all(b.alive() for b in beats)

        # 1. The leader is SIGKILLed: its session ends, a follower leads within a round.
        killed = by_identity(identity)
        at = now()
        killed.signal(signal.SIGKILL)
        identity, epoch = event("SIGKILL", at, epoch)
        assert identity != killed.identity
        beats.append(Beat("beat4", env, tmp_path))  # its supervisor starts it again
        reported_logs.append(beats[-1])
        beats[-1].start()

        # 2. The leader hangs (SIGSTOP): its heartbeat goes stale, a follower ends its
        # session and leads. Continued, it finds its session gone and follows.
        hung = by_identity(identity)
        hung_epoch = epoch
        at = now()
        hung.signal(signal.SIGSTOP)
        identity, epoch = event("SIGSTOP", at, epoch)
        assert identity != hung.identity
        assert any("stopped its heartbeat" in b.log() for b in beats)  # it was deposed
        time.sleep(max(0.0, TAKEOVER_S - (now() - at).total_seconds()))  # hung that long
        sent_by_hung = epoch_ticks(db, hung_epoch)
        before = len(hung.log())
        hung.signal(signal.SIGCONT)
        wait_for(
            lambda: (
                "stops leading" in hung.log()[before:] or "no longer leads" in hung.log()[before:]
            ),
            WAIT_S,
            "the continued leader to step down",
        )
        steady(db, epoch, epoch_ticks(db, epoch) + 3)
        assert hung.alive()
        assert epoch_ticks(db, hung_epoch) == sent_by_hung, "the deposed leader sent a tick"
        assert db.leader() is not None and db.leader()[0] != hung.identity

        # 3. The leader's connection is cut (pg_terminate_backend).
        backend = db.leader()
        assert backend is not None
        at = now()
        assert db.value("SELECT pg_terminate_backend(%s)", (backend[1],))
        identity, epoch = event("pg_terminate_backend", at, epoch)

        # 4. PostgreSQL crashes (stop -m immediate), then is restarted cleanly (stop -m
        # fast): every session ends; a beat leads again once the server is back.
        # Down 2.5 s after the crash: due times pass with no leader (one catch-up tick).
        restarts = (("crash", beat_server.crash, 2.5), ("fast restart", beat_server.shut_down, 0))
        for how, stop, down in restarts:
            quiet_moment(db)
            at = now()
            stop()
            time.sleep(down)
            beat_server.start_again()
            up = now()
            name = f"PostgreSQL {how}"
            identity, epoch = event(name, up, epoch)
            takeovers[f"{name} (from the stop)"] = round(
                takeovers[name] + (up - at).total_seconds(), 2
            )

        # Run on until two minute boundaries passed (crontab ticks), then stop the beats.
        wait_for(
            lambda: (
                (
                    db.try_value(
                        "SELECT count(*) FROM kombu_pgmq.beat_ticks WHERE entry = %s",
                        (BEAT_EVERY_MINUTE,),
                    )
                    or 0
                )
                >= 2
            ),
            150,
            "two minute boundaries",
            interval=0.5,
        )
        live = [b for b in beats if b.alive()]
        assert len(live) == 3, "a beat process died"
        for beat in live:
            beat.kill()
        end = now()
        summary = check_ticks_and_runs(db, end)
        assert worker.alive(), "the worker died"
    finally:
        for beat in beats:
            beat.kill()
        worker.kill()
    print(f"takeover seconds: {takeovers}; {summary}")


@pytest.mark.slow
def test_worker_b_on_two_workers_sends_each_tick_once(
    app: Celery,
    db: psycopg.Connection,
    e2e_env: dict[str, str],
    db_dsn: str,
    start_worker: Callable[..., Worker],
) -> None:
    db.execute(BEAT_RUNS_DDL)
    beat = {"KPT_BEAT": "1", "KPT_BEAT_TAKEOVER_SECONDS": str(TAKEOVER_S)}
    workers = [start_worker(wait=False, extra_args=["-B"], **beat) for _ in range(2)]
    for worker in workers:
        worker.wait_ready(app)
    store = Db(db_dsn)
    _, _, epoch = wait_for(store.leader, WAIT_S, "an embedded beat to lead")
    # Both embedded beats run: one leads, the other follows it.
    wait_for(
        lambda: (
            all("leads now" in w.log() or "beat: following" in w.log() for w in workers)
            and any("beat: following" in w.log() for w in workers)
        ),
        WAIT_S,
        "one embedded beat to lead and the other to follow",
    )
    steady(store, epoch, 8)
    ticks = store.ticks()
    every = [t for t in ticks if t[0] == BEAT_EVERY_SECOND]
    assert {(t[6], t[7]) for t in ticks} == {(store.leader()[0], epoch)}  # one leads
    previous = store.created_at(BEAT_EVERY_SECOND)
    for tick in every:
        assert tick[1] - previous == SECOND * (tick[4] + 1), (previous, tick)
        previous = tick[1]
    wanted = {t[5] for t in ticks}
    wait_for(lambda: wanted <= {r[0] for r in store.runs()}, WAIT_S, "the ticks' tasks to run")
    sent = {t[5] for t in store.ticks()}
    counts = Counter(r[0] for r in store.runs())
    assert {i: n for i, n in counts.items() if n != 1} == {}, "a tick's task ran twice"
    assert set(counts) <= sent, "a task ran that no tick sent"
    assert all(w.alive() for w in workers)
