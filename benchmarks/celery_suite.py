"""Celery's own integration suites on kombu_pgmq: our result backend vs Redis's, same run.

Usage::

    python benchmarks/celery_suite.py [--pg postgresql://postgres@127.0.0.1:5432/kpb_suite]
        [--redis redis://127.0.0.1:6379/0] [--timeout 30] [--reruns 0] [-k EXPR]
        [--runs postgresql,redis] [--workdir DIR] [--out benchmarks/results/celery_suite]

What it does:

1. Downloads the sdist of the installed Celery (``pip download --no-binary :all: --no-deps
   celery==<version>``; it holds ``t/``) into ``--workdir`` unless already there, and
   copies its ``t/`` next to a ``pytest.ini`` (Celery's own pytest options:
   ``--strict-markers``, ``xfail_strict``, its markers) and a ``conftest.py`` that gives
   every test the same time limit (``--timeout`` s, then every 5 s again: a test looping
   over ``subtests`` would otherwise hang; Celery's ``@flaky`` sets 300 s) and
   ``--reruns`` reruns (Celery's ``@flaky`` reruns a test up to 5 times on timeouts and
   connection errors; 0 here, so a test that hangs costs the same bounded time in both
   runs).
2. Runs ``t/integration/test_canvas.py`` and ``t/integration/test_tasks.py`` once per
   ``--runs`` entry, one after the other (they share Redis keys), each in a fresh
   PostgreSQL database (``<db>_<run>``, dropped and created again):

   * ``postgresql``: ``TEST_BROKER`` and ``TEST_BACKEND`` both that database (our result
     backend, selected by Celery's ``celery.result_backends`` entry point);
   * ``redis``: ``TEST_BROKER`` that database, ``TEST_BACKEND`` ``--redis``.

   pytest loads ``-p kombu_pgmq`` (registers the ``postgresql://`` transport) and
   ``-p celery.contrib.pytest`` (the ``celery_session_worker`` fixture: a prefork worker
   started by the test session itself). Celery's tests also use Redis directly (its
   ``get_redis_connection()``, ``$REDIS_HOST``/``$REDIS_PORT``, default localhost:6379)
   to record side effects, in both runs.
3. Writes ``<out>.json`` (outcome per test per run, the failure's first lines, durations)
   and ``<out>.md`` (counts, then every test whose outcome differs between the runs).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from brokers import dist_version, git_describe, pg_version  # noqa: E402

SUITES = ["t/integration/test_canvas.py", "t/integration/test_tasks.py"]

PYTEST_INI = """\
[pytest]
# Celery's own options (its pyproject.toml), without its testpaths
addopts = --strict-markers
python_classes = test_*
xfail_strict = true
markers =
    sleepdeprived_patched_module
    masked_modules
    patched_environ
    patched_module
    flaky
    timeout
    amqp
"""

CONFTEST = '''\
"""Written by kombu_pgmq's benchmarks/celery_suite.py: one time limit and the same number
of reruns for every test, so a test that hangs costs the same bounded time in every run.

pytest-timeout's SIGALRM fires once; a test that waits inside ``subtests.test()`` (which
catches the timeout's exception as a subtest failure) would then wait for ever at its
next ``get()``. So its timer repeats every REPEAT_S seconds until the test ends."""
import json
import os
import signal

import pytest

TIMEOUT_S = float(os.environ["CELERY_SUITE_TIMEOUT"])
RERUNS = int(os.environ["CELERY_SUITE_RERUNS"])
REPEAT_S = 5.0

_setitimer = signal.setitimer


def _repeating_setitimer(which, seconds, interval=0.0):
    if which == signal.ITIMER_REAL and seconds > 0 and not interval:
        interval = REPEAT_S
    return _setitimer(which, seconds, interval)


signal.setitimer = _repeating_setitimer


def pytest_runtest_logreport(report):
    """One JSON line per phase report (setup, call, teardown, each subtest), written at
    once: a run killed by its wall-clock limit still tells what ran."""
    text = str(report.longrepr or "") if report.outcome != "passed" else ""
    line = {
        "nodeid": report.nodeid,
        "when": report.when,
        "outcome": report.outcome,
        "xfail": bool(getattr(report, "wasxfail", None) is not None),
        "subtest": type(report).__name__ != "TestReport",
        "seconds": round(report.duration, 2),
        "message": text[-1500:],
    }
    with open(os.environ["CELERY_SUITE_REPORT"], "a") as fh:
        fh.write(json.dumps(line) + "\\n")


def pytest_runtest_logstart(nodeid, location):
    with open(os.environ["CELERY_SUITE_REPORT"], "a") as fh:
        fh.write(json.dumps({"nodeid": nodeid, "when": "start"}) + "\\n")


def pytest_collection_modifyitems(items):
    for item in items:
        item.add_marker(pytest.mark.timeout(TIMEOUT_S), append=False)
        flaky = item.get_closest_marker("flaky")
        if flaky is not None:
            item.add_marker(pytest.mark.flaky(**{**flaky.kwargs, "reruns": RERUNS}), append=False)
'''


#: Celery's guard in front of the tests that record side effects in Redis (they still use
#: Redis at localhost for that, whatever the result backend): ``--unguard`` lets them run.
GUARDS = (
    "manager.app.conf.result_backend.startswith('redis')",
    'manager.app.conf.result_backend.startswith("redis")',
)
UNGUARDED = "manager.app.conf.result_backend.startswith(('redis', 'postgres'))"


def prepare_suite(workdir: Path, version: str, unguard: bool = False) -> Path:
    """``workdir/suite-<version>``: Celery's ``t/`` with our pytest.ini and conftest.py
    (``unguard``: ``suite-<version>-unguarded``, its Redis-backend guards opened to ours)."""
    suite = workdir / f"suite-{version}{'-unguarded' if unguard else ''}"
    if (suite / "t" / "integration" / "test_canvas.py").exists():
        return suite
    workdir.mkdir(parents=True, exist_ok=True)
    sdist = workdir / f"celery-{version}.tar.gz"
    if not sdist.exists():
        pip = [sys.executable, "-m", "pip", "download", "-q", "--no-binary", ":all:"]
        subprocess.run([*pip, "--no-deps", f"celery=={version}", "-d", str(workdir)], check=True)
    prefix = f"celery-{version}/t/"
    with tarfile.open(sdist) as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(prefix)]
        tar.extractall(workdir / "unpacked", members=members, filter="data")
    suite.mkdir()
    shutil.copytree(workdir / "unpacked" / f"celery-{version}" / "t", suite / "t")
    if unguard:
        for path in (suite / "t" / "integration").glob("test_*.py"):
            text = path.read_text()
            for guard in GUARDS:
                text = text.replace(guard, UNGUARDED)
            path.write_text(text)
    (suite / "pytest.ini").write_text(PYTEST_INI)
    (suite / "conftest.py").write_text(CONFTEST)
    return suite


def fresh_database(url: str) -> None:
    parts = urlsplit(url)
    name = parts.path.lstrip("/")
    admin = urlunsplit(parts._replace(path="/postgres"))
    import psycopg
    from psycopg import sql

    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
        )
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))


def first_lines(text: str, n: int = 6) -> str:
    """The lines of a failure that say what failed: pytest's ``E`` lines first."""
    lines = text.strip().splitlines()
    errors = [line for line in lines if line.startswith("E ")]
    return "\n".join((errors or lines)[:n])


def parse_reports(path: Path) -> dict[str, dict[str, Any]]:
    """``{test id: {"outcome", "seconds", "message"}}`` from the conftest's JSON lines:
    ``failed`` if any phase or subtest failed (``error``: setup or teardown), ``skipped``,
    ``xfailed``/``xpassed``, ``passed``; ``hung`` for a test started but never finished
    (pytest was killed after ``--stall`` seconds without a report)."""
    out: dict[str, dict[str, Any]] = {}
    for raw in path.read_text().splitlines():
        rep = json.loads(raw)
        entry = out.setdefault(
            rep["nodeid"], {"outcome": "hung", "seconds": 0.0, "message": "", "failed_subtests": 0}
        )
        if rep["when"] == "start":
            continue
        entry["seconds"] = round(entry["seconds"] + rep["seconds"], 2)
        outcome = rep["outcome"]
        if rep["subtest"]:
            if outcome == "failed":
                entry["failed_subtests"] += 1
                entry["message"] = entry["message"] or first_lines(rep["message"])
            continue
        if outcome == "failed" and rep["when"] != "call":
            outcome = "error"
        elif rep["xfail"]:
            outcome = "xfailed" if outcome == "skipped" else "xpassed"
        if rep["when"] == "teardown" and entry["outcome"] != "hung":
            if outcome == "error" and entry["outcome"] in ("passed", "hung"):
                entry["outcome"] = "error"
                entry["message"] = first_lines(rep["message"])
            continue
        if rep["when"] == "call" or outcome in ("skipped", "error"):
            entry["outcome"] = outcome
            if outcome not in ("passed", "xpassed"):
                entry["message"] = entry["message"] or first_lines(rep["message"])
        elif rep["when"] == "setup" and outcome == "passed":
            entry["outcome"] = "hung"  # until its call report arrives
    for entry in out.values():
        if entry["outcome"] == "passed" and entry["failed_subtests"]:
            entry["outcome"] = "failed"
    return out


def wait_progress(proc: subprocess.Popen[bytes], reports: Path, stall: float) -> int | str:
    """Wait for pytest; kill it (its process group) when no test reported for ``stall``
    seconds (a test that waits for ever where pytest-timeout cannot interrupt it)."""
    last = time.monotonic()
    size = -1
    while True:
        try:
            return proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            pass
        now_size = reports.stat().st_size if reports.exists() else 0
        if now_size != size:
            size, last = now_size, time.monotonic()
        elif time.monotonic() - last > stall:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return f"killed: no test reported for {stall:.0f} s"


def run_suite(
    suite: Path, name: str, broker: str, backend: str, args: argparse.Namespace, out: Path
) -> dict[str, Any]:
    reports = out.with_name(f"{out.name}_{name}.jsonl")
    reports.unlink(missing_ok=True)
    log = out.with_name(f"{out.name}_{name}.log")
    env = {
        **os.environ,
        "TEST_BROKER": broker,
        "TEST_BACKEND": backend,
        "CELERY_SUITE_TIMEOUT": str(args.timeout),
        "CELERY_SUITE_RERUNS": str(args.reruns),
        "CELERY_SUITE_REPORT": str(reports),
    }
    base = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "kombu_pgmq"]
    base += ["-p", "celery.contrib.pytest"]
    selection = [*SUITES] + (["-k", args.k] if args.k else [])
    collected = subprocess.run(
        [*base, "--collect-only", "-q", *selection],
        cwd=suite,
        env=env,
        capture_output=True,
        text=True,
    ).stdout
    todo = [line for line in collected.splitlines() if "::" in line]
    print(f"[{name}] {len(todo)} tests: {' '.join(base[3:] + selection)}", flush=True)
    started = time.monotonic()
    codes: list[int | str] = []
    with log.open("wb") as fh:
        while todo:
            proc = subprocess.Popen(
                [*base, "-rA", *todo],
                cwd=suite,
                env=env,
                stdout=fh,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            code = wait_progress(proc, reports, args.stall)
            codes.append(code)
            if isinstance(code, int):
                break
            # a test hung past its time limit: it stays "hung"; go on with the tests after it
            seen = {json.loads(line)["nodeid"] for line in reports.read_text().splitlines()}
            todo = [t for t in todo if t not in seen]
            print(f"[{name}] {code}; {len(todo)} tests left", flush=True)
    seconds = time.monotonic() - started
    tests = parse_reports(reports) if reports.exists() else {}
    counts: dict[str, int] = {}
    for entry in tests.values():
        counts[entry["outcome"]] = counts.get(entry["outcome"], 0) + 1
    print(f"[{name}] exit {codes} in {seconds:.0f} s: {counts}", flush=True)
    return {
        "broker": "postgresql://…",
        "backend": backend.split("://")[0] + "://…",
        "exit_codes": codes,
        "seconds": round(seconds),
        "counts": counts,
        "tests": tests,
        "log": log.name,
    }


def compare(runs: dict[str, Any]) -> dict[str, Any]:
    names = list(runs)
    if len(names) != 2:
        return {}
    a, b = (runs[n]["tests"] for n in names)
    ok = {"passed", "xfailed", "xpassed", "skipped"}
    return {
        f"passes_with_{names[1]}_not_{names[0]}": sorted(
            t for t in b if b[t]["outcome"] == "passed" and a.get(t, {}).get("outcome") != "passed"
        ),
        f"passes_with_{names[0]}_not_{names[1]}": sorted(
            t for t in a if a[t]["outcome"] == "passed" and b.get(t, {}).get("outcome") != "passed"
        ),
        "fail_in_both": sorted(
            t for t in a if a[t]["outcome"] not in ok and b.get(t, {}).get("outcome") not in ok
        ),
    }


def markdown(result: dict[str, Any]) -> str:
    runs, diff = result["runs"], result["comparison"]
    lines = [
        f"# Celery {result['environment']['celery']} integration suites "
        f"({', '.join(SUITES)}), broker kombu_pgmq",
        "",
        f"Per-test time limit {result['environment']['timeout_s']} s, reruns "
        f"{result['environment']['reruns']}; load average at start "
        f"{result['environment']['loadavg_start']}, at end {result['environment']['loadavg_end']}.",
        "",
        "| run | backend | passed | failed | error | hung | skipped | xfailed | xpassed | min |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, run in runs.items():
        c = run["counts"]
        lines.append(
            f"| {name} | `{run['backend']}` | {c.get('passed', 0)} | {c.get('failed', 0)} | "
            f"{c.get('error', 0)} | {c.get('hung', 0)} | {c.get('skipped', 0)} | "
            f"{c.get('xfailed', 0)} | {c.get('xpassed', 0)} | "
            f"{run['seconds'] / 60:.1f} |"
        )
    for title, tests in diff.items():
        lines += ["", f"## {title.replace('_', ' ')} ({len(tests)})", ""]
        for test in tests:
            lines.append(f"- `{test}`")
            for name, run in runs.items():
                entry = run["tests"].get(test)
                if entry and entry["outcome"] != "passed":
                    first = entry["message"].splitlines()[0][:240] if entry["message"] else ""
                    lines.append(f"  - {name}: {entry['outcome']} ({entry['seconds']} s): {first}")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pg", default="postgresql://postgres@127.0.0.1:5432/kpb_suite")
    parser.add_argument("--redis", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds per test")
    parser.add_argument("--reruns", type=int, default=0)
    parser.add_argument(
        "--stall",
        type=float,
        default=120.0,
        help="seconds without a test report before pytest is killed (the test then counts "
        "as hung) and started again with the tests after it",
    )
    parser.add_argument("-k", default=None, help="pytest -k expression")
    parser.add_argument("--runs", default="postgresql,redis")
    parser.add_argument(
        "--report-only",
        action="store_true",
        help="no run: the JSON and Markdown from the runs' <out>_<run>.jsonl files",
    )
    parser.add_argument(
        "--unguard",
        action="store_true",
        help="run the tests Celery skips unless the result backend is Redis's "
        "('Requires redis result backend.'; they use Redis only to record side effects)",
    )
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/kombu_pgmq_celery_suite"))
    parser.add_argument("--out", type=Path, default=HERE / "results" / "celery_suite")
    args = parser.parse_args()

    args.out = args.out.resolve()
    version = dist_version("celery") or "unknown"
    suite = prepare_suite(args.workdir, version, args.unguard)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    loadavg_start = os.getloadavg()
    runs: dict[str, Any] = {}
    for name in args.runs.split(","):
        url = args.pg.rstrip("/") + f"_{name}"
        backend = url if name == "postgresql" else args.redis
        if args.report_only:  # the outcomes of an earlier (or interrupted) run
            reports = args.out.with_name(f"{args.out.name}_{name}.jsonl")
            tests = parse_reports(reports)
            counts: dict[str, int] = {}
            for entry in tests.values():
                counts[entry["outcome"]] = counts.get(entry["outcome"], 0) + 1
            runs[name] = {
                "broker": "postgresql://…",
                "backend": backend.split("://")[0] + "://…",
                "exit_codes": ["report only"],
                "seconds": 0,
                "counts": counts,
                "tests": tests,
            }
            continue
        fresh_database(url)
        runs[name] = run_suite(suite, name, url, backend, args, args.out)
    result = {
        "environment": {
            "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "celery": version,
            "kombu": dist_version("kombu"),
            "kombu_pgmq": git_describe(),
            "postgresql": pg_version(args.pg.rstrip("/") + f"_{args.runs.split(',')[0]}"),
            "timeout_s": args.timeout,
            "reruns": args.reruns,
            "k": args.k,
            "loadavg_start": [round(x, 2) for x in loadavg_start],
            "loadavg_end": [round(x, 2) for x in os.getloadavg()],
        },
        "runs": runs,
        "comparison": compare(runs),
    }
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    args.out.with_suffix(".md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
