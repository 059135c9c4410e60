"""Fault injection: tasks published while Celery workers are SIGKILLed and the broker
crashes; every message accounted for.

:func:`run` is the engine of ``benchmarks/chaos.py`` (full size, several brokers, by hand)
and of ``tests/e2e/test_chaos.py`` (small, in CI). One run:

1. ``workers`` Celery workers (prefork, ``concurrency`` processes each,
   :mod:`tests.e2e.chaos_app`: ``acks_late``, ``reject_on_worker_lost``) consume queue
   ``chaos``, emptied first.
2. A publisher thread sends ``tasks`` tasks ``chaos.work(n)``, each ``apply_async`` with
   kombu's retry (a publish that fails on a lost connection is retried after a
   reconnect); ``published`` are the ``n`` whose ``apply_async`` returned.
3. Meanwhile a chaos thread SIGKILLs a worker (its whole process group: the parent and
   its pool processes, as a machine or container dying) every ``kill_every_s`` seconds
   and starts it again at once, until the publisher is done and ``kill_tail_s`` more
   seconds passed; once ``crash_after_fraction`` of the tasks are published it calls
   ``crash()`` (for PostgreSQL: ``pg_ctl stop -m immediate``, a few seconds down,
   ``pg_ctl start``: crash recovery).
4. Then it waits (up to ``settle_timeout_s``) until every published task ran, and stops
   the workers (warm shutdown).

Counts: ``published``; ``executed`` (lines: task bodies that ran to their end);
``distinct``; ``lost`` = published but never executed (must be 0); ``duplicates`` =
executed lines beyond the first of their task (at least once: each is a redelivery of
a message whose ack did not land, e.g. its worker was killed after the task ran and
before the ack committed, or the database crashed with asynchronously committed acks;
``duplicate_gaps_ms``: how long before the next kill each one's first run ended);
``executed_unpublished``: executed though their ``apply_async`` raised (an ambiguous
publish: committed, but the answer was lost).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tests.e2e.helpers import REPO_ROOT, Worker

QUEUE = "chaos"
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
    the workers or the broker do (failures land in ``errors``)."""
    from tests.e2e.chaos_app import create_app

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
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")])),
        PYTHONUNBUFFERED="1",
    )
    app = create_app(env)
    result = ChaosResult(workdir=str(workdir))
    rng = random.Random(config.seed)
    workers: list[Worker] = []
    published: list[int] = []
    failed: list[int] = []

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
        work = app.tasks["chaos.work"]
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
                                (n,), producer=producer, retry=True, retry_policy=retry_policy
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
        while config.kill_every_s > 0:
            time.sleep(config.kill_every_s)
            if done.is_set():
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
            runs = executions(log)
            if wanted <= runs.keys() or time.monotonic() > deadline:
                break
            for slot, worker in enumerate(workers):
                if not worker.alive():  # a worker that gave up: count it, start another
                    result.errors.append(f"worker {slot} exited with {worker.proc.returncode}")
                    workers[slot] = new_worker(slot)
            time.sleep(0.2)
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
    return result


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
