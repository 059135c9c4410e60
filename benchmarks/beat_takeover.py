"""Beat failover: how long a leader's death (or hang) leaves no leader, over many kills.

Usage::

    python benchmarks/beat_takeover.py [--url postgresql://postgres@127.0.0.1:5432/kpb_beat]
        [--kills 20] [--beats 3] [--mode kill|stop] [--takeover-seconds 10] [--json PATH]

``--beats`` ``celery beat -S kombu_pgmq.beat:Scheduler`` processes (default settings unless
``--takeover-seconds``) run on one database with an every-second entry. ``--kills`` times:
the leader of record (``kombu_pgmq.beat_leader``: ``host:pid``) gets SIGKILL (``kill``)
or SIGSTOP (``stop``: a hung leader, deposed by its stale heartbeat), then a replacement
process starts so ``--beats`` keep running. Measured per kill, from the signal:

- ``elected``: a new leader of record (another identity, its session holding the lock);
- ``first_tick``: the first tick the new leader sent (``beat_ticks.sent_at``, leader
  column), i.e. how long no periodic task went out.

Also checked: no (entry, due_at) twice (the primary key), and ticks sent in the whole run
versus seconds elapsed (missed ticks are folded into one catch-up tick each time).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import psycopg

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from brokers import ensure_database  # noqa: E402

DEFAULT_URL = "postgresql://postgres@127.0.0.1:5432/kpb_beat_takeover"


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    k = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[k]


def start_beat(url: str, takeover: float | None, log: Path) -> subprocess.Popen[bytes]:
    env = dict(os.environ, BEAT_BENCH_URL=url, PYTHONPATH=f"{HERE}:{HERE.parent}")
    if takeover:
        env["BEAT_BENCH_TAKEOVER"] = str(takeover)
    return subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "beat_app", "beat", "--loglevel", "WARNING",
         "-s", str(log.with_suffix(".schedule"))],
        env=env, cwd=str(HERE), stdout=log.open("ab"), stderr=subprocess.STDOUT,
    )  # fmt: skip


def leader(conn: psycopg.Connection[Any]) -> tuple[str, int, bool] | None:
    row = conn.execute(
        "SELECT identity, epoch, alive FROM kombu_pgmq.beat_leader_info()"
    ).fetchone()
    return None if row is None else (row[0], row[1], row[2])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", default=DEFAULT_URL)
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--beats", type=int, default=3)
    parser.add_argument("--mode", choices=["kill", "stop"], default="kill")
    parser.add_argument("--takeover-seconds", type=float, default=None)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    ensure_database(args.url)
    logdir = Path("/tmp/beat_takeover")
    logdir.mkdir(exist_ok=True)
    procs: dict[int, subprocess.Popen[bytes]] = {}
    stopped: list[subprocess.Popen[bytes]] = []
    results: list[dict[str, float]] = []
    conn = psycopg.connect(args.url, autocommit=True)
    try:
        for i in range(args.beats):
            p = start_beat(args.url, args.takeover_seconds, logdir / f"beat{i}.log")
            procs[p.pid] = p
        deadline = time.monotonic() + 60
        while True:
            try:
                current = leader(conn)
            except (psycopg.errors.UndefinedFunction, psycopg.errors.InvalidSchemaName):
                current = None
            if current and current[2]:
                break
            if time.monotonic() > deadline:
                raise SystemExit("no beat leads after 60 s: see /tmp/beat_takeover/*.log")
            time.sleep(0.2)
        started = datetime.now(timezone.utc)
        time.sleep(3)
        for k in range(args.kills):
            current = leader(conn)
            assert current is not None
            identity, _epoch, _ = current
            pid = int(identity.rsplit(":", 1)[1])
            victim = procs.pop(pid)
            t_kill = time.monotonic()
            at_kill = datetime.now(timezone.utc)
            os.kill(pid, signal.SIGKILL if args.mode == "kill" else signal.SIGSTOP)
            elected = first_tick = None
            while time.monotonic() - t_kill < 60 and (elected is None or first_tick is None):
                now = leader(conn)
                if elected is None and now and now[0] != identity and now[2]:
                    elected = time.monotonic() - t_kill
                if elected is not None and first_tick is None:
                    row = conn.execute(
                        "SELECT min(sent_at) FROM kombu_pgmq.beat_ticks WHERE sent_at > %s "
                        "AND leader <> %s",
                        (at_kill, identity),
                    ).fetchone()
                    if row and row[0] is not None:
                        first_tick = (row[0] - at_kill).total_seconds()
                time.sleep(0.02)
            if elected is None or first_tick is None:
                raise SystemExit(f"kill {k + 1}: no takeover within 60 s")
            results.append({"elected_s": elected, "first_tick_s": first_tick})
            print(f"kill {k + 1}: elected after {elected:.2f} s, first tick {first_tick:.2f} s",
                  flush=True)  # fmt: skip
            if args.mode == "stop":
                stopped.append(victim)
            else:
                victim.wait()
            p = start_beat(args.url, args.takeover_seconds, logdir / f"beat{k + 10}.log")
            procs[p.pid] = p
            time.sleep(2)
        ended = datetime.now(timezone.utc)
        ticks, dup = conn.execute(
            "SELECT count(*), count(*) - count(DISTINCT (entry, due_at)) FROM "
            "kombu_pgmq.beat_ticks WHERE sent_at BETWEEN %s AND %s",
            (started, ended),
        ).fetchone()
    finally:
        for p in list(procs.values()) + stopped:
            p.kill()
            p.wait()
        conn.close()
    elected_s = [r["elected_s"] for r in results]
    first_s = [r["first_tick_s"] for r in results]
    summary = {
        "mode": args.mode,
        "kills": len(results),
        "takeover_seconds_setting": args.takeover_seconds or 10.0,
        "elected_p50_s": round(_percentile(elected_s, 0.5), 3),
        "elected_p99_s": round(_percentile(elected_s, 0.99), 3),
        "first_tick_p50_s": round(_percentile(first_s, 0.5), 3),
        "first_tick_p99_s": round(_percentile(first_s, 0.99), 3),
        "run_seconds": round((ended - started).total_seconds(), 1),
        "ticks": ticks,
        "duplicate_ticks": dup,
        "runs": results,
    }
    print(json.dumps({k: v for k, v in summary.items() if k != "runs"}, indent=2))
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
