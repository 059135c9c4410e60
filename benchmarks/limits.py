"""Fleet-wide limits (issue 29): what a limit costs the read, on a private PostgreSQL with
``pg_stat_statements``.

Usage::

    python benchmarks/limits.py [--messages 20000] [--qty 10] [--keys 10000] [--rounds 3] \
        [--json benchmarks/results/limits_read_cost.json]

A throwaway server (this machine's PostgreSQL 15 binaries, ``fsync=on``,
``shared_preload_libraries=pg_stat_statements``) gets one queue per case, each filled
with ``--messages`` messages (headers ``x-limit-key`` over ``--keys`` keys, round robin),
then drained by one consumer loop as a worker drains a backlog: read ``--qty`` messages
(``Broker.read_many``, the transport's read), ack them with the next read (held acks).
Cases (limits that never bind, unless said):

* ``none``: no limit (statement ``read_queue``: the queue's read function);
* ``concurrency``: ``concurrency`` = 1,000,000;
* ``rate``: ``rate`` = 1,000,000/s;
* ``keys``: ``key_concurrency`` = 1,000,000 over ``--keys`` keys;
* ``keys_binding``: ``key_concurrency`` = 1 over ``--keys`` keys (each read is handed at
  most one message per key: the cost of skipping keys at their limit).

Reported per case (median of ``--rounds``, cases interleaved): messages drained per second
and the read statement's mean server time per call (``pg_stat_statements``), with the ratio
to ``none``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kombu import Connection, Queue

import kombu_pgmq  # noqa: F401  (registers postgresql://)
from kombu_pgmq._db.broker import Broker
from kombu_pgmq._db.connector import Connector
from kombu_pgmq._db.rows import Receipt
from tests.support import pgserver

SYSTEM_BIN = Path("/usr/lib/postgresql/15/bin")
CASES: dict[str, dict[str, Any] | None] = {
    "none": None,
    "concurrency": {"concurrency": 1_000_000},
    "rate": {"rate": "1000000/s"},
    "keys": {"key_concurrency": 1_000_000},
    "keys_binding": {"key_concurrency": 1},
}


def _fill(dsn: str, queue: str, messages: int, keys: int) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        table = sql.Identifier("pgmq", f"q_{queue}")
        conn.execute(sql.SQL("TRUNCATE {}").format(table))
        conn.execute(
            'SELECT pgmq.send_batch(%s, array_agg(\'{"task": "noop"}\'::jsonb),'
            " array_agg(jsonb_build_object('x-limit-key', 'k' || (i %% %s))))"
            " FROM generate_series(1, %s) i",
            (queue, keys, messages),
        )
        conn.execute(sql.SQL("VACUUM ANALYZE {}").format(table))


def _drain(dsn: str, queue: str, messages: int, qty: int) -> float:
    broker = Broker(Connector(dsn))
    acks: list[Receipt] = []
    done = 0
    start = time.perf_counter()
    while done < messages:
        rows = broker.read_many([queue], 30, qty, acks, durable_acks=False)
        acks = [Receipt(queue, r.msg_id, r.read_ct, r.enqueued_at) for r in rows]
        done += len(rows)
        if not rows:
            raise RuntimeError(f"{queue}: nothing read after {done} of {messages}")
    broker.ack(acks, durable=False)
    elapsed = time.perf_counter() - start
    broker.db.close()
    return messages / elapsed


def _statement_ms(dsn: str) -> dict[str, tuple[int, float]]:
    """Mean server time (ms) and calls of the read statements, by kind."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT query, calls, mean_exec_time FROM pg_stat_statements"
            " WHERE query LIKE '%kombu_pgmq.read(%' OR query LIKE '%\"read\\_q\\_%'"
        ).fetchall()
    out: dict[str, tuple[int, float]] = {}
    for query, calls, mean in rows:
        kind = "read_queue" if '"read_q_' in query else "kombu_pgmq.read"
        if kind in out:
            calls0, mean0 = out[kind]
            mean = (mean0 * calls0 + mean * calls) / (calls0 + calls)
            calls += calls0
        out[kind] = (calls, mean)
    return out


class _Pg15(pgserver.LocalServer):
    """A :class:`~tests.support.pgserver.LocalServer` on this machine's PostgreSQL 15
    (whose ``initdb`` has no ``--set``: the settings go to ``postgresql.conf``). It
    listens on its socket only, unless the settings give ``listen_addresses`` (e.g.
    ``'127.0.0.2'``: a loopback address the local server does not use; ``trust`` for
    127.0.0.0/8)."""

    def start(self, settings: Mapping[str, str]) -> None:
        self.root.chmod(0o755)
        self.data_dir.mkdir()
        self.socket_dir.mkdir()
        for path in (self.root, self.data_dir, self.socket_dir):
            pgserver._chown(path, self.user)
        cmd = [str(self.bin_dir / "initdb"), "-D", str(self.data_dir), "--auth=trust"]
        cmd += ["--encoding=UTF8", "--locale=C", "--no-sync", "-U", pgserver.SUPERUSER]
        pgserver._run(cmd, user=self.user, cwd=self.root)
        conf = {"listen_addresses": "''", **settings, "unix_socket_directories": "'%s'"}
        lines = [f"{k} = {v}" for k, v in conf.items()]
        lines[-1] = lines[-1] % self.socket_dir
        with (self.data_dir / "postgresql.conf").open("a") as out:
            out.write("\n".join(lines) + "\n")
        with (self.data_dir / "pg_hba.conf").open("a") as out:
            out.write("host all all 127.0.0.0/8 trust\n")
        self._pg_ctl("-l", str(self.log_file), "start")


def _start_server(**overrides: str) -> pgserver.LocalServer:
    """A throwaway PostgreSQL 15 with pg_stat_statements, fsync and synchronous commit on
    (as a production server), else the tests' settings; ``overrides``: more settings
    (``max_connections="400"``)."""
    settings = {
        "shared_buffers": "'256MB'",
        "max_wal_size": "'2GB'",
        "max_connections": "100",
        "shared_preload_libraries": "'pg_stat_statements'",
        "pg_stat_statements.track": "top",
        **overrides,
    }
    root = Path(tempfile.mkdtemp(prefix="kpt_pg_"))
    server = _Pg15(root, SYSTEM_BIN, pgserver._server_user())
    try:
        server.start(settings)
    except BaseException:
        server.stop()
        raise
    return server


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--messages", type=int, default=20_000)
    parser.add_argument("--qty", type=int, default=10)
    parser.add_argument("--keys", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cases", nargs="*", default=list(CASES))
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    server = _start_server()
    try:
        dsn = server.dsn
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("CREATE EXTENSION pg_stat_statements")
        limits = {f"lim_{name}": each for name, each in CASES.items() if each is not None}
        with Connection(dsn, transport_options={"queue_limits": limits}) as conn:
            channel = conn.channel()
            for name in args.cases:
                Queue(f"lim_{name}")(channel).declare()
        results: dict[str, dict[str, list[float]]] = {
            name: {"per_s": [], "read_ms": []} for name in args.cases
        }
        for _ in range(args.rounds):
            for name in args.cases:
                queue = f"lim_{name}"
                _fill(dsn, queue, args.messages, args.keys)
                with psycopg.connect(dsn, autocommit=True) as conn:
                    conn.execute("SELECT pg_stat_statements_reset()")
                rate = _drain(dsn, queue, args.messages, args.qty)
                stats = _statement_ms(dsn)
                kind = (
                    "read_queue" if name in ("none", "concurrency", "rate") else "kombu_pgmq.read"
                )
                results[name]["per_s"].append(rate)
                results[name]["read_ms"].append(stats.get(kind, (0, float("nan")))[1])
                results[name].setdefault("statement", []).append(kind)  # type: ignore[arg-type]
        base = statistics.median(results["none"]["per_s"]) if "none" in results else None
        base_ms = statistics.median(results["none"]["read_ms"]) if "none" in results else None
        report = []
        for name, got in results.items():
            per_s = statistics.median(got["per_s"])
            read_ms = statistics.median(got["read_ms"])
            report.append(
                {
                    "case": name,
                    "limits": CASES[name],
                    "drained_per_s": round(per_s),
                    "vs_none": round(per_s / base, 3) if base else None,
                    "read_statement_ms": round(read_ms, 3),
                    "read_ms_vs_none": round(read_ms / base_ms, 2) if base_ms else None,
                    "rounds_per_s": [round(x) for x in got["per_s"]],
                }
            )
            print(
                f"{name:14} {per_s:8.0f} msg/s  x{per_s / base if base else 0:.2f}   "
                f"read {read_ms:.3f} ms/call  x{read_ms / base_ms if base_ms else 0:.2f}"
            )
        if args.json:
            args.json.write_text(
                json.dumps(
                    {
                        "benchmark": "limits read cost",
                        "messages": args.messages,
                        "qty": args.qty,
                        "keys": args.keys,
                        "rounds": args.rounds,
                        "results": report,
                    },
                    indent=2,
                )
                + "\n"
            )
    finally:
        server.stop()


if __name__ == "__main__":
    main()
