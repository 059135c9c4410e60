"""The README's main job, run as a user runs it: worker, tasks and the Spark pipeline."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.spark
def test_main_job_runs_every_task_and_the_spark_pipeline(db_dsn, spark_server):
    # spark_server: the Spark tasks use the test session's Connect server (its port is in
    # os.environ), not one on the default port that would outlive the tests.
    # The test servers use trust auth: a password is sent but not checked, which lets
    # us check that it is never printed.
    url = db_dsn.replace("://postgres@", "://postgres:Sekr%40t-pw@", 1)
    env = {**os.environ, "KOMBU_PGMQ_URL": url, "PYTHONUNBUFFERED": "1"}
    env.pop("DATABASE_URL", None)
    proc = subprocess.run(
        [sys.executable, "-m", "examples.main_job"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = proc.stdout
    assert proc.returncode == 0, f"exit {proc.returncode}\n{out}\n{proc.stderr[-3000:]}"
    assert "add(2, 3) = 5" in out
    assert "chain add(2, 3) | mul(4) | add(1) = 21" in out
    assert "xsum = 336,776" in out
    assert re.search(r"in one transaction, committed: ran once, order \d+ found", out), out
    assert "in one transaction, rolled back: never queued, never ran" in out
    assert re.search(r"enqueued in SQL \(kombu_pgmq.send_task\): ran, order \d+ found", out)
    assert re.search(r"every 2 s \(beat\): = 42, sent once by the leader \S+:\d+", out), out
    spread = re.search(r"at most 20/s across workers: delivered over (\d+\.\d\d) s", out)
    assert spread and float(spread.group(1)) >= 0.9, out  # 20 at 20/s, burst 1: >= 0.95 s
    assert "same as pandas" in out
    assert "Frontier Airlines Inc." in out
    assert "flights pipeline (15 Spark tasks) = 16 carriers" in out
    assert re.search(r"^  month_delays +12 ", out, re.M), out  # latency, from the archive
    chart = re.search(r"chart: (\S+\.png)", out)
    assert chart and Path(chart.group(1)).stat().st_size > 10_000
    assert "worker: stopped (exit code 0)" in out
    if url != db_dsn:
        assert "Sekr" not in out and "Sekr" not in proc.stderr
