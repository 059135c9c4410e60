"""Celery result backends compared, same run: kombu_pgmq's vs Redis vs Celery's SQLAlchemy.

Usage::

    python benchmarks/results_backend.py [--broker postgresql://postgres@127.0.0.1:5432/kpb_results]
        [--backend NAME=URL ...] [--rounds 2] [--gets 300] [--group 1000] [--chord 1000]
        [--writes 1000 --writers 4] [--million 1000000] [--json PATH]

Default result backends (``--backend`` replaces the list):

* ``kombu_pgmq``  ``postgresql://`` + the broker's database (this project)
* ``redis``       ``redis://127.0.0.1:6379/3``
* ``sqlalchemy``  ``db+postgresql+psycopg://`` + the broker's database (Celery's
  ``DatabaseBackend``, what ``examples/celeryapp.py`` used before issue 27)

The broker is kombu_pgmq in every row (``--broker``; the database is created if missing).
For each round and backend (backends interleaved within a round): the queue is purged, a
worker ``celery -A results_backend_app worker -P prefork -c 2`` is started and warmed up
(one ``add`` whose result is read), then, from this process:

1. ``get()`` round trip: ``--gets`` times ``add.delay(i, i).get()``, one after the other;
   p50/p90/p99 ms (all rounds pooled).
2. group: ``group(add.s(i, i) for i in range(--group)).apply_async().get()``: seconds
   from the call to the list of results.
3. chord: ``chord(add.s(i, i) for i in range(--chord))(tsum.s()).get()``: seconds from
   the call to the sum (checked).

Then, per backend, once: results written/s by ``--writers`` processes, each calling
``app.backend.store_result(uuid, i, "SUCCESS")`` ``--writes`` times (spawned processes,
one warm-up write each, a barrier, then the timed loop: what a worker's pool process does
after a task, without the broker); rate = all writes / (last end - first start).

For ``kombu_pgmq`` also: ``--million`` typical results (the meta our backend stores for an
``add`` result, with its own key each) inserted by one ``INSERT ... SELECT
generate_series`` already expired; ``pg_total_relation_size('kombu_pgmq.results')``
(table, index, TOAST) after ``VACUUM ANALYZE``; then ``backend.cleanup()`` (what
``celery.backend_cleanup`` and the worker's sweep run: ``results_expire`` batches of
``expire_batch`` = 5,000) is timed until the table is empty.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import multiprocessing
import os
import platform
import statistics
import sys
import time
import traceback
import uuid
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(REPO_ROOT))

import celery  # noqa: E402
import celery_bench  # noqa: E402
import psycopg  # noqa: E402
import results_backend_app  # noqa: E402
from brokers import dist_version, ensure_database, git_describe, pg_dsn, pg_version  # noqa: E402
from celery import chord, group  # noqa: E402
from kombu.utils.url import maybe_sanitize_url  # noqa: E402

DEFAULT_BROKER = "postgresql://postgres@127.0.0.1:5432/kpb_results"
GET_TIMEOUT_S = 300.0


def default_backends(broker: str) -> dict[str, str]:
    rest = broker.split("://", 1)[1]
    return {
        "kombu_pgmq": broker,
        "redis": "redis://127.0.0.1:6379/3",
        "sqlalchemy": f"db+postgresql+psycopg://{rest}",
    }


# -- worker -------------------------------------------------------------------------------


class Worker(celery_bench.Worker):
    """celery_bench's worker, on results_backend_app."""

    app_module = "results_backend_app"
    node_prefix = "rb"

    def __init__(self, name: str, broker: str, backend: str, out: Path, concurrency: int = 2):
        self.name = name
        self.env = self.environment(
            {"RESULTS_BENCH_BROKER": broker, "RESULTS_BENCH_BACKEND": backend}
        )
        self.out = out
        self.concurrency = concurrency
        self.proc = None


def percentiles(samples: list[float]) -> dict[str, float | int]:
    ordered = sorted(samples)

    def pick(q: float) -> float:
        return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 2)

    return {
        "n": len(ordered),
        "p50_ms": pick(0.50),
        "p90_ms": pick(0.90),
        "p99_ms": pick(0.99),
        "max_ms": round(ordered[-1], 2),
    }


# -- one round of one backend -------------------------------------------------------------


def run_round(name: str, broker: str, backend: str, args: argparse.Namespace, workdir: Path):
    app = results_backend_app.create_app(broker, backend)
    add, tsum = app.tasks["rb.add"], app.tasks["rb.tsum"]
    with app.connection_for_write() as conn:
        conn.default_channel.queue_purge(results_backend_app.QUEUE)
    worker = Worker(name, broker, backend, workdir / f"worker-{name}.log")
    worker.start()
    out: dict[str, Any] = {}
    try:
        add.delay(0, 0).get(timeout=120)  # worker ready, connections made
        time.sleep(1.0)
        lat = []
        for i in range(args.gets):
            t0 = time.perf_counter()
            value = add.delay(i, i).get(timeout=GET_TIMEOUT_S)
            lat.append((time.perf_counter() - t0) * 1000)
            assert value == 2 * i, value
        out["get_ms"] = lat

        t0 = time.perf_counter()
        values = (
            group(add.s(i, i) for i in range(args.group)).apply_async().get(timeout=GET_TIMEOUT_S)
        )
        out["group_s"] = round(time.perf_counter() - t0, 3)
        assert values == [2 * i for i in range(args.group)]

        t0 = time.perf_counter()
        total = chord(add.s(i, i) for i in range(args.chord))(tsum.s()).get(timeout=GET_TIMEOUT_S)
        out["chord_s"] = round(time.perf_counter() - t0, 3)
        assert total == args.chord * (args.chord - 1), total
    finally:
        worker.stop()
        app.close()
    return out


# -- results written/s by N processes -----------------------------------------------------


def _writer(broker: str, backend: str, n: int, barrier: Any, queue: Any) -> None:
    try:
        app = results_backend_app.create_app(broker, backend)
        be = app.backend
        be.store_result(uuid.uuid4().hex, 0, "SUCCESS")  # connect, tables
        ids = [str(uuid.uuid4()) for _ in range(n)]
        barrier.wait(timeout=120)
        start = time.time()
        for i, task_id in enumerate(ids):
            be.store_result(task_id, i, "SUCCESS")
        queue.put(("ok", start, time.time()))
    except BaseException as exc:  # reported by the parent
        queue.put(("error", repr(exc), traceback.format_exc()))


def write_rate(broker: str, backend: str, writers: int, n: int) -> dict[str, Any]:
    ctx = multiprocessing.get_context("spawn")
    barrier, queue = ctx.Barrier(writers), ctx.Queue()
    procs = [
        ctx.Process(target=_writer, args=(broker, backend, n, barrier, queue))
        for _ in range(writers)
    ]
    for p in procs:
        p.start()
    got = [queue.get(timeout=600) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    errors = [g for g in got if g[0] != "ok"]
    if errors:
        raise RuntimeError(f"writer failed: {errors[0][1]}\n{errors[0][2]}")
    start, end = min(g[1] for g in got), max(g[2] for g in got)
    return {
        "writers": writers,
        "writes": writers * n,
        "seconds": round(end - start, 3),
        "per_s": round(writers * n / (end - start)),
    }


# -- 1M results: size on disk and expiry --------------------------------------------------


def million(broker: str, backend: str, count: int) -> dict[str, Any]:
    app = results_backend_app.create_app(broker, backend)
    be = app.backend
    dsn = pg_dsn(broker)
    assert dsn
    sample_id = str(uuid.uuid4())
    be.store_result(sample_id, 12345, "SUCCESS")
    with psycopg.connect(dsn, autocommit=True) as conn:
        meta = conn.execute(
            "SELECT convert_from(meta, 'UTF8') FROM kombu_pgmq.results WHERE key = %s",
            (be.get_key_for_task(sample_id),),
        ).fetchone()[0]
        conn.execute("DELETE FROM kombu_pgmq.results")
        empty = conn.execute("SELECT pg_total_relation_size('kombu_pgmq.results')").fetchone()[0]
        t0 = time.perf_counter()
        # the sample meta with each row's own task id; expired a second ago
        conn.execute(
            """
            INSERT INTO kombu_pgmq.results (key, state, meta, date_done, expires_at)
            SELECT 'celery-task-meta-' || id, 'SUCCESS',
                   convert_to(replace(%(meta)s, %(sample)s, id), 'UTF8'),
                   clock_timestamp(), clock_timestamp() - interval '1 second'
            FROM (SELECT gen_random_uuid()::text AS id FROM generate_series(1, %(n)s)) AS g
            """,
            {"meta": meta, "sample": sample_id, "n": count},
        )
        insert_s = time.perf_counter() - t0
        conn.execute("VACUUM ANALYZE kombu_pgmq.results")
        size = conn.execute(
            "SELECT pg_total_relation_size('kombu_pgmq.results'), "
            "pg_relation_size('kombu_pgmq.results'), pg_indexes_size('kombu_pgmq.results')"
        ).fetchone()
    t0 = time.perf_counter()
    be.cleanup()
    expire_s = time.perf_counter() - t0
    with psycopg.connect(dsn, autocommit=True) as conn:
        left = conn.execute("SELECT count(*) FROM kombu_pgmq.results").fetchone()[0]
    app.close()
    return {
        "results": count,
        "meta_bytes": len(meta.encode()),
        "sample_meta": meta,
        "insert_s": round(insert_s, 2),
        "empty_table_bytes": empty,
        "total_bytes": size[0],
        "heap_bytes": size[1],
        "index_bytes": size[2],
        "bytes_per_result": round(size[0] / count, 1),
        "expire_s": round(expire_s, 2),
        "expired_per_s": round(count / expire_s),
        "left_after_cleanup": left,
    }


# -- main ---------------------------------------------------------------------------------


def summarize(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [r for r in rounds if "error" not in r]
    out: dict[str, Any] = {"errors": [r["error"] for r in rounds if "error" in r]}
    if ok:
        out["get"] = percentiles([x for r in ok for x in r["get_ms"]])
        out["get"]["round_p50_ms"] = [round(statistics.median(r["get_ms"]), 2) for r in ok]
        out["group_s"] = [r["group_s"] for r in ok]
        out["chord_s"] = [r["chord_s"] for r in ok]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--broker", default=DEFAULT_BROKER)
    parser.add_argument("--backend", action="append", default=[], metavar="NAME=URL")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--gets", type=int, default=300)
    parser.add_argument("--group", type=int, default=1000)
    parser.add_argument("--chord", type=int, default=1000)
    parser.add_argument("--writes", type=int, default=1000, help="per writer process")
    parser.add_argument("--writers", type=int, default=4)
    parser.add_argument("--million", type=int, default=1_000_000)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    backends = (
        dict(b.split("=", 1) for b in args.backend)
        if args.backend
        else default_backends(args.broker)
    )
    dsn = pg_dsn(args.broker)
    assert dsn, "the broker must be kombu_pgmq's postgresql:// URL"
    ensure_database(dsn)
    workdir = Path(os.environ.get("TMPDIR", "/tmp")) / f"results_bench_{os.getpid()}"
    workdir.mkdir(parents=True, exist_ok=True)
    load_start = os.getloadavg()

    per_round: dict[str, list[dict[str, Any]]] = {name: [] for name in backends}
    for rnd in range(args.rounds):
        for name, url in backends.items():
            print(f"round {rnd + 1}: {name}", flush=True)
            try:
                res = run_round(name, args.broker, url, args, workdir)
                print(
                    f"  get p50 {statistics.median(res['get_ms']):.1f} ms, group "
                    f"{res['group_s']} s, chord {res['chord_s']} s",
                    flush=True,
                )
            except Exception as exc:
                traceback.print_exc()
                res = {"error": repr(exc)}
            per_round[name].append(res)

    results: dict[str, Any] = {name: summarize(rounds) for name, rounds in per_round.items()}
    for name, url in backends.items():
        if args.writes:
            print(f"writes: {name}", flush=True)
            try:
                results[name]["writes"] = write_rate(args.broker, url, args.writers, args.writes)
                print(f"  {results[name]['writes']}", flush=True)
            except Exception as exc:
                traceback.print_exc()
                results[name]["writes"] = {"error": repr(exc)}
    if args.million and "kombu_pgmq" in backends:
        print(f"{args.million:,} results: size and expiry", flush=True)
        results["kombu_pgmq"]["million"] = million(
            args.broker, backends["kombu_pgmq"], args.million
        )
        print(f"  {results['kombu_pgmq']['million']}", flush=True)

    report = {
        "environment": {
            "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "python": platform.python_version(),
            "celery": celery.__version__,
            "kombu": dist_version("kombu"),
            "kombu_pgmq": git_describe(),
            "postgresql": pg_version(dsn),
            "sqlalchemy": dist_version("sqlalchemy"),
            "redis_py": dist_version("redis"),
            "broker": maybe_sanitize_url(args.broker),
            "backends": {n: maybe_sanitize_url(u) for n, u in backends.items()},
            "worker": "prefork -c 2",
            "args": {k: v for k, v in vars(args).items() if k not in ("json", "backend", "broker")},
            "loadavg_start": [round(x, 2) for x in load_start],
            "loadavg_end": [round(x, 2) for x in os.getloadavg()],
            "cpus": os.cpu_count(),
        },
        "results": results,
        "rounds": {
            name: [{k: v for k, v in r.items() if k != "get_ms"} for r in rounds]
            for name, rounds in per_round.items()
        },
    }
    text = json.dumps(report, indent=1)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text + "\n")
    print(table(report))


def table(report: dict[str, Any]) -> str:
    res = report["results"]
    redis = res.get("redis", {})
    lines = [
        "| result backend | get() p50 / p90 / p99 ms | group of "
        f"{report['environment']['args']['group']:,} s | chord of "
        f"{report['environment']['args']['chord']:,} → sum s | results written/s, "
        f"{report['environment']['args']['writers']} processes |",
        "|---|---|---|---|---|",
    ]
    for name, r in res.items():
        if "get" not in r:
            lines.append(f"| {name} | error: {r.get('errors')} | | | |")
            continue
        g = r["get"]
        w = r.get("writes") or {}
        lines.append(
            f"| {name} | {g['p50_ms']} / {g['p90_ms']} / {g['p99_ms']} | "
            f"{', '.join(str(x) for x in r['group_s'])} | "
            f"{', '.join(str(x) for x in r['chord_s'])} | "
            f"{w.get('per_s', w.get('error', '-'))} |"
        )
    ours = res.get("kombu_pgmq", {})
    if "get" in ours and "get" in redis:
        lines.append("")
        lines.append(
            f"Ratios to Redis (medians): get() p50 "
            f"{ours['get']['p50_ms'] / redis['get']['p50_ms']:.2f}x (goal <= 1.2), chord "
            f"{statistics.median(ours['chord_s']) / statistics.median(redis['chord_s']):.2f}x "
            "(goal <= 1.5)"
        )
        sqla = res.get("sqlalchemy", {})
        if "chord_s" in sqla:
            lines.append(
                f"SQLAlchemy chord / ours: "
                f"{statistics.median(sqla['chord_s']) / statistics.median(ours['chord_s']):.1f}x "
                "(goal >= 10)"
            )
    m = ours.get("million")
    if m:
        lines.append(
            f"\n{m['results']:,} results ({m['meta_bytes']} B meta each): "
            f"{m['total_bytes'] / 2**20:,.0f} MiB on disk ({m['bytes_per_result']} B per result; "
            f"heap {m['heap_bytes'] / 2**20:,.0f} MiB, "
            f"indexes {m['index_bytes'] / 2**20:,.0f} MiB); "
            f"expired by backend.cleanup() in {m['expire_s']} s ({m['expired_per_s']:,}/s)"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
