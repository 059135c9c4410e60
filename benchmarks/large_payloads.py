"""Large task payloads: publish, delivery, result store and round trip of 1, 10 and 50 MB
arguments and results, kombu_pgmq against Redis in one run.

Usage::

    python benchmarks/large_payloads.py [--target NAME=BROKER_URL[|BACKEND_URL] ...]
        [--sizes-mb 1,10,50] [--rounds 3] [--kind text|bytes] [--json PATH] [-v]

Default targets (``--target`` replaces the list), broker and result backend both:

* ``kombu_pgmq``  ``postgresql://postgres@127.0.0.1:5432/kpb_large``, result backend
  ``postgresql://`` (the broker's database)
* ``redis``       ``redis://127.0.0.1:6379/4``, result backend the same

The PostgreSQL database is created if missing. Payload (``--kind``): ``text``, a random
string of letters and digits of the size (MB = 10**6 bytes; random text holds ``NaN`` and
``Infinity`` here and there, as base64 does); ``bytes``, random bytes of the size (the
JSON serializer sends them as base64: 4/3 of the size).

One worker per target (``celery -A large_payloads_app worker -P prefork -c 1
--without-gossip --without-mingle --without-heartbeat``), started once and warmed up (a
small ``echo`` whose result is read); all stay up for the whole run. Then for each round,
each size, each target (targets interleaved: a drift of the machine hits them alike), one
``lp.echo.delay(payload).get()``, checked equal to the payload, and its times (worker
events from the task log, :mod:`large_payloads_app`):

* ``publish_s``: the ``apply_async`` call (serialize, send, commit);
* ``delivery_s``: ``apply_async`` returned -> the task body starts (the worker reads and
  decodes the message and hands it to its pool process);
* ``store_s``: the task body returned -> the result is stored (Celery encodes the result
  and the backend writes it; Celery's ``task_success`` signal);
* ``fetch_s``: the result stored -> ``get()`` returns (wake-up, read, decode);
* ``round_trip_s``: ``apply_async`` called -> ``get()`` returned (the sum of the four).

Per target and size: the median of each time over the rounds, and every round's values.
An error (a payload over a limit) is recorded for that size and target, with its message.
At the end the archive of the PostgreSQL queue is pruned (an acked message stays there:
tens of MB each).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import platform
import random
import statistics
import string
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(REPO_ROOT))

import celery  # noqa: E402
import celery_bench  # noqa: E402
import kombu  # noqa: E402
import large_payloads_app  # noqa: E402
from brokers import dist_version, ensure_database, git_describe, pg_dsn, pg_version  # noqa: E402
from celery.exceptions import TimeoutError as CeleryTimeoutError  # noqa: E402
from kombu.utils.url import maybe_sanitize_url  # noqa: E402

from kombu_pgmq.retention import prune_archives  # noqa: E402

DEFAULT_TARGETS = {
    "kombu_pgmq": ("postgresql://postgres@127.0.0.1:5432/kpb_large", "postgresql://"),
    "redis": ("redis://127.0.0.1:6379/4", "redis://127.0.0.1:6379/4"),
}
READY_TIMEOUT_S = 120.0
GET_TIMEOUT_S = 600.0
PARTS = ("publish_s", "delivery_s", "store_s", "fetch_s", "round_trip_s")
_ALNUM = (string.ascii_letters + string.digits).encode()
_TO_ALNUM = bytes(_ALNUM[i % len(_ALNUM)] for i in range(256))


def payload(kind: str, size: int, seed: int) -> str | bytes:
    """``size`` random bytes, or as many random letters and digits (reproducible)."""
    raw = random.Random(seed).randbytes(size)
    return raw if kind == "bytes" else raw.translate(_TO_ALNUM).decode("ascii")


class Worker(celery_bench.Worker):
    """celery_bench's worker, on large_payloads_app with one pool process."""

    app_module = "large_payloads_app"
    concurrency = 1
    node_prefix = "large"

    def __init__(self, name: str, broker: str, backend: str, log: Path, out: Path) -> None:
        self.name = name
        self.env = self.environment(
            {
                "LARGE_BENCH_BROKER": broker,
                "LARGE_BENCH_BACKEND": backend,
                "LARGE_BENCH_LOG": str(log),
            }
        )
        self.out = out
        self.proc = None


def read_events(path: Path) -> dict[tuple[str, str], float]:
    """``{(kind, task_id): ts}`` of the complete lines of a task log."""
    try:
        data = path.read_text()
    except FileNotFoundError:
        return {}
    events = {}
    for line in data.splitlines(keepends=True):
        if not line.endswith("\n"):
            break  # partial last line
        kind, task_id, ts = line.rstrip("\n").split(",")
        events[(kind, task_id)] = float(ts)
    return events


def wait_event(log: Path, worker: Worker, kind: str, task_id: str, timeout: float) -> float:
    """The time of worker event ``kind`` of ``task_id`` (written before or just after the
    result arrives: polled)."""
    deadline = time.monotonic() + timeout
    while True:
        ts = read_events(log).get((kind, task_id))
        if ts is not None:
            return ts
        worker.check_alive()
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {kind} line for task {task_id} after {timeout:.0f} s")
        time.sleep(0.02)


def one_task(app: Any, worker: Worker, log: Path, data: str | bytes) -> dict[str, float]:
    """One echo round trip of ``data`` and its times (see the module docstring)."""
    echo = app.tasks["lp.echo"]
    t0 = time.time()
    result = echo.delay(data)
    t1 = time.time()
    got = result.get(timeout=GET_TIMEOUT_S)
    t2 = time.time()
    if got != data:
        raise AssertionError(f"the result differs from the payload ({len(got)} vs {len(data)})")
    start = wait_event(log, worker, "start", result.id, 30.0)
    returned = wait_event(log, worker, "return", result.id, 30.0)
    stored = wait_event(log, worker, "stored", result.id, 30.0)
    with contextlib.suppress(Exception):
        result.forget()
    return {
        "publish_s": round(t1 - t0, 4),
        "delivery_s": round(start - t1, 4),
        "store_s": round(stored - returned, 4),
        "fetch_s": round(t2 - stored, 4),
        "round_trip_s": round(t2 - t0, 4),
    }


def setup(name: str, broker: str, backend: str, workdir: Path) -> tuple[Any, Worker, Path]:
    dsn = pg_dsn(broker)
    if dsn:
        ensure_database(dsn)
    app = large_payloads_app.create_app(broker, backend)
    with contextlib.suppress(Exception):
        app.control.purge()
    log = workdir / f"{name}-events.log"
    worker = Worker(name, broker, backend, log, workdir / f"{name}-worker.out")
    worker.start()
    deadline = time.monotonic() + READY_TIMEOUT_S
    while True:  # warm-up: the worker is up, both connections made, a result read
        worker.check_alive()
        try:
            if app.tasks["lp.echo"].delay("warm-up").get(timeout=5) == "warm-up":
                break
        except CeleryTimeoutError:
            if time.monotonic() > deadline:
                raise
    return app, worker, log


def summarize(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [r for r in rounds if "error" not in r]
    out: dict[str, Any] = {"rounds": len(ok)}
    if ok:
        out["median"] = {p: round(statistics.median(r[p] for r in ok), 3) for p in PARTS}
        out["each"] = {p: [r[p] for r in ok] for p in PARTS}
    errors = sorted({r["error"] for r in rounds if "error" in r})
    if errors:
        out["errors"] = errors
    return out


def table(results: dict[str, Any], sizes: list[float]) -> str:
    names = list(results)
    base = "redis" if "redis" in results else None
    head = f"{'target':<12} {'MB':>4} " + " ".join(f"{p[:-2]:>11}" for p in PARTS)
    head += "  vs redis" if base else ""
    lines = [head]
    for size in sizes:
        key = f"{size:g}"
        ref = results.get(base or "", {}).get("sizes", {}).get(key, {}).get("median", {})
        for name in names:
            res = results[name]
            if "error" in res:
                lines.append(f"{name:<12} {key:>4} {res['error'][:90]}")
                continue
            row = res["sizes"].get(key, {})
            med = row.get("median")
            if not med:
                lines.append(f"{name:<12} {key:>4} {'; '.join(row.get('errors', []))[:110]}")
                continue
            text = f"{name:<12} {key:>4} " + " ".join(f"{med[p]:>11.3f}" for p in PARTS)
            if ref and name != base:
                text += f"  {med['round_trip_s'] / ref['round_trip_s']:.2f}x"
            lines.append(text)
    return "\n".join(lines)


def parse_targets(values: list[str] | None) -> dict[str, tuple[str, str]]:
    if not values:
        return dict(DEFAULT_TARGETS)
    out = {}
    for value in values:
        name, sep, rest = value.partition("=")
        if not sep or not name:
            raise SystemExit(f"--target must be NAME=BROKER_URL[|BACKEND_URL]: {value!r}")
        broker, _, backend = rest.partition("|")
        out[name] = (broker, backend or broker)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", action="append", metavar="NAME=BROKER_URL[|BACKEND_URL]")
    parser.add_argument("--sizes-mb", default="1,10,50", help="payload sizes, MB (10**6 bytes)")
    parser.add_argument("--rounds", type=int, default=3, help="tasks per size and target")
    parser.add_argument("--kind", choices=("text", "bytes"), default="text")
    parser.add_argument("--json", type=Path, help="write results as JSON here")
    parser.add_argument("--keep", action="store_true", help="keep the task logs / worker output")
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args()
    targets = parse_targets(args.target)
    sizes = [float(s) for s in args.sizes_mb.split(",") if s.strip()]

    first_pg = next((d for d in (pg_dsn(b) for b, _ in targets.values()) if d), None)
    env = {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "cpu_count": os.cpu_count(),
        "loadavg_start": os.getloadavg(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "celery": celery.__version__,
        "kombu": kombu.__version__,
        "psycopg": dist_version("psycopg"),
        "redis_py": dist_version("redis"),
        "kombu_pgmq_git": git_describe(),
        "postgresql": pg_version(first_pg) if first_pg else None,
        "sizes_mb": sizes,
        "rounds": args.rounds,
        "kind": args.kind,
        "worker": "prefork -c 1, --without-gossip/mingle/heartbeat; json serializers",
    }
    workdir = Path(tempfile.mkdtemp(prefix="large_payloads-"))
    results: dict[str, dict[str, Any]] = {}
    running: dict[str, tuple[Any, Worker, Path]] = {}
    try:
        for name, (broker, backend) in targets.items():
            results[name] = {
                "broker": maybe_sanitize_url(broker),
                "backend": maybe_sanitize_url(backend),
                "sizes": {},
            }
            try:
                running[name] = setup(name, broker, backend, workdir)
            except Exception as exc:  # never let one target stop the run
                results[name]["error"] = f"setup: {type(exc).__name__}: {exc}"
                if args.verbose:
                    traceback.print_exc()
        rounds: dict[tuple[str, str], list[dict[str, Any]]] = {}
        for size in sizes:
            data = payload(args.kind, int(size * 1_000_000), seed=int(size * 1000))
            for i in range(args.rounds):
                for name, (app, worker, log) in running.items():
                    try:
                        row: dict[str, Any] = one_task(app, worker, log, data)
                    except Exception as exc:
                        row = {"error": f"{type(exc).__name__}: {exc}"[:500]}
                    rounds.setdefault((name, f"{size:g}"), []).append(row)
                    if args.verbose:
                        print(f"{name} {size:g} MB round {i + 1}: {row}", flush=True)
            del data
        for (name, key), rows in rounds.items():
            results[name]["sizes"][key] = summarize(rows)
    finally:
        for app, worker, _ in running.values():
            worker.stop()
            with contextlib.suppress(Exception):
                app.close()
        for name, (broker, _) in targets.items():
            if pg_dsn(broker) and name in running:  # acked messages: tens of MB each
                with contextlib.suppress(Exception):
                    pruned = prune_archives(
                        broker, older_than_seconds=0, queues=[large_payloads_app.QUEUE]
                    )
                    results[name]["archive_pruned"] = sum(pruned.values())
    env["loadavg_end"] = os.getloadavg()
    print(table(results, sizes))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"environment": env, "results": results}, indent=2) + "\n")
    if args.keep:
        print(f"task logs and worker output kept in {workdir}", file=sys.stderr)
    else:
        for path in workdir.iterdir():
            path.unlink()
        workdir.rmdir()


if __name__ == "__main__":
    main()
