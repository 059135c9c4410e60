"""Fleet-wide limits (issue 29) with Celery: backlog drain with limits that never bind vs
no limit, and with 10,000 keys, on a private PostgreSQL 15 with ``pg_stat_statements``.

Usage::

    python benchmarks/limits_celery.py [--backlog 10000] [--rounds 3] [--keys 10000] \
        [--cases none concurrency rate keys] [--json benchmarks/results/limits_celery.json]

One throwaway server (see :mod:`limits`: this machine's PostgreSQL 15, fsync and
synchronous commit on), one database per case, and :mod:`celery_bench` run once over all
cases (latency, then ``--rounds`` backlog rounds interleaved): a Celery worker (prefork
2) drains ``--backlog`` noop tasks, each with header ``x-limit-key`` (one of ``--keys``).
Cases, transport option ``queue_limits`` of queue ``celery_bench``:

* ``none``: no limit;
* ``concurrency``: ``{"concurrency": 1000000}`` (never binds);
* ``rate``: ``{"rate": "1000000/s"}`` (never binds);
* ``keys``: ``{"key_concurrency": 1000000}`` over ``--keys`` keys (never binds; the keyed
  read, through ``kombu_pgmq.read``).

Reported per case: celery_bench's backlog tasks/s (median) and its ratio to ``none``, the
latency p50/p99, and the read statement's mean server time and calls
(``pg_stat_statements``: ``read_queue``, the queue's read function, or ``kombu_pgmq.read``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import limits  # noqa: E402

CASES: dict[str, dict[str, Any] | None] = {
    "none": None,
    "concurrency": {"concurrency": 1_000_000},
    "rate": {"rate": "1000000/s"},
    "keys": {"key_concurrency": 1_000_000},
}


def _read_statements(url: str) -> dict[str, dict[str, float]]:
    with psycopg.connect(url, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT query, calls, mean_exec_time FROM pg_stat_statements s"
            " JOIN pg_database d ON d.oid = s.dbid AND d.datname = current_database()"
            " WHERE query LIKE '%%FROM kombu_pgmq.read(%%' OR query LIKE '%%\"read\\_q\\_%%'"
        ).fetchall()
    out: dict[str, dict[str, float]] = {}
    for query, calls, mean in rows:
        kind = "read_queue" if '"read_q_' in query else "kombu_pgmq.read"
        got = out.setdefault(kind, {"calls": 0, "mean_ms": 0.0})
        total = got["calls"] * got["mean_ms"] + calls * mean
        got["calls"] += calls
        got["mean_ms"] = round(total / got["calls"], 3)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backlog", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--keys", type=int, default=10_000)
    parser.add_argument("--latency-tasks", type=int, default=100)
    parser.add_argument("--cases", nargs="*", default=list(CASES))
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    server = limits._start_server()
    try:
        socket_dir = server.dsn.split("host=", 1)[1]

        def url(db: str) -> str:
            return f"postgresql://postgres@/{db}?host={socket_dir}"

        with psycopg.connect(server.dsn, autocommit=True) as conn:
            for case in args.cases:
                conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(f"lim_{case}")))
        for case in args.cases:
            with psycopg.connect(url(f"lim_{case}"), autocommit=True) as conn:
                conn.execute("CREATE EXTENSION pg_stat_statements")
        out = Path(tempfile.mkdtemp(prefix="limits_celery-")) / "bench.json"
        cmd = [sys.executable, str(HERE / "celery_bench.py")]
        for case in args.cases:
            cmd += ["--broker", f"{case}={url(f'lim_{case}')}"]
            each = CASES[case]
            options = {"queue_limits": {"celery_bench": each}} if each else {}
            cmd += ["--options", f"{case}={json.dumps(options)}"]
        cmd += ["--backlog", str(args.backlog), "--backlog-rounds", str(args.rounds)]
        cmd += ["--latency-tasks", str(args.latency_tasks), "--limit-keys", str(args.keys)]
        cmd += ["--json", str(out)]
        subprocess.run(cmd, check=True)
        bench = json.loads(out.read_text())
        results = bench["results"]
        base = results.get("none", {}).get("backlog", {}).get("tasks_per_s")
        report = []
        for case in args.cases:
            backlog = results[case].get("backlog", {})
            latency = results[case].get("latency", {})
            rate = backlog.get("tasks_per_s")
            row = {
                "case": case,
                "queue_limits": CASES[case],
                "backlog_tasks_per_s": rate,
                "vs_none": round(rate / base, 3) if rate and base else None,
                "round_tasks_per_s": backlog.get("round_tasks_per_s"),
                "latency_p50_ms": latency.get("p50_ms"),
                "latency_p99_ms": latency.get("p99_ms"),
                "read_statements": _read_statements(url(f"lim_{case}")),
            }
            report.append(row)
            print(json.dumps(row))
        if args.json:
            meta = bench.get("environment", {})
            payload = {"benchmark": "limits with Celery", "keys": args.keys, "meta": meta}
            args.json.write_text(json.dumps({**payload, "results": report}, indent=2) + "\n")
    finally:
        server.stop()


if __name__ == "__main__":
    main()
