"""Run the flights pipeline once through a worker of ``examples.celeryapp``; print its
report table as JSON on the last line of stdout.

Run as ``python -m tests.e2e.run_pipeline LOG`` from the repository root, with
``KOMBU_PGMQ_URL`` (the test database), ``PIPELINE_DIR`` and, for a cluster,
``SPARK_REMOTE`` in the environment (read by ``examples.celeryapp`` at import, which is why
this is a process of its own). Exit status 1 with the error if the pipeline failed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from examples.celeryapp import app
from examples.main_job import Job
from examples.pipeline import flights_pipeline

TIMEOUT_SECONDS = 600.0


def main() -> int:
    job = Job(Path(sys.argv[1]))
    job.start_worker(str(app.conf.broker_url))
    try:
        out = job.get(flights_pipeline().apply_async(), timeout=TIMEOUT_SECONDS)
    except Exception as exc:
        print(f"pipeline failed: {type(exc).__name__}: {exc}", flush=True)
        return 1
    finally:
        job.stop_worker()
    print(json.dumps({"table": out["report"]["table"], "latency": out["latency"]}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
