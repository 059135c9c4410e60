"""A Celery app for ``kombu-pgmq beat add -A tests.integration.beat_cli_app``: it registers
``beatcli.noop`` and ``beatcli.report``. Its broker is a port nothing listens on: a test
sets ``app.conf.broker_url`` to its own database (never a default database)."""

from __future__ import annotations

from celery import Celery

import kombu_pgmq  # noqa: F401  (registers postgresql:// with kombu)

app = Celery("beat_cli_app", set_as_current=False)
app.conf.broker_url = "postgresql://postgres@127.0.0.1:1/nowhere"


@app.task(name="beatcli.noop", shared=False)
def noop() -> None:
    """Nothing."""


@app.task(name="beatcli.report", shared=False)
def report() -> None:
    """Nothing either."""
