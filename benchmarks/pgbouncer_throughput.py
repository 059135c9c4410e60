"""Kombu publish and consume+ack rates directly and through PgBouncer (transaction mode).

Usage::

    python benchmarks/pgbouncer_throughput.py [--messages 2000] [--prefetch 10] \
        [--repeat 5] [--pool-size 10] [--json benchmarks/results/pgbouncer.json]

Starts a PgBouncer 1.18 (``tests/support/pgbouncer.py``: ``pool_mode = transaction``,
``default_pool_size`` ``--pool-size``) in front of ``--server`` and measures, in turn,
``--repeat`` times each (median reported), with ``kombu_throughput.measure`` (one
producer publishing N messages, then one consumer draining them, one ack per message):

* ``direct``: the broker URL is the server's;
* ``pgbouncer``: the broker URL is PgBouncer's, ``pooler="transaction"`` and
  ``direct_url`` (LISTEN on the server); reads and acks commit durably
  (``kombu_pgmq._db.pooling.ASYNC_COMMIT_PER_TRANSACTION`` False, the release's choice);
* ``pgbouncer async-commit-per-transaction``: the same, with reads and acks in a
  transaction of their own that sets ``synchronous_commit`` off (the alternative);
* ``pgbouncer polling``: no ``direct_url`` (no LISTEN: a backlog drains the same way).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from brokers import ensure_database, pg_version
from kombu_throughput import measure

from kombu_pgmq._db import pooling
from tests.support.pgbouncer import PgBouncer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--server", default="postgresql://postgres@127.0.0.1:5432/kpb_pgb")
    parser.add_argument("--messages", type=int, default=2000)
    parser.add_argument("--prefetch", type=int, default=10)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--pool-size", type=int, default=10)
    parser.add_argument("--json")
    args = parser.parse_args()
    direct = args.server
    ensure_database(direct)
    runs: dict[str, list[dict[str, Any]]] = {}
    with PgBouncer(direct, default_pool_size=args.pool_size) as bouncer:
        pooled = bouncer.pooled_url(direct)
        cases: dict[str, tuple[str, dict[str, Any], bool]] = {
            "direct": (direct, {}, False),
            "pgbouncer": (pooled, {"pooler": "transaction", "direct_url": direct}, False),
            "pgbouncer async-commit-per-transaction": (
                pooled,
                {"pooler": "transaction", "direct_url": direct},
                True,
            ),
            "pgbouncer polling": (pooled, {"pooler": "transaction"}, False),
        }
        measure(direct, {}, 200, args.prefetch)  # schema installed, caches warm
        for _ in range(args.repeat):
            for name, (url, options, async_commit) in cases.items():
                pooling.ASYNC_COMMIT_PER_TRANSACTION = async_commit
                try:
                    runs.setdefault(name, []).append(
                        measure(url, options, args.messages, args.prefetch)
                    )
                finally:
                    pooling.ASYNC_COMMIT_PER_TRANSACTION = False
    rows = []
    for name, each in runs.items():
        row = {
            "case": name,
            "publish_per_s": statistics.median(r["publish_per_s"] for r in each),
            "consume_ack_per_s": statistics.median(r["consume_ack_per_s"] for r in each),
            "runs": each,
        }
        rows.append(row)
        print(
            f"{name:42} publish {row['publish_per_s']:>7.0f}/s   consume+ack "
            f"{row['consume_ack_per_s']:>7.0f}/s"
        )
    report = {
        "benchmark": "pgbouncer_throughput",
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "messages": args.messages,
        "prefetch": args.prefetch,
        "repeat": args.repeat,
        "pool_size": args.pool_size,
        "pgbouncer": "1.18 (Debian), pool_mode=transaction",
        "server_version": pg_version(direct),
        "results": rows,
    }
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
