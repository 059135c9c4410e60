"""Kombu's own transport test suite (``t/integration/common.py``) on kombu_pgmq and Redis.

Usage::

    python benchmarks/kombu_suite.py [--pg postgresql://postgres@127.0.0.1:5432/kpb_kombu_suite]
        [--redis redis://127.0.0.1:6379/5] [--runs postgresql,redis] [--workdir DIR]
        [--out benchmarks/results/kombu_suite]

What it does:

1. Downloads the sdist of the installed kombu (``pip download --no-binary :all: --no-deps
   kombu==<version>``; it holds ``t/``) into ``--workdir`` unless already there, and copies
   ``t/integration/common.py``: the base classes kombu runs against each of its transports
   (``BasicFunctionality``, ``BaseExchangeTypes``, ``BaseTimeToLive``, ``BasePriority``,
   ``BaseMessage``, ``BaseEventLoop``).
2. Writes ``test_transport.py`` beside it: one subclass of each base class, with the
   ``connection`` fixture kombu's transport modules define (here ``kombu.Connection(URL)``
   with the run's URL) and ``invalid_connection`` (the same transport on a port nothing
   listens on). Priorities: higher numbers first (``PRIORITY_ORDER = "asc"``, as AMQP) for
   kombu_pgmq, lower first (``"desc"``) for Redis, as kombu's ``test_redis.py`` sets it.
3. Runs pytest once per ``--runs`` entry, kombu_pgmq in a fresh database
   (``DROP DATABASE ... WITH (FORCE)`` and ``CREATE``), and writes ``<out>.json`` (outcome
   of every test per run, the first lines of each failure) and ``<out>.md`` (counts, then
   each test that did not pass).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from brokers import dist_version, git_describe, pg_version  # noqa: E402

BASES = [
    "BasicFunctionality",
    "BaseExchangeTypes",
    "BaseTimeToLive",
    "BasePriority",
    "BaseMessage",
    "BaseEventLoop",
]

#: kombu's own collection rule (its setup.cfg): test classes are named ``test_*``.
PYTEST_INI = "[pytest]\naddopts = -p no:cacheprovider\npython_classes = test_*\n"

TEST_MODULE = '''\
"""Written by kombu_pgmq's benchmarks/kombu_suite.py: kombu's transport suite on one URL."""
import os
from urllib.parse import urlsplit, urlunsplit

import kombu
import pytest

from common import {bases}

URL = os.environ["KOMBU_SUITE_URL"]


def _unreachable(url):
    parts = urlsplit(url)
    host = parts.netloc.rsplit("@", 1)
    netloc = (host[0] + "@" if len(host) == 2 else "") + "127.0.0.1:59999"
    return urlunsplit(parts._replace(netloc=netloc))


@pytest.fixture()
def connection():
    return kombu.Connection(URL, transport_options={{"polling_interval": 0.1}})


@pytest.fixture()
def invalid_connection():
    return kombu.Connection(
        _unreachable(URL), connect_timeout=1, transport_options={{"max_retries": 1}}
    )


{classes}
'''


def prepare_suite(workdir: Path, version: str, priority_order: str, url: str, name: str) -> Path:
    """``workdir/<name>``: kombu's ``common.py`` and a ``test_transport.py`` for ``url``."""
    workdir.mkdir(parents=True, exist_ok=True)
    sdist = workdir / f"kombu-{version}.tar.gz"
    if not sdist.exists():
        pip = [sys.executable, "-m", "pip", "download", "-q", "--no-binary", ":all:"]
        subprocess.run([*pip, "--no-deps", f"kombu=={version}", "-d", str(workdir)], check=True)
    common = workdir / f"common-{version}.py"
    if not common.exists():
        with tarfile.open(sdist) as tar:
            member = tar.extractfile(f"kombu-{version}/t/integration/common.py")
            assert member is not None, "kombu's sdist has no t/integration/common.py"
            common.write_bytes(member.read())
    suite = workdir / name
    shutil.rmtree(suite, ignore_errors=True)
    suite.mkdir()
    shutil.copy(common, suite / "common.py")
    classes = "\n\n".join(
        f"class test_{base}({base}):\n"
        + (f'    PRIORITY_ORDER = "{priority_order}"\n' if base == "BasePriority" else "    pass\n")
        for base in BASES
    )
    (suite / "test_transport.py").write_text(
        TEST_MODULE.format(bases=", ".join(BASES), classes=classes)
    )
    (suite / "pytest.ini").write_text(PYTEST_INI)
    return suite


def fresh_database(url: str) -> None:
    import psycopg
    from psycopg import sql

    parts = urlsplit(url)
    name = parts.path.lstrip("/")
    admin = urlunsplit(parts._replace(path="/postgres"))
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
        )
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))


def run(suite: Path, url: str, timeout: float) -> dict[str, Any]:
    junit = suite / "junit.xml"
    env = {**os.environ, "KOMBU_SUITE_URL": url}
    started = time.monotonic()
    proc = subprocess.run(
        [
            *(sys.executable, "-m", "pytest", "-p", "kombu_pgmq", "-q"),
            *(f"--junitxml={junit}", f"--timeout={timeout:g}", "test_transport.py"),
        ],
        cwd=suite,
        env=env,
        capture_output=True,
        text=True,
    )
    seconds = time.monotonic() - started
    tests: dict[str, dict[str, Any]] = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        test = f"{case.get('classname', '').rsplit('.', 1)[-1]}::{case.get('name')}"
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            found = case.find(tag)
            if found is not None:
                outcome = {"failure": "failed"}.get(tag, tag)
                text = found.get("message") or found.text or ""
                message = "\n".join(text.strip().splitlines()[:4])
        tests[test] = {"outcome": outcome, "seconds": round(float(case.get("time", 0)), 2)}
        if message:
            tests[test]["message"] = message
    counts: dict[str, int] = {}
    for entry in tests.values():
        counts[entry["outcome"]] = counts.get(entry["outcome"], 0) + 1
    return {
        "exit_code": proc.returncode,
        "seconds": round(seconds, 1),
        "counts": counts,
        "tests": tests,
        "summary": proc.stdout.strip().splitlines()[-1:],
    }


def markdown(result: dict[str, Any]) -> str:
    env = result["environment"]
    lines = [
        f"# kombu {env['kombu']}'s transport suite (t/integration/common.py)",
        "",
        f"{env['date']}, kombu_pgmq {env['kombu_pgmq']}, PostgreSQL {env['postgresql']}.",
        "",
        "| run | passed | failed | error | skipped | seconds |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in result["runs"].items():
        c = r["counts"]
        lines.append(
            f"| {name} | {c.get('passed', 0)} | {c.get('failed', 0)} | {c.get('error', 0)} | "
            f"{c.get('skipped', 0)} | {r['seconds']} |"
        )
    for name, r in result["runs"].items():
        bad = {t: e for t, e in r["tests"].items() if e["outcome"] != "passed"}
        if bad:
            lines += ["", f"## {name}: not passed ({len(bad)})", ""]
            for test, entry in bad.items():
                first = entry.get("message", "").splitlines()[:1]
                lines.append(f"- `{test}`: {entry['outcome']}: {' '.join(first)[:240]}")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pg", default="postgresql://postgres@127.0.0.1:5432/kpb_kombu_suite")
    parser.add_argument("--redis", default="redis://127.0.0.1:6379/5")
    parser.add_argument("--runs", default="postgresql,redis")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds per test")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/kombu_pgmq_kombu_suite"))
    parser.add_argument("--out", type=Path, default=HERE / "results" / "kombu_suite")
    args = parser.parse_args()

    import kombu

    version = kombu.__version__
    runs: dict[str, Any] = {}
    for name in args.runs.split(","):
        url, order = (args.pg, "asc") if name == "postgresql" else (args.redis, "desc")
        if name == "postgresql":
            fresh_database(url)
        suite = prepare_suite(args.workdir, version, order, url, name)
        runs[name] = run(suite, url, args.timeout)
        print(f"[{name}] {runs[name]['counts']} in {runs[name]['seconds']} s", flush=True)
    result = {
        "environment": {
            "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "kombu": version,
            "kombu_pgmq": git_describe(),
            "psycopg": dist_version("psycopg"),
            "postgresql": pg_version(args.pg),
        },
        "runs": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
