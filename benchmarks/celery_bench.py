"""Celery end to end, several brokers in one run: task latency and backlog drain rate.

Usage::

    python benchmarks/celery_bench.py [--broker NAME=URL ...] [--options NAME=JSON ...]
        [--latency-tasks 200] [--interval-ms 20] [--rounds 1] [--backlog 10000]
        [--backlog-rounds 1] [--json PATH]

Default brokers (``--broker`` replaces the whole list):

* ``kombu_pgmq``   ``postgresql://postgres@127.0.0.1:5432/kpb_ours`` (this project)
* ``redis``        ``redis://127.0.0.1:6379/0``
* ``rabbitmq``     ``amqp://guest:guest@127.0.0.1:5672//``
* ``kombu57_pgmq`` ``pgmq://postgres@127.0.0.1:5432/kpb_kombu57``: kombu 5.7's built-in
  ``pgmq`` transport, transport option ``init_extension=False`` on an SQL-only PGMQ
  install (``pgmq.install.install_pgmq_from_sql``, run once if ``pgmq.meta`` is missing).

``--pgbouncer`` adds ``kombu_pgmq_pgbouncer``: ``kombu_pgmq``'s database through a PgBouncer
1.18 started for the run (``tests/support/pgbouncer.py``: transaction mode, pool 8), with
``pooler="transaction"`` and ``direct_url`` the direct URL (issue 30).

PostgreSQL databases of the URLs are created if missing. For each broker, a worker
subprocess ``celery -A celery_bench_app worker -P prefork -c 2 --without-gossip
--without-mingle --without-heartbeat`` (queue ``celery_bench``, no result backend: tasks
append ``kind,value,ts`` lines to a per-run file with ``O_APPEND``), then:

1. latency (``--rounds`` times, brokers interleaved, samples pooled): queue purged,
   worker started and warmed up (one ``ping`` task run), then
   ``--latency-tasks`` tasks sent ``--interval-ms`` apart with ``apply_async``; each
   records ``task start - sent timestamp`` (its argument). p50/p90/p99/max in ms, and
   the slowest samples with the second of the round they were sent in (``slowest``;
   printed with ``-v``): a periodic cause shows as one offset modulo its period. Each
   sample is also split where the worker's main process received the task (Celery's
   ``task_received`` signal): ``to_worker_ms`` (publish, broker, wake-up) and
   ``in_worker_ms`` (Celery hands it to a pool process), printed with ``-v``.
2. backlog: worker stopped, queue purged, one ``ping`` then ``--backlog`` noop tasks
   published with no worker running; a worker is started; rate = backlog / (last noop
   done - ping start), i.e. from worker ready to the last task done. ``--backlog-rounds``
   times, brokers interleaved: the median (each round's rate kept).

A failing broker gets its error string in the results; the others still run.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import itertools
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

HERE = Path(__file__).resolve().parent
REPO_ROOT = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(REPO_ROOT))

import celery  # noqa: E402
import celery_bench_app  # noqa: E402
import kombu  # noqa: E402
from brokers import (  # noqa: E402
    DEFAULT_BROKERS,
    DEFAULT_OPTIONS,
    dist_version,
    ensure_database,
    ensure_sql_pgmq,
    git_describe,
    pg_dsn,
    pg_version,
)
from kombu.utils.url import maybe_sanitize_url  # noqa: E402

from tests.support import pgbouncer  # noqa: E402

WORKER_STOP_TIMEOUT_S = 20.0
READY_TIMEOUT_S = 60.0
# After the warm-up task, before the latency tasks: the previous round's worker processes
# are still exiting for a moment, and stalls of ~0.5 s hit the first tasks of every
# broker alike when this was 0.5 s.
SETTLE_S = 3.0


# -- worker and task log ------------------------------------------------------------------


class Worker:
    """A ``celery worker`` subprocess of a benchmark's app module (its own process group,
    output to ``out``); subclasses name another app, pool, concurrency or environment."""

    #: The ``-A`` module (in benchmarks/), ``-P`` pool, ``-c`` and the node name's prefix.
    app_module = "celery_bench_app"
    pool = "prefork"
    concurrency = 2
    node_prefix = "bench"
    #: More ``celery worker`` flags.
    flags: tuple[str, ...] = ("--without-gossip", "--without-mingle", "--without-heartbeat")

    def __init__(self, name: str, url: str, options: dict[str, Any], log: Path, out: Path):
        self.name = name
        self.env = self.environment(
            {
                "CELERY_BENCH_BROKER": url,
                "CELERY_BENCH_TRANSPORT_OPTIONS": json.dumps(options),
                "CELERY_BENCH_LOG": str(log),
            }
        )
        self.out = out
        self.proc: subprocess.Popen[bytes] | None = None

    @staticmethod
    def environment(settings: dict[str, str]) -> dict[str, str]:
        """This process's environment with ``settings``, and benchmarks/ and the
        repository on ``PYTHONPATH``."""
        path = os.pathsep.join(
            filter(None, [str(HERE), str(REPO_ROOT), os.environ.get("PYTHONPATH")])
        )
        return {**os.environ, **settings, "PYTHONPATH": path}

    def start(self) -> None:
        cmd = [sys.executable, "-m", "celery", "-A", self.app_module, "worker"]
        cmd += ["-P", self.pool, "-c", str(self.concurrency), *self.flags]
        cmd += ["-l", "warning", "-n", f"{self.node_prefix}-{self.name}@%h"]
        with self.out.open("ab") as out:
            self.proc = subprocess.Popen(
                cmd,
                cwd=HERE,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def check_alive(self) -> None:
        if not self.alive():
            code = self.proc.returncode if self.proc else None
            raise RuntimeError(f"worker exited with {code}: {tail(self.out)}")

    def stop(self) -> int | None:
        """SIGTERM (warm shutdown), then SIGKILL of the process group after 20 s."""
        if self.proc is None:
            return None
        code = self.proc.poll()
        if code is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)
            try:
                code = self.proc.wait(timeout=WORKER_STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                code = None
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        if code is None:
            self.proc.wait(timeout=10)
        self.proc = None
        return code


def tail(path: Path, n: int = 800) -> str:
    try:
        return path.read_text(errors="replace")[-n:].strip()
    except FileNotFoundError:
        return ""


_LOGS = itertools.count(1)


def fresh_log(workdir: Path, stem: str) -> Path:
    """A task log of its own for each run: a round must never count the lines of an
    earlier round (they share the queue and the task names)."""
    return workdir / f"{stem}-{next(_LOGS)}.log"


def read_log(path: Path) -> list[tuple[str, str, float]]:
    try:
        data = path.read_text()
    except FileNotFoundError:
        return []
    rows = []
    for line in data.splitlines(keepends=True):
        if not line.endswith("\n"):
            break  # partial last line
        kind, value, ts = line.rstrip("\n").split(",")
        rows.append((kind, value, float(ts)))
    return rows


def wait_log(path: Path, worker: Worker, done, timeout: float) -> list[tuple[str, str, float]]:
    """Poll the task log until ``done(rows)``; raise if the worker dies or on timeout."""
    deadline = time.monotonic() + timeout
    while True:
        rows = read_log(path)
        if done(rows):
            return rows
        worker.check_alive()
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s ({len(rows)} task lines)")
        time.sleep(0.05)


def count(kind: str, rows: list[tuple[str, str, float]]) -> int:
    return sum(1 for row in rows if row[0] == kind)


def pct(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile of sorted values."""
    k = max(0, min(len(sorted_values) - 1, round(q / 100 * len(sorted_values) + 0.5) - 1))
    return sorted_values[k]


# -- workloads ------------------------------------------------------------------------------


def purge(app) -> int | None:
    return app.control.purge()


def run_latency(app, name, url, options, workdir: Path, n: int, interval_s: float) -> dict:
    log = fresh_log(workdir, f"{name}-latency")
    worker = Worker(name, url, options, log, workdir / f"{name}-worker.out")
    purged = purge(app)
    worker.start()
    try:
        app.tasks["bench.ping"].apply_async()
        wait_log(log, worker, lambda rows: count("ping", rows) >= 1, READY_TIMEOUT_S)
        time.sleep(SETTLE_S)
        task = app.tasks["bench.latency"]
        t0, wall0 = time.monotonic(), time.time()
        for i in range(n):
            delay = t0 + i * interval_s - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            task.apply_async((time.time(),))
        send_s = time.monotonic() - t0
        rows = wait_log(log, worker, lambda rows: count("lat", rows) >= n, 60.0 + n * 0.05)
    finally:
        code = worker.stop()
    in_order = [(ts - float(value)) * 1000 for kind, value, ts in rows if kind == "lat"]
    # split at the worker's main process (celery_bench_app's task_received line)
    received = {value: ts for kind, value, ts in rows if kind == "rx"}
    split = [
        ((received[value] - float(value)) * 1000, (ts - received[value]) * 1000)
        for kind, value, ts in rows
        if kind == "lat" and value in received
    ]
    # seconds into the round each task was sent, sample order (where in the round the slow
    # ones are: a periodic cause shows as the same offset modulo its period)
    sent_s = [float(value) - wall0 for kind, value, ts in rows if kind == "lat"]
    return {
        "tasks": n,
        "interval_ms": interval_s * 1000,
        "purged_before": purged,
        "send_s": round(send_s, 3),
        "executed": len(in_order),
        **percentiles(in_order),
        "worker_exit_code": code,
        "samples_ms": [round(x, 3) for x in in_order],  # in completion order
        "sent_s": [round(x, 4) for x in sent_s],  # seconds into the round, same order
        # sent -> received by the worker's main process, received -> task start
        "to_worker_ms": [round(a, 3) for a, _ in split],
        "in_worker_ms": [round(b, 3) for _, b in split],
    }


def percentiles(values: list[float]) -> dict:
    """p50/p90/p99/max/mean in ms of latency samples (any order)."""
    lat = sorted(values)
    return {
        "p50_ms": round(pct(lat, 50), 2),
        "p90_ms": round(pct(lat, 90), 2),
        "p99_ms": round(pct(lat, 99), 2),
        "max_ms": round(lat[-1], 2),
        "mean_ms": round(statistics.fmean(lat), 2),
    }


def pool_latency(runs: list[dict]) -> dict:
    """Percentiles over the samples of several latency rounds (each round's p50 kept)."""
    ok = [r for r in runs if "samples_ms" in r]
    if not ok:
        return runs[-1] if runs else {"error": "no latency run"}
    samples = [x for r in ok for x in r["samples_ms"]]
    # the slowest samples but each round's first task (a cold start for every broker)
    slow = sorted(
        (
            (ms, i, sent)
            for i, r in enumerate(ok)
            for ms, sent in zip(r["samples_ms"], r.get("sent_s") or [], strict=False)
            if sent > 0.01
        ),
        reverse=True,
    )
    return {
        "rounds": len(ok),
        "tasks": len(samples),
        **percentiles(samples),
        "round_p50_ms": [r["p50_ms"] for r in ok],
        "round_p99_ms": [r["p99_ms"] for r in ok],
        **{
            part: percentiles(values)
            for part in ("to_worker_ms", "in_worker_ms")
            if (values := [x for r in ok for x in r.get(part) or []])
        },
        "slowest": [{"ms": ms, "round": i, "sent_s": sent} for ms, i, sent in slow[:WORST_SAMPLES]],
        "errors": [r["error"] for r in runs if "error" in r],
    }


#: --limit-keys: backlog tasks carry header x-limit-key, one of this many keys (issue 29).
LIMIT_KEYS = 0
#: Slowest latency samples kept in the results (``slowest``; printed with -v).
WORST_SAMPLES = 12


def run_backlog(app, name, url, options, workdir: Path, n: int) -> dict:
    log = fresh_log(workdir, f"{name}-backlog")
    worker = Worker(name, url, options, log, workdir / f"{name}-worker.out")
    purged = purge(app)
    noop = app.tasks["bench.noop"]
    t0 = time.monotonic()
    app.tasks["bench.ping"].apply_async()
    for i in range(n):
        if LIMIT_KEYS:
            noop.apply_async((i,), headers={"x-limit-key": f"k{i % LIMIT_KEYS}"})
        else:
            noop.apply_async((i,))
    publish_s = time.monotonic() - t0
    worker.start()
    try:
        rows = wait_log(
            log,
            worker,
            lambda rows: count("noop", rows) >= n and count("ping", rows) >= 1,
            READY_TIMEOUT_S + max(120.0, n / 10),
        )
    finally:
        code = worker.stop()
    ready = min(ts for kind, _, ts in rows if kind == "ping")
    noops = [(int(value), ts) for kind, value, ts in rows if kind == "noop"]
    last = max(ts for _, ts in noops)
    distinct = len({i for i, _ in noops})
    drain_s = last - ready
    return {
        "tasks": n,
        "purged_before": purged,
        "publish_s": round(publish_s, 3),
        "publish_per_s": round((n + 1) / publish_s, 1),
        "drain_s": round(drain_s, 3),
        "tasks_per_s": round(n / drain_s, 1),
        "executed": len(noops),
        "distinct": distinct,
        "worker_exit_code": code,
    }


def pool_backlog(runs: list[dict]) -> dict:
    """Median (and range) of the backlog rounds; the median round's details kept."""
    ok = [r for r in runs if "tasks_per_s" in r]
    if not ok:
        return runs[-1] if runs else {"error": "no backlog run"}
    ordered = sorted(ok, key=lambda r: r["tasks_per_s"])
    median = ordered[(len(ordered) - 1) // 2]
    return {
        **median,
        "tasks_per_s": round(statistics.median(r["tasks_per_s"] for r in ok), 1),
        "publish_per_s": round(statistics.median(r["publish_per_s"] for r in ok), 1),
        "rounds": len(ok),
        "round_tasks_per_s": [r["tasks_per_s"] for r in ok],
        "round_publish_per_s": [r["publish_per_s"] for r in ok],
        "errors": [r["error"] for r in runs if "error" in r],
    }


def setup_broker(name: str, url: str, options: dict[str, Any]) -> Any:
    """Create the database (and kombu 5.7's SQL-only PGMQ) if needed; return the app."""
    dsn = pg_dsn(url)
    if dsn is not None:
        ensure_database(dsn)
        if urlsplit(url).scheme == "pgmq" and not options.get("init_extension", True):
            ensure_sql_pgmq(dsn)
    return celery_bench_app.create_app(url, options)


def guarded(label: str, name: str, fn: Any, verbose: bool) -> dict:
    print(f"[{name}] {label}...", file=sys.stderr, flush=True)
    try:
        return fn()
    except Exception as exc:
        if verbose:
            traceback.print_exc()
        return {"error": f"{type(exc).__name__}: {exc}"}


# -- output ---------------------------------------------------------------------------------


def fmt(section: dict | None, key: str, spec: str = ",.1f") -> str:
    if not section or "error" in section:
        return "ERR"
    return format(section[key], spec)


def table(results: dict[str, dict]) -> str:
    head = ["broker", "lat p50 ms", "p90", "p99", "max", "backlog tasks/s", "publish/s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    errors = []
    for name, res in results.items():
        lat, back = res.get("latency"), res.get("backlog")
        lines.append(
            "| "
            + " | ".join(
                [
                    name,
                    fmt(lat, "p50_ms"),
                    fmt(lat, "p90_ms"),
                    fmt(lat, "p99_ms"),
                    fmt(lat, "max_ms"),
                    fmt(back, "tasks_per_s", ",.0f"),
                    fmt(back, "publish_per_s", ",.0f"),
                ]
            )
            + " |"
        )
        for label in ("error", "latency", "backlog"):
            sec = res.get(label)
            msg = sec if label == "error" else (sec or {}).get("error")
            if msg:
                errors.append(f"{name} {label}: {msg}")
    return "\n".join(lines + [f"  ! {e}" for e in errors])


def parse_pairs(values: list[str] | None, what: str) -> dict[str, str]:
    out = {}
    for value in values or []:
        name, sep, rest = value.partition("=")
        if not sep or not name:
            raise SystemExit(f"{what} must be NAME=VALUE: {value!r}")
        out[name] = rest
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--broker", action="append", metavar="NAME=URL")
    parser.add_argument(
        "--options",
        action="append",
        metavar="NAME=JSON",
        help="transport options of broker NAME (replace the defaults)",
    )
    parser.add_argument("--latency-tasks", type=int, default=200)
    parser.add_argument("--interval-ms", type=float, default=20.0)
    parser.add_argument("--backlog", type=int, default=10_000)
    parser.add_argument(
        "--rounds", type=int, default=1, help="latency rounds per broker (samples pooled)"
    )
    parser.add_argument(
        "--backlog-rounds", type=int, default=1, help="backlog rounds per broker (median)"
    )
    parser.add_argument(
        "--limit-keys",
        type=int,
        default=0,
        help="backlog tasks carry header x-limit-key, one of this many keys (limits, issue 29)",
    )
    parser.add_argument(
        "--pgbouncer",
        action="store_true",
        help="add broker kombu_pgmq_pgbouncer: kombu_pgmq's URL through a PgBouncer started "
        "here (transaction mode, pool 8; pooler + direct_url, issue 30)",
    )
    parser.add_argument("--json", type=Path, help="write results as JSON here")
    parser.add_argument("--keep", action="store_true", help="keep the task logs / worker output")
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args()
    global LIMIT_KEYS
    LIMIT_KEYS = args.limit_keys

    brokers = parse_pairs(args.broker, "--broker") or dict(DEFAULT_BROKERS)
    options = {n: dict(DEFAULT_OPTIONS.get(n, {})) for n in brokers}
    for n, raw in parse_pairs(args.options, "--options").items():
        options[n] = json.loads(raw)
    with contextlib.ExitStack() as stack:
        if args.pgbouncer:
            direct = brokers["kombu_pgmq"]
            ensure_database(pg_dsn(direct) or direct)
            bouncer = stack.enter_context(pgbouncer.PgBouncer(direct, default_pool_size=8))
            brokers["kombu_pgmq_pgbouncer"] = bouncer.pooled_url(direct)
            options["kombu_pgmq_pgbouncer"] = {"pooler": "transaction", "direct_url": direct}
        run(args, brokers, options)


def run(args: argparse.Namespace, brokers: dict[str, str], options: dict[str, Any]) -> None:
    """One run of every broker (see the module docstring)."""

    first_pg = next((d for d in map(pg_dsn, brokers.values()) if d), None)
    env = {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "cpu_count": os.cpu_count(),
        "loadavg_start": os.getloadavg(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "celery": celery.__version__,
        "kombu": kombu.__version__,
        "kombu_pgmq_git": git_describe(),
        "pgmq_py": dist_version("pgmq"),
        "postgresql": pg_version(first_pg) if first_pg else None,
        "latency_tasks": args.latency_tasks,
        "interval_ms": args.interval_ms,
        "backlog": args.backlog,
        "limit_keys": args.limit_keys,
        "rounds": args.rounds,
        "backlog_rounds": args.backlog_rounds,
        "worker": "prefork -c 2, --without-gossip/mingle/heartbeat, no result backend",
    }
    workdir = Path(tempfile.mkdtemp(prefix="celery_bench-"))
    results: dict[str, dict] = {}
    apps: dict[str, Any] = {}
    for name, url in brokers.items():
        results[name] = {"url": maybe_sanitize_url(url), "transport_options": options[name]}
        try:
            apps[name] = setup_broker(name, url, options[name])
        except Exception as exc:  # never let one broker stop the run
            results[name]["error"] = f"setup: {type(exc).__name__}: {exc}"
    latency_runs: dict[str, list[dict]] = {name: [] for name in apps}
    for _ in range(args.rounds):  # brokers interleaved: drifts of the machine hit all alike
        for name, app in apps.items():
            url, opts = brokers[name], options[name]
            latency_runs[name].append(
                guarded(
                    "latency",
                    name,
                    lambda app=app, name=name, url=url, opts=opts: run_latency(
                        app, name, url, opts, workdir, args.latency_tasks, args.interval_ms / 1000
                    ),
                    args.verbose,
                )
            )
    backlog_runs: dict[str, list[dict]] = {name: [] for name in apps}
    for _ in range(args.backlog_rounds):  # interleaved as well
        for name, app in apps.items():
            url, opts = brokers[name], options[name]
            backlog_runs[name].append(
                guarded(
                    "backlog",
                    name,
                    lambda app=app, name=name, url=url, opts=opts: run_backlog(
                        app, name, url, opts, workdir, args.backlog
                    ),
                    args.verbose,
                )
            )
    for name, app in apps.items():
        results[name]["latency"] = pool_latency(latency_runs[name])
        results[name]["backlog"] = pool_backlog(backlog_runs[name])
        with contextlib.suppress(Exception):
            purge(app)
        with contextlib.suppress(Exception):
            app.close()
    env["loadavg_end"] = os.getloadavg()

    print(table(results))
    if args.verbose:  # the slowest samples, by where in the round they were sent
        for name, res in results.items():
            slow = (res.get("latency") or {}).get("slowest") or []
            shown = ", ".join(f"{s['ms']:.1f} ms at {s['sent_s']:.2f} s" for s in slow)
            print(f"slowest {name}: {shown}")
        for name, res in results.items():  # where the time goes
            lat = res.get("latency") or {}
            parts = [
                f"{label} "
                + " / ".join(f"{lat[part][k]:.2f}" for k in ("p50_ms", "p90_ms", "p99_ms"))
                for part, label in (
                    ("to_worker_ms", "sent->received"),
                    ("in_worker_ms", "received->started"),
                )
                if part in lat
            ]
            if parts:
                print(f"split {name} (p50 / p90 / p99 ms): " + "; ".join(parts))
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
