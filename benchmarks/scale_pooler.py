"""Scale through PgBouncer (issue 30): a 1,000,000-message backlog drained by 16, 64 and 128
consumer processes, directly and through PgBouncer in transaction mode.

Usage::

    python benchmarks/scale_pooler.py [--backlog 1000000] [--consumers 16,64,128] \
        [--pooler-from 64] [--pool-size 8] [--direct-url] [--prepared] [--max-seconds 900] \
        [--json benchmarks/results/scale_pooler.json]

A throwaway server (this machine's PostgreSQL 15 binaries, ``fsync=on``,
``pg_stat_statements``, ``max_connections`` 400) gets one queue filled with ``--backlog``
copies of one Kombu-published message (``scale.fill``). For each consumer count ``k``,
``k`` processes (Kombu ``Consumer``, prefetch 10, one ack per message, as ``scale.py``)
drain the whole backlog; the queue is filled again before the next count. From
``--pooler-from`` consumers up, their broker URL is a PgBouncer (Debian's 1.18,
``pool_mode = transaction``, ``default_pool_size = --pool-size``, started by
``tests.support.pgbouncer``) with the transport option ``pooler: "transaction"``; without
``--direct-url`` the consumers have no LISTEN connection and poll (a drain never waits).
``--prepared``: PgBouncer >= 1.21 (``tests.support.pgbouncer.prepared_binary``, e.g. built
by ``.ci/build-pgbouncer``; ``max_prepared_statements = 200``) and the transport option
``pooler_prepared_statements``: statements prepared through the pooler.

Each cell records: the drain rate (messages acked / seconds from the start signal to the
last ack), the machine's CPU busy share, CPU ms per 1,000 messages of the PostgreSQL
server, PgBouncer and the consumer processes (``/proc``, the drain's steady part),
PostgreSQL backends, the wait events of active backends sampled every 0.25 s (lock waits
show up as ``Lock:*``/``LWLock:*``), and the top statements by total time: where it bends,
and why.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from brokers import reset_statement_stats, top_statements
from limits import _start_server
from scale import consume, cpu_busy, fill

import kombu_pgmq  # noqa: F401  (registers postgresql://)
from tests.support import pgbouncer

QUEUE = "scale_pooler"


def cpu_by_group() -> dict[str, float]:
    """CPU seconds so far (user + system) of the live processes, by group: ``postgres``,
    ``pgbouncer``, ``python`` (the consumers, this process included)."""
    tick = os.sysconf("SC_CLK_TCK")
    groups: Counter[str] = Counter()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as stat:
                text = stat.read()
        except OSError:
            continue
        comm = text[text.index("(") + 1 : text.rindex(")")]
        fields = text[text.rindex(")") + 2 :].split()
        group = next((g for g in ("postgres", "pgbouncer", "python") if comm.startswith(g)), "")
        if group:
            groups[group] += (int(fields[11]) + int(fields[12])) / tick
    return dict(groups)


class Sampler(threading.Thread):
    """Wait events of active client backends and the backend count, every 0.25 s."""

    def __init__(self, dsn: str) -> None:
        super().__init__(daemon=True)
        self.dsn = dsn
        self.waits: Counter[str] = Counter()
        self.samples = 0
        self.backends_max = 0
        self.stop = threading.Event()

    def run(self) -> None:
        with psycopg.connect(self.dsn, autocommit=True) as db:
            while not self.stop.wait(0.25):
                rows = db.execute(
                    "SELECT state, coalesce(wait_event_type || ':' || wait_event, 'CPU'), "
                    "count(*) FROM pg_stat_activity WHERE backend_type = 'client backend' "
                    "AND pid <> pg_backend_pid() GROUP BY 1, 2"
                ).fetchall()
                self.samples += 1
                self.backends_max = max(self.backends_max, sum(n for _, _, n in rows))
                for state, wait, n in rows:
                    if state == "active":
                        self.waits[wait] += n

    def summary(self) -> dict[str, Any]:
        per_sample = {k: round(v / max(1, self.samples), 1) for k, v in self.waits.most_common(6)}
        return {"backends_max": self.backends_max, "active_by_wait_event": per_sample}


def drain(
    url: str, options: dict[str, Any], dsn: str, k: int, total: int, limit: float
) -> dict[str, Any]:
    ready, go, acked = mp.Value("i", 0), mp.Event(), mp.Value("q", 0)
    procs = [
        mp.Process(target=consume, args=(url, options, QUEUE, total, limit, go, acked, ready))
        for _ in range(k)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + 120 + k
    while ready.value < k and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(1.0)  # the last ones' declarations settle
    reset_statement_stats(dsn)
    sampler = Sampler(dsn)
    sampler.start()
    busy0, all0 = cpu_busy()
    start = time.monotonic()
    go.set()
    # CPU by group over the steady middle of the drain (every process alive): from 10 %
    # to 90 % of the messages
    marks: list[tuple[int, dict[str, float]]] = []
    while acked.value < total and time.monotonic() - start < limit:
        done = acked.value
        if (not marks and done >= total // 10) or (len(marks) == 1 and done >= total * 9 // 10):
            marks.append((done, cpu_by_group()))
        time.sleep(0.01)
    seconds = time.monotonic() - start
    busy1, all1 = cpu_busy()
    cpu_ms: dict[str, float] = {}
    if len(marks) == 2:
        (n0, c0), (n1, c1) = marks
        cpu_ms = {
            g: round((c1.get(g, 0.0) - c0.get(g, 0.0)) * 1000 * 1000 / max(1, n1 - n0), 1)
            for g in ("postgres", "pgbouncer", "python")
        }
    sampler.stop.set()
    sampler.join()
    count = acked.value
    top = top_statements(dsn, 3)
    with acked.get_lock():
        acked.value = total  # the rest stop too (time limit)
    for p in procs:
        p.join(timeout=60)
        if p.is_alive():
            p.kill()
    return {
        "consumers": k,
        "acked": count,
        "seconds": round(seconds, 1),
        "per_s": round(count / seconds),
        "cpu_busy": round((busy1 - busy0) / max(1, all1 - all0), 2),
        "cpu_ms_per_1000": cpu_ms,
        **sampler.summary(),
        "top_statements": [
            {key: t[key] for key in ("calls", "mean_ms", "total_ms", "rows_per_call", "query")}
            for t in top
        ],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backlog", type=int, default=1_000_000)
    parser.add_argument("--consumers", default="16,64,128")
    parser.add_argument("--pooler-from", type=int, default=64)
    parser.add_argument("--pool-size", type=int, default=8)
    parser.add_argument("--direct-url", action="store_true")
    parser.add_argument("--prepared", action="store_true", help="PgBouncer >= 1.21, prepared")
    parser.add_argument("--max-seconds", type=float, default=900.0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    counts = [int(c) for c in args.consumers.split(",")]
    server = _start_server(max_connections="400")
    results: list[dict[str, Any]] = []
    try:
        dsn = server.dsn
        with psycopg.connect(dsn, autocommit=True) as db:
            db.execute("CREATE EXTENSION pg_stat_statements")
        needed = any(k >= args.pooler_from for k in counts)
        binary = pgbouncer.BINARY
        settings: dict[str, str] = {}
        if args.prepared:
            binary = pgbouncer.prepared_binary() or sys.exit("no PgBouncer >= 1.21 here")
            settings["max_prepared_statements"] = "200"
        bouncing = (
            pgbouncer.PgBouncer(
                dsn, default_pool_size=args.pool_size, settings=settings, binary=binary
            )
            if needed
            else None
        )
        with bouncing or contextlib.nullcontext() as bouncer:
            for k in counts:
                pooled = k >= args.pooler_from
                url, options = dsn, {}
                if pooled:
                    url, options = bouncer.pooled_url(dsn), {"pooler": "transaction"}
                    if args.direct_url:
                        options["direct_url"] = dsn
                    if args.prepared:
                        options["pooler_prepared_statements"] = True
                fill_s = fill(dsn, {}, QUEUE, args.backlog)
                print(f"{k} consumers: filled {args.backlog:,} in {fill_s:.1f} s", flush=True)
                run = drain(url, options, dsn, k, args.backlog, args.max_seconds)
                version = ".".join(map(str, pgbouncer.version(binary) or ()))
                prepared = ", prepared" if args.prepared else ""
                run["via"] = (
                    f"pgbouncer {version} (pool {args.pool_size}{prepared})" if pooled else "direct"
                )
                print(json.dumps({key: v for key, v in run.items() if key != "top_statements"}))
                for t in run["top_statements"]:
                    print(f"    {t['calls']:>9} calls {t['mean_ms']:.3f} ms  {t['query'][:70]!r}")
                results.append(run)
                with psycopg.connect(dsn, autocommit=True) as db:
                    db.execute("SELECT pgmq.purge_queue(%s)", (QUEUE,))
    finally:
        server.stop()
    peak = max(r["per_s"] for r in results)
    print()
    print(
        "| consumers | via | drained/s | x peak | CPU busy | CPU ms / 1,000 msgs: server, "
        "PgBouncer, consumers | backends | top wait events |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        waits = ", ".join(f"{k} {v}" for k, v in r["active_by_wait_event"].items())
        cpu = r["cpu_ms_per_1000"]
        shares = " / ".join(str(cpu.get(g, "-")) for g in ("postgres", "pgbouncer", "python"))
        print(
            f"| {r['consumers']} | {r['via']} | {r['per_s']:,} | {r['per_s'] / peak:.2f} | "
            f"{r['cpu_busy']:.0%} | {shares} | {r['backends_max']} | {waits} |"
        )
    if args.json:
        meta = {"backlog": args.backlog, "pool_size": args.pool_size, "host_cpus": os.cpu_count()}
        args.json.write_text(json.dumps({**meta, "results": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
