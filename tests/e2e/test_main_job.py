"""The README's main job, run as a user runs it: worker, tasks and the Spark job."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.spark
def test_main_job_runs_every_task_and_the_spark_job(db_dsn):
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
    assert "same as pandas" in out
    assert "Frontier Airlines Inc." in out
    assert "worker: stopped (exit code 0)" in out
    if url != db_dsn:
        assert "Sekr" not in out and "Sekr" not in proc.stderr
