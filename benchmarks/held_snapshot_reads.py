"""What one read costs while an old snapshot is held, as messages are consumed: shared
buffers touched by one read (``EXPLAIN (ANALYZE, BUFFERS)``) of each read design, after
1,000 ... 50,000 messages published, read and archived behind a held ``REPEATABLE READ``
snapshot.

Usage (from the repository root)::

    python benchmarks/held_snapshot_reads.py [--url postgresql://...] \
        [--checkpoints 1000,5000,20000,50000] [--json benchmarks/results/held_snapshot_reads.json]

One database (created if missing; PGMQ's SQL from the ``pgmq`` package if the extension
is not there), one queue per design. A session opens a ``REPEATABLE READ`` transaction,
runs one ``SELECT`` and stays open; then, per design, one connection publishes batches of
100 messages (``pgmq.send_batch``), reads them 10 at a time with a visibility timeout of
1 s (so that the entries of archived rows reach the scanned range, as after a visibility
timeout in a long run) and archives each. At each checkpoint one more message is
published and one read of it is explained. Designs:

* ``pgmq.read``: PGMQ's own function;
* ``vt_scan``: the transport's read shape today (``vt <= clock_timestamp()`` on the vt
  index, oldest first, ``FOR UPDATE SKIP LOCKED``);
* ``vt_from_low``: the same scan started at a position ``low`` the reader keeps
  (``vt >= low``, bound as a parameter): the statement time when the previous read found
  fewer rows than it asked for, else the vt of the last row it took, minus 100 ms.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import psycopg  # noqa: E402
from brokers import ensure_database, ensure_sql_pgmq  # noqa: E402

VT_SCAN = """
WITH picked AS (
    SELECT msg_id, vt FROM pgmq.q_{q}
    WHERE vt <= (SELECT clock_timestamp())
    ORDER BY vt, msg_id LIMIT 10 FOR UPDATE SKIP LOCKED
)
UPDATE pgmq.q_{q} m SET vt = clock_timestamp() + interval '1 second', read_ct = m.read_ct + 1
FROM picked WHERE m.msg_id = picked.msg_id
RETURNING m.msg_id, picked.vt AS old_vt, (SELECT clock_timestamp()) AS scanned_at
"""

VT_FROM_LOW = """
WITH picked AS (
    SELECT msg_id, vt FROM pgmq.q_{q}
    WHERE vt >= %(low)s AND vt <= (SELECT clock_timestamp())
    ORDER BY vt, msg_id LIMIT 10 FOR UPDATE SKIP LOCKED
)
UPDATE pgmq.q_{q} m SET vt = clock_timestamp() + interval '1 second', read_ct = m.read_ct + 1
FROM picked WHERE m.msg_id = picked.msg_id
RETURNING m.msg_id, picked.vt AS old_vt, (SELECT clock_timestamp()) AS scanned_at
"""

DESIGNS = ("pgmq.read", "vt_scan", "vt_from_low")


class Reader:
    def __init__(self, conn: psycopg.Connection, design: str, queue: str) -> None:
        self.conn, self.design, self.queue = conn, design, queue
        self.low = dt.datetime(1970, 1, 1, tzinfo=dt.timezone.utc)

    def statement(self) -> tuple[str, dict[str, Any]]:
        if self.design == "pgmq.read":
            return "SELECT msg_id FROM pgmq.read(%(q)s, 1, 10)", {"q": self.queue}
        if self.design == "vt_scan":
            return VT_SCAN.format(q=self.queue), {}
        return VT_FROM_LOW.format(q=self.queue), {"low": self.low}

    def read(self) -> list[int]:
        query, params = self.statement()
        rows = self.conn.execute(query, params).fetchall()
        if self.design == "vt_from_low":
            if len(rows) < 10:
                scanned = rows[0][2] if rows else self._now()
                self.low = scanned - dt.timedelta(milliseconds=100)
            else:
                self.low = max(r[1] for r in rows) - dt.timedelta(milliseconds=100)
        return [r[0] for r in rows]

    def _now(self) -> dt.datetime:
        return self.conn.execute("SELECT clock_timestamp()").fetchone()[0]

    def explain(self) -> dict[str, Any]:
        query, params = self.statement()
        plan = self.conn.execute(
            "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + query, params
        ).fetchone()[0][0]
        top = plan["Plan"]
        return {
            "shared_hit": top.get("Shared Hit Blocks", 0),
            "shared_read": top.get("Shared Read Blocks", 0),
            "ms": round(plan["Execution Time"], 3),
        }


def run(url: str, design: str, checkpoints: list[int]) -> list[dict[str, Any]]:
    queue = "kpb_hsr_" + design.replace(".", "_")
    with psycopg.connect(url, autocommit=True) as conn:
        if conn.execute("SELECT 1 FROM pgmq.meta WHERE queue_name = %s", (queue,)).fetchone():
            conn.execute("SELECT pgmq.drop_queue(%s)", (queue,))
        conn.execute("SELECT pgmq.create(%s)", (queue,))
    holder = psycopg.connect(url, application_name="held_snapshot_reads")
    holder.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
    holder.execute("SELECT count(*) FROM pg_class")
    out = []
    try:
        with psycopg.connect(url, autocommit=True) as conn:
            reader = Reader(conn, design, queue)
            consumed = 0
            for checkpoint in checkpoints:
                while consumed < checkpoint:
                    conn.execute(
                        "SELECT pgmq.send_batch(%s, array_fill('{}'::jsonb, ARRAY[100]))",
                        (queue,),
                    )
                    got = 0
                    while got < 100:
                        ids = reader.read()
                        if not ids:
                            continue
                        conn.execute("SELECT pgmq.archive(%s, %s::bigint[])", (queue, ids))
                        got += len(ids)
                    consumed += got
                conn.execute("SELECT pgmq.send(%s, '{}'::jsonb)", (queue,))
                cost = reader.explain()
                row = {"design": design, "consumed": consumed, **cost}
                print(json.dumps(row), flush=True)
                out.append(row)
    finally:
        holder.rollback()
        holder.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="postgresql://postgres@127.0.0.1:5432/kpb_hsr")
    parser.add_argument("--checkpoints", default="1000,5000,20000,50000")
    parser.add_argument("--designs", nargs="*", default=list(DESIGNS))
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    ensure_database(args.url)
    with psycopg.connect(args.url, autocommit=True) as conn:
        if conn.execute("SELECT 1 FROM pg_available_extensions WHERE name = 'pgmq'").fetchone():
            conn.execute("CREATE EXTENSION IF NOT EXISTS pgmq")
    ensure_sql_pgmq(args.url)
    checkpoints = [int(c) for c in args.checkpoints.split(",")]
    results = {design: run(args.url, design, checkpoints) for design in args.designs}
    print("| design | " + " | ".join(f"{c:,} consumed" for c in checkpoints) + " |")
    print("|---|" + "---|" * len(checkpoints))
    for design, rows in results.items():
        cells = " | ".join(
            f"{r['shared_hit'] + r['shared_read']} buffers, {r['ms']} ms" for r in rows
        )
        print(f"| {design} | {cells} |")
    if args.json:
        env = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")}
        args.json.write_text(
            json.dumps(
                {"environment": env | vars(args) | {"json": None}, "results": results}, indent=2
            )
            + "\n"
        )


if __name__ == "__main__":
    main()
