"""Throughput of a task that writes one row: plain ``acks_late`` against
``kombu_pgmq.AtomicTask`` (the row, the result and the ack in one transaction), same run.

Usage::

    python benchmarks/atomic_bench.py [--broker postgresql://postgres@127.0.0.1:5432/kpb_atomic]
        [--tasks 3000] [--rounds 3] [--no-results] [--json PATH] [--keep] [-v]

The broker is kombu_pgmq (``--broker``; the database is created if missing) and so is the
result backend (``postgresql://``: the broker's database). Two task kinds on one app
(``atomic_bench_app``), each inserting one row into ``atomic_bench_rows``:

* ``plain``: ``acks_late=True``, the INSERT on the pool process's own psycopg connection
  (autocommit); Celery stores the result after the body, the worker's main process acks.
* ``atomic``: ``base=kombu_pgmq.AtomicTask``, the same INSERT through ``self.db``; the
  row, the result and the ack commit in one transaction.

``--no-results``: ``task_ignore_result=True`` for both (no result written).

Rounds alternate the kinds (``plain, atomic, plain, atomic, ...``: ``--rounds`` of each).
One round: queue purged, ``atomic_bench_rows`` truncated, the queue's table and
``kombu_pgmq.transactional_acks`` vacuumed; one ``ping`` then ``--tasks`` tasks of the
round's kind published with no worker running; then a worker ``celery -A
atomic_bench_app worker -P prefork -c 2 --without-gossip --without-mingle
--without-heartbeat`` is started, and this process polls (every 20 ms) until the round's
rows are all there and the queue is empty. Rates:

* ``tasks_per_s``: tasks / (last row's ``done_at`` - the ping row's ``done_at``), both
  the server's ``clock_timestamp()`` at the INSERT: from the worker ready to the last
  task's write (as ``celery_bench.py``'s backlog).
* ``settled_per_s``: tasks / (the poll that saw every row and an empty queue - the ping
  row's ``done_at``): every ack landed too (20 ms granularity; this machine's clock
  against the server's: the server on the same host).

Checks at the end of each round (a failed one makes the round an error, so a broken path
cannot look fast): rows == tasks, one per task (distinct ``i``); the queue empty; the
results stored (``SUCCESS`` for each task id; none with ``--no-results``); messages
settled in a transaction (``kombu_pgmq.settled_in_transaction()``) up by tasks for
``atomic``, by 0 for ``plain``; no traceback, stale ack or lost lease in the worker's
output. The round's results are deleted afterwards.

Also per round: CPU seconds of the worker's main process and of its pool processes during
the drain (``/proc``), per task. Printed: each round, the median per kind and the ratio
atomic/plain of the medians (and of each pair of rounds).

Statements: when the server loads ``pg_stat_statements`` (``shared_preload_libraries``;
the extension is created in the broker's database), its counters are reset when the
worker starts and read after the drain: each round records every statement sent during
it (worker main process and pool processes; this script's polling left out) with its
calls per task and mean server time (``-v`` prints them). ``--private-server`` runs the
benchmark on a throwaway PostgreSQL 15 of this machine's (``limits.py``'s: fsync on,
``pg_stat_statements``, Unix socket only: its rates are not comparable with TCP ones).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(REPO_ROOT))

import atomic_bench_app  # noqa: E402
import celery  # noqa: E402
import kombu  # noqa: E402
import psycopg  # noqa: E402
from brokers import dist_version, ensure_database, git_describe, pg_dsn, pg_version  # noqa: E402
from celery_bench import READY_TIMEOUT_S, Worker, guarded, tail  # noqa: E402
from kombu.utils.encoding import bytes_to_str  # noqa: E402
from kombu.utils.url import maybe_sanitize_url  # noqa: E402
from profile_worker import children, cpu_seconds  # noqa: E402
from psycopg import sql  # noqa: E402

DEFAULT_BROKER = "postgresql://postgres@127.0.0.1:5432/kpb_atomic"
KINDS = ("plain", "atomic")
POLL_S = 0.02
#: Lines of a worker's output that make a round an error.
BAD_OUTPUT = ("Traceback", "stale", "lost the lease", "ERROR")


class AtomicWorker(Worker):
    """A worker of ``atomic_bench_app`` (prefork, 2 processes)."""

    app_module = "atomic_bench_app"
    node_prefix = "atomic"

    def __init__(self, name: str, url: str, results: bool, out: Path):
        self.name = name
        self.env = self.environment(
            {"ATOMIC_BENCH_BROKER": url, "ATOMIC_BENCH_RESULTS": "1" if results else "0"}
        )
        self.out = out
        self.proc = None


# -- database -------------------------------------------------------------------------------


def prepare(dsn: str) -> None:
    """The table of the task rows (the queue and kombu_pgmq's schema are made by the
    first publish)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(atomic_bench_app.ROWS_DDL)


def reset(dsn: str) -> None:
    """No rows; the queue's dead rows (a purge) and the counters' vacuumed, so every round
    starts from the same tables (the shared server runs no autovacuum)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("TRUNCATE atomic_bench_rows")
        for schema, table in (
            ("pgmq", f"q_{atomic_bench_app.QUEUE}"),
            ("kombu_pgmq", "transactional_acks"),
            ("kombu_pgmq", "results"),
        ):
            name = sql.Identifier(schema, table)
            if conn.execute("SELECT to_regclass(%s)", (name.as_string(conn),)).fetchone()[0]:
                conn.execute(sql.SQL("VACUUM {}").format(name))


def settled_in_transaction(conn: psycopg.Connection[Any]) -> int:
    row = conn.execute(
        "SELECT coalesce(sum(settled), 0) FROM kombu_pgmq.settled_in_transaction() "
        "WHERE pgmq_queue = %s",
        (atomic_bench_app.QUEUE,),
    ).fetchone()
    return int(row[0]) if row else 0


def progress(conn: psycopg.Connection[Any], kind: str) -> tuple[int, int]:
    """(rows of ``kind``, messages in the queue)."""
    row = conn.execute(
        sql.SQL(
            "SELECT (SELECT count(*) FROM atomic_bench_rows WHERE kind = %s), "
            "(SELECT count(*) FROM {})"
        ).format(sql.Identifier("pgmq", f"q_{atomic_bench_app.QUEUE}")),
        (kind,),
    ).fetchone()
    assert row is not None
    return int(row[0]), int(row[1])


# -- one round ------------------------------------------------------------------------------


def statements_available(dsn: str) -> bool:
    """Whether the server loads pg_stat_statements (then the extension is made here)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        loaded = conn.execute("SHOW shared_preload_libraries").fetchone()
        if loaded is None or "pg_stat_statements" not in loaded[0]:
            return False
        conn.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
    return True


#: Every statement of this database since the last reset but this script's polling.
_STATEMENTS = """
SELECT calls, mean_exec_time, rows, regexp_replace(left(query, 120), '\\s+', ' ', 'g')
FROM pg_stat_statements
WHERE dbid = (SELECT oid FROM pg_database WHERE datname = current_database())
  AND query NOT LIKE 'SELECT (SELECT count(*) FROM atomic_bench_rows%%'
  AND query NOT LIKE '%%pg_stat_statements%%'
ORDER BY calls DESC
"""


def statements(conn: psycopg.Connection[Any], n: int) -> dict[str, Any]:
    """Calls per task of each statement since the reset, and their sum."""
    rows = conn.execute(_STATEMENTS).fetchall()
    listed = [
        {
            "per_task": round(calls / n, 3),
            "calls": calls,
            "mean_ms": round(mean, 3),
            "rows": rows_,
            "query": query,
        }
        for calls, mean, rows_, query in rows
    ]
    return {"per_task": round(sum(r["calls"] for r in listed) / n, 2), "statements": listed}


def run_round(
    app, url: str, dsn: str, kind: str, n: int, results: bool, workdir: Path, count: bool
) -> dict:
    app.control.purge()
    reset(dsn)
    out = workdir / f"{kind}-{time.monotonic_ns()}.out"
    worker = AtomicWorker(kind, url, results, out)
    task = app.tasks[f"ab.{kind}"]
    with psycopg.connect(dsn, autocommit=True) as conn:
        settled_before = settled_in_transaction(conn)
        t0 = time.monotonic()
        app.tasks["ab.ping"].apply_async()
        ids = [task.apply_async((i,)).id for i in range(n)]
        publish_s = time.monotonic() - t0
        if count:
            conn.execute("SELECT pg_stat_statements_reset()")
        worker.start()
        assert worker.proc is not None
        main_pid = worker.proc.pid
        cpu = {"main": 0.0, "pool": {}}
        deadline = time.monotonic() + READY_TIMEOUT_S + max(120.0, n / 10)
        try:
            while True:
                cpu["main"] = cpu_seconds(main_pid) or cpu["main"]
                for child in children(main_pid):
                    cpu["pool"][child] = cpu_seconds(child) or cpu["pool"].get(child, 0.0)
                rows, queued = progress(conn, kind)
                if rows >= n and queued == 0:
                    settled_at = time.time()
                    break
                worker.check_alive()
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{rows} rows of {n}, {queued} messages queued")
                time.sleep(POLL_S)
        finally:
            code = worker.stop()
        sent = statements(conn, n) if count else None  # before this script's checks
        output = tail(out, 100_000)
        timing = conn.execute(
            "SELECT extract(epoch FROM min(done_at) FILTER (WHERE kind = 'ping')), "
            "extract(epoch FROM max(done_at) FILTER (WHERE kind = %s)), "
            "count(*) FILTER (WHERE kind = %s), count(DISTINCT i) FILTER (WHERE kind = %s) "
            "FROM atomic_bench_rows",
            (kind, kind, kind),
        ).fetchone()
        assert timing is not None
        ready, last, rows, distinct = float(timing[0]), float(timing[1]), timing[2], timing[3]
        _, queued = progress(conn, kind)
        keys = [bytes_to_str(app.backend.get_key_for_task(task_id)) for task_id in ids]
        stored = conn.execute(
            "SELECT count(*) FROM kombu_pgmq.results WHERE key = ANY(%s) AND state = 'SUCCESS'",
            (keys,),
        ).fetchone()[0]
        settled = settled_in_transaction(conn) - settled_before
        conn.execute("DELETE FROM kombu_pgmq.results WHERE key = ANY(%s)", (keys,))
    pool_cpu = sum(cpu["pool"].values())
    result = {
        "kind": kind,
        "tasks": n,
        "publish_s": round(publish_s, 3),
        "drain_s": round(last - ready, 3),
        "tasks_per_s": round(n / (last - ready), 1),
        "settled_s": round(settled_at - ready, 3),
        "settled_per_s": round(n / (settled_at - ready), 1),
        "cpu_s": {"worker_main": round(cpu["main"], 2), "pool_processes": round(pool_cpu, 2)},
        "pool_cpu_ms_per_task": round(1000 * pool_cpu / n, 3),
        "worker_exit_code": code,
        "checks": {
            "rows": rows,
            "distinct": distinct,
            "queued": queued,
            "results_stored": stored,
            "settled_in_transaction": settled,
        },
    }
    if sent is not None:
        result["statements"] = sent
    expected = {
        "rows": n,
        "distinct": n,
        "queued": 0,
        "results_stored": n if results else 0,
        "settled_in_transaction": n if kind == "atomic" else 0,
    }
    checks = result["checks"]
    wrong = [f"{k} {checks[k]} (expected {v})" for k, v in expected.items() if checks[k] != v]
    bad = [line for line in output.splitlines() if any(b in line for b in BAD_OUTPUT)]
    if bad:
        wrong.append(f"worker output: {bad[:3]}")
    if wrong:
        result["error"] = "check failed: " + "; ".join(wrong)
    return result


# -- summary --------------------------------------------------------------------------------


def median(runs: list[dict], key: str, digits: int) -> float | None:
    return round(statistics.median(r[key] for r in runs), digits) if runs else None


def summarize(runs: list[dict]) -> dict:
    """Median per kind (rounds with errors left out) and the ratio atomic/plain of the
    medians, and of each pair of rounds (plain i, atomic i)."""
    out: dict[str, Any] = {}
    for kind in KINDS:
        ok = [r for r in runs if r["kind"] == kind and "error" not in r]
        out[kind] = {
            "rounds": len(ok),
            "round_tasks_per_s": [r["tasks_per_s"] for r in ok],
            "round_settled_per_s": [r["settled_per_s"] for r in ok],
            "tasks_per_s": median(ok, "tasks_per_s", 1),
            "settled_per_s": median(ok, "settled_per_s", 1),
            "pool_cpu_ms_per_task": median(ok, "pool_cpu_ms_per_task", 3),
            "errors": [r["error"] for r in runs if r["kind"] == kind and "error" in r],
        }
    plain, atomic = out["plain"]["tasks_per_s"], out["atomic"]["tasks_per_s"]
    out["ratio_atomic_plain"] = round(atomic / plain, 3) if plain and atomic else None
    pairs = zip(
        [r for r in runs if r["kind"] == "plain"],
        [r for r in runs if r["kind"] == "atomic"],
        strict=False,
    )
    out["pair_ratios"] = [
        round(a["tasks_per_s"] / p["tasks_per_s"], 3)
        for p, a in pairs
        if "error" not in p and "error" not in a
    ]
    return out


def table(runs: list[dict], summary: dict) -> str:
    head = ["round", "kind", "tasks/s", "settled/s", "pool CPU ms/task", "check"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for i, r in enumerate(runs, 1):
        if "tasks_per_s" not in r:
            lines.append(f"| {i} | {r['kind']} | ERR | | | {r.get('error')} |")
            continue
        lines.append(
            f"| {i} | {r['kind']} | {r['tasks_per_s']:,.0f} | {r['settled_per_s']:,.0f} | "
            f"{r['pool_cpu_ms_per_task']:.2f} | {r.get('error', 'ok')} |"
        )
    for kind in KINDS:
        s = summary[kind]
        if s["tasks_per_s"] is not None:
            lines.append(
                f"| median | {kind} | {s['tasks_per_s']:,.0f} | {s['settled_per_s']:,.0f} | "
                f"{s['pool_cpu_ms_per_task']:.2f} | {s['rounds']} rounds |"
            )
    ratio = summary["ratio_atomic_plain"]
    lines.append(
        f"ratio atomic/plain (medians): {ratio if ratio is not None else 'n/a'}; "
        f"per pair: {summary['pair_ratios']}"
    )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--broker", default=DEFAULT_BROKER, help="kombu_pgmq broker URL")
    parser.add_argument("--tasks", type=int, default=3000, help="tasks per round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of each kind")
    parser.add_argument(
        "--no-results", action="store_true", help="task_ignore_result=True for both kinds"
    )
    parser.add_argument(
        "--private-server",
        action="store_true",
        help="run on a throwaway PostgreSQL 15 with pg_stat_statements (statements per task)",
    )
    parser.add_argument("--json", type=Path, help="write results as JSON here")
    parser.add_argument("--keep", action="store_true", help="keep the worker output")
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args()
    server = None
    if args.private_server:
        import limits

        server = limits._start_server()
        socket_dir = server.dsn.split("host=", 1)[1]
        args.broker = f"postgresql://postgres@/kpb_atomic?host={socket_dir}"
    try:
        run(args)
    finally:
        if server is not None:
            server.stop()


def run(args: argparse.Namespace) -> None:
    """Every round (see the module docstring), then the table and the JSON."""
    dsn = pg_dsn(args.broker)
    if dsn is None:
        raise SystemExit(f"--broker must be a postgresql:// URL: {args.broker!r}")
    ensure_database(dsn)
    results = not args.no_results
    app = atomic_bench_app.create_app(args.broker, results)
    prepare(dsn)
    count = statements_available(dsn)
    env = {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "cpu_count": os.cpu_count(),
        "loadavg_start": os.getloadavg(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "celery": celery.__version__,
        "kombu": kombu.__version__,
        "kombu_pgmq_git": git_describe(),
        "postgresql": pg_version(dsn),
        "psycopg": dist_version("psycopg"),
        "broker": maybe_sanitize_url(args.broker),
        "result_backend": "postgresql:// (kombu_pgmq's, the broker's database)",
        "results": results,
        "tasks": args.tasks,
        "rounds": args.rounds,
        "worker": "prefork -c 2, --without-gossip/mingle/heartbeat",
        "private_server": args.private_server,
        "pg_stat_statements": count,
    }
    workdir = Path(tempfile.mkdtemp(prefix="atomic_bench-"))
    runs: list[dict] = []
    try:
        for _ in range(args.rounds):
            for kind in KINDS:
                run = guarded(
                    "round",
                    kind,
                    lambda kind=kind: run_round(
                        app, args.broker, dsn, kind, args.tasks, results, workdir, count
                    ),
                    args.verbose,
                )
                run.setdefault("kind", kind)
                runs.append(run)
                if args.verbose:
                    print(json.dumps(run), file=sys.stderr)
    finally:
        app.control.purge()
        app.close()
    env["loadavg_end"] = os.getloadavg()
    summary = summarize(runs)
    print(table(runs, summary))
    if args.verbose:
        for i, r in enumerate(runs, 1):
            sent = r.get("statements")
            if sent:
                print(f"\nround {i} ({r['kind']}): {sent['per_task']} statements per task")
                for each in sent["statements"]:
                    if each["per_task"] >= 0.01:
                        print(
                            f"  {each['per_task']:7.3f} {each['mean_ms']:7.3f} ms  {each['query']}"
                        )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        payload = {"environment": env, "rounds": runs, "summary": summary}
        args.json.write_text(json.dumps(payload, indent=2) + "\n")
    if args.keep:
        print(f"worker output kept in {workdir}", file=sys.stderr)
    else:
        for path in workdir.iterdir():
            path.unlink()
        workdir.rmdir()


if __name__ == "__main__":
    main()
