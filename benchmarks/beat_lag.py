"""Beat: due time to publish lag with N entries due in the same second, and what an idle
and a busy tick cost (CPU, statements).

Usage::

    python benchmarks/beat_lag.py [--url postgresql://postgres@127.0.0.1:5432/kpb_beat]
        [--entries 1000 10000] [--rounds 3] [--idle-seconds 10] [--json PATH]

For each N: a fresh schedule of N interval entries (every 3600 s) whose next due time is
the same instant (``last_run_at`` set by SQL, 3 s ahead), one
:class:`kombu_pgmq.beat.Scheduler` leading in this process (``tick()`` in a loop, as
``celery beat`` runs it), broker kombu_pgmq in the same database. The lag of a tick is
from its due time to the commit of the transaction that claimed and published it (the
moment workers can see it), measured in the scheduler right after the commit
(``_advance``). Reported: p50/p90/p99/max ms, how long the whole burst took, and the
statements the burst sent (counted in this process: psycopg's execute).

Idle: the leader with N entries none due for ``--idle-seconds``: process CPU seconds per
second and statements per second (election rounds and waits only).
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import psycopg

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from brokers import ensure_database  # noqa: E402

DEFAULT_URL = "postgresql://postgres@127.0.0.1:5432/kpb_beat"


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    k = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[k]


def _app(url: str, lookahead: float) -> Any:
    from celery import Celery

    app = Celery("beat_lag", broker=url)
    app.conf.beat_lookahead_seconds = lookahead
    app.conf.beat_schedule = {}
    app.conf.result_backend = None
    app.conf.result_expires = None
    return app


class _Counter:
    """Statements this process sends (psycopg ``Cursor.execute`` and ``Connection.execute``,
    by the first words of their text): pg_stat_statements needs a server restart."""

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}
        for cls in (psycopg.Cursor, psycopg.Connection):
            original = cls.execute

            def execute(obj: Any, query: Any, *a: Any, _original: Any = original, **k: Any) -> Any:
                text = query.as_string(None) if hasattr(query, "as_string") else query
                text = text.decode() if isinstance(text, bytes) else str(text)
                key = " ".join(text.split())[:60]
                self.calls[key] = self.calls.get(key, 0) + 1
                return _original(obj, query, *a, **k)

            cls.execute = execute  # type: ignore[method-assign]

    def take(self) -> dict[str, int]:
        calls, self.calls = self.calls, {}
        return dict(sorted(calls.items(), key=lambda kv: -kv[1]))


COUNTER: _Counter | None = None


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _fresh_schedule(url: str, n: int, due: datetime) -> None:
    from kombu_pgmq.beat import PeriodicTasks

    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("SELECT 1 FROM pg_namespace WHERE nspname = 'kombu_pgmq'")
    with PeriodicTasks(url, check_queues=False) as tasks:
        tasks.store.db.execute("beat_list")  # installs the schema when missing
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("DELETE FROM kombu_pgmq.beat_entries")
        conn.execute("DELETE FROM kombu_pgmq.beat_ticks")
        conn.execute(
            "INSERT INTO kombu_pgmq.beat_entries (name, task, schedule_kind, schedule, args,"
            " last_run_at) SELECT 'e' || i, 'beat_lag.noop', 'interval',"
            ' \'{"every": 3600, "relative": false}\', jsonb_build_array(i), %s'
            " FROM generate_series(1, %s) i",
            (due - timedelta(seconds=3600), n),
        )
        conn.execute(
            "SELECT pgmq.purge_queue('celery') WHERE EXISTS "
            "(SELECT 1 FROM pgmq.meta WHERE queue_name = 'celery')"
        )


def burst(url: str, n: int, lookahead: float = 0.0) -> dict[str, Any]:
    from kombu_pgmq.beat import Scheduler

    lags: list[float] = []

    class Measured(Scheduler):
        def _advance(self, entry: Any, claim: Any) -> None:
            lags.append((datetime.now(timezone.utc) - claim.due_at).total_seconds() * 1000)
            super()._advance(entry, claim)

    due = datetime.now(timezone.utc) + timedelta(seconds=4 + lookahead)
    _fresh_schedule(url, n, due)
    app = _app(url, lookahead)
    scheduler = Measured(app)
    try:
        while not scheduler.leader.is_leader:  # lead, load, publish one message (declares)
            scheduler.tick()
        scheduler.tick()
        assert COUNTER is not None
        COUNTER.take()
        cpu0, t0 = _cpu(), time.monotonic()
        deadline = due + timedelta(seconds=120)
        while len(lags) < n and datetime.now(timezone.utc) < deadline:
            wait = scheduler.tick()
            if wait:
                time.sleep(wait)
        elapsed = time.monotonic() - t0
        cpu = _cpu() - cpu0
        top = COUNTER.take()
        # idle: nothing due for a while
        idle_cpu0, idle_t0 = _cpu(), time.monotonic()
        while time.monotonic() - idle_t0 < ARGS.idle_seconds:
            wait = scheduler.tick()
            if wait:
                time.sleep(wait)
        idle_elapsed = time.monotonic() - idle_t0
        idle_cpu = _cpu() - idle_cpu0
        idle_top = COUNTER.take()
    finally:
        scheduler.close()
    with psycopg.connect(url, autocommit=True) as conn:
        queued = conn.execute("SELECT count(*) FROM pgmq.q_celery").fetchone()[0]
    visible = [max(lag, 0.0) for lag in lags]  # a tick published ahead shows at its due time
    return {
        "entries": n,
        "lookahead_seconds": lookahead,
        "visible_lag_ms": {
            "p50": _percentile(visible, 0.5),
            "p99": _percentile(visible, 0.99),
            "max": max(visible) if visible else None,
        },
        "sent": len(lags),
        "queued": queued,
        "lag_ms": {
            "p50": _percentile(lags, 0.5),
            "p90": _percentile(lags, 0.9),
            "p99": _percentile(lags, 0.99),
            "max": max(lags) if lags else None,
        },
        "burst_cpu_s": round(cpu, 3),
        "burst_wall_s": round(elapsed, 3),
        "burst_statements": sum(top.values()),
        "burst_statement_kinds": top,
        "idle_cpu_per_s": round(idle_cpu / idle_elapsed, 5),
        "idle_statements_per_s": round(sum(idle_top.values()) / idle_elapsed, 2),
        "idle_statements": idle_top,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", default=DEFAULT_URL)
    parser.add_argument("--entries", type=int, nargs="+", default=[1000, 10000])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--idle-seconds", type=float, default=10.0)
    parser.add_argument(
        "--lookahead-seconds", type=float, nargs="+", default=[0.0],
        help="beat_lookahead_seconds values to run (0: publish at the due time)",
    )  # fmt: skip
    parser.add_argument("--json", type=Path)
    global ARGS
    ARGS = parser.parse_args()
    ensure_database(ARGS.url)
    global COUNTER
    COUNTER = _Counter()
    results = []
    for lookahead in ARGS.lookahead_seconds:
        for n in ARGS.entries:
            for r in range(ARGS.rounds):
                res = burst(ARGS.url, n, lookahead)
                res["round"] = r + 1
                results.append(res)
                _print(res)
    if ARGS.json:
        ARGS.json.write_text(json.dumps(results, indent=2, default=str) + "\n")


def _print(res: dict[str, Any]) -> None:
    n, lag, vis = res["entries"], res["lag_ms"], res["visible_lag_ms"]
    print(
        f"lookahead={res['lookahead_seconds']} entries={n} round={res['round']}: sent "
        f"{res['sent']} (queued {res['queued']}), visible p50 {vis['p50']:.1f} p99 "
        f"{vis['p99']:.1f} ms, commit lag p50 {lag['p50']:.1f} p99 {lag['p99']:.1f} ms; "
        f"burst {res['burst_wall_s']} s wall, {res['burst_cpu_s']} s CPU, "
        f"{res['burst_statements']} statements; idle {res['idle_cpu_per_s']} CPU s/s, "
        f"{res['idle_statements_per_s']} statements/s",
        flush=True,
    )


ARGS: Any = None

if __name__ == "__main__":
    main()
