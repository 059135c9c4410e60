"""Where a Celery worker's time goes while it drains a backlog over kombu_pgmq.

Usage::

    python benchmarks/profile_worker.py [--url postgresql://...] [--backlog 10000]
        [--options JSON] [--rate 250] [--folded PATH] [--json PATH]

Publishes ``--backlog`` noop tasks (``celery_bench_app``) with no worker running, resets
``pg_stat_statements``, starts the worker of ``celery_bench.py`` (prefork, 2 processes) and records
its **main process** (the one that reads, acks and dispatches) with ``py-spy record``
until the last task ran. Prints:

* the drain rate (tasks/s, as ``celery_bench.py``'s backlog),
* CPU seconds used during the drain by the worker's main process, its pool processes and
  all PostgreSQL server processes (from ``/proc``; the machine has 2 cores),
* the flame graph's top frames: inclusive and self share of the main process's samples,
* the top statements of ``pg_stat_statements`` by total execution time (calls, mean ms,
  rows).

Needs ``py-spy`` (``pip install py-spy``; root or ptrace rights) and
``shared_preload_libraries = 'pg_stat_statements'`` on the server (the extension is
created in the broker database if missing). ``--folded`` keeps the collapsed stacks
(input of ``flamegraph.pl`` or speedscope).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import celery_bench_app  # noqa: E402
from brokers import ensure_database, pg_dsn, reset_statement_stats, top_statements  # noqa: E402
from celery_bench import READY_TIMEOUT_S, Worker, count, wait_log  # noqa: E402

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of one process (0 if it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except FileNotFoundError:
        return []
    return [int(p) for p in text.split()]


def postgres_pids() -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if (entry / "comm").read_text().strip() in ("postgres", "postmaster"):
                    pids.append(int(entry.name))
    return pids


def postgres_cpu() -> dict[int, float]:
    return {pid: cpu_seconds(pid) for pid in postgres_pids()}


def top_frames(raw: Path, limit: int) -> dict[str, list[tuple[str, float]]]:
    """Inclusive and self share (%) of each frame in py-spy's collapsed stacks."""
    inclusive: collections.Counter[str] = collections.Counter()
    own: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if not stack:
            continue
        samples = int(n)
        total += samples
        frames = stack.split(";")
        for frame in set(frames):
            inclusive[frame] += samples
        own[frames[-1]] += samples
    if not total:
        return {"inclusive": [], "self": []}

    def share(counter: collections.Counter[str]) -> list[tuple[str, float]]:
        return [(frame, round(100 * n / total, 1)) for frame, n in counter.most_common(limit)]

    return {"samples": total, "inclusive": share(inclusive), "self": share(own)}  # type: ignore[dict-item]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="postgresql://postgres@127.0.0.1:5432/kpb_ours")
    parser.add_argument("--options", default="{}", help="transport options (JSON)")
    parser.add_argument("--backlog", type=int, default=10000)
    parser.add_argument("--rate", type=int, default=250, help="py-spy samples per second")
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--folded", type=Path, help="keep the collapsed stacks here")
    parser.add_argument("--json", type=Path, help="write the results as JSON here")
    args = parser.parse_args()
    if shutil.which("py-spy") is None and not (Path(sys.executable).parent / "py-spy").exists():
        sys.exit("py-spy is not installed: pip install py-spy")
    pyspy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    options = json.loads(args.options)
    dsn = pg_dsn(args.url)
    assert dsn is not None, "a postgresql:// URL"
    ensure_database(dsn)
    app = celery_bench_app.create_app(args.url, options)
    workdir = Path(tempfile.mkdtemp(prefix="profile_worker-"))
    log = workdir / "backlog.log"
    worker = Worker("profile", args.url, options, log, workdir / "worker.out")

    app.control.purge()
    noop = app.tasks["bench.noop"]
    app.tasks["bench.ping"].apply_async()
    for i in range(args.backlog):
        noop.apply_async((i,))
    reset_statement_stats(dsn)
    pg_before = postgres_cpu()
    worker.start()
    assert worker.proc is not None
    main_pid = worker.proc.pid
    raw = workdir / "main.raw"
    spy = subprocess.Popen(
        [
            pyspy,
            "record",
            "--pid",
            str(main_pid),
            "--rate",
            str(args.rate),
            "--format",
            "raw",
            "--output",
            str(raw),
            "--nonblocking",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    pool: set[int] = set()
    pool_cpu: dict[int, float] = {}
    main_cpu = 0.0

    def sample(rows: list[Any]) -> bool:
        nonlocal main_cpu
        main_cpu = cpu_seconds(main_pid) or main_cpu
        for child in children(main_pid):
            pool.add(child)
            pool_cpu[child] = cpu_seconds(child) or pool_cpu.get(child, 0.0)
        return count("noop", rows) >= args.backlog and count("ping", rows) >= 1

    try:
        rows = wait_log(log, worker, sample, READY_TIMEOUT_S + max(120.0, args.backlog / 10))
    finally:
        pg_after = postgres_cpu()
        spy.send_signal(signal.SIGINT)
        with contextlib.suppress(subprocess.TimeoutExpired):
            spy.wait(timeout=30)
        worker.stop()
    ready = min(ts for kind, _, ts in rows if kind == "ping")
    last = max(ts for kind, _, ts in rows if kind == "noop")
    drain_s = last - ready
    statements = top_statements(dsn, args.top)
    pg_cpu = sum(max(0.0, pg_after.get(pid, 0.0) - before) for pid, before in pg_before.items())
    pg_cpu += sum(cpu for pid, cpu in pg_after.items() if pid not in pg_before)
    frames = top_frames(raw, args.top) if raw.exists() else {}
    result = {
        "url": args.url,
        "options": options,
        "backlog": args.backlog,
        "drain_s": round(drain_s, 3),
        "tasks_per_s": round(args.backlog / drain_s, 1),
        "cpu_s": {
            "worker_main": round(main_cpu, 2),
            "pool_processes": round(sum(pool_cpu.values()), 2),
            "postgres": round(pg_cpu, 2),
        },
        "frames": frames,
        "statements": statements,
    }
    print(f"drain: {result['tasks_per_s']:,} tasks/s ({drain_s:.2f} s for {args.backlog:,})")
    print("CPU s during the run:", result["cpu_s"])
    if frames:
        print(f"\nmain process, {frames['samples']} samples; inclusive %:")
        for frame, share in frames["inclusive"]:
            print(f"  {share:5.1f}  {frame}")
        print("self %:")
        for frame, share in frames["self"]:
            print(f"  {share:5.1f}  {frame}")
    print("\ntop statements (pg_stat_statements):")
    for s in result["statements"]:
        print(
            f"  {s['calls']:>7} calls {s['total_ms']:>9.1f} ms {s['mean_ms']:>8.3f} ms/call "
            f"{s['rows']:>7} rows  {s['query']}"
        )
    if args.folded and raw.exists():
        shutil.copy(raw, args.folded)  # flamegraph.pl / speedscope input
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
