"""Fault injection: tasks published while Celery workers are SIGKILLed and the broker
crashes; every message accounted for.

:func:`run` is the engine of ``benchmarks/chaos.py`` (full size, several brokers, by hand)
and of ``tests/e2e/test_chaos.py`` (small, in CI). One run:

1. ``workers`` Celery workers (prefork, ``concurrency`` processes each,
   :mod:`tests.e2e.chaos_app`: ``acks_late``, ``reject_on_worker_lost``) consume queue
   ``chaos``, emptied first.
2. A publisher thread sends ``tasks`` tasks ``chaos.<task>(n)`` (``task``: ``work``,
   ``count`` or ``count_plain``, see :mod:`tests.e2e.chaos_app`), each ``apply_async``
   with kombu's retry (a publish that fails on a lost connection is retried after a
   reconnect); ``published`` are the ``n`` whose ``apply_async`` returned.
3. Meanwhile a chaos thread SIGKILLs a worker (its whole process group: the parent and
   its pool processes, as a machine or container dying) every ``kill_every_s`` seconds
   (plus up to ``kill_jitter_s``, drawn per kill) and starts it again at once, until the
   publisher is done (with ``kill_until_done``: and every published task is done, see 4)
   and ``kill_tail_s`` more seconds passed; once ``crash_after_fraction`` of the tasks
   are published it calls ``crash()`` (for PostgreSQL: ``pg_ctl stop -m immediate``, a
   few seconds down, ``pg_ctl start``: crash recovery).
4. Then it waits (up to ``settle_timeout_s``) until every published task is done, and
   stops the workers (warm shutdown). Done: ``work``, every published task ran (one line
   each, then 1 s for late duplicates); ``count`` and ``count_plain``, every published
   ``n`` is in ``chaos_applied`` and the queue's table holds no message (a redelivery
   still due is waited for, so its duplicate is counted).

Counts: ``published``; ``executed`` (lines: task bodies that ran to their end);
``distinct``; ``lost`` = published but never executed (must be 0); ``duplicates`` =
executed lines beyond the first of their task (at least once: each is a redelivery of
a message whose ack did not land, e.g. its worker was killed after the task ran and
before the ack committed, or the database crashed with asynchronously committed acks;
``duplicate_gaps_ms``: how long before the next kill each one's first run ended);
``executed_unpublished``: executed though their ``apply_async`` raised (an ambiguous
publish: committed, but the answer was lost). For the counting tasks ``executed`` are
attempts (bodies that ended; ``count``'s commit comes after its line), and the database
tells what was applied: ``counter`` (the final ``chaos_counter`` value), ``applied_rows``,
``applied_distinct``, ``applied_duplicates`` (rows beyond the first of their ``n``: tasks
applied twice), ``unapplied`` (published, never applied; must be 0), ``results`` (with a
result backend: the published tasks' result states, ``MISSING`` for none stored) and
``queue_left`` (messages still in the queue's table at the end).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

from tests.e2e.helpers import REPO_ROOT, Worker

QUEUE = "chaos"
#: Tasks of :mod:`tests.e2e.chaos_app` a run can publish (``ChaosConfig.task``).
TASKS = ("work", "count", "count_plain")
#: The modes whose tasks store results (kombu_pgmq's backend, the broker's database).
WITH_RESULTS = ("count",)
#: Longest wait for a worker's first start (2-core machine, cold imports).
READY_TIMEOUT_S = 90.0


@dataclass
class ChaosConfig:
    """One fault-injection run (see the module docstring)."""

    broker_url: str
    transport_options: dict[str, Any] = field(default_factory=dict)
    tasks: int = 20_000
    workers: int = 4
    concurrency: int = 2
    #: Seconds between two SIGKILLs of a worker (0: none).
    kill_every_s: float = 3.0
    #: Up to this many seconds more between two kills (uniform, per kill).
    kill_jitter_s: float = 0.0
    #: Kills go on until every published task is done (not only while publishing).
    kill_until_done: bool = False
    #: Kills go on this long after the last publish.
    kill_tail_s: float = 5.0
    #: Crashes the broker and brings it back (None: no crash step).
    crash: Callable[[], None] | None = None
    crash_after_fraction: float = 0.4
    #: How long each task works (ms).
    task_ms: int = 0
    #: Longest wait for every published task to run, after the chaos stopped.
    settle_timeout_s: float = 180.0
    seed: int = 14
    workdir: Path | None = None
    #: ``work`` (any broker), ``count`` or ``count_plain`` (kombu_pgmq's broker only).
    task: str = "work"


@dataclass
class ChaosResult:
    published: int = 0
    publish_errors: int = 0
    executed: int = 0
    distinct: int = 0
    lost: int = 0
    duplicates: int = 0
    executed_unpublished: int = 0
    kills: int = 0
    #: ``time.time()`` just before each SIGKILL (to set against the executions' times).
    kill_times: list[float] = field(default_factory=list)
    #: Per duplicated task, ms between its first run's end and the next SIGKILL.
    duplicate_gaps_ms: list[float] = field(default_factory=list)
    crashes: int = 0
    publish_s: float = 0.0
    total_s: float = 0.0
    settle_s: float = 0.0
    lost_sample: list[int] = field(default_factory=list)
    max_runs_of_one_task: int = 0
    errors: list[str] = field(default_factory=list)
    crash_at_published: int | None = None
    crash_s: float | None = None
    workdir: str = ""
    task: str = "work"
    #: The counting tasks only (None otherwise): the database's account.
    counter: int | None = None
    applied_rows: int | None = None
    applied_distinct: int | None = None
    applied_duplicates: int | None = None
    #: ``n`` of tasks applied more than once (up to 20).
    applied_twice_sample: list[int] = field(default_factory=list)
    unapplied: int | None = None
    unapplied_sample: list[int] = field(default_factory=list)
    #: Result state -> published tasks in it (``MISSING``: no result stored).
    results: dict[str, int] | None = None
    #: ``n:task_id:state`` of published tasks whose result is not SUCCESS (up to 20).
    results_not_success: list[str] = field(default_factory=list)
    queue_left: int | None = None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def executions(path: Path) -> Counter[int]:
    """How many times each task ``n`` ran to its end (lines of the executions file)."""
    runs: Counter[int] = Counter()
    try:
        data = path.read_text()
    except FileNotFoundError:
        return runs
    for line in data.splitlines():
        head = line.split(",", 1)[0]
        if head.isdigit():
            runs[int(head)] += 1
    return runs


def _pinged(path: Path, token: str) -> bool:
    try:
        return f"ping:{token}," in path.read_text()
    except FileNotFoundError:
        return False


def run(config: ChaosConfig) -> ChaosResult:
    """Run one fault-injection round (see the module docstring); never raises for what
    the workers or the broker do (failures land in ``errors``).

    Raises:
        ValueError: ``config.task`` is not one of :data:`TASKS`, or a counting task with a
            broker other than kombu_pgmq's.
    """
    from tests.e2e.chaos_app import COUNT_DDL, create_app

    if config.task not in TASKS:
        raise ValueError(f"task {config.task!r}: one of {TASKS}")
    counting = config.task != "work"
    if counting and not config.broker_url.startswith(("postgresql:", "postgres:")):
        raise ValueError(f"task {config.task!r} writes to the broker's database: postgresql://")

    workdir = config.workdir or Path(tempfile.mkdtemp(prefix="kpt_chaos_"))
    workdir.mkdir(parents=True, exist_ok=True)
    log = workdir / "executions.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("KPT_")}
    env.update(
        KPT_CHAOS_BROKER=config.broker_url,
        KPT_CHAOS_OPTIONS=json.dumps(config.transport_options),
        KPT_CHAOS_LOG=str(log),
        KPT_CHAOS_TASK_MS=str(config.task_ms),
        KPT_CHAOS_QUEUE=QUEUE,
        KPT_CHAOS_RESULTS="postgresql" if config.task in WITH_RESULTS else "",
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")])),
        PYTHONUNBUFFERED="1",
    )
    app = create_app(env)
    result = ChaosResult(workdir=str(workdir), task=config.task)
    rng = random.Random(config.seed)
    workers: list[Worker] = []
    published: list[int] = []
    failed: list[int] = []
    task_ids = [str(uuid.uuid4()) for _ in range(config.tasks)]

    def all_done() -> bool:
        """Whether every task published so far is done (see the module docstring)."""
        if not counting:
            return set(published) <= executions(log).keys()
        try:
            with psycopg.connect(config.broker_url, autocommit=True, connect_timeout=5) as db:
                applied = {n for (n,) in db.execute("SELECT DISTINCT n FROM chaos_applied")}
                left = _queue_left(db)
        except psycopg.Error:  # the server is down
            return False
        return left == 0 and set(published) <= applied

    def new_worker(slot: int) -> Worker:
        worker = Worker(
            f"chaos{slot}",
            env,
            workdir / f"worker{slot}.log",
            app_module="tests.e2e.chaos_app",
            queues=(QUEUE,),
            own_queue=False,
            concurrency=config.concurrency,
        )
        worker.start()
        return worker

    try:
        with app.connection_for_write() as conn:  # the queue exists and is empty
            queue = app.amqp.queues[QUEUE](conn.default_channel)
            queue.declare()
            queue.purge()
        if counting:
            with psycopg.connect(config.broker_url, autocommit=True) as db:
                db.execute(COUNT_DDL)
        workers = [new_worker(slot) for slot in range(config.workers)]
        ping = app.tasks["chaos.ping"]
        deadline = time.monotonic() + READY_TIMEOUT_S
        token = os.urandom(4).hex()
        for _ in range(config.workers * config.concurrency):
            ping.apply_async((token,))
        while not _pinged(log, token):  # a worker runs tasks
            if time.monotonic() > deadline:
                raise TimeoutError(f"no worker ran a task in {READY_TIMEOUT_S} s")
            time.sleep(0.1)

        done = threading.Event()
        crash_now = threading.Event()
        work = app.tasks[f"chaos.{config.task}"]
        retry_policy = {
            "max_retries": 120,
            "interval_start": 0.1,
            "interval_step": 0.2,
            "interval_max": 1.0,
        }
        crash_at = int(config.tasks * config.crash_after_fraction)

        def publish() -> None:
            t0 = time.monotonic()
            try:
                with app.producer_or_acquire() as producer:
                    for n in range(config.tasks):
                        if n == crash_at and config.crash is not None:
                            result.crash_at_published = len(published)
                            crash_now.set()
                        try:
                            work.apply_async(
                                (n,),
                                task_id=task_ids[n],
                                producer=producer,
                                retry=True,
                                retry_policy=retry_policy,
                            )
                        except Exception as exc:
                            failed.append(n)
                            if len(result.errors) < 20:
                                result.errors.append(f"publish {n}: {type(exc).__name__}: {exc}")
                        else:
                            published.append(n)
            finally:
                result.publish_s = round(time.monotonic() - t0, 2)
                done.set()

        def crash() -> None:
            crash_now.wait()
            if config.crash is None:
                return
            t0 = time.monotonic()
            try:
                config.crash()
                result.crashes += 1
            except Exception as exc:
                result.errors.append(f"crash: {type(exc).__name__}: {exc}")
            result.crash_s = round(time.monotonic() - t0, 2)

        t_start = time.monotonic()
        publisher = threading.Thread(target=publish, name="chaos-publisher")
        crasher = threading.Thread(target=crash, name="chaos-crash", daemon=True)
        crasher.start()
        publisher.start()
        tail_end: float | None = None
        give_up = t_start + config.settle_timeout_s * 3
        while config.kill_every_s > 0:
            time.sleep(config.kill_every_s + rng.uniform(0, config.kill_jitter_s))
            if done.is_set() and (
                not config.kill_until_done or all_done() or time.monotonic() > give_up
            ):
                tail_end = tail_end or time.monotonic() + config.kill_tail_s
                if time.monotonic() >= tail_end:
                    break
            slot = rng.randrange(config.workers)
            result.kill_times.append(time.time())
            workers[slot].kill()
            result.kills += 1
            workers[slot] = new_worker(slot)
        publisher.join()
        if config.crash is not None:
            crash_now.set()  # fewer tasks than the crash point: crash now
            crasher.join()

        t_settle = time.monotonic()
        wanted = set(published)
        deadline = t_settle + config.settle_timeout_s
        while True:
            if (
                (counting and all_done())
                or (not counting and wanted <= executions(log).keys())
                or time.monotonic() > deadline
            ):
                break
            for slot, worker in enumerate(workers):
                if not worker.alive():  # a worker that gave up: count it, start another
                    result.errors.append(f"worker {slot} exited with {worker.proc.returncode}")
                    workers[slot] = new_worker(slot)
            time.sleep(0.5 if counting else 0.2)
        if not counting:
            time.sleep(1.0)  # late duplicates of the last redeliveries
        result.settle_s = round(time.monotonic() - t_settle, 2)
        result.total_s = round(time.monotonic() - t_start, 2)
    except Exception as exc:
        result.errors.append(f"run: {type(exc).__name__}: {exc}")
    finally:
        for worker in workers:
            worker.terminate()
        for worker in workers:
            worker.stop()
        with contextlib.suppress(Exception):
            app.close()

    result.published = len(published)
    result.publish_errors = len(failed)
    runs = executions(log)
    lost = sorted(set(published) - runs.keys())
    result.executed = sum(runs.values())
    result.distinct = len(runs)
    result.lost = len(lost)
    result.lost_sample = lost[:20]
    result.duplicates = result.executed - result.distinct
    result.executed_unpublished = len(set(failed) & runs.keys())
    result.max_runs_of_one_task = max(runs.values(), default=0)
    result.duplicate_gaps_ms = duplicate_gaps(log, result.kill_times)
    if counting:
        try:
            account(config, result, published, task_ids)
        except psycopg.Error as exc:
            result.errors.append(f"account: {type(exc).__name__}: {exc}")
    return result


def _queue_left(db: psycopg.Connection[Any]) -> int:
    """Messages in the queue's table (due, in flight or delayed)."""
    table = sql.Identifier("pgmq", f"q_{QUEUE}")
    row = db.execute(sql.SQL("SELECT count(*) FROM {}").format(table)).fetchone()
    return int(row[0]) if row else 0


def account(
    config: ChaosConfig, result: ChaosResult, published: list[int], task_ids: list[str]
) -> None:
    """Fill in the database's account of a counting run (see the module docstring)."""
    with psycopg.connect(config.broker_url, autocommit=True) as db:
        row = db.execute("SELECT n FROM chaos_counter WHERE id = 1").fetchone()
        result.counter = None if row is None else int(row[0])
        per_n = Counter(
            {
                int(n): int(c)
                for n, c in db.execute("SELECT n, count(*) FROM chaos_applied GROUP BY n")
            }
        )
        result.queue_left = _queue_left(db)
        if config.task in WITH_RESULTS:
            keys = {f"celery-task-meta-{task_ids[n]}": n for n in published}
            states = dict(
                db.execute(
                    "SELECT key, state FROM kombu_pgmq.results WHERE key = ANY(%s)", (list(keys),)
                ).fetchall()
            )
            by_state: Counter[str] = Counter()
            for key, n in keys.items():
                state = states.get(key, "MISSING")
                by_state[state] += 1
                if state != "SUCCESS" and len(result.results_not_success) < 20:
                    result.results_not_success.append(f"{n}:{task_ids[n]}:{state}")
            result.results = dict(by_state)
    result.applied_rows = sum(per_n.values())
    result.applied_distinct = len(per_n)
    result.applied_duplicates = result.applied_rows - result.applied_distinct
    result.applied_twice_sample = sorted(n for n, c in per_n.items() if c > 1)[:20]
    unapplied = sorted(set(published) - per_n.keys())
    result.unapplied = len(unapplied)
    result.unapplied_sample = unapplied[:20]


def duplicate_gaps(path: Path, kill_times: list[float]) -> list[float]:
    """For each task that ran more than once: how long before the next SIGKILL its first
    run ended (ms): the window in which a finished task's ack had not reached the broker.
    Uses the end time of the executions file's lines (``n,pid,task_id,time``); tasks whose
    first run no kill followed within 10 s are left out."""
    first: dict[str, float] = {}
    seen: Counter[str] = Counter()
    with contextlib.suppress(FileNotFoundError):
        for line in path.read_text().splitlines():
            fields = line.split(",")
            if len(fields) >= 4 and fields[0].isdigit():
                seen[fields[0]] += 1
                first.setdefault(fields[0], float(fields[3]))
    gaps = []
    for n, count in seen.items():
        later = [k for k in kill_times if 0 <= k - first[n] < 10]
        if count > 1 and later:
            gaps.append(round((min(later) - first[n]) * 1000, 2))
    return sorted(gaps)
